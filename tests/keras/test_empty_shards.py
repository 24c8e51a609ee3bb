"""Global metrics when some ranks' validation or evaluation shard is empty.

A set with fewer rows than ranks leaves the last ranks nothing. Every rank must still report,
under the same keys, the metrics one process computes on the union of the shards: plain Keras
on all rows, here. An empty shard needs a second rank, so these tests skip in one process.
"""

import keras
import numpy as np
import pytest

import kerasdist as kd

kd.init()
RANK, SIZE = kd.rank(), kd.size()
needs_two_ranks = pytest.mark.skipif(SIZE < 2, reason="an empty shard needs at least 2 ranks")


def classifier():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])


def metrics():
    return ["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")]


def rows(count, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(count, 4)).astype("float32"), rng.integers(0, 3, size=count)


def trained_model(**fit_options):
    """Fitted on 4 rows per rank in batches of 2, with `kerasdist.callbacks()`."""
    model = classifier()
    model.compile(
        kd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="sparse_categorical_crossentropy", metrics=metrics()
    )
    x, y = kd.data.shard(rows(4 * SIZE, seed=1))
    history = model.fit(x, y, batch_size=2, verbose=0, callbacks=kd.callbacks(), **fit_options)
    return model, history


def union_metrics(model, x, y):
    """What one process reports on every row, with `model`'s weights."""
    reference = classifier()
    reference.set_weights(model.get_weights())
    reference.compile(loss="sparse_categorical_crossentropy", metrics=metrics())
    return reference.evaluate(x, y, verbose=0, return_dict=True)


@needs_two_ranks
def test_validation_with_empty_shards_logs_the_union_metrics_on_every_rank():
    val_x, val_y = rows(SIZE - 1, seed=2)  # the last rank's shard is empty
    model, history = trained_model(epochs=2, validation_data=kd.data.shard((val_x, val_y)))

    logs = {name: values[-1] for name, values in history.history.items()}
    assert kd.allgather_object(sorted(logs)) == [sorted(logs)] * SIZE
    expected = union_metrics(model, val_x, val_y)
    for name, value in expected.items():
        assert logs[f"val_{name}"] == pytest.approx(value, rel=1e-5, abs=1e-6), name


@needs_two_ranks
def test_evaluate_after_fit_with_empty_shards_is_the_union_metrics_on_every_rank():
    model, _ = trained_model()
    x, y = rows(1, seed=4)  # rank 0 holds the one row
    got = model.evaluate(*kd.data.shard((x, y)), verbose=0, return_dict=True)
    expected = union_metrics(model, x, y)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


@needs_two_ranks
def test_inside_local_metrics_a_rank_with_an_empty_shard_reports_nothing_as_in_keras():
    # Inside local_metrics a rank reports its own shard: nothing for an empty one, as in Keras.
    model, _ = trained_model()
    x, y = kd.data.shard(rows(1, seed=4))
    with kd.callbacks.local_metrics(model):
        got = model.evaluate(x, y, verbose=0, return_dict=True)
    if RANK == 0:
        assert got == pytest.approx(union_metrics(model, x, y), rel=1e-5, abs=1e-6)
    else:
        assert got == {}
