"""model.fit with kerasdist across ranks against plain Keras in one process at the global batch.

Every rank trains an MLP with DistributedOptimizer(SGD with momentum) and kerasdist.callbacks()
on its shard (kerasdist.data.shard: rows rank, rank + size, ...), PER_RANK_BATCH rows a step.
Step k of the ranks together then covers rows [k·size·B, (k+1)·size·B) of the whole set, which
is the batch a single process with batch size·B trains on at step k; and the mean of equal-sized
per-rank mean losses is the global mean. Rank 0 then trains that single process itself, with
plain Keras from the same initial weights, and prints
FIT {"rank": 0, "size": n, "max_weight_difference": ..., "largest_update": ..., "loss": [...],
     "reference_loss": [...]}
(largest_update: how far training moved the weights, so that a run that changed nothing
cannot pass). Every rank prints FIT {"rank": r, "weights_digest": ...} to show all end equal.
"""

import hashlib
import json
import sys

import keras
import numpy as np

import kerasdist as kd

PER_RANK_BATCH = 16
EPOCHS = 3
FEATURES, CLASSES = 12, 4

kd.init()
rank, size = kd.rank(), kd.size()
rng = np.random.default_rng(7)
x = rng.normal(size=(size * PER_RANK_BATCH * 8, FEATURES)).astype("float32")
y = (x[:, :CLASSES] + 0.3 * rng.normal(size=(len(x), CLASSES))).argmax(axis=1)


def make_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ]
    )


def optimizer():
    return keras.optimizers.SGD(0.1, momentum=0.9)


model = make_model()
initial = [w.copy() for w in model.get_weights()]
model.compile(kd.DistributedOptimizer(optimizer()), loss="sparse_categorical_crossentropy")
shard_x, shard_y = kd.data.shard((x, y), batch_size=PER_RANK_BATCH)
history = model.fit(
    shard_x, shard_y, batch_size=PER_RANK_BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=kd.callbacks()
)
weights = model.get_weights()
digest = hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest()
report = {"rank": rank, "weights_digest": digest}
if rank == 0:
    reference = make_model()
    reference.set_weights(initial)
    reference.compile(optimizer(), loss="sparse_categorical_crossentropy")
    reference_history = reference.fit(x, y, batch_size=size * PER_RANK_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    report.update(
        size=size,
        max_weight_difference=max(float(np.abs(a - b).max()) for a, b in zip(weights, reference.get_weights())),
        largest_update=max(float(np.abs(a - b).max()) for a, b in zip(weights, initial)),
        loss=history.history["loss"],
        reference_loss=reference_history.history["loss"],
    )
sys.stdout.write("FIT " + json.dumps(report) + "\n")
