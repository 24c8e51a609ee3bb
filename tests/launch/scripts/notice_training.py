"""fit on one data set sharded by kerasdist.data, with Rank0Checkpoint(resume=True), for a job
given notice to leave in the middle of an epoch.

    notice_training.py DIR RANK  on the first attempt, rank RANK sends itself the notice signal
                                 (SIGUSR1) at the end of batch 1 of epoch 2 (-1: never)
    notice_training.py DIR -1 PATH  on the first attempt, rank 0 creates PATH when epoch 2 begins
                                 and batches from then on take 0.3 s, so that a test can offer
                                 more hosts while the job trains

Each rank prints STARTED_AT=<time.time() once kerasdist is up>, ATTEMPT=<attempt> SIZE=<ranks>
RESUMED_FROM=<epoch>/<batch> and, on the first attempt, BATCH_END=<rank> <epoch> <batch> after
each batch (and NOTICE_AT=<time> before the signal); TRAINED_AT=<time> once fit has returned; at
the end rank 0 prints ITERATIONS=<updates> and MAX_DIFFERENCE=<largest weight difference from
plain Keras in one process on the planned global batch, computed here>.
"""

import os
import signal
import sys
import time

import keras
import numpy as np

import kerasdist as kd

kd.init()
print(f"STARTED_AT={time.time():.3f}", flush=True)
directory, noticed_rank = sys.argv[1], int(sys.argv[2])
grow_signal_path = sys.argv[3] if len(sys.argv) > 3 else None
attempt = int(os.environ.get("KERASDIST_RESTART", "0"))
EPOCHS, PER_RANK_BATCH, NOTICE_EPOCH, UPDATES_PER_EPOCH = 4, 4, 2, 6
GLOBAL_BATCH = PER_RANK_BATCH * kd.planned_size()


class Notice(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if attempt == 0 and grow_signal_path and epoch == NOTICE_EPOCH and kd.rank() == 0:
            open(grow_signal_path, "w").close()

    def on_train_batch_end(self, batch, logs=None):
        if attempt == 0:
            print(f"BATCH_END={kd.rank()} {self._epoch} {batch}", flush=True)
            if grow_signal_path and self._epoch >= NOTICE_EPOCH:
                time.sleep(0.3)
            if kd.rank() == noticed_rank and self._epoch == NOTICE_EPOCH and batch == 1:
                print(f"NOTICE_AT={time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGUSR1)


def make_model():
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])


rng = np.random.default_rng(7)
x = rng.normal(size=(UPDATES_PER_EPOCH * GLOBAL_BATCH, 6)).astype("float32")
y = (np.sin(x) @ np.linspace(-1, 1, 6).reshape(6, 1)).astype("float32")
model = make_model()
model.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
checkpoint = kd.callbacks.Rank0Checkpoint(directory, resume=True)
resumed = checkpoint.resumed_from
print(
    f"ATTEMPT={attempt} SIZE={kd.size()} RESUMED_FROM={checkpoint.initial_epoch}/"
    f"{resumed.batches_of_all_ranks // kd.size() if resumed else 0}",
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
    callbacks=[Notice(), checkpoint, *kd.callbacks()],
)
print(f"TRAINED_AT={time.time():.3f}", flush=True)
if kd.rank() == 0:
    reference = make_model()
    reference.compile(keras.optimizers.Adam(0.01), loss="mse")
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    difference = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights()))
    print(f"ITERATIONS={int(model.optimizer.iterations.numpy())}", flush=True)
    print(f"MAX_DIFFERENCE={difference:.3g}", flush=True)
