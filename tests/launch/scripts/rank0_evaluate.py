"""fit with kerasdist.callbacks(), then rank 0 alone calls model.evaluate() while the other ranks
finish: the pattern that needs `local_metrics(model)`. argv[1]: "local" wraps it, "plain" does not."""

import os
import sys

import keras
import numpy as np

import kerasdist as kd

kd.init()
print(f"LAUNCH_PID rank={kd.rank()} pid={os.getpid()}", flush=True)
x = np.random.default_rng(kd.rank()).normal(size=(16, 3)).astype("float32")
y = x.sum(axis=1, keepdims=True)
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse", metrics=["mae"])
model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=kd.callbacks())
if kd.rank() == 0:
    if sys.argv[1] == "local":
        with kd.callbacks.local_metrics(model):
            print("EVALUATED=", model.evaluate(x, y, verbose=0), flush=True)
    else:
        model.evaluate(x, y, verbose=0)
print(f"RANK_DONE={kd.rank()}", flush=True)
