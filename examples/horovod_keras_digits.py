"""A Horovod TF2 Keras script, run on kerasdist by changing its import line alone.

Written the way Horovod's Keras examples are: a scaled learning rate, Horovod's warmup (which
takes the scaled rate), a broadcast and a metric-average callback, a dataset that repeats with
`steps_per_epoch` divided by the number of workers, and a checkpoint callback that only rank 0
adds. The data are scikit-learn's bundled digits (no download):

    kerasdist-run -np 2 python -m kerasdist.examples.horovod_keras_digits   # pip install 'kerasdist[examples]'
    .venv/bin/kerasdist-run -np 2 examples/horovod_keras_digits.py --checkpoint_dir=/tmp/hvd_checkpoints   # a clone
"""

import os
import sys

import keras
import tensorflow as tf
from absl import app, flags

import kerasdist.horovod.tensorflow.keras as hvd  # was: import horovod.tensorflow.keras as hvd

try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ModuleNotFoundError:  # one line on every rank, not a traceback from each
    sys.exit("horovod_keras_digits.py needs scikit-learn, for its digits: pip install 'kerasdist[examples]'")

EPOCHS = flags.DEFINE_integer("epochs", 20, "Epochs to train.")
CHECKPOINT_DIR = flags.DEFINE_string("checkpoint_dir", None, "Where rank 0 saves a checkpoint each epoch.")


def main(_):
    hvd.init()

    digits = load_digits()
    images = (digits.images[..., None] / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.25, random_state=0, stratify=digits.target
    )
    batch_size = 32
    dataset = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .repeat()
        .shuffle(len(x_train), seed=hvd.rank())
        .batch(batch_size)
    )

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, activation="relu", padding="same"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu", padding="same"),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    scaled_lr = 0.02 * hvd.size()  # Horovod's recipe: scale the rate by the number of workers
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(scaled_lr, momentum=0.9))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]
    if hvd.rank() == 0 and CHECKPOINT_DIR.value:  # only the root writes checkpoints
        os.makedirs(CHECKPOINT_DIR.value, exist_ok=True)
        callbacks.append(
            keras.callbacks.ModelCheckpoint(os.path.join(CHECKPOINT_DIR.value, "checkpoint-{epoch}.keras"))
        )

    model.fit(
        dataset,
        steps_per_epoch=len(x_train) // (batch_size * hvd.size()),
        epochs=EPOCHS.value,
        callbacks=callbacks,
        verbose=2 if hvd.rank() == 0 else 0,
    )
    if hvd.rank() == 0:  # evaluation on rank 0 alone: Horovod's metric averaging leaves evaluate() local
        loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
        print(f"{hvd.size()} worker(s): test accuracy {accuracy:.4f}, test loss {loss:.4f}")


if __name__ == "__main__":
    app.run(main)
