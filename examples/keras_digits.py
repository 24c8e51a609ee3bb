"""A Keras script made data-parallel with kerasdist: a small CNN on handwritten digits.

The default data are scikit-learn's bundled 8x8 digits (1,797 real scans, no download). The
lines marked `# kerasdist` are all that differ from a single-process script:

    kerasdist-run -np 2 python -m kerasdist.examples.keras_digits   # installed: pip install 'kerasdist[examples]'
    .venv/bin/kerasdist-run -np 2 examples/keras_digits.py          # in a clone; each rank runs the launcher's Python
    .venv/bin/python examples/keras_digits.py                       # one process, same script

`--tfds_name NAME --data_dir DIR` trains on the train split of a TensorFlow Datasets set already
prepared in DIR and tests on its test split; each rank reads its own files of both
(`kerasdist.data.tfds_load`). Nothing is downloaded: prepare the set where there is network
(`tfds.builder("mnist", data_dir=DIR).download_and_prepare()`) and copy DIR. A prepared set
loads by name from DIR without its builder code, so these digits, written as a TFDS set by the
tests' builder, train offline:

    python tests/tfds_digits.py --data_dir=/tmp/tfds
    kerasdist-run -np 2 python examples/keras_digits.py --tfds_name=kerasdist_digits --data_dir=/tmp/tfds
"""

import sys

import keras
import tensorflow as tf
from absl import app, flags

import kerasdist  # kerasdist
from kerasdist.models import small_cnn

try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ModuleNotFoundError:  # one line on every rank, not a traceback from each
    sys.exit("keras_digits.py needs scikit-learn, for its digits: pip install 'kerasdist[examples]'")

EPOCHS = flags.DEFINE_integer("epochs", 20, "Passes over the training data.")
BATCH = flags.DEFINE_integer("batch_size", 32, "Per-rank batch size.")
LR = flags.DEFINE_float(
    "learning_rate", 0.02, "The single-process learning rate; warmup scales it by the number of processes."
)
WARMUP = flags.DEFINE_float("warmup_epochs", 3, "Epochs over which the learning rate ramps up.")
SEED = flags.DEFINE_integer("seed", 0, "Seed of the split, the weights and the shuffles.")
AVERAGE_MODELS_EVERY = flags.DEFINE_integer(
    "average_models_every", 0, "> 0: local SGD, the ranks averaging their models every so many steps (slow links)."
)
DELAY_GRADIENTS = flags.DEFINE_bool(
    "delay_gradients", False, "Each update applies the step before's gradients, reduced while this step computes."
)
ONE_BIT_GRADIENTS = flags.DEFINE_bool(
    "one_bit_gradients", False, "Send one sign bit per gradient value, with error feedback (slow links)."
)
CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir", None, "Rank 0 saves a checkpoint here each epoch and a rerun resumes from the latest one."
)
TFDS_NAME = flags.DEFINE_string(
    "tfds_name", None, "A TensorFlow Datasets name (e.g. mnist) instead of the bundled digits."
)
DATA_DIR = flags.DEFINE_string("data_dir", None, "Where the --tfds_name data set is already prepared.")


def bundled_digits(seed):
    digits = load_digits()
    images = (digits.images[..., None] / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.25, random_state=seed, stratify=digits.target
    )
    return (x_train, y_train), (x_test, y_test)


def prepared_tfds(name, data_dir, seed):
    """This rank's batched, shuffled share of the train split, and its share of the test split."""
    if data_dir is None:
        sys.exit(
            f"--tfds_name={name} needs --data_dir: this example never downloads. Prepare the data "
            "set where the machine has network access (tfds.builder(name, data_dir=DIR)."
            "download_and_prepare()) and pass --data_dir=DIR."
        )

    def scaled(image, label):
        return tf.cast(image, tf.float32) / 255.0, label

    train = kerasdist.data.tfds_load(
        name,
        "train",
        data_dir,
        batch_size=BATCH.value,
        shuffle_files=True,  # kerasdist
        seed=seed,
        as_supervised=True,
    )
    train = (
        train.map(scaled)
        .shuffle(int(train.cardinality()), seed=kerasdist.data.seed_for_rank(seed))  # kerasdist
        .batch(BATCH.value)
    )
    test = kerasdist.data.tfds_load(name, "test", data_dir, as_supervised=True).map(scaled)  # kerasdist
    x_test, y_test = test.batch(int(test.cardinality())).get_single_element()
    return train, (x_test.numpy(), y_test.numpy())


def main(_):
    kerasdist.init()  # kerasdist
    # Each rank trains on its own shard, shuffled with its own seed, and evaluates on its own
    # part of the test set; the metrics are combined exactly.
    if TFDS_NAME.value:
        train, (x_test, y_test) = prepared_tfds(TFDS_NAME.value, DATA_DIR.value, SEED.value)
    else:
        (x_train, y_train), (x_test, y_test) = bundled_digits(SEED.value)
        x_train, y_train = kerasdist.data.shard((x_train, y_train), batch_size=BATCH.value)  # kerasdist
        x_test, y_test = kerasdist.data.shard((x_test, y_test))  # kerasdist
        train = (
            tf.data.Dataset.from_tensor_slices((x_train, y_train))
            .shuffle(len(x_train), seed=kerasdist.data.seed_for_rank(SEED.value))  # kerasdist
            .batch(BATCH.value)
        )

    keras.utils.set_random_seed(SEED.value)
    model = small_cnn(input_shape=x_test.shape[1:], num_classes=10)
    optimizer = keras.optimizers.SGD(LR.value, momentum=0.9)
    if not AVERAGE_MODELS_EVERY.value:  # local SGD keeps the plain optimizer
        optimizer = kerasdist.DistributedOptimizer(  # kerasdist
            optimizer, delay_gradients=DELAY_GRADIENTS.value, one_bit_gradients=ONE_BIT_GRADIENTS.value
        )
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    # With a checkpoint directory, a rerun continues after the last saved epoch.
    callbacks = kerasdist.callbacks(
        warmup_epochs=WARMUP.value,
        checkpoint_dir=CHECKPOINT_DIR.value,  # kerasdist
        resume=CHECKPOINT_DIR.value is not None,
        average_models_every=AVERAGE_MODELS_EVERY.value or None,
    )
    # shuffle=False: the dataset shuffles itself (per rank, above); Keras warns that it ignores shuffle=True.
    model.fit(
        train, epochs=EPOCHS.value, validation_data=(x_test, y_test), callbacks=callbacks, shuffle=False, verbose=2
    )
    loss, accuracy = model.evaluate(x_test, y_test, verbose=0)  # exact over every rank's part
    test_images = sum(kerasdist.allgather_object(len(y_test)))  # kerasdist: every rank calls collectives
    if kerasdist.rank() == 0:  # kerasdist
        print(
            f"{kerasdist.size()} process(es): test accuracy {accuracy:.4f}, test loss {loss:.4f} "
            f"on {test_images} held-out images"
        )


if __name__ == "__main__":
    app.run(main)
