"""The job benchmarks/elastic.py gives notices to: fit a small model, on a data set sharded by
kerasdist.data, with Rank0Checkpoint(resume=True), epoch after epoch until a file appears.

    elastic_training.py CHECKPOINTS STATE FINISH

Each rank, at its first batch of an attempt, writes STATE/up-<attempt>-<rank> holding
"<pid> <ranks> <time.time()>" (so the benchmark can signal it and time its start) and prints
RESUMED_FROM=<attempt> <epoch>/<batches of all ranks>. Batches take at least 0.05 s, so that an
epoch lasts long enough to be given notice in. At the end of the epoch in which FINISH exists,
every rank stops; rank 0 prints ITERATIONS=<updates> and MAX_DIFFERENCE=<largest weight
difference from plain Keras in one process, on the planned global batch, over as many epochs>.
"""

import os
import pathlib
import sys
import time

import keras
import numpy as np

import kerasdist as kd

kd.init()
checkpoints, state, finish = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
attempt = int(os.environ.get("KERASDIST_RESTART", "0"))
PER_RANK_BATCH, UPDATES_PER_EPOCH, LONGEST_EPOCHS = 4, 12, 100_000
GLOBAL_BATCH = PER_RANK_BATCH * kd.planned_size()


class Pace(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if not hasattr(self, "up"):
            self.up = time.time()
            written = state / f".up-{attempt}-{kd.rank()}"
            written.write_text(f"{os.getpid()} {kd.size()} {self.up:.3f}\n")
            written.rename(state / f"up-{attempt}-{kd.rank()}")
        time.sleep(0.05)

    def on_epoch_end(self, epoch, logs=None):
        if finish.exists():
            self.model.stop_training = True  # StopAgreement makes every rank stop here


def make_model():
    keras.utils.set_random_seed(11)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])


rng = np.random.default_rng(11)
x = rng.normal(size=(UPDATES_PER_EPOCH * GLOBAL_BATCH, 6)).astype("float32")
y = (np.sin(x) @ np.linspace(-1, 1, 6).reshape(6, 1)).astype("float32")
model = make_model()
model.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.003)), loss="mse")
checkpoint = kd.callbacks.Rank0Checkpoint(checkpoints, keep_last=3, resume=True)
resumed = checkpoint.resumed_from
if kd.rank() == 0:
    batches = resumed.batches_of_all_ranks if resumed else 0
    print(f"RESUMED_FROM={attempt} {checkpoint.initial_epoch}/{batches}", flush=True)
x_shard, y_shard = kd.data.shard((x, y), batch_size=PER_RANK_BATCH)
model.fit(
    x_shard,
    y_shard,
    batch_size=PER_RANK_BATCH,
    epochs=LONGEST_EPOCHS,
    shuffle=False,
    verbose=0,
    callbacks=[checkpoint, Pace(), *kd.callbacks()],
)
if kd.rank() == 0:
    updates = int(model.optimizer.iterations.numpy())
    reference = make_model()
    reference.compile(keras.optimizers.Adam(0.003), loss="mse")
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=updates // UPDATES_PER_EPOCH, shuffle=False, verbose=0)
    difference = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights()))
    print(f"ITERATIONS={updates}", flush=True)
    print(f"MAX_DIFFERENCE={difference:.3g}", flush=True)
