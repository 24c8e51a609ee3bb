"""Embedding gradients (`tf.IndexedSlices`) stay sparse through `backward_passes_per_step`.

One process with the global batch hands its optimizer the embedding's gradient as slices, one row
per lookup, duplicates kept; Keras's Adam, Adagrad and RMSprop treat such rows otherwise than their
dense sum (each row is squared before duplicates are added up). An accumulated update must therefore
hand the inner optimizer every micro-batch's rows from every rank, scaled as the dense mean would
be. References are plain Keras in one process on the global batch, or NumPy.

Global step t uses rows [t·G, (t+1)·G) with G = size·k·b; rank r's micro-batch j of that step is
the b-row slice (j·size + r) of it.
"""

import dataclasses
import shutil
import tempfile
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd
from kerasdist import runtime
from kerasdist.callbacks import Rank0Checkpoint

kd.init()
RANK, SIZE = kd.rank(), kd.size()
VOCABULARY, WIDTH, LOOKUPS = 10, 3, 4  # few rows, so that a batch looks some of them up twice
PER_RANK_BATCH = 2
STEPS = 3

# Optimizers whose update from slices differs from their update from the slices' dense sum.
SPARSE_AWARE_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adagrad": lambda: keras.optimizers.Adagrad(0.5),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.05),
}


def global_data(global_batch, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCABULARY, size=(STEPS * global_batch, LOOKUPS)).astype("int32")
    y = rng.normal(size=(len(ids), 1)).astype("float32")
    return ids, y


def this_ranks_rows(array, micro_batches, ranks=SIZE, rank=RANK):
    """Rank `rank`'s rows in training order, when each update takes `micro_batches` per rank."""
    global_batch = ranks * micro_batches * PER_RANK_BATCH
    slots = [j * ranks + rank for j in range(micro_batches)]
    rows = [
        np.arange(start + slot * PER_RANK_BATCH, start + (slot + 1) * PER_RANK_BATCH)
        for start in range(0, len(array), global_batch)
        for slot in slots
    ]
    return array[np.concatenate(rows)]


def embedding_model(seed=5):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((LOOKUPS,), dtype="int32"),
            keras.layers.Embedding(VOCABULARY, WIDTH),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )


def reference_weights(make_optimizer, ids, y, global_batch):
    """Plain Keras, one process, the global batch, two epochs."""
    reference = embedding_model()
    reference.compile(make_optimizer(), loss="mse")
    reference.fit(ids, y, batch_size=global_batch, epochs=2, shuffle=False, verbose=0)
    return reference.get_weights()


def max_difference(a, b):
    return max(float(np.abs(p - q).max()) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("passes", [2, 3])
@pytest.mark.parametrize("optimizer_name", sorted(SPARSE_AWARE_OPTIMIZERS))
def test_accumulated_embedding_gradients_update_as_one_process_with_the_global_batch(optimizer_name, passes):
    make_optimizer = SPARSE_AWARE_OPTIMIZERS[optimizer_name]
    global_batch = SIZE * passes * PER_RANK_BATCH
    ids, y = global_data(global_batch)
    expected = reference_weights(make_optimizer, ids, y, global_batch)

    model = embedding_model()
    model.compile(kd.DistributedOptimizer(make_optimizer(), backward_passes_per_step=passes), loss="mse")
    model.fit(
        this_ranks_rows(ids, passes),
        this_ranks_rows(y, passes),
        batch_size=PER_RANK_BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=kd.callbacks(),
    )

    assert max_difference(model.get_weights(), expected) < 1e-5
    assert int(model.optimizer.iterations.numpy()) == 2 * STEPS


TABLE_ROWS = 8


class RecordingSGD(keras.optimizers.SGD):
    """SGD that keeps the gradients handed to it (call it eagerly)."""

    def apply(self, grads, trainable_variables=None):
        self.received = list(grads)
        return super().apply(grads, trainable_variables)


def micro_batch_slices(rank, micro_batch):
    """Rank `rank`'s gradient in micro-batch `micro_batch`: rows (rank + 1, micro_batch + 1) at
    rows rank % 3 (twice) and micro_batch + 3 of a TABLE_ROWS-row table."""
    indices = np.array([rank % 3, micro_batch + 3, rank % 3])
    values = np.tile(np.array([[rank + 1.0, micro_batch + 1.0]], np.float32), (3, 1))
    return indices, values


@pytest.fixture
def planned_ranks(monkeypatch):
    """Sets how many planned ranks each running rank stands in for (what a restart on fewer hosts gives)."""

    def plan(stand_ins):
        planned = dataclasses.replace(runtime.state(), planned_size=stand_ins * SIZE)
        monkeypatch.setattr(runtime, "_state", planned)

    return plan


@pytest.mark.parametrize("stand_ins", [1, 2])
@pytest.mark.parametrize("average", [True, False], ids=["mean_of_micro_batches", "sum_of_micro_batches"])
@pytest.mark.parametrize("op", [kd.Average, kd.Sum], ids=["average_ranks", "sum_ranks"])
def test_an_update_hands_on_every_micro_batchs_rows_from_every_rank_scaled_like_the_dense_sum(
    planned_ranks, op, average, stand_ins
):
    planned_ranks(stand_ins)
    passes = 2
    table = keras.Variable(np.zeros((TABLE_ROWS, 2), np.float32))
    inner = RecordingSGD(1.0)
    optimizer = kd.DistributedOptimizer(
        inner, op=op, backward_passes_per_step=passes, average_aggregated_gradients=average
    )
    micro_batches = passes * stand_ins  # this rank's, standing in for `stand_ins` planned ranks
    for micro_batch in range(micro_batches):
        indices, values = micro_batch_slices(RANK, micro_batch)
        optimizer.apply(
            [tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([TABLE_ROWS, 2]))], [table]
        )

    # What the planned ranks would give: each the mean (or sum) of its k micro-batches,
    # combined as `op` combines ranks.
    planned = stand_ins * SIZE
    scale = (1 / passes if average else 1) * (1 / planned if op == kd.Average else 1)
    pieces = [micro_batch_slices(r, m) for r in range(SIZE) for m in range(micro_batches)]
    expected_indices = np.concatenate([indices for indices, _ in pieces])
    expected_values = np.concatenate([values for _, values in pieces]) * scale
    (received,) = inner.received
    assert isinstance(received, tf.IndexedSlices), type(received)
    np.testing.assert_array_equal(received.indices.numpy(), expected_indices)
    np.testing.assert_allclose(received.values.numpy(), expected_values, rtol=1e-6)
    dense_sum = np.zeros((TABLE_ROWS, 2), np.float32)
    np.add.at(dense_sum, expected_indices, expected_values)
    np.testing.assert_allclose(table.numpy(), -dense_sum, rtol=1e-6)
    assert int(optimizer.iterations.numpy()) == 1
    assert all(len(v.numpy()) == 0 for v in optimizer._held_row_variables())  # the window starts afresh


def test_sparse_as_dense_adds_the_micro_batches_up_dense():
    table = keras.Variable(np.zeros((TABLE_ROWS, 2), np.float32))
    inner = RecordingSGD(1.0)
    optimizer = kd.DistributedOptimizer(inner, backward_passes_per_step=2, sparse_as_dense=True)
    for micro_batch in range(2):
        indices, values = micro_batch_slices(RANK, micro_batch)
        optimizer.apply(
            [tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([TABLE_ROWS, 2]))], [table]
        )
    expected = np.zeros((TABLE_ROWS, 2), np.float32)
    for r in range(SIZE):
        for m in range(2):
            np.add.at(expected, *micro_batch_slices(r, m))
    (received,) = inner.received
    assert isinstance(received, tf.Tensor), type(received)
    np.testing.assert_allclose(received.numpy(), expected / (2 * SIZE), rtol=1e-6)
    assert optimizer._held_row_variables() == []


def test_reset_per_rank_state_drops_the_held_rows():
    table = keras.Variable(np.zeros((TABLE_ROWS, 2), np.float32))
    inner = RecordingSGD(1.0)
    optimizer = kd.DistributedOptimizer(inner, backward_passes_per_step=2)

    def apply(micro_batch):
        indices, values = micro_batch_slices(RANK, micro_batch)
        optimizer.apply(
            [tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([TABLE_ROWS, 2]))], [table]
        )

    apply(0)
    assert len(optimizer._held_row_variables()[1].numpy()) == 3  # this rank's three lookups
    optimizer.reset_per_rank_state()
    assert all(len(v.numpy()) == 0 for v in optimizer._held_row_variables())
    apply(1)
    apply(2)  # the window: micro-batches 1 and 2, not 0
    (received,) = inner.received
    expected = np.concatenate([micro_batch_slices(r, m)[0] for r in range(SIZE) for m in (1, 2)])
    np.testing.assert_array_equal(received.indices.numpy(), expected)


def test_a_gradient_that_is_slices_in_one_step_and_dense_in_another_is_refused():
    table = keras.Variable(np.zeros((TABLE_ROWS, 2), np.float32))
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    indices, values = micro_batch_slices(RANK, 0)
    optimizer.apply(
        [tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([TABLE_ROWS, 2]))], [table]
    )
    with pytest.raises(ValueError, match="comes as tf.IndexedSlices in one traced step and as a dense tensor"):
        optimizer.apply([tf.ones((TABLE_ROWS, 2))], [table])


def test_the_gradient_noise_scale_sees_the_held_rows_as_their_dense_sum():
    passes = 2
    global_batch = SIZE * passes * PER_RANK_BATCH
    ids, y = global_data(global_batch)
    noise = kd.GradientNoiseScale(batch_size=PER_RANK_BATCH)
    model = embedding_model()
    model.compile(
        kd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=passes, gradient_noise_scale=noise),
        loss="mse",
    )
    first_update = passes * PER_RANK_BATCH  # this rank's rows of the first global batch
    model.fit(
        this_ranks_rows(ids, passes)[:first_update],
        this_ranks_rows(y, passes)[:first_update],
        batch_size=PER_RANK_BATCH,
        shuffle=False,
        verbose=0,
    )

    # Every micro-batch's gradient at the initial weights, by plain Keras and NumPy.
    reference = embedding_model()
    gradients = []
    for slot in range(SIZE * passes):
        rows = slice(slot * PER_RANK_BATCH, (slot + 1) * PER_RANK_BATCH)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y[rows], reference(ids[rows])))
        gradients.append(
            np.concatenate(
                [np.ravel(tf.convert_to_tensor(g)) for g in tape.gradient(loss, reference.trainable_variables)]
            )
        )
    gradients = np.array(gradients, np.float64)
    small = np.mean(np.sum(gradients**2, axis=1))
    big = np.sum(np.mean(gradients, axis=0) ** 2)
    ratio = SIZE * passes
    np.testing.assert_allclose(noise.gradient_sq_norm(), (ratio * big - small) / (ratio - 1), rtol=1e-4)
    np.testing.assert_allclose(noise.trace_covariance(), PER_RANK_BATCH * (small - big) / (1 - 1 / ratio), rtol=1e-4)


def test_delayed_gradients_hold_a_window_of_embedding_gradients_dense():
    passes = 2
    global_batch = SIZE * passes * PER_RANK_BATCH
    ids, y = global_data(global_batch)
    model = embedding_model()
    optimizer = kd.DistributedOptimizer(
        keras.optimizers.Adam(0.05), backward_passes_per_step=passes, delay_gradients=True
    )
    model.compile(optimizer, loss="mse")
    model.fit(
        this_ranks_rows(ids, passes), this_ranks_rows(y, passes), batch_size=PER_RANK_BATCH, shuffle=False, verbose=0
    )
    assert optimizer._held_row_variables() == []

    # Plain Keras: each update applies the global batch before's gradient, as a dense tensor.
    reference = embedding_model()
    adam = keras.optimizers.Adam(0.05)
    held = None
    for step in range(STEPS):
        rows = slice(step * global_batch, (step + 1) * global_batch)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y[rows], reference(ids[rows])))
        gradients = [tf.convert_to_tensor(g) for g in tape.gradient(loss, reference.trainable_variables)]
        if held is not None:
            adam.apply(held, reference.trainable_variables)
        held = gradients
    assert max_difference(model.get_weights(), reference.get_weights()) < 1e-5


@pytest.fixture
def shared_dir():
    path = Path(kd.broadcast_object(tempfile.mkdtemp(prefix="kerasdist-sparse-") if RANK == 0 else None))
    yield path
    kd.barrier()  # nobody still reads it
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)


class _HeldRowsAtTrainBegin(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.values = [v.numpy() for v in self.model.optimizer._held_row_variables()]


def test_a_resume_inside_a_window_of_held_rows_continues_like_an_uninterrupted_run(shared_dir):
    # Three micro-batches an epoch, two an update: the first epoch ends with rows held.
    ids, y = global_data(SIZE * 3 * PER_RANK_BATCH)

    def fit(seed, epochs, callbacks=()):
        model = embedding_model(seed)
        model.compile(kd.DistributedOptimizer(keras.optimizers.Adam(0.05), backward_passes_per_step=2), loss="mse")
        rows = slice(RANK * 3 * PER_RANK_BATCH, (RANK + 1) * 3 * PER_RANK_BATCH)
        model.fit(
            ids[rows],
            y[rows],
            batch_size=PER_RANK_BATCH,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=list(callbacks),
        )
        return model

    uninterrupted = fit(seed=5, epochs=3)
    interrupted = fit(seed=5, epochs=1, callbacks=[Rank0Checkpoint(shared_dir, resume=True)])
    held = [v.numpy() for v in interrupted.optimizer._held_row_variables()]
    assert int(interrupted.optimizer._micro_step.numpy()) == 1 and len(held[1]) == PER_RANK_BATCH * LOOKUPS

    probe = _HeldRowsAtTrainBegin()
    resumed = fit(seed=100 + RANK, epochs=3, callbacks=[Rank0Checkpoint(shared_dir, resume=True), probe])

    for restored, expected in zip(probe.values, held, strict=True):  # each rank's own rows
        np.testing.assert_array_equal(restored, expected)
    assert max_difference(resumed.get_weights(), uninterrupted.get_weights()) < 1e-6
    assert int(resumed.optimizer.iterations.numpy()) == int(uninterrupted.optimizer.iterations.numpy())


def test_held_rows_load_into_an_optimizer_that_adds_gradients_up_dense_as_an_empty_window(tmp_path):
    ids, y = global_data(SIZE * 3 * PER_RANK_BATCH)
    model = embedding_model()
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2), loss="mse")
    model.fit(ids[: 3 * PER_RANK_BATCH], y[: 3 * PER_RANK_BATCH], batch_size=PER_RANK_BATCH, shuffle=False, verbose=0)
    path = tmp_path / f"rank{RANK}.keras"
    model.save(path)

    dense = embedding_model(seed=7)
    dense.compile(
        kd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2, sparse_as_dense=True), loss="mse"
    )
    dense.optimizer.build(dense.trainable_variables)
    dense.load_weights(path)

    assert int(dense.optimizer._micro_step.numpy()) == 0  # saved inside a window: it starts afresh
    assert max_difference(dense.get_weights(), model.get_weights()) == 0.0
