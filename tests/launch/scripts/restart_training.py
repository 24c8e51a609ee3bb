"""fit with Rank0Checkpoint(resume=True); on the job's first attempt (KERASDIST_RESTART=0) rank 1
raises in the middle of epoch argv[2] (-1: never). argv[1]: the checkpoint directory.

Prints RESUMED_FROM=<epoch this attempt started at> and, at the end, WEIGHTS=<hex of every weight>.
"""

import os
import sys

import keras
import numpy as np

import kerasdist as kd

kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)
directory, fail_epoch = sys.argv[1], int(sys.argv[2])
attempt = int(os.environ.get("KERASDIST_RESTART", "0"))
EPOCHS = 4


class FailOnce(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if attempt == 0 and kd.rank() == 1 and self._epoch == fail_epoch and batch == 2:
            raise RuntimeError(f"injected fault in epoch {fail_epoch}")


keras.utils.set_random_seed(7)
rng = np.random.default_rng([7, kd.rank()])
x = rng.normal(size=(64, 8)).astype("float32")
y = (x @ np.linspace(-1, 1, 8).reshape(8, 1)).astype("float32")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
model.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
checkpoint = kd.callbacks.Rank0Checkpoint(directory, resume=True)
print(f"RESUMED_FROM={checkpoint.initial_epoch}", flush=True)
model.fit(
    x, y, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[*kd.callbacks(), checkpoint, FailOnce()]
)
if kd.rank() == 0:
    print("WEIGHTS=" + "".join(w.tobytes().hex() for w in model.get_weights()), flush=True)
