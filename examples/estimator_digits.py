"""tf.estimator-style code, data-parallel with kerasdist: a DNN classifier on handwritten digits.

`model_fn` and the two `input_fn`s are written the way they were for TF1's `tf.estimator`, with
Keras 3 layers in place of `tf.layers`. `train_and_evaluate` trains on every rank (gradients
averaged across ranks), checkpoints from rank 0, and evaluates on every rank's shard of the test
set, combining the metrics exactly. The data are scikit-learn's bundled 8x8 digits (no download).

    kerasdist-run -np 2 python -m kerasdist.examples.estimator_digits   # installed: pip install 'kerasdist[examples]'
    .venv/bin/kerasdist-run -np 2 examples/estimator_digits.py          # in a clone, under the launcher's Python
    .venv/bin/python examples/estimator_digits.py                       # one process, same script

Run it again with the same --model_dir and a larger --max_steps to continue from the newest
checkpoint.
"""

import itertools
import logging
import sys

import keras
import tensorflow as tf
from absl import app, flags

import kerasdist
from kerasdist import estimator

try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ModuleNotFoundError:  # one line on every rank, not a traceback from each
    sys.exit("estimator_digits.py needs scikit-learn, for its digits: pip install 'kerasdist[examples]'")

MODEL_DIR = flags.DEFINE_string(
    "model_dir", None, "Where rank 0 keeps checkpoints and summaries (default: a temporary directory, deleted at exit)."
)
HIDDEN_UNITS = flags.DEFINE_list("hidden_units", ["128", "64"], "Sizes of the hidden layers.")
LEARNING_RATE = flags.DEFINE_float("learning_rate", 0.003, "Adam's learning rate.")
BATCH_SIZE = flags.DEFINE_integer("batch_size", 32, "Per-rank batch size.")
MAX_STEPS = flags.DEFINE_integer("max_steps", 600, "Train until the global step reaches this.")
EVAL_EVERY = flags.DEFINE_integer("eval_every", 200, "Checkpoint and evaluate every this many steps.")
SEED = flags.DEFINE_integer("seed", 0, "Seed of the split, the initial weights and the shuffles.")
EXPORT_PATH = flags.DEFINE_string(
    "export_path",
    None,
    "Also export the trained model here: a .keras file, or a SavedModel directory for any other name.",
)


def digits_split(seed):
    digits = load_digits()
    pixels = (digits.data / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(
        pixels, digits.target, test_size=0.25, random_state=seed, stratify=digits.target
    )
    return (x_train, y_train), (x_test, y_test)


def model_fn(features, labels, mode, params):
    """A DNN classifier, as for tf.estimator; the layers are Keras 3 layers gathered in a model."""
    hidden = [keras.layers.Dense(units, activation="relu") for units in params["hidden_units"]]
    model = keras.Sequential(hidden + [keras.layers.Dense(params["n_classes"])])
    logits = model(features["pixels"], training=mode == estimator.ModeKeys.TRAIN)
    predictions = {"class_ids": tf.argmax(logits, axis=1), "probabilities": tf.nn.softmax(logits)}
    if mode == estimator.ModeKeys.PREDICT:
        return estimator.EstimatorSpec(mode, predictions=predictions, model=model)

    loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    accuracy.update_state(labels, logits)
    return estimator.EstimatorSpec(
        mode,
        loss=loss,
        optimizer=keras.optimizers.Adam(params["learning_rate"]),
        eval_metrics={"accuracy": accuracy},
        model=model,
    )


def print_estimator_progress():
    """Rank 0's Estimator reports (checkpoints, evaluations, the loss) as plain lines, without the
    header absl's log handler would give every record."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    progress = logging.getLogger("kerasdist.estimator")
    progress.addHandler(handler)
    progress.setLevel(logging.INFO)
    progress.propagate = False


def main(_):
    kerasdist.init()
    print_estimator_progress()
    (x_train, y_train), (x_test, y_test) = digits_split(SEED.value)

    def train_input_fn(params, input_context):
        # With input_context the function shards its data itself: first the shard, then a
        # shuffle seeded differently on every rank.
        dataset = tf.data.Dataset.from_tensor_slices(({"pixels": x_train}, y_train))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        dataset = dataset.shuffle(len(x_train), seed=kerasdist.data.seed_for_rank(SEED.value))
        return dataset.repeat().batch(params["batch_size"])

    def eval_input_fn(params):
        # Without input_context the Estimator shards the batches across ranks by itself.
        return tf.data.Dataset.from_tensor_slices(({"pixels": x_test}, y_test)).batch(params["batch_size"])

    keras.utils.set_random_seed(SEED.value)  # rank 0's initial weights, which every rank starts from
    classifier = estimator.Estimator(
        model_fn,
        model_dir=MODEL_DIR.value,
        config=estimator.RunConfig(save_checkpoints_steps=EVAL_EVERY.value, log_step_count_steps=100),
        params={
            "hidden_units": [int(units) for units in HIDDEN_UNITS.value],
            "n_classes": 10,
            "learning_rate": LEARNING_RATE.value,
            "batch_size": BATCH_SIZE.value,
        },
    )
    metrics = estimator.train_and_evaluate(
        classifier, estimator.TrainSpec(train_input_fn, max_steps=MAX_STEPS.value), estimator.EvalSpec(eval_input_fn)
    )

    # predict() and export_model() are collectives too: every rank calls them.
    first_digits = classifier.predict(lambda: tf.data.Dataset.from_tensor_slices({"pixels": x_test[:10]}).batch(10))
    predicted = [int(prediction["class_ids"]) for prediction in itertools.islice(first_digits, 10)]
    if EXPORT_PATH.value:
        classifier.export_model(EXPORT_PATH.value)
    if kerasdist.rank() == 0:
        print(
            f"{kerasdist.size()} process(es): accuracy {metrics['accuracy']:.4f}, loss {metrics['loss']:.4f} at "
            f"global step {metrics['global_step']} on {len(y_test)} held-out digits"
        )
        print(f"first 10 test digits: predicted {predicted}, true {y_test[:10].tolist()}")


if __name__ == "__main__":
    app.run(main)
