"""fit on one data set sharded by kerasdist.data, with Rank0Checkpoint(resume=True), for a job
that `kerasdist-run --min-np` may restart on fewer ranks than planned.

    shrinking_training.py DIR raise      on the first attempt, rank 1 raises in epoch 2
    shrinking_training.py DIR slow PATH  on the first attempt, batches from epoch 2 on take 0.5 s
                                         and rank 0 creates PATH when epoch 2 begins, so that a
                                         test can take a host away while the job trains

Each rank prints STARTED_AT=<time.time() once kerasdist is up>, then ATTEMPT=<attempt>
SIZE=<ranks> PLANNED=<planned ranks> RESUMED_FROM=<epoch>; at the end rank 0 prints
ITERATIONS=<updates> and MAX_DIFFERENCE=<largest weight difference from plain Keras in one
process on the planned global batch, computed here>.
"""

import os
import sys
import time
from pathlib import Path

import keras
import numpy as np

import kerasdist as kd

kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)
print(f"STARTED_AT={time.time():.3f}", flush=True)
directory, mode = sys.argv[1], sys.argv[2]
attempt = int(os.environ.get("KERASDIST_RESTART", "0"))
EPOCHS, PER_RANK_BATCH, FAULT_EPOCH = 5, 8, 2
GLOBAL_BATCH = PER_RANK_BATCH * kd.planned_size()
UPDATES_PER_EPOCH = 4


class Fault(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if attempt == 0 and mode == "slow" and epoch == FAULT_EPOCH and kd.rank() == 0:
            Path(sys.argv[3]).touch()

    def on_train_batch_end(self, batch, logs=None):
        if attempt == 0 and self._epoch >= FAULT_EPOCH:
            if mode == "raise" and kd.rank() == 1:
                raise RuntimeError(f"injected fault in epoch {self._epoch}")
            if mode == "slow":
                time.sleep(0.5)


def make_model():
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])


rng = np.random.default_rng(7)
x = rng.normal(size=(UPDATES_PER_EPOCH * GLOBAL_BATCH, 6)).astype("float32")
y = (np.sin(x) @ np.linspace(-1, 1, 6).reshape(6, 1)).astype("float32")
model = make_model()
model.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
checkpoint = kd.callbacks.Rank0Checkpoint(directory, resume=True)
print(
    f"ATTEMPT={attempt} SIZE={kd.size()} PLANNED={kd.planned_size()} RESUMED_FROM={checkpoint.initial_epoch}",
    flush=True,
)
x_shard, y_shard = kd.data.shard((x, y), batch_size=PER_RANK_BATCH)
model.fit(
    x_shard,
    y_shard,
    batch_size=PER_RANK_BATCH,
    epochs=EPOCHS,
    shuffle=False,
    verbose=0,
    callbacks=[*kd.callbacks(), checkpoint, Fault()],
)
if kd.rank() == 0:
    reference = make_model()
    reference.compile(keras.optimizers.Adam(0.01), loss="mse")
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    difference = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights()))
    print(f"ITERATIONS={int(model.optimizer.iterations.numpy())}", flush=True)
    print(f"MAX_DIFFERENCE={difference:.3g}", flush=True)
