"""Training throughput of `model.fit` on synthetic images: kerasdist against plain Keras.

Every rank trains a model from `kerasdist.models` on one fixed random batch of images and
labels, repeated by `tf.data`, so input costs nothing and only the training step (forward,
backward, gradient allreduce, update) is timed. After `--num_warmup_batches` untimed batches,
`--num_iters` iterations of `--num_batches_per_iter` batches each are timed from the start to
the end of an epoch; rank 0 prints each iteration's images per second and, at the end, the
median over iterations, per rank and in total (the slowest rank's time sets the total), then one
line `RESULT {json}` (with the step time and the CPU time per step) for scripts such as
`benchmarks/keras_scaling.py`.

    .venv/bin/kerasdist-run -np 2 examples/keras_synthetic_benchmark.py --model=cifar_resnet20
    .venv/bin/python examples/keras_synthetic_benchmark.py --nouse_kerasdist   # plain Keras, the baseline

With `--nouse_kerasdist` the script is plain Keras (of kerasdist it imports only the model
definitions, which are plain Keras too: no runtime, no ops, no MPI): the baseline against which
the cost of `DistributedOptimizer` and `kerasdist.callbacks()` is measured.
Set the threads per rank with TensorFlow's environment variables (`TF_NUM_INTRAOP_THREADS`,
`TF_NUM_INTEROP_THREADS`), as `make bench` does.
"""

import functools
import json
import os
import statistics
import time

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

# Plain Keras model definitions: importing them loads neither kerasdist's runtime nor MPI.
from kerasdist import models  # noqa: E402

MODEL = flags.DEFINE_enum(
    "model",
    "cifar_resnet20",
    ["small_cnn", "cifar_resnet20", "resnet50", "mlp"],
    "Model from kerasdist.models to train.",
)
IMAGE_SIZE = flags.DEFINE_integer(
    "image_size", None, "Side of the square RGB images; default: 224 for resnet50, 32 for the others."
)
NUM_CLASSES = flags.DEFINE_integer("num_classes", None, "Classes; default: 1000 for resnet50, 10 for the others.")
BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Images per batch on each rank.")
NUM_WARMUP_BATCHES = flags.DEFINE_integer(
    "num_warmup_batches",
    10,
    "Untimed batches before the first iteration (tracing, first allocations, first negotiations).",
)
NUM_BATCHES_PER_ITER = flags.DEFINE_integer(
    "num_batches_per_iter", 10, "Batches per timed iteration (one epoch of model.fit)."
)
NUM_ITERS = flags.DEFINE_integer("num_iters", 10, "Timed iterations.")
FP16_ALLREDUCE = flags.DEFINE_bool("fp16_allreduce", False, "Send gradients in float16 (kerasdist.Compression.fp16).")
AVERAGE_MODELS_EVERY = flags.DEFINE_integer(
    "average_models_every",
    0,
    "> 0: local SGD instead of DistributedOptimizer: the plain optimizer, and the ranks average their "
    "weights every so many steps (kerasdist.callbacks.ModelAveraging).",
)
DELAY_GRADIENTS = flags.DEFINE_bool(
    "delay_gradients",
    False,
    "Apply each step the gradients of the step before, reduced while this one computes "
    "(DistributedOptimizer(delay_gradients=True)).",
)
ONE_BIT_GRADIENTS = flags.DEFINE_bool(
    "one_bit_gradients",
    False,
    "Send one sign bit per gradient value, with error feedback (DistributedOptimizer(one_bit_gradients=True)).",
)
USE_KERASDIST = flags.DEFINE_bool(
    "use_kerasdist",
    True,
    "Train with kerasdist.DistributedOptimizer and "
    "kerasdist.callbacks(); false: plain Keras (no kerasdist runtime, ops or MPI).",
)
SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and (plus the rank) of the synthetic batch.")

# name -> (builder(input_shape, num_classes), default image side, default classes)
MODELS = {
    "small_cnn": (models.small_cnn, 32, 10),
    "cifar_resnet20": (functools.partial(models.cifar_resnet, 20), 32, 10),
    "resnet50": (models.resnet50, 224, 1000),
    "mlp": (models.mlp, 32, 10),
}


def cpu_seconds_by_thread():
    """This process's CPU seconds so far, by what its threads do: "python" (the main thread, which
    runs Keras's loop and the callbacks), "tensorflow" (TensorFlow's pools, threads named tf_*),
    "kerasdist" (the engine's threads, named kd_*) and "other". Linux's per-thread scheduler
    counts (nanoseconds); empty where there are none. A thread that ended is no longer counted."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return {}
    seconds = dict.fromkeys(("python", "tensorflow", "kerasdist", "other"), 0.0)
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/schedstat") as stat, open(f"{tasks}/{tid}/comm") as comm:
                on_cpu_ns, name = int(stat.read().split()[0]), comm.read().strip()
        except (OSError, ValueError, IndexError):
            return {}  # the thread ended while being read, or no scheduler counts: no split
        if int(tid) == os.getpid():
            role = "python"
        elif name.startswith("tf_"):
            role = "tensorflow"
        elif name.startswith("kd_"):
            role = "kerasdist"
        else:
            role = "other"
        seconds[role] += on_cpu_ns / 1e9
    return seconds


class IterationTimer(keras.callbacks.Callback):
    """Records the wall time and this process's CPU time (all its threads) of every epoch, one
    timed iteration each, and prints the iteration's throughput on `rank` 0; and the CPU time of
    all the timed epochs by thread role (`cpu_seconds_by_thread`).

    Other processes on the machine disturb CPU time far less than wall time, so it shows the
    cost kerasdist adds even on a busy machine. Only epoch hooks: a per-batch hook would add
    work to every step of the loop being measured.
    """

    def __init__(self, images_per_iteration, rank):
        super().__init__()
        self.images_per_iteration = images_per_iteration
        self.rank = rank
        self.wall_seconds = []
        self.cpu_seconds = []
        self.cpu_seconds_by_thread = {}
        self.epochs_split = 0  # epochs whose CPU time is in cpu_seconds_by_thread
        self._start = None

    def on_epoch_begin(self, epoch, logs=None):
        self._start = (time.perf_counter(), time.process_time(), cpu_seconds_by_thread())

    def on_epoch_end(self, epoch, logs=None):
        self.wall_seconds.append(time.perf_counter() - self._start[0])
        self.cpu_seconds.append(time.process_time() - self._start[1])
        by_thread = cpu_seconds_by_thread()
        if by_thread and self._start[2]:
            self.epochs_split += 1
            for role, seconds in by_thread.items():
                spent = seconds - self._start[2][role]
                self.cpu_seconds_by_thread[role] = self.cpu_seconds_by_thread.get(role, 0.0) + spent
        if self.rank == 0:
            print(
                f"iter {epoch + 1}: {self.images_per_iteration / self.wall_seconds[-1]:.1f} img/s on rank 0", flush=True
            )


def engine_phases_per_step(before, after):
    """The engine thread's busy phases (kerasdist.engine_times()) in ms per timed step, and its
    negotiation cycles and collectives that rode with them per step, the mean of the ranks; every
    rank must call it. Idle is left out: a stretch of it is charged when the engine next wakes."""
    import kerasdist

    steps = NUM_ITERS.value * NUM_BATCHES_PER_ITER.value
    counts = ("cycles", "rode")
    busy = [key for key in after if key not in ("idle", "pickup", "collectives", "hierarchical", *counts)]
    mine = [(after[key] - before[key]) / steps for key in [*busy, *counts]]
    mean = np.mean(kerasdist.allgather_object(mine), axis=0)
    return {
        **{key: 1e3 * value for key, value in zip(busy, mean)},
        **{key: float(value) for key, value in zip(counts, mean[len(busy) :])},
    }


def cpu_ms_per_step_by_thread(splits):
    """The mean over the ranks of a rank's CPU ms per timed step by thread role, from each rank's
    (CPU seconds by role, epochs they cover); empty when a rank has no split."""
    if not all(epochs for _, epochs in splits):
        return {}
    per_rank = [
        {role: 1e3 * seconds / (epochs * NUM_BATCHES_PER_ITER.value) for role, seconds in split.items()}
        for split, epochs in splits
    ]
    return {role: statistics.mean(rank[role] for rank in per_rank) for role in per_rank[0]}


def synthetic_batches(image_size, num_classes, batch_size, seed):
    """One fixed random batch, repeated for ever."""
    rng = np.random.default_rng(seed)
    images = rng.random((batch_size, image_size, image_size, 3), dtype=np.float32)
    labels = rng.integers(0, num_classes, size=batch_size)
    return tf.data.Dataset.from_tensors((images, labels)).repeat()


def main(_):
    if USE_KERASDIST.value:
        import kerasdist

        kerasdist.init()
        rank, size = kerasdist.rank(), kerasdist.size()
    else:
        rank, size = 0, 1
    build, default_side, default_classes = MODELS[MODEL.value]
    image_size = IMAGE_SIZE.value or default_side
    num_classes = NUM_CLASSES.value or default_classes

    keras.utils.set_random_seed(SEED.value)
    model = build((image_size, image_size, 3), num_classes)
    optimizer = keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
    callbacks = []
    if USE_KERASDIST.value:
        compression = kerasdist.Compression.fp16 if FP16_ALLREDUCE.value else kerasdist.Compression.none
        if AVERAGE_MODELS_EVERY.value:
            callbacks = kerasdist.callbacks(average_models_every=AVERAGE_MODELS_EVERY.value)
        else:
            optimizer = kerasdist.DistributedOptimizer(
                optimizer,
                compression=compression,
                delay_gradients=DELAY_GRADIENTS.value,
                one_bit_gradients=ONE_BIT_GRADIENTS.value,
            )
            callbacks = kerasdist.callbacks()
    # XLA off in both modes: kerasdist's ops cannot run under it, and the baseline must match.
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"], jit_compile=False)
    dataset = synthetic_batches(image_size, num_classes, BATCH_SIZE.value, SEED.value + rank)

    if rank == 0:
        print(
            f"model {MODEL.value} ({model.count_params():,} parameters), {image_size}x{image_size}x3 "
            f"images, batch {BATCH_SIZE.value} per rank, {size} rank(s), "
            f"{'kerasdist' if USE_KERASDIST.value else 'plain Keras'}"
            f"{', fp16 allreduce' if USE_KERASDIST.value and FP16_ALLREDUCE.value else ''}",
            flush=True,
        )
    model.fit(
        dataset, steps_per_epoch=NUM_WARMUP_BATCHES.value, epochs=1, callbacks=callbacks, shuffle=False, verbose=0
    )
    timer = IterationTimer(BATCH_SIZE.value * NUM_BATCHES_PER_ITER.value, rank)
    engine_before = kerasdist.engine_times() if USE_KERASDIST.value else None
    model.fit(
        dataset,
        steps_per_epoch=NUM_BATCHES_PER_ITER.value,
        epochs=NUM_ITERS.value,
        callbacks=callbacks + [timer],
        shuffle=False,
        verbose=0,
    )

    timings = [(timer.wall_seconds, timer.cpu_seconds)]
    by_thread = [(timer.cpu_seconds_by_thread, timer.epochs_split)]
    engine_ms_per_step = None
    if USE_KERASDIST.value:
        timings = kerasdist.allgather_object(timings[0])
        by_thread = kerasdist.allgather_object(by_thread[0])
        engine_ms_per_step = engine_phases_per_step(engine_before, kerasdist.engine_times())
    if rank != 0:
        return
    # An iteration is over when the slowest rank is done with it.
    slowest = [max(per_rank) for per_rank in zip(*(wall for wall, _ in timings))]
    mean_cpu = [statistics.mean(per_rank) for per_rank in zip(*(cpu for _, cpu in timings))]
    total = [size * timer.images_per_iteration / seconds for seconds in slowest]
    median_total = statistics.median(total)
    print(
        f"median over {NUM_ITERS.value} iterations: {median_total / size:.1f} img/s per rank, "
        f"{median_total:.1f} img/s in total on {size} rank(s)",
        flush=True,
    )
    result = {
        "model": MODEL.value,
        "image_size": image_size,
        "parameters": model.count_params(),
        "batch_size_per_rank": BATCH_SIZE.value,
        "ranks": size,
        "kerasdist": USE_KERASDIST.value,
        "fp16_allreduce": USE_KERASDIST.value and FP16_ALLREDUCE.value,
        "average_models_every": AVERAGE_MODELS_EVERY.value if USE_KERASDIST.value else 0,
        "delay_gradients": USE_KERASDIST.value and DELAY_GRADIENTS.value,
        "one_bit_gradients": USE_KERASDIST.value and ONE_BIT_GRADIENTS.value,
        "batches_per_iter": NUM_BATCHES_PER_ITER.value,
        "images_per_second": median_total,
        "images_per_second_per_rank": median_total / size,
        "step_ms": 1e3 * statistics.median(slowest) / NUM_BATCHES_PER_ITER.value,
        "cpu_ms_per_step_per_rank": 1e3 * statistics.median(mean_cpu) / NUM_BATCHES_PER_ITER.value,
        "cpu_ms_per_step_by_thread": cpu_ms_per_step_by_thread(by_thread),
        "iteration_images_per_second": total,
        "threads": {name: os.environ.get(name) for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")},
        "engine_ms_per_step": engine_ms_per_step,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    app.run(main)
