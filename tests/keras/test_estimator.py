"""The Estimator wrapper: model_fn / input_fn training, evaluation and prediction across ranks.

Runs as one process and under `mpiexec -n 2` / `-n 3`; every rank runs every test. Expected
values come from plain Keras or NumPy on the union of every rank's data, computed on each rank.
"""

import glob
import os
import re
import shutil
import tempfile
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd
from kerasdist import estimator
from kerasdist.estimator import EstimatorSpec, ModeKeys

kd.init()
RANK, SIZE = kd.rank(), kd.size()
NUM_CLASSES = 3


def examples(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.5)


def classifier():
    """Seeded initializers: every call starts from the same weights, here and in model_fn."""
    return keras.Sequential(
        [
            keras.layers.Dense(8, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(seed=1)),
            keras.layers.Dense(NUM_CLASSES, kernel_initializer=keras.initializers.GlorotUniform(seed=2)),
        ]
    )


def mean_cross_entropy(labels, logits):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))


def classifier_fn(features, labels, mode):
    model = classifier()
    logits = model(features, training=mode == ModeKeys.TRAIN)
    if mode == ModeKeys.PREDICT:
        return EstimatorSpec(mode, predictions={"logits": logits, "class": tf.argmax(logits, 1)}, model=model)
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    accuracy.update_state(labels, logits)
    return EstimatorSpec(
        mode,
        loss=mean_cross_entropy(labels, logits),
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        eval_metrics={"accuracy": accuracy},
        model=model,
    )


def batches(x, y=None, batch_size=4, repeat=False):
    """An input_fn without input_context: the Estimator shards its batches across ranks."""

    def input_fn():
        dataset = tf.data.Dataset.from_tensor_slices(x if y is None else (x, y))
        return (dataset.repeat() if repeat else dataset).batch(batch_size)

    return input_fn


def rows_of_this_rank(x, y, rows_per_rank):
    """An input_fn that gives rank r rows [r*k, (r+1)*k) as its batch, again and again."""

    def input_fn(input_context):
        start = input_context.input_pipeline_id * rows_per_rank
        rows = slice(start, start + rows_per_rank)
        return tf.data.Dataset.from_tensors((x[rows], y[rows])).repeat()

    return input_fn


@pytest.fixture(scope="module")
def shared_root():
    root = kd.broadcast_object(tempfile.mkdtemp(prefix="kerasdist-estimator-") if RANK == 0 else None)
    yield root
    kd.barrier()
    if RANK == 0:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def model_dir(shared_root, request):
    # No brackets from parametrized names: checkpoint lookup treats them as glob patterns.
    return os.path.join(shared_root, re.sub(r"[^\w.-]", "_", request.node.name))


def test_train_evaluate_and_predict(model_dir):
    x, y = examples(48, seed=1)
    trained = estimator.Estimator(classifier_fn, model_dir=model_dir)
    assert trained.train(batches(x, y, repeat=True), steps=6) is trained

    results = trained.evaluate(batches(x, y, batch_size=5))
    assert set(results) == {"loss", "accuracy", "global_step"} and results["global_step"] == 6
    assert kd.allgather_object(results) == [results] * SIZE

    predictions = list(trained.predict(batches(x, batch_size=5)))
    assert len(predictions) == len(x)  # predict does not shard: every rank predicts everything
    assert predictions[0]["logits"].shape == (NUM_CLASSES,) and predictions[0]["class"].shape == ()
    logits = np.stack([p["logits"] for p in predictions])
    assert all(np.array_equal(logits, other) for other in kd.allgather_object(logits))
    whole_batches = list(trained.predict(batches(x, batch_size=20), yield_single_examples=False))
    assert [len(batch["class"]) for batch in whole_batches] == [20, 20, 8]


def test_a_step_averages_the_gradients_of_all_ranks(model_dir):
    # Equal batches on every rank: the mean of the ranks' mean losses is the mean over the union.
    x, y = examples(4 * SIZE, seed=2)
    trained = estimator.Estimator(classifier_fn, model_dir=model_dir)
    trained.train(rows_of_this_rank(x, y, rows_per_rank=4), steps=2)
    got = np.stack([p["logits"] for p in trained.predict(batches(x, batch_size=8))])

    reference = classifier()
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = mean_cross_entropy(y, reference(x))
        optimizer.apply(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables)
    np.testing.assert_allclose(got, reference(x).numpy(), rtol=1e-5, atol=1e-6)


def classifier_with_optimizer_fn(**optimizer_options):
    """classifier_fn, but model_fn returns DistributedOptimizer(SGD, **optimizer_options) itself."""

    def model_fn(features, labels, mode):
        model = classifier()
        logits = model(features, training=mode == ModeKeys.TRAIN)
        if mode == ModeKeys.PREDICT:
            return EstimatorSpec(mode, predictions={"logits": logits}, model=model)
        optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), **optimizer_options)
        return EstimatorSpec(mode, loss=mean_cross_entropy(labels, logits), optimizer=optimizer, model=model)

    return model_fn


def gradients_of(model, x, y):
    with tf.GradientTape() as tape:
        loss = mean_cross_entropy(y, model(x))
    return [tf.identity(g) for g in tape.gradient(loss, model.trainable_variables)]


def trained_logits(options, x, y, model_dir, steps):
    trained = estimator.Estimator(classifier_with_optimizer_fn(**options), model_dir=model_dir)
    trained.train(rows_of_this_rank(x, y, rows_per_rank=4), steps=steps)
    return np.stack([p["logits"] for p in trained.predict(batches(x, batch_size=8))])


def test_a_delayed_gradients_optimizer_from_model_fn_applies_each_step_the_gradient_before(model_dir):
    x, y = examples(4 * SIZE, seed=3)
    got = trained_logits({"delay_gradients": True}, x, y, model_dir, steps=3)

    # One process on the union: step t applies the gradient of step t - 1 (nothing at step 0).
    reference, optimizer, held = classifier(), keras.optimizers.SGD(0.1, momentum=0.9), None
    for _ in range(3):
        gradients = gradients_of(reference, x, y)
        if held is not None:
            optimizer.apply(held, reference.trainable_variables)
        held = gradients
    np.testing.assert_allclose(got, reference(x).numpy(), rtol=1e-5, atol=1e-6)


def test_a_one_bit_optimizer_from_model_fn_sends_signs_with_error_feedback(model_dir):
    x, y = examples(4 * SIZE, seed=4)
    got = trained_logits({"one_bit_gradients": True}, x, y, model_dir, steps=3)

    # Every rank simulated: each adds its residual to the gradient of its 4 rows, sends
    # sign * mean(|corrected|) per tensor, keeps the rest; the update is the mean of what was sent.
    reference, optimizer = classifier(), keras.optimizers.SGD(0.1, momentum=0.9)
    reference(x)  # builds its variables, which the residuals follow
    residuals = [[0.0] * len(reference.trainable_variables) for _ in range(SIZE)]
    for _ in range(3):
        sent = []
        for rank in range(SIZE):
            rows = slice(4 * rank, 4 * rank + 4)
            corrected = [g.numpy() + e for g, e in zip(gradients_of(reference, x[rows], y[rows]), residuals[rank])]
            quantized = [np.where(c >= 0, 1.0, -1.0).astype("float32") * np.mean(np.abs(c)) for c in corrected]
            residuals[rank] = [c - q for c, q in zip(corrected, quantized)]
            sent.append(quantized)
        mean_sent = [np.mean(tensors, axis=0, dtype="float32") for tensors in zip(*sent)]
        optimizer.apply(mean_sent, reference.trainable_variables)
    np.testing.assert_allclose(got, reference(x).numpy(), rtol=1e-4, atol=1e-5)


def test_only_rank_0_touches_model_dir(shared_root):
    # Each rank names its own directory: any file outside rank 0's would show another rank wrote.
    own_dir = os.path.join(shared_root, "own-dirs", f"rank{RANK}")
    x, y = examples(24, seed=3)
    config = estimator.RunConfig(save_checkpoints_steps=2, save_summary_steps=1)
    trained = estimator.Estimator(classifier_fn, model_dir=own_dir, config=config)
    trained.train(batches(x, y, repeat=True), steps=4)
    trained.evaluate(batches(x, y))
    trained.export_model(os.path.join(own_dir, "model.keras"))
    latest = trained.latest_checkpoint()

    assert kd.allgather_object(os.path.exists(own_dir)) == [True] + [False] * (SIZE - 1)
    assert latest == os.path.join(shared_root, "own-dirs", "rank0", "model.ckpt-4")  # rank 0's, on every rank
    if RANK == 0:
        names = set(os.listdir(own_dir))
        assert {"checkpoint", "model.ckpt-2.index", "model.ckpt-4.index", "model.keras", "eval"} <= names
        assert summary_tags(own_dir) == {"loss": [1, 2, 3, 4]}
        assert summary_tags(os.path.join(own_dir, "eval")) == {"loss": [4], "accuracy": [4]}


def summary_tags(directory):
    """{tag: [steps]} of the summaries in a directory's event files."""
    tags = {}
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(event.step)
    return {tag: sorted(steps) for tag, steps in tags.items() if tag != "global_step/sec"}


def test_resumed_training_continues_from_the_saved_step_as_if_uninterrupted(shared_root):
    # The same batch every step, so 3 steps, a restart and 2 more steps must give exactly the
    # weights and optimizer state (momentum) of 5 steps in one go.
    x, y = examples(4 * SIZE, seed=4)
    input_fn = rows_of_this_rank(x, y, rows_per_rank=4)
    interrupted, straight = os.path.join(shared_root, "interrupted"), os.path.join(shared_root, "straight")
    estimator.Estimator(classifier_fn, model_dir=interrupted).train(input_fn, steps=3)

    restarted = estimator.Estimator(classifier_fn, model_dir=interrupted)  # as a new process would
    restarted.train(input_fn, max_steps=3)  # already there: trains nothing
    assert restarted.latest_checkpoint() == os.path.join(interrupted, "model.ckpt-3")
    restarted.train(input_fn, steps=2)
    estimator.Estimator(classifier_fn, model_dir=straight).train(input_fn, steps=5)

    assert restarted.latest_checkpoint() == os.path.join(interrupted, "model.ckpt-5")
    differences = kd.broadcast_object(
        checkpoint_differences(os.path.join(interrupted, "model.ckpt-5"), os.path.join(straight, "model.ckpt-5"))
        if RANK == 0
        else None
    )
    assert differences == []


def checkpoint_differences(path, other_path):
    """Names of the variables (model, optimizer, global step) whose values differ."""
    reader, other = tf.train.load_checkpoint(path), tf.train.load_checkpoint(other_path)
    names = [
        name
        for name in reader.get_variable_to_shape_map()
        if name != "_CHECKPOINTABLE_OBJECT_GRAPH" and not name.startswith("save_counter")
    ]
    assert any(name.startswith("optimizer/") for name in names) and "global_step/.ATTRIBUTES/VARIABLE_VALUE" in names
    return [name for name in names if not np.array_equal(reader.get_tensor(name), other.get_tensor(name))]


def test_evaluation_equals_one_process_on_the_whole_set(model_dir):
    # 23 examples in batches of 5: 5 batches, dealt 3+2 on 2 ranks and 2+2+1 on 3, the last one partial.
    x_train, y_train = examples(40, seed=5)
    x, y = examples(23, seed=6)
    trained = estimator.Estimator(classifier_fn, model_dir=model_dir)
    trained.train(batches(x_train, y_train, repeat=True), steps=3)
    results = trained.evaluate(batches(x, y, batch_size=5))

    exported = keras.saving.load_model(trained.export_model(os.path.join(model_dir, "model.keras")))
    logits = exported.predict(x, verbose=0).astype("float64")
    log_probabilities = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    assert results["loss"] == pytest.approx(-log_probabilities[np.arange(len(y)), y].mean(), rel=1e-5)
    assert results["accuracy"] == pytest.approx(np.mean(logits.argmax(axis=1) == y), abs=1e-7)
    assert results["global_step"] == 3


def test_export_model_writes_a_savedmodel_for_serving(model_dir):
    x, y = examples(16, seed=7)
    trained = estimator.Estimator(classifier_fn, model_dir=model_dir)
    trained.train(batches(x, y, repeat=True), steps=2)
    path = trained.export_model(os.path.join(model_dir, "serving"))
    serving = tf.saved_model.load(path)
    served = serving.serve(tf.constant(x)).numpy()
    predicted = np.stack([p["logits"] for p in trained.predict(batches(x))])
    np.testing.assert_allclose(served, predicted, rtol=1e-6, atol=1e-6)


def sums_examples_fn(features, labels, mode):
    """Evaluates nothing but which examples it saw: the feature is the example's index."""
    model = keras.Sequential([keras.layers.Dense(1)])
    outputs = model(features)
    seen, index_sum = keras.metrics.Sum(), keras.metrics.Sum()
    seen.update_state(tf.ones_like(features[:, 0]))
    index_sum.update_state(features[:, 0])
    return EstimatorSpec(
        mode, loss=tf.reduce_mean(outputs) * 0.0, eval_metrics={"seen": seen, "index_sum": index_sum}, model=model
    )


INDICES = np.arange(17, dtype="float32")[:, None]


def test_input_fn_without_input_context_is_sharded_by_the_estimator(model_dir):
    # 2 batches: with 3 ranks, rank 2 has none and builds its model from an empty batch.
    def input_fn(params):
        assert params == {"batch_size": 9}
        return tf.data.Dataset.from_tensor_slices((INDICES, np.zeros(17))).batch(params["batch_size"])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluator = estimator.Estimator(sums_examples_fn, model_dir=model_dir, params={"batch_size": 9})
        results = evaluator.evaluate(input_fn)
    assert results["seen"] == 17 and results["index_sum"] == INDICES.sum()  # each example once
    warned = [str(w.message) for w in caught if "no checkpoint" in str(w.message)]
    assert len(warned) == (1 if RANK == 0 else 0)  # initial weights are evaluated, and rank 0 says so


@pytest.mark.filterwarnings("ignore:kerasdist.estimator. no checkpoint")
def test_input_fn_with_input_context_reads_what_it_chooses(model_dir):
    contexts = []

    def input_fn(params, input_context):
        contexts.append(
            (input_context.num_input_pipelines, input_context.input_pipeline_id, input_context.num_replicas_in_sync)
        )
        return tf.data.Dataset.from_tensor_slices((INDICES, np.zeros(17))).batch(3)  # not sharded: all of it

    results = estimator.Estimator(sums_examples_fn, model_dir=model_dir).evaluate(input_fn)
    assert kd.allgather_object(contexts) == [[(SIZE, rank, SIZE)] for rank in range(SIZE)]
    assert results["seen"] == 17 * SIZE  # every rank evaluated everything: no sharding on top


@pytest.mark.parametrize("countable", [True, False], ids=["known_length", "unknown_length"])
def test_training_stops_on_every_rank_when_the_shortest_input_ends(model_dir, countable):
    x, y = examples(4 * (SIZE + 1), seed=8)

    def input_fn(input_context):
        rank = input_context.input_pipeline_id
        dataset = tf.data.Dataset.from_tensor_slices((x[: 4 * (2 + rank)], y[: 4 * (2 + rank)]))  # 2 + rank batches
        return (dataset if countable else dataset.filter(lambda *_: True)).batch(4)

    trained = estimator.Estimator(classifier_fn, model_dir=model_dir)
    trained.train(input_fn)
    assert trained.latest_checkpoint() == os.path.join(model_dir, "model.ckpt-2")


def test_train_and_evaluate_evaluates_at_the_checkpoint_steps_and_at_the_end(model_dir):
    x, y = examples(32, seed=9)
    steps_seen = []

    class StepRecorder(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps_seen.append((batch, logs["loss"] > 0))

    evaluated_at = []

    def eval_input_fn():
        evaluated_at.append(len(steps_seen))
        return batches(x, y)()

    trained = estimator.Estimator(
        classifier_fn, model_dir=model_dir, config=estimator.RunConfig(save_checkpoints_steps=2)
    )
    results = estimator.train_and_evaluate(
        trained,
        estimator.TrainSpec(batches(x, y, repeat=True), max_steps=5, callbacks=[StepRecorder()]),
        estimator.EvalSpec(eval_input_fn),
    )
    assert results["global_step"] == 5 and set(results) == {"loss", "accuracy", "global_step"}
    assert steps_seen == [(step, True) for step in range(1, 6)]
    assert evaluated_at == [2, 4, 5]
    if RANK == 0:
        assert summary_tags(os.path.join(model_dir, "eval"))["accuracy"] == [2, 4, 5]
        assert {"model.ckpt-2.index", "model.ckpt-4.index", "model.ckpt-5.index"} <= set(os.listdir(model_dir))


@pytest.mark.parametrize(
    "save_checkpoints_steps, every_n_steps, max_steps, expected",
    [
        (2, 3, 7, [3, 6, 7]),  # every_n_steps wins over the checkpoint steps
        (None, 2, 4, [2, 4]),  # the last step was just evaluated: no second evaluation
        (None, None, 3, [3]),  # neither: only at the end
    ],
    ids=["own_period", "no_checkpoint_steps", "only_at_the_end"],
)
def test_eval_spec_every_n_steps_sets_when_train_and_evaluate_evaluates(
    model_dir, save_checkpoints_steps, every_n_steps, max_steps, expected
):
    x, y = examples(32, seed=11)
    steps_done = []

    class StepCounter(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps_done.append(batch)

    evaluated_at = []

    def eval_input_fn():
        evaluated_at.append(len(steps_done))
        return batches(x, y)()

    trained = estimator.Estimator(
        classifier_fn, model_dir=model_dir, config=estimator.RunConfig(save_checkpoints_steps=save_checkpoints_steps)
    )
    results = estimator.train_and_evaluate(
        trained,
        estimator.TrainSpec(batches(x, y, repeat=True), max_steps=max_steps, callbacks=[StepCounter()]),
        estimator.EvalSpec(eval_input_fn, every_n_steps=every_n_steps),
    )
    assert evaluated_at == expected
    assert results["global_step"] == max_steps
    if RANK == 0:
        assert summary_tags(os.path.join(model_dir, "eval"))["accuracy"] == expected


def test_an_input_without_end_needs_a_step_limit(model_dir):
    x, y = examples(8, seed=10)
    with pytest.raises(ValueError, match="never ends; give steps or max_steps"):
        estimator.Estimator(classifier_fn, model_dir=model_dir).train(batches(x, y, repeat=True))


def faulty_fn(fault):
    """A model_fn whose spec has one fault."""

    def model_fn(features, labels, mode):
        model = keras.Sequential([keras.layers.Dense(NUM_CLASSES)])
        logits = model(features)
        fields = {"predictions": {"logits": logits}, "optimizer": keras.optimizers.SGD(0.1), "model": model}
        if labels is not None:
            per_example_loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            fields["loss"] = tf.reduce_mean(per_example_loss)
        if fault == "returns a dict":
            return fields
        if fault == "wrong mode":
            return EstimatorSpec(ModeKeys.EVAL, **fields)
        if fault == "stray layer":
            fields["loss"] += tf.reduce_mean(keras.layers.Dense(1)(features))
        elif fault.startswith("no "):
            fields.pop(fault[3:])
        else:
            fields.update(
                {
                    "per-example loss": {"loss": per_example_loss},
                    "optimizer name": {"optimizer": "sgd"},
                    "tensor metric": {"eval_metrics": {"accuracy": tf.reduce_mean(logits)}},
                }[fault]
            )
        return EstimatorSpec(mode, **fields)

    return model_fn


@pytest.mark.parametrize(
    "mode, fault, error, message",
    [
        (ModeKeys.TRAIN, "no loss", ValueError, "loss is missing in train mode"),
        (ModeKeys.EVAL, "no loss", ValueError, "loss is missing in eval mode"),
        (ModeKeys.TRAIN, "no optimizer", ValueError, "optimizer is missing in train mode"),
        (ModeKeys.PREDICT, "no predictions", ValueError, "predictions is missing in infer"),
        (ModeKeys.EVAL, "no model", ValueError, "model is missing"),
        (ModeKeys.TRAIN, "per-example loss", ValueError, r"loss must be a scalar; got shape \(4,\)"),
        (ModeKeys.TRAIN, "optimizer name", TypeError, "optimizer must be a keras.optimizers.Optimizer"),
        (ModeKeys.EVAL, "tensor metric", TypeError, r"eval_metrics\['accuracy'\] must be a keras.metrics.Metric"),
        (
            ModeKeys.TRAIN,
            "wrong mode",
            ValueError,
            "called in mode 'train' but returned an EstimatorSpec for mode 'eval'",
        ),
        (ModeKeys.TRAIN, "stray layer", ValueError, "trainable variables that are not in EstimatorSpec.model"),
        (ModeKeys.PREDICT, "returns a dict", TypeError, "must return a kerasdist.estimator.EstimatorSpec"),
    ],
)
def test_a_bad_spec_raises_a_clear_error_on_every_rank(model_dir, mode, fault, error, message):
    x, y = examples(8, seed=11)
    faulty = estimator.Estimator(faulty_fn(fault), model_dir=model_dir)
    run = {
        ModeKeys.TRAIN: lambda: faulty.train(batches(x, y, repeat=True), steps=1),
        ModeKeys.EVAL: lambda: faulty.evaluate(batches(x, y)),
        ModeKeys.PREDICT: lambda: faulty.predict(batches(x)),
    }[mode]
    with pytest.raises(error, match=message):
        run()
    kd.barrier()  # every rank raised before any collective and is still in step


def changes_when_traced_fn(change):
    """A model_fn that builds something else when traced than on its eager run."""

    def model_fn(features, labels, mode):
        eager = tf.executing_eagerly()
        layers = [keras.layers.Dense(NUM_CLASSES if eager or change != "wider layer" else NUM_CLASSES + 1)]
        if change == "extra layer" and not eager:
            layers.append(keras.layers.Dense(NUM_CLASSES))
        model = keras.Sequential(layers)
        loss = mean_cross_entropy(labels, model(features))
        optimizer = keras.optimizers.SGD(0.1)
        metrics = {"mean": keras.metrics.Mean()} if change == "extra metric last" and not eager else {}
        return EstimatorSpec(mode, loss=loss, optimizer=optimizer, eval_metrics=metrics, model=model)

    return model_fn


@pytest.mark.parametrize(
    "change, message",
    [
        ("wider layer", r"has shape \(4, 4\) but received a variable of shape \(4, 3\)"),
        ("extra layer", "created its variables in a different order when traced: variable #2"),
        ("extra metric last", "created more variables when traced than on its eager run"),
    ],
)
def test_a_model_fn_that_builds_differently_when_traced_is_refused(model_dir, change, message):
    x, y = examples(8, seed=12)
    with pytest.raises(ValueError, match=message):
        estimator.Estimator(changes_when_traced_fn(change), model_dir=model_dir).train(batches(x, y), steps=1)


def test_bad_arguments_are_refused(model_dir):
    with pytest.raises(ValueError, match="give steps or max_steps, not both"):
        estimator.Estimator(classifier_fn, model_dir).train(batches(np.zeros((4, 4))), steps=1, max_steps=2)
    with pytest.raises(ValueError, match="must take an argument named `features`"):
        estimator.Estimator(lambda mode, params: None)
    with pytest.raises(ValueError, match="argument 'inputs' that the Estimator cannot fill"):
        estimator.Estimator(lambda inputs, mode: None)
    with pytest.raises(ValueError, match="save_checkpoints_steps or save_checkpoints_secs, not both"):
        estimator.RunConfig(save_checkpoints_steps=10, save_checkpoints_secs=60)
    with pytest.raises(TypeError, match="input_fn must return a tf.data.Dataset"):
        estimator.Estimator(classifier_fn, model_dir).evaluate(lambda: np.zeros((4, 4)))
    with pytest.raises(ValueError, match="mode='training' is not a ModeKeys value"):
        EstimatorSpec("training", model=keras.Sequential())
