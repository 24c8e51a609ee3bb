"""What the replica check costs: one `kerasdist.check_replicas(model)` against an epoch of the
Keras benchmark (examples/keras_synthetic_benchmark.py: --num_batches_per_iter batches of
--batch_size random images per rank, one fixed batch repeated, DistributedOptimizer(SGD with
momentum), kerasdist.callbacks()), for each of kerasdist.models' mlp, small_cnn and
cifar_resnet20, at the ranks it runs under:

  .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/replica_check.py --json benchmarks/results/replica_check.json

Per model, with the same model and optimizer state in one process:
  check      a check_replicas(model) call alone (what ReplicaCheck runs at each epoch end), the
             median over --checks calls, each timed by the slowest rank
  epoch      one fit epoch of the benchmark with the check off (KERASDIST_REPLICA_CHECK=off's
             list), the median over --epochs, timed by the slowest rank
  share      check / epoch: what the check adds to such an epoch (target < 0.5 %); epochs of real
             data sets hold many more batches, so the share falls with their length
  A/B        the same epochs with the check on and off, taking turns: on / off (noisy: the share
             is well under the spread of epoch times on a shared machine)
TensorFlow runs with one intra-op and one inter-op thread per rank, as the Keras benchmark does.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import kerasdist as kd  # noqa: E402

kd.init()
import results as result_files  # noqa: E402  (benchmarks/results.py, beside this script)
from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
MODELS = {
    "mlp": lambda: kd.models.mlp((32, 32, 3), 10),
    "small_cnn": lambda: kd.models.small_cnn((32, 32, 3), 10),
    "cifar_resnet20": lambda: kd.models.cifar_resnet(20, input_shape=(32, 32, 3), num_classes=10),
}


def slowest(seconds):
    return COMM.allreduce(seconds, op=MPI.MAX)


class EpochTimer(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = time.perf_counter() - self.start


def measure(name, arguments):
    keras.utils.set_random_seed(RANK)
    model = MODELS[name]()
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.01, momentum=0.9)), "sparse_categorical_crossentropy")
    rng = np.random.default_rng(RANK)
    batch = (rng.random((arguments.batch_size, 32, 32, 3), np.float32), rng.integers(0, 10, arguments.batch_size))
    dataset = tf.data.Dataset.from_tensors(batch).repeat()
    fit_options = dict(steps_per_epoch=arguments.batches, shuffle=False, verbose=0)
    model.fit(dataset, epochs=1, callbacks=kd.callbacks(check_replicas="off"), **fit_options)  # warm up, trace

    checks = []
    for _ in range(arguments.checks):
        COMM.Barrier()
        start = time.perf_counter()
        kd.check_replicas(model)
        checks.append(slowest(time.perf_counter() - start))

    timer = EpochTimer()
    epochs = {"off": [], "epoch": []}
    lists = {when: kd.callbacks(check_replicas=when) + [timer] for when in epochs}
    for turn in range(2 * arguments.epochs):
        when = ("off", "epoch")[turn % 2]
        COMM.Barrier()
        # The timer comes last, so an epoch's time holds its check (run at on_epoch_end) when on.
        model.fit(dataset, epochs=1, callbacks=lists[when], **fit_options)
        epochs[when].append(slowest(timer.seconds))
    check, epoch = statistics.median(checks), statistics.median(epochs["off"])
    row = {
        "model": name,
        "parameters": model.count_params(),
        "variables_checked": len(kd.replicas.replicated_variables(model)) + len(model.optimizer.variables),
        "check_ms": 1e3 * check,
        "epoch_ms": 1e3 * epoch,
        "share": check / epoch,
        "epoch_on_over_off": statistics.median(epochs["epoch"]) / epoch,
        "check_samples_ms": [1e3 * s for s in checks],
        "epoch_samples_ms": {when: [1e3 * s for s in samples] for when, samples in epochs.items()},
    }
    if RANK == 0:
        print(
            f"{name:15s} {row['parameters']:>10,d} params  check {row['check_ms']:7.2f} ms  epoch of "
            f"{arguments.batches} batches {row['epoch_ms']:8.1f} ms  share {100 * row['share']:.2f} %  "
            f"A/B on/off {row['epoch_on_over_off']:.3f}",
            flush=True,
        )
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_size", type=int, default=64, help="images per batch on each rank")
    parser.add_argument("--batches", type=int, default=10, help="batches per epoch (the Keras benchmark's 10)")
    parser.add_argument("--checks", type=int, default=30, help="check_replicas calls timed per model")
    parser.add_argument("--epochs", type=int, default=8, help="epochs timed per model, with the check and without")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--json", help="result file to write (rank 0)")
    arguments = parser.parse_args()
    run = result_files.start_run("replica_check", launcher=("mpiexec", "-n", str(SIZE)))
    rows = [measure(name, arguments) for name in arguments.models]
    if RANK == 0 and arguments.json:
        record = result_files.finish_run(
            run, ranks=SIZE, batch_size=arguments.batch_size, batches_per_epoch=arguments.batches, models=rows
        )
        result_files.write(arguments.json, record)


if __name__ == "__main__":
    main()
