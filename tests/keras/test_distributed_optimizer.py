"""DistributedOptimizer and DistributedGradientTape against one process with the global batch.

Every rank builds the whole data set and the reference result itself with plain Keras
(no kerasdist in the reference), so the comparison is independent of the code under test.
Global step t uses rows [t·G, (t+1)·G) with G = size·k·b; rank r's micro-batch j of that step
is the b-row slice (j·size + r) of it: the union over ranks and micro-batches is the global
batch, and the mean of the per-rank means is the global mean.
"""

import dataclasses

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd
from kerasdist import runtime
from kerasdist.optimizers import LAMB, LARC, LARS
from kerasdist.reductions import allreduce as allreduce_module

kd.init()
RANK, SIZE = kd.rank(), kd.size()
PER_RANK_BATCH = 4
STEPS = 6
FEATURES = 5


def global_data(steps, global_batch, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * global_batch, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(len(x), 1))).astype("float32")
    return x, y


def this_ranks_rows(array, per_rank_batch, passes):
    """Rank RANK's rows, in the order it trains on them (see the module docstring)."""
    global_batch = SIZE * passes * per_rank_batch
    chunks = []
    for start in range(0, len(array), global_batch):
        for micro in range(passes):
            slot = micro * SIZE + RANK
            chunks.append(array[start + slot * per_rank_batch : start + (slot + 1) * per_rank_batch])
    return np.concatenate(chunks)


def make_model(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])


OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "lars": lambda: LARS(0.1, momentum=0.9, weight_decay=1e-4),
    "lamb": lambda: LAMB(0.01, weight_decay=1e-2),
    "larc": lambda: LARC(keras.optimizers.SGD(0.5, momentum=0.9), weight_decay=1e-4),
}


def max_difference(a, b):
    return max(float(np.abs(p - q).max()) for p, q in zip(a, b))


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_fit_equals_one_process_with_the_global_batch(optimizer_name, passes):
    x, y = global_data(STEPS, SIZE * passes * PER_RANK_BATCH)
    reference = make_model()
    reference.compile(OPTIMIZERS[optimizer_name](), loss="mse")
    reference_history = reference.fit(
        x, y, batch_size=SIZE * passes * PER_RANK_BATCH, epochs=2, shuffle=False, verbose=0
    )

    model = make_model()
    model.compile(kd.DistributedOptimizer(OPTIMIZERS[optimizer_name](), backward_passes_per_step=passes), loss="mse")
    history = model.fit(
        this_ranks_rows(x, PER_RANK_BATCH, passes),
        this_ranks_rows(y, PER_RANK_BATCH, passes),
        batch_size=PER_RANK_BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=kd.callbacks(),
    )

    assert max_difference(model.get_weights(), reference.get_weights()) < 1e-5
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    if passes == 1:  # the running loss is over micro-batches, which a k-step window splits
        np.testing.assert_allclose(history.history["loss"], reference_history.history["loss"], rtol=1e-5)


def test_ranks_that_start_from_different_weights_end_equal_and_follow_rank_0():
    x, y = global_data(STEPS, SIZE * PER_RANK_BATCH)
    model = make_model(seed=100 + RANK)  # every rank initialises differently
    rank0_initial = kd.broadcast_object(model.get_weights(), root_rank=0)
    reference = make_model()
    reference.set_weights(rank0_initial)
    reference.compile(keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    reference.fit(x, y, batch_size=SIZE * PER_RANK_BATCH, shuffle=False, verbose=0)

    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    model.fit(
        this_ranks_rows(x, PER_RANK_BATCH, 1),
        this_ranks_rows(y, PER_RANK_BATCH, 1),
        batch_size=PER_RANK_BATCH,
        shuffle=False,
        verbose=0,
        callbacks=kd.callbacks(),
    )

    every_ranks = kd.allgather_object(model.get_weights())
    for weights in every_ranks[1:]:
        assert max_difference(weights, every_ranks[0]) == 0.0
    assert max_difference(model.get_weights(), reference.get_weights()) < 1e-5


@pytest.mark.parametrize("passes", [1, 2])
def test_without_a_broadcast_the_first_update_gives_every_rank_rank_0s_weights_and_says_so(capfd, passes):
    x, y = global_data(STEPS, SIZE * passes * PER_RANK_BATCH)
    model = make_model(seed=200 + RANK)  # every rank initialises differently, and nothing broadcasts
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.05), backward_passes_per_step=passes), loss="mse")
    model.fit(
        this_ranks_rows(x, PER_RANK_BATCH, passes),
        this_ranks_rows(y, PER_RANK_BATCH, passes),
        batch_size=PER_RANK_BATCH,
        shuffle=False,
        verbose=0,
    )

    every_ranks = kd.allgather_object(model.get_weights())
    for weights in every_ranks[1:]:
        assert max_difference(weights, every_ranks[0]) == 0.0
    warned = "different trainable weights at the first update" in capfd.readouterr().err
    assert warned == (SIZE > 1 and RANK == 0)


def test_ranks_that_start_equal_are_left_alone_without_a_warning(capfd):
    x, y = global_data(STEPS, SIZE * PER_RANK_BATCH)
    model = make_model()  # the same seed on every rank
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    model.fit(
        this_ranks_rows(x, PER_RANK_BATCH, 1),
        this_ranks_rows(y, PER_RANK_BATCH, 1),
        batch_size=PER_RANK_BATCH,
        shuffle=False,
        verbose=0,
    )
    assert "different trainable weights" not in capfd.readouterr().err
    reference = make_model()
    reference.compile(keras.optimizers.SGD(0.05), loss="mse")
    reference.fit(x, y, batch_size=SIZE * PER_RANK_BATCH, shuffle=False, verbose=0)
    assert max_difference(model.get_weights(), reference.get_weights()) < 1e-5


class RecordingSGD(keras.optimizers.SGD):
    """SGD that notes which of the gradients handed to it are IndexedSlices (when traced)."""

    def apply(self, grads, trainable_variables=None):
        self.received_slices = [isinstance(g, tf.IndexedSlices) for g in grads]
        return super().apply(grads, trainable_variables)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_embedding_gradients_equal_the_global_batch_gathered_or_densified(sparse_as_dense):
    rng = np.random.default_rng(3)
    global_batch = SIZE * PER_RANK_BATCH
    ids = rng.integers(0, 20, size=(STEPS * global_batch, 3))
    y = rng.normal(size=(len(ids), 1)).astype("float32")

    def embedding_model():
        keras.utils.set_random_seed(5)
        return keras.Sequential(
            [
                keras.Input((3,), dtype="int32"),
                keras.layers.Embedding(20, 4),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )

    reference = embedding_model()
    reference.compile(keras.optimizers.SGD(0.1), loss="mse")
    reference.fit(ids, y, batch_size=global_batch, shuffle=False, verbose=0)
    model = embedding_model()
    inner = RecordingSGD(0.1)
    model.compile(kd.DistributedOptimizer(inner, sparse_as_dense=sparse_as_dense), loss="mse")
    model.fit(
        this_ranks_rows(ids, PER_RANK_BATCH, 1),
        this_ranks_rows(y, PER_RANK_BATCH, 1),
        batch_size=PER_RANK_BATCH,
        shuffle=False,
        verbose=0,
        callbacks=kd.callbacks(),
    )
    assert max_difference(model.get_weights(), reference.get_weights()) < 1e-5
    # What reached the inner optimizer for the embedding, kernel and bias: the gathered slices,
    # or one dense tensor (in a world of one nothing is reduced, so the slices stay).
    assert inner.received_slices == [not (sparse_as_dense and SIZE > 1), False, False]


def embedding_lookups(rank):
    """The rows of a 20-row table rank `rank` looks up: its own, one shared, some twice."""
    return np.array([rank, 19, rank + 5, rank])


def embedding_loss(table, rank):
    # d loss / d table[row] = (rank + 1) for each lookup of row
    return tf.reduce_sum(tf.gather(table, embedding_lookups(rank))) * (rank + 1)


def test_gradient_tape_gathers_embedding_gradients_as_slices_from_every_rank():
    table = tf.Variable(tf.zeros([20, 3]))
    with kd.DistributedGradientTape(tf.GradientTape(), op=kd.Sum) as tape:
        loss = embedding_loss(table, RANK)
    grad = tape.gradient(loss, table)
    assert isinstance(grad, tf.IndexedSlices), type(grad)
    np.testing.assert_array_equal(grad.indices.numpy(), np.concatenate([embedding_lookups(r) for r in range(SIZE)]))
    np.testing.assert_array_equal(
        grad.values.numpy(), np.concatenate([np.full((len(embedding_lookups(r)), 3), r + 1.0) for r in range(SIZE)])
    )


def test_gradient_tape_with_sparse_as_dense_reduces_one_dense_tensor():
    table = tf.Variable(tf.zeros([20, 3]))
    with kd.DistributedGradientTape(tf.GradientTape(), op=kd.Sum, sparse_as_dense=True) as tape:
        loss = embedding_loss(table, RANK)
    grad = tape.gradient(loss, table)
    expected = np.zeros((20, 3))
    for r in range(SIZE):
        np.add.at(expected, embedding_lookups(r), r + 1.0)
    if SIZE == 1:  # nothing is reduced in a world of one: the slices come back as they are
        grad = tf.convert_to_tensor(grad)
    assert isinstance(grad, tf.Tensor) and grad.shape == (20, 3), type(grad)
    np.testing.assert_array_equal(grad.numpy(), expected)


# Gradient components that float16 and bfloat16 round differently, to values known exactly
# (tests/collectives/test_compression.py): the result tells which dtype travelled.
ROUNDING_PROBES = np.float32([1 + 2**-9 + 2**-12, 1000.3, 0.1, -(2 + 2**-5 + 2**-8 + 2**-14), -3e-3])
WIRE_DTYPES = {"none": None, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}


def probe_row(rank):
    """Rank r's input: probe i % 5 at the places i with i % SIZE == r, zero elsewhere. Summed over
    ranks, each place then holds its one sender's value as the wire carried it."""
    probes = np.tile(ROUNDING_PROBES, SIZE)
    return np.where(np.arange(len(probes)) % SIZE == rank, probes, np.float32(0))


def summed_probes_as_received(compression):
    """The ranks' probe rows summed, each value rounded to the wire dtype. In a world of one
    nothing travels, so nothing is rounded."""
    probes = np.tile(ROUNDING_PROBES, SIZE)
    wire = WIRE_DTYPES[compression]
    return probes if wire is None or SIZE == 1 else probes.astype(wire).astype(np.float32)


@pytest.mark.parametrize("compression", list(WIRE_DTYPES))
def test_fit_sends_gradients_in_the_compressed_dtype(compression):
    # The loss (w·x − 0.5)² at w = 0 has the gradient −x: one SGD step at rate 1 with op=Sum
    # sets w to the sum over ranks of x as it travelled.
    model = keras.Sequential(
        [keras.Input((len(ROUNDING_PROBES) * SIZE,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    model.compile(
        kd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=kd.Sum, compression=getattr(kd.Compression, compression)),
        loss="mse",
    )
    model.fit(probe_row(RANK)[None], np.float32([[0.5]]), batch_size=1, verbose=0, callbacks=kd.callbacks())
    np.testing.assert_array_equal(model.get_weights()[0][:, 0], summed_probes_as_received(compression))


@pytest.mark.parametrize("compression", list(WIRE_DTYPES))
def test_gradient_tape_sends_gradients_in_the_compressed_dtype(compression):
    w = tf.Variable(tf.zeros([len(ROUNDING_PROBES) * SIZE]))
    x = tf.constant(probe_row(RANK))
    optimizer = keras.optimizers.SGD(1.0)

    @tf.function
    def step():
        with kd.DistributedGradientTape(
            tf.GradientTape(), op=kd.Sum, compression=getattr(kd.Compression, compression)
        ) as tape:
            loss = tf.reduce_sum(w * x)  # gradient x
        grads = tape.gradient(loss, [w])
        optimizer.apply(grads, [w])
        return grads[0]

    np.testing.assert_array_equal(step().numpy(), summed_probes_as_received(compression))
    np.testing.assert_array_equal(w.numpy(), -summed_probes_as_received(compression))


def test_gathered_embedding_gradients_travel_compressed():
    table = tf.Variable(tf.zeros([20, len(ROUNDING_PROBES)]))
    lookups = embedding_lookups(RANK)
    with kd.DistributedGradientTape(tf.GradientTape(), op=kd.Sum, compression=kd.Compression.bf16) as tape:
        loss = tf.reduce_sum(tf.gather(table, lookups) * ROUNDING_PROBES)  # each row's gradient: the probes
    grad = tape.gradient(loss, table)
    received = ROUNDING_PROBES if SIZE == 1 else ROUNDING_PROBES.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(grad.values.numpy(), np.tile(received, (SIZE * len(lookups), 1)))


def test_backward_passes_per_step_can_change_between_epochs():
    x, y = global_data(8, SIZE * 2 * PER_RANK_BATCH)
    model = make_model()
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(0.05), backward_passes_per_step=2)
    model.compile(optimizer, loss="mse")
    rows_x, rows_y = this_ranks_rows(x, PER_RANK_BATCH, 2), this_ranks_rows(y, PER_RANK_BATCH, 2)
    model.fit(rows_x, rows_y, batch_size=PER_RANK_BATCH, shuffle=False, verbose=0, callbacks=kd.callbacks())
    assert int(optimizer.iterations.numpy()) == 8
    optimizer.backward_passes_per_step = 4
    model.fit(rows_x, rows_y, batch_size=PER_RANK_BATCH, shuffle=False, verbose=0, callbacks=kd.callbacks())
    assert int(optimizer.iterations.numpy()) == 8 + 4  # 16 micro-batches per rank, 4 per update


def test_lowering_passes_inside_a_window_averages_what_it_holds():
    w = keras.Variable(0.0)
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=4)
    for _ in range(3):
        optimizer.apply([keras.ops.ones(())], [w])
    optimizer.backward_passes_per_step = 2
    optimizer.apply([keras.ops.ones(())], [w])  # 4 micro-batches of gradient 1: one step of 1
    assert float(w.numpy()) == -1.0
    assert int(optimizer.iterations.numpy()) == 1


def test_raising_passes_from_one_needs_a_new_train_function():
    x, y = global_data(4, SIZE * PER_RANK_BATCH)
    model = make_model()
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(0.05))
    model.compile(optimizer, loss="mse")
    model.fit(x[:8], y[:8], batch_size=PER_RANK_BATCH, verbose=0, callbacks=kd.callbacks())
    optimizer.backward_passes_per_step = 2
    before = model.get_weights()
    with pytest.raises(tf.errors.InvalidArgumentError, match="make_train_function"):
        model.fit(x[:8], y[:8], batch_size=PER_RANK_BATCH, verbose=0)
    assert max_difference(model.get_weights(), before) == 0.0  # the stale step changed nothing
    model.make_train_function(force=True)
    model.fit(x[:8], y[:8], batch_size=PER_RANK_BATCH, verbose=0)
    assert int(optimizer.iterations.numpy()) == 2 + 1


def test_set_backward_passes_per_step_takes_effect_in_the_next_fit():
    x, y = global_data(4, SIZE * PER_RANK_BATCH)
    model = make_model()
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(0.05))
    model.compile(optimizer, loss="mse")
    model.fit(x[:8], y[:8], batch_size=PER_RANK_BATCH, verbose=0, callbacks=kd.callbacks())  # traced with k = 1
    assert optimizer.set_backward_passes_per_step(2, model) is True  # new accumulators: the hook retraced
    model.fit(x[:8], y[:8], batch_size=PER_RANK_BATCH, verbose=0)
    assert int(optimizer.iterations.numpy()) == 2 + 1
    assert optimizer.set_backward_passes_per_step(4, model) is False  # k is a variable the trace reads
    model.fit(x[:16], y[:16], batch_size=PER_RANK_BATCH, verbose=0)
    assert int(optimizer.iterations.numpy()) == 2 + 1 + 1


def test_gradient_statistics_are_attached_before_the_first_step_and_read_after_it():
    x, y = global_data(4, SIZE * 2 * PER_RANK_BATCH)
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(0.05), backward_passes_per_step=2)
    statistics = optimizer.gradient_statistics(batch_size=PER_RANK_BATCH)
    model = make_model()
    model.compile(optimizer, loss="mse")
    model.fit(x, y, batch_size=PER_RANK_BATCH, shuffle=False, verbose=0, callbacks=kd.callbacks())
    assert optimizer.gradient_statistics() is statistics
    assert statistics.updates == len(x) // (2 * PER_RANK_BATCH)  # every update fed them
    assert np.isfinite(statistics.noise_scale())
    plain = kd.DistributedOptimizer(keras.optimizers.SGD(0.05))
    plain.build(make_model().trainable_variables)
    with pytest.raises(ValueError, match="before the optimizer's first step"):
        plain.gradient_statistics()


def test_gradient_tape_matches_one_process_with_the_global_batch():
    x, y = global_data(STEPS, SIZE * PER_RANK_BATCH)
    mse = keras.losses.MeanSquaredError()

    def train(model, xs, ys, batch, wrap):
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = mse(yb, model(xb, training=True))
            tape = wrap(tape)
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

        for start in range(0, len(xs), batch):
            step(xs[start : start + batch], ys[start : start + batch])
        return model.get_weights()

    expected = train(make_model(), x, y, SIZE * PER_RANK_BATCH, lambda tape: tape)
    got = train(
        make_model(),
        this_ranks_rows(x, PER_RANK_BATCH, 1),
        this_ranks_rows(y, PER_RANK_BATCH, 1),
        PER_RANK_BATCH,
        kd.DistributedGradientTape,
    )
    assert max_difference(got, expected) < 1e-5


@pytest.fixture
def bucket_bytes(monkeypatch):
    """Sets KERASDIST_BUCKET_BYTES for one test (init() read it once)."""

    def set_to(value):
        monkeypatch.setattr(runtime.state(), "knobs", dataclasses.replace(runtime.state().knobs, bucket_bytes=value))

    return set_to


# make_model's variables, in reduction order (last first): bias 1 (4 B), kernel 8x1 (32 B),
# bias 8 (32 B), kernel 5x8 (160 B). Buckets of 64 bytes close after 68 and 160 bytes.
_BUCKETS_OF_64_BYTES = 2


@pytest.mark.skipif(SIZE == 1, reason="a world of one reduces nothing")
@pytest.mark.parametrize("size, allreduce_ops", [(0, 1), (64, _BUCKETS_OF_64_BYTES), (1, 4)])
def test_gradients_travel_in_buckets_filled_from_the_last_layer(bucket_bytes, size, allreduce_ops):
    bucket_bytes(size)
    model = make_model()
    x, y = global_data(1, PER_RANK_BATCH)

    @tf.function
    def gradients(xb, yb):
        with kd.DistributedGradientTape(tf.GradientTape()) as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        return tape.gradient(loss, model.trainable_variables)

    graph = gradients.get_concrete_function(x, y).graph
    reductions = [op for op in graph.get_operations() if op.type == "KerasdistAllreduce"]
    assert len(reductions) == allreduce_ops
    # The first reduction holds the last variable's gradient: backprop produces it first.
    last_bias_gradient_shape = [1]
    assert reductions[0].inputs[0].shape.as_list() == last_bias_gradient_shape


@pytest.mark.parametrize(
    "gradient_bytes, expected",
    [
        (240_000, 64 * 2**10),  # a small CNN: the 64 KiB floor, 4 buckets
        (1_084_384, 1_084_384 // 8),  # ResNet-20: 8 buckets
        (102_228_128, 4 * 2**20),
    ],
)  # ResNet-50: the 4 MiB cap, 25 buckets
def test_automatic_bucket_size_is_an_eighth_of_the_gradients_within_bounds(monkeypatch, gradient_bytes, expected):
    monkeypatch.setattr(runtime.state(), "one_cpu_host", False)  # as on several hosts, or with a GPU
    half = gradient_bytes // 2
    grads = [tf.zeros([half // 4]), tf.zeros([half // 8], tf.float64)]
    assert allreduce_module._bucket_bytes("auto", grads) == expected
    assert allreduce_module._bucket_bytes(12345, grads) == 12345  # a size the user set is kept


def test_automatic_buckets_are_one_when_every_rank_is_on_one_cpu_host():
    # This machine: every rank of the job on it, TensorFlow without GPUs.
    assert runtime.state().one_cpu_host
    grads = [tf.zeros([2**20])]  # 4 MiB: 8 buckets of 512 KiB elsewhere
    assert allreduce_module._bucket_bytes("auto", grads) == 0
    assert allreduce_module._bucket_bytes(12345, grads) == 12345  # a size the user set is kept


def ops_waited_for(op):
    """Every op that `op` waits for: its inputs' producers and control inputs, transitively."""
    seen, pending = set(), [op]
    while pending:
        current = pending.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                pending.append(parent)
    return seen


@pytest.mark.skipif(SIZE == 1, reason="a world of one reduces nothing")
def test_first_bucket_leaves_without_waiting_for_the_first_layers_gradient(bucket_bytes):
    # Overlap needs dataflow alone to order the step: the last layer's bucket must not wait (by
    # input or control edge, e.g. tf.function's automatic ones) for the first layer's kernel
    # gradient, which backprop computes last.
    bucket_bytes(64)
    model = make_model()
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(0.05))
    optimizer.build(model.trainable_variables)
    x, y = global_data(1, PER_RANK_BATCH)
    first_kernel_gradient = []

    @tf.function
    def train_step(xb, yb):  # what Model.train_step does
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        first_kernel_gradient.append(grads[0].op)
        optimizer.apply(grads, model.trainable_variables)

    graph = train_step.get_concrete_function(x, y).graph
    reductions = [op for op in graph.get_operations() if op.type == "KerasdistAllreduce"]
    assert len(reductions) == _BUCKETS_OF_64_BYTES
    assert first_kernel_gradient[0] in ops_waited_for(reductions[-1])  # the check below can see it
    assert first_kernel_gradient[0] not in ops_waited_for(reductions[0]), (
        "the first bucket's reduction waits for the first layer's gradient: nothing can overlap"
    )


@pytest.mark.parametrize("size", [0, 64, 1])
def test_fit_gives_the_same_weights_whatever_the_bucket_size(bucket_bytes, size):
    bucket_bytes(size)
    x, y = global_data(STEPS, SIZE * PER_RANK_BATCH)
    reference = make_model()
    reference.compile(keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    reference.fit(x, y, batch_size=SIZE * PER_RANK_BATCH, shuffle=False, verbose=0)

    model = make_model()
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    model.fit(
        this_ranks_rows(x, PER_RANK_BATCH, 1),
        this_ranks_rows(y, PER_RANK_BATCH, 1),
        batch_size=PER_RANK_BATCH,
        shuffle=False,
        verbose=0,
        callbacks=kd.callbacks(),
    )
    assert max_difference(model.get_weights(), reference.get_weights()) < 1e-5


BUCKETED_FEATURES = {
    "two_passes_per_update": lambda: (
        kd.DistributedOptimizer(keras.optimizers.SGD(0.05), backward_passes_per_step=2),
        None,
    ),
    "loss_scaling": lambda: (
        kd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))),
        None,
    ),
    # Clipping by the global norm needs every bucket: it must see the whole reduced gradient.
    "global_clipnorm": lambda: (kd.DistributedOptimizer(keras.optimizers.SGD(0.05, global_clipnorm=0.01)), None),
    "noise_scale": lambda: (
        lambda noise: (kd.DistributedOptimizer(keras.optimizers.SGD(0.05), gradient_noise_scale=noise), noise)
    )(kd.GradientNoiseScale(batch_size=PER_RANK_BATCH)),
}


@pytest.mark.skipif(SIZE == 1, reason="a world of one reduces nothing")
@pytest.mark.parametrize("feature", sorted(BUCKETED_FEATURES))
def test_features_give_the_same_result_with_one_bucket_per_tensor(bucket_bytes, feature):
    x, y = global_data(STEPS, SIZE * 2 * PER_RANK_BATCH)
    results = []
    for size in (0, 1):  # one bucket after backprop; every tensor its own bucket
        bucket_bytes(size)
        model = make_model()
        optimizer, noise = BUCKETED_FEATURES[feature]()
        model.compile(optimizer, loss="mse")
        model.fit(
            this_ranks_rows(x, PER_RANK_BATCH, 2),
            this_ranks_rows(y, PER_RANK_BATCH, 2),
            batch_size=PER_RANK_BATCH,
            shuffle=False,
            verbose=0,
            callbacks=kd.callbacks(),
        )
        statistics = (noise.updates, noise.gradient_sq_norm(), noise.noise_scale()) if noise else ()
        results.append((model.get_weights(), statistics))
    (one_bucket, one_bucket_statistics), (per_tensor, per_tensor_statistics) = results
    assert max_difference(one_bucket, per_tensor) < 1e-6
    assert max_difference(one_bucket, make_model().get_weights()) > 1e-3  # training did something
    np.testing.assert_allclose(per_tensor_statistics, one_bucket_statistics, rtol=1e-5)


def test_gradient_tape_sum_and_structure():
    w = tf.Variable([1.0, 2.0])
    b = tf.Variable(3.0)
    with kd.DistributedGradientTape(tf.GradientTape(), op=kd.Sum) as tape:
        loss = tf.reduce_sum(w * w) * (RANK + 1) + b
    grads = tape.gradient(loss, {"w": w, "b": b})
    ranks_sum = SIZE * (SIZE + 1) / 2
    np.testing.assert_allclose(grads["w"].numpy(), [2.0 * ranks_sum, 4.0 * ranks_sum])
    assert float(grads["b"]) == SIZE


def test_get_config_round_trip():
    optimizer = kd.DistributedOptimizer(
        LARS(0.5, momentum=0.8),
        op=kd.Sum,
        compression=kd.Compression.fp16,
        backward_passes_per_step=3,
        sparse_as_dense=True,
    )
    config = optimizer.get_config()
    again = kd.DistributedOptimizer.from_config(config)
    assert again.get_config() == config
    assert isinstance(again.inner_optimizer, LARS) and again.inner_optimizer.momentum == 0.8
    assert again.op == kd.Sum and again.compression is kd.Compression.fp16
    assert again.backward_passes_per_step == 3


def test_keras_file_round_trip_keeps_the_optimizer_state(tmp_path):
    x, y = global_data(4, SIZE * PER_RANK_BATCH)
    model = make_model()
    model.compile(
        kd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), backward_passes_per_step=2), loss="mse"
    )
    model.fit(x, y, batch_size=PER_RANK_BATCH, shuffle=False, verbose=0, callbacks=kd.callbacks())
    path = tmp_path / f"rank{RANK}.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.optimizer, kd.DistributedOptimizer)
    assert loaded.optimizer.backward_passes_per_step == 2
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(saved.numpy(), restored.numpy())


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(op=kd.Max), "Average or kerasdist.Sum"),
        (dict(compression="zip"), "compression="),
        (dict(backward_passes_per_step=0), "backward_passes_per_step=0"),
        (dict(clipnorm=1.0), "set them on the inner optimizer"),
    ],
)
def test_bad_arguments_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        kd.DistributedOptimizer(keras.optimizers.SGD(0.1), **bad)


@pytest.mark.parametrize("not_an_optimizer", [None, 0.01, keras.layers.Dense(1)], ids=["none", "float", "layer"])
def test_something_that_is_not_an_optimizer_is_named(not_an_optimizer):
    with pytest.raises(TypeError, match=r"DistributedOptimizer\(optimizer=.*expected a keras.optimizers.Optimizer"):
        kd.DistributedOptimizer(not_an_optimizer)


def test_wrapping_twice_is_refused():
    with pytest.raises(ValueError, match="already"):
        kd.DistributedOptimizer(kd.DistributedOptimizer("sgd"))


def test_loss_scale_optimizer_inside_sees_the_reduced_gradient():
    x, y = global_data(STEPS, SIZE * PER_RANK_BATCH)
    reference = make_model()
    reference.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    reference.fit(x, y, batch_size=SIZE * PER_RANK_BATCH, shuffle=False, verbose=0)
    model = make_model()
    model.compile(kd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))), loss="mse")
    model.fit(
        this_ranks_rows(x, PER_RANK_BATCH, 1),
        this_ranks_rows(y, PER_RANK_BATCH, 1),
        batch_size=PER_RANK_BATCH,
        shuffle=False,
        verbose=0,
        callbacks=kd.callbacks(),
    )
    assert max_difference(model.get_weights(), reference.get_weights()) < 1e-5


def test_jit_compile_is_turned_off_with_a_warning():
    x, y = global_data(2, SIZE * PER_RANK_BATCH)
    model = make_model()
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse", jit_compile=True)
    with pytest.warns(UserWarning, match="jit_compile=False"):
        model.fit(x, y, batch_size=PER_RANK_BATCH, verbose=0, callbacks=kd.callbacks())
    assert model.jit_compile is False


def test_an_xla_compiled_step_is_refused_with_a_clear_error():
    w = tf.Variable(1.0)

    @tf.function(jit_compile=True)
    def step():
        with kd.DistributedGradientTape(tf.GradientTape()) as tape:
            loss = w * w
        return tape.gradient(loss, w)

    with pytest.raises(ValueError, match="jit_compile"):
        step()


@pytest.mark.skipif(SIZE > 1, reason="one subprocess is enough; run from plain pytest")
def test_a_saved_model_loads_without_kerasdist(tmp_path):
    import subprocess
    import sys

    model = make_model()
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    model.fit(*global_data(2, 4), batch_size=4, verbose=0)
    model.save(tmp_path / "model.keras")
    np.save(tmp_path / "x.npy", global_data(1, 4)[0])
    np.save(tmp_path / "expected.npy", model.predict(global_data(1, 4)[0], verbose=0))
    # A fresh Python in which `import kerasdist` fails, as on a machine without it.
    script = (
        "import sys; sys.modules['kerasdist'] = None\n"
        "import keras, numpy as np\n"
        f"model = keras.saving.load_model({str(tmp_path / 'model.keras')!r}, compile=False)\n"
        f"got = model.predict(np.load({str(tmp_path / 'x.npy')!r}), verbose=0)\n"
        f"np.testing.assert_allclose(got, np.load({str(tmp_path / 'expected.npy')!r}), rtol=1e-6)\n"
        "print('LOADED')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "LOADED" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("average", [True, False])
def test_accumulated_micro_batches_are_averaged_or_summed_as_asked(average):
    # Rank r's micro-batch m has gradient (r + 1) * (m + 1); k = 2 micro-batches per update.
    lr, k = 0.5, 2
    variable = tf.Variable([1.0, -2.0])
    optimizer = kd.DistributedOptimizer(
        keras.optimizers.SGD(lr), backward_passes_per_step=k, average_aggregated_gradients=average
    )
    for micro_batch in range(k):
        optimizer.apply([tf.constant([1.0, 2.0]) * (RANK + 1) * (micro_batch + 1)], [variable])
    rank_sums = [sum((r + 1) * (m + 1) for m in range(k)) for r in range(SIZE)]
    per_update = np.mean(rank_sums) / (k if average else 1)
    np.testing.assert_allclose(variable.numpy(), np.array([1.0, -2.0]) - lr * per_update * np.array([1.0, 2.0]))
    assert optimizer.get_config()["average_aggregated_gradients"] is average


def test_summed_micro_batches_refuse_the_gradient_noise_scale():
    with pytest.raises(ValueError, match="average_aggregated_gradients=True"):
        kd.DistributedOptimizer(
            keras.optimizers.SGD(0.1),
            backward_passes_per_step=2,
            average_aggregated_gradients=False,
            gradient_noise_scale=kd.GradientNoiseScale(),
        )
