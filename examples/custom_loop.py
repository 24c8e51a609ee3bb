"""A custom training loop made data-parallel with `kerasdist.DistributedGradientTape`.

For code that writes its own `tf.function` train step instead of calling `model.fit`. The
model is an MLP on scikit-learn's bundled digits; every rank trains on its own shard.

    kerasdist-run -np 2 python -m kerasdist.examples.custom_loop   # installed: pip install 'kerasdist[examples]'
    .venv/bin/kerasdist-run -np 2 examples/custom_loop.py          # in a clone; each rank runs the launcher's Python
"""

import sys

import keras
import tensorflow as tf
from absl import app, flags

import kerasdist
from kerasdist.models import mlp

try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ModuleNotFoundError:  # one line on every rank, not a traceback from each
    sys.exit("custom_loop.py needs scikit-learn, for its digits: pip install 'kerasdist[examples]'")

EPOCHS = flags.DEFINE_integer("epochs", 15, "Passes over the training data.")
BATCH = flags.DEFINE_integer("batch_size", 32, "Per-rank batch size.")
LR = flags.DEFINE_float("learning_rate", 0.05, "Single-process learning rate, scaled by the number of processes.")
SEED = flags.DEFINE_integer("seed", 0, "Seed of the split, the weights and the shuffles.")


def main(_):
    kerasdist.init()
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=SEED.value, stratify=digits.target
    )
    x_train, y_train = kerasdist.data.shard((x_train, y_train), batch_size=BATCH.value)
    x_test, y_test = kerasdist.data.shard((x_test, y_test))
    train = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=kerasdist.data.seed_for_rank(SEED.value))
        .batch(BATCH.value)
    )

    keras.utils.set_random_seed(SEED.value)
    model = mlp((64,), num_classes=10, hidden=(64,), classifier_activation=None)
    optimizer = keras.optimizers.SGD(LR.value * kerasdist.size(), momentum=0.9)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # Same starting point everywhere: rank 0's weights and (fresh) optimizer state.
    kerasdist.broadcast_variables(model.variables + optimizer.variables, root_rank=0)

    @tf.function
    def train_step(images, labels):
        with kerasdist.DistributedGradientTape(tf.GradientTape()) as tape:
            loss = loss_fn(labels, model(images, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    for epoch in range(EPOCHS.value):
        losses = [train_step(images, labels) for images, labels in train]
        # The mean of the per-rank mean losses (equal batch counts on every rank).
        mean_loss = kerasdist.allreduce(tf.reduce_mean(losses), name=f"epoch_loss.{epoch}")
        if kerasdist.rank() == 0 and (epoch + 1) % 5 == 0:
            print(f"epoch {epoch + 1}: training loss {float(mean_loss):.4f}", flush=True)

    # Exact accuracy over the whole test set: sum the correct counts and the sizes.
    correct = tf.reduce_sum(tf.cast(tf.argmax(model(x_test), axis=1) == y_test, tf.int64))
    totals = kerasdist.allreduce(tf.stack([correct, tf.constant(len(y_test), tf.int64)]), op=kerasdist.Sum)
    if kerasdist.rank() == 0:
        print(
            f"{kerasdist.size()} process(es): test accuracy {int(totals[0]) / int(totals[1]):.4f} "
            f"on {int(totals[1])} held-out images"
        )


if __name__ == "__main__":
    app.run(main)
