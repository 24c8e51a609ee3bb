"""Data-parallel training on scikit-learn's bundled handwritten digits with the core collectives.

Every rank holds a replica of a small Keras model, trains on its own shard of the data and
averages gradients with one fused ``kerasdist.grouped_allreduce`` per step; test accuracy is
combined exactly from per-rank counts. Run with any number of processes:

    mpiexec -n 2 python examples/allreduce_digits.py
"""
from absl import app, flags

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import kerasdist

EPOCHS = flags.DEFINE_integer("epochs", 30, "Passes over each rank's shard.")
BATCH = flags.DEFINE_integer("batch_size", 32, "Per-rank batch size.")
LR = flags.DEFINE_float("learning_rate", 0.05, "Single-process learning rate; scaled by size().")
SEED = flags.DEFINE_integer("seed", 0, "Split and initialisation seed.")


def main(_):
    kerasdist.init()
    rank, size = kerasdist.rank(), kerasdist.size()
    digits = load_digits()
    x = (digits.images.reshape(-1, 64) / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25,
                                                        random_state=SEED.value, stratify=digits.target)
    # Each rank trains on every size-th example; equal step counts keep the allreduces paired.
    steps = len(x_train) // size // BATCH.value
    shard = slice(rank, steps * BATCH.value * size, size)
    x_shard, y_shard = x_train[shard], y_train[shard]

    keras.utils.set_random_seed(SEED.value + rank)  # replicas start different on purpose...
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    kerasdist.broadcast_variables(model.trainable_variables, root_rank=0)  # ...and are made equal here
    optimizer = keras.optimizers.SGD(LR.value * size, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = kerasdist.grouped_allreduce(tape.gradient(loss, model.trainable_variables))
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return kerasdist.allreduce(loss)

    dataset = tf.data.Dataset.from_tensor_slices((x_shard, y_shard))
    for epoch in range(EPOCHS.value):
        losses = [train_step(xb, yb) for xb, yb in dataset.shuffle(len(x_shard), seed=epoch).batch(BATCH.value)]
        if rank == 0 and (epoch + 1) % 10 == 0:
            print(f"epoch {epoch + 1}: mean loss {float(np.mean(losses)):.4f}", flush=True)

    # Exact accuracy: sum correct predictions and counts over the test shards.
    test = slice(rank, None, size)
    correct = np.sum(np.argmax(model(x_test[test]), axis=1) == y_test[test])
    totals = kerasdist.allreduce(tf.constant([correct, len(y_test[test])], tf.int64), op=kerasdist.Sum).numpy()
    if rank == 0:
        print(f"{size} process(es), {steps} steps/epoch, test accuracy {totals[0] / totals[1]:.4f} "
              f"on {totals[1]} held-out digits")


if __name__ == "__main__":
    app.run(main)
