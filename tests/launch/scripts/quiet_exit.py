"""Ranks leave with os._exit(STATUS), which skips every exit handler: rank 1 alone in the middle
of `fit` (WHEN=mid_fit), or every rank once `fit` is over (WHEN=after_fit). With --once, rank 1
leaves mid-fit only in the first attempt of a `kerasdist-run --restarts` job.

Expected: mid-fit, the job ends soon with a non-zero status (STATUS when it is not 0) and a line
naming rank 1; the other ranks never finish `fit`. After fit, the job ends with STATUS.
"""

import os
import sys
import time

import keras
import numpy as np

import kerasdist as kd

status, when = int(sys.argv[1]), sys.argv[2]
leave_mid_fit = when == "mid_fit" and ("--once" not in sys.argv or os.environ.get("KERASDIST_RESTART") == "0")
kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)


class LeaveQuietly(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if leave_mid_fit and kd.rank() == 1 and batch == 2:
            print(f"FAIL_AT={time.time()}", flush=True)
            os._exit(status)


model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
rows = np.ones((16, 3), "float32")
model.fit(rows, rows[:, :1], batch_size=2, epochs=2, verbose=0, callbacks=kd.callbacks(extra=[LeaveQuietly()]))
print(f"FIT_FINISHED rank={kd.rank()}", flush=True)
os._exit(status)
