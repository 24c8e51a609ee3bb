"""model.fit of six 512-wide Dense layers (1 MiB of kernel each): 1 MiB buckets hold one each.

Run with KERASDIST_TIMELINE and KERASDIST_BUCKET_BYTES=1048576 set: the test reads when each
step's buckets were queued.
"""

import keras
import numpy as np

import kerasdist as kd

kd.init()
WIDTH, LAYERS, BATCH, STEPS = 512, 6, 512, 12
keras.utils.set_random_seed(kd.rank())
model = keras.Sequential(
    [keras.Input((WIDTH,))] + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(LAYERS)]
)
model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(1e-3)), loss="mse")
x = np.random.default_rng(kd.rank()).normal(size=(BATCH * STEPS, WIDTH)).astype("float32")
model.fit(x, x, batch_size=BATCH, epochs=1, verbose=0, callbacks=kd.callbacks())
print("OVERLAP_STEPS_DONE", flush=True)
