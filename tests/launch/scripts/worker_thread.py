"""kerasdist started in a thread other than the main thread: that thread's unnamed eager
collectives (kerasdist's own callbacks in fit make some) work, the main thread's are refused.

argv[1]:
* "init": a worker thread calls kerasdist.init(), then builds a model, compiles it with a
  DistributedOptimizer and fits it with kerasdist.callbacks(). Each rank prints its trained
  weights (`WEIGHTS rank=R [...]`); rank 0 also those of one plain Keras process fitted on
  every rank's data with the global batch (`REFERENCE [...]`).
* "optimizer": the same without init(): the DistributedOptimizer starts kerasdist.
* "py_function": a named collective in a `tf.py_function` body, which TensorFlow runs on one of
  its own threads, starts kerasdist.
Then the main thread makes one unnamed allreduce and prints `MAIN_REFUSED rank=R <message>`
(or `MAIN_RAN rank=R` if it ran). Exits 1 if the worker thread raised.
"""

import json
import os
import sys
import threading
import traceback

import keras
import numpy as np
import tensorflow as tf

import kerasdist as kd

MODE = sys.argv[1]
ROWS_PER_RANK, BATCH_PER_RANK, EPOCHS = 16, 4, 2


def rank_data(rank):
    x = np.random.default_rng(rank).normal(size=(ROWS_PER_RANK, 3)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def build_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])


def one_process_weights(initial_weights, size):
    """One plain Keras process fitted with the global batch: its batch i holds every rank's
    batch i, in rank order."""
    per_rank = [rank_data(rank) for rank in range(size)]
    batches = range(ROWS_PER_RANK // BATCH_PER_RANK)
    rows = [slice(i * BATCH_PER_RANK, (i + 1) * BATCH_PER_RANK) for i in batches]
    x = np.concatenate([data[0][r] for r in rows for data in per_rank])
    y = np.concatenate([data[1][r] for r in rows for data in per_rank])
    model = build_model()
    model.set_weights(initial_weights)
    model.compile(keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=BATCH_PER_RANK * size, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


def as_json(weights):
    return json.dumps([w.tolist() for w in weights])


def train():
    if MODE == "init":
        kd.init()
    model = build_model()
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(0.05))
    print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)
    initial_weights = model.get_weights()
    model.compile(optimizer, loss="mse")
    x, y = rank_data(kd.rank())
    model.fit(x, y, batch_size=BATCH_PER_RANK, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=kd.callbacks())
    print(f"WEIGHTS rank={kd.rank()} {as_json(model.get_weights())}", flush=True)
    if kd.rank() == 0:
        print(f"REFERENCE {as_json(one_process_weights(initial_weights, kd.size()))}", flush=True)


def start_in_a_py_function():
    @tf.function
    def step(x):
        return tf.py_function(lambda value: kd.allreduce(value, name="first_call"), [x], tf.float32)

    step(tf.constant(1.0))
    print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)


worker_error = []


def in_the_worker():
    try:
        train()
    except Exception:  # noqa: BLE001 - reported below, and the script fails
        worker_error.append(traceback.format_exc())


if MODE == "py_function":
    start_in_a_py_function()
else:
    worker = threading.Thread(target=in_the_worker, name="trainer")
    worker.start()
    worker.join()
try:
    kd.allreduce(tf.constant(1.0))
    print(f"MAIN_RAN rank={kd.rank()}", flush=True)
except RuntimeError as refusal:
    print(f"MAIN_REFUSED rank={kd.rank()} {refusal}", flush=True)
if worker_error:
    print(f"WORKER_FAILED rank={kd.rank()}\n{worker_error[0]}", flush=True)
    sys.exit(1)
