"""allreduce and grouped_allreduce against NumPy, including the ordering race:
many independent allreduces in one tf.function must each get their own sum."""

import ctypes
import pathlib

import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import (
    FLOAT_DTYPES,
    MODES,
    NUMERIC_DTYPES,
    RANK,
    REDUCE_OPS,
    SHAPES,
    SIZE,
    as_tensor,
    check,
    dtype_id,
    max_abs,
    rank_values,
    reduce_op,
    reference_reduce,
    run,
    shape_id,
)

import kerasdist as kd
from kerasdist.knobs import Knobs


def _purpose(op_name):
    return "product" if op_name == "Product" else "sum"


def _exact(op_name, dtype):
    return not (op_name == "Average" and dtype.is_floating)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", NUMERIC_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op_name", REDUCE_OPS)
def test_allreduce_matches_numpy(op_name, dtype, shape):
    sent = [rank_values(r, dtype, shape, _purpose(op_name)) for r in range(SIZE)]
    out = kd.allreduce(as_tensor(sent[RANK], dtype), op=reduce_op(op_name))
    check(out, reference_reduce(sent, op_name, dtype), dtype, exact=_exact(op_name, dtype), magnitude=max_abs(sent))


@pytest.mark.parametrize("dtype", [tf.int32, tf.float16, tf.bfloat16, tf.float32], ids=dtype_id)
@pytest.mark.parametrize("op_name", REDUCE_OPS)
def test_allreduce_matches_numpy_in_tf_function(op_name, dtype):
    shape = (3, 5)
    sent = [rank_values(r, dtype, shape, _purpose(op_name), salt="fn") for r in range(SIZE)]
    op = reduce_op(op_name)
    out = run("function", lambda x: kd.allreduce(x, op=op), as_tensor(sent[RANK], dtype))
    check(out, reference_reduce(sent, op_name, dtype), dtype, exact=_exact(op_name, dtype), magnitude=max_abs(sent))


@pytest.mark.parametrize("dtype", NUMERIC_DTYPES, ids=dtype_id)
def test_allreduce_of_a_scalar(dtype):
    sent = [rank_values(r, dtype, ()) for r in range(SIZE)]
    out = kd.allreduce(as_tensor(sent[RANK], dtype), op=kd.Sum)
    check(out, reference_reduce(sent, "Sum", dtype), dtype)


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_of_an_empty_tensor(mode):
    out = run(mode, lambda x: kd.allreduce(x, op=kd.Sum), tf.zeros((0, 3), tf.float32))
    check(out, np.zeros((0, 3)), tf.float32)


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_default_op_is_average(mode):
    sent = [np.full((4,), 2.0 * (r + 1)) for r in range(SIZE)]
    out = run(mode, kd.allreduce, tf.constant(sent[RANK], tf.float32))
    check(out, np.full((4,), float(SIZE + 1)), tf.float32)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op_name", ["Sum", "Average", "Max"])
def test_allreduce_applies_prescale_then_postscale(op_name, dtype):
    # Powers of two keep every intermediate exact (Average aside).
    pre, post = 0.5, 4.0
    sent = [rank_values(r, dtype, (3, 4), salt="scale") for r in range(SIZE)]
    out = kd.allreduce(as_tensor(sent[RANK], dtype), op=reduce_op(op_name), prescale_factor=pre, postscale_factor=post)
    expected = post * reference_reduce([pre * s for s in sent], op_name, dtype)
    check(out, expected, dtype, exact=_exact(op_name, dtype), magnitude=post * max_abs(sent))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64], ids=dtype_id)
def test_allreduce_with_arbitrary_scale_factors(dtype, mode):
    pre, post = 0.1, 3.0
    sent = [rank_values(r, dtype, (6,), salt="scale2") for r in range(SIZE)]
    out = run(
        mode,
        lambda x: kd.allreduce(x, op=kd.Sum, prescale_factor=pre, postscale_factor=post),
        as_tensor(sent[RANK], dtype),
    )
    check(
        out, post * np.sum([pre * s for s in sent], axis=0), dtype, exact=False, magnitude=post * max_abs(sent) * SIZE
    )


def test_many_unnamed_eager_calls_pair_up_in_call_order():
    outs = [kd.allreduce(tf.constant([float(i * (RANK + 1)), float(i)]), op=kd.Sum) for i in range(100)]
    got = np.array([o.numpy() for o in outs])
    expected = np.array([[i * SIZE * (SIZE + 1) / 2, i * SIZE] for i in range(100)])
    np.testing.assert_array_equal(got, expected)


def test_an_explicit_name_can_be_reused_once_the_first_call_completed():
    outs = [kd.allreduce(tf.constant([float(i + RANK)]), op=kd.Max, name="reused_name") for i in range(5)]
    assert [o.numpy()[0] for o in outs] == [float(i + SIZE - 1) for i in range(5)]


# ---------------------------------------------------------------- grouped

_GROUP = [
    (tf.float32, (5,)),
    (tf.int32, (2, 3)),
    (tf.float64, (4, 1, 2)),
    (tf.float16, (3,)),
    (tf.uint8, (6,)),
    (tf.float32, ()),
    (tf.bfloat16, (2, 2)),
    (tf.int64, (1,)),
    (tf.int8, (3, 1)),
]


def _group_inputs(salt):
    return [
        [rank_values(r, dtype, shape, salt=f"{salt}{i}") for r in range(SIZE)]
        for i, (dtype, shape) in enumerate(_GROUP)
    ]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op_name", ["Sum", "Average", "Max"])
def test_grouped_allreduce_of_mixed_dtypes_and_shapes(op_name, mode):
    sent = _group_inputs("group")
    tensors = [as_tensor(s[RANK], dtype) for s, (dtype, _) in zip(sent, _GROUP)]
    op = reduce_op(op_name)
    outs = run(mode, lambda *ts: kd.grouped_allreduce(list(ts), op=op), *tensors)
    assert len(outs) == len(_GROUP)
    for out, s, (dtype, _) in zip(outs, sent, _GROUP):
        check(out, reference_reduce(s, op_name, dtype), dtype, exact=_exact(op_name, dtype), magnitude=max_abs(s))


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_applies_scale_factors(mode):
    pre, post = 0.25, 2.0
    floats = [(dtype, shape) for dtype, shape in _GROUP if dtype.is_floating]
    sent = [
        [rank_values(r, dtype, shape, salt=f"gs{i}") for r in range(SIZE)] for i, (dtype, shape) in enumerate(floats)
    ]
    tensors = [as_tensor(s[RANK], dtype) for s, (dtype, _) in zip(sent, floats)]
    outs = run(
        mode,
        lambda *ts: kd.grouped_allreduce(list(ts), op=kd.Sum, prescale_factor=pre, postscale_factor=post),
        *tensors,
    )
    for out, s, (dtype, _) in zip(outs, sent, floats):
        check(out, post * pre * np.sum(s, axis=0), dtype)


def test_grouped_allreduce_of_one_tensor():
    outs = kd.grouped_allreduce([tf.constant([RANK + 1.0])], op=kd.Sum)
    assert len(outs) == 1
    check(outs[0], [SIZE * (SIZE + 1) / 2], tf.float32)


# ----------------------------------------------- fused results are views

# Fused results are views of one buffer that a later cycle reuses once no result
# views it any more; results that are still alive must never change.


def _step_values(step, i, n):
    return tf.fill([n], float(step * 100 + i * 10 + RANK))


def _step_expected(step, i):
    return SIZE * (step * 100 + i * 10) + SIZE * (SIZE - 1) / 2


def test_results_kept_alive_survive_many_later_fused_allreduces():
    sizes = [3, 17, 1, 1000]  # odd sizes: each view starts at a padded offset
    kept = []
    for step in range(40):  # more steps than the engine keeps pooled buffers (32)
        kept.append(kd.grouped_allreduce([_step_values(step, i, n) for i, n in enumerate(sizes)], op=kd.Sum))
    for step, outs in enumerate(kept):
        for i, (out, n) in enumerate(zip(outs, sizes)):
            np.testing.assert_array_equal(out.numpy(), np.full(n, _step_expected(step, i)))


def test_results_dropped_at_once_are_still_right_when_their_buffer_is_reused():
    @tf.function
    def step_sum(step):
        outs = kd.grouped_allreduce([tf.fill([5 + i], step * 100.0 + i * 10 + RANK) for i in range(4)], op=kd.Sum)
        return tf.stack([tf.reduce_sum(o) for o in outs])

    for step in range(10):
        expected = [(5 + i) * _step_expected(step, i) for i in range(4)]
        np.testing.assert_array_equal(step_sum(tf.constant(float(step))).numpy(), expected)


def test_updating_one_result_leaves_the_others_alone():
    @tf.function
    def update_first():
        a, b = kd.grouped_allreduce([tf.fill([7], 1.0 + RANK), tf.fill([7], 2.0)], op=kd.Sum)
        # Element-wise ops may write into their input's memory when nothing else reads it.
        return a * 3.0 + 1.0, b

    a, b = update_first()
    total = SIZE * (SIZE + 1) / 2
    np.testing.assert_array_equal(a.numpy(), np.full(7, 3.0 * total + 1.0))
    np.testing.assert_array_equal(b.numpy(), np.full(7, 2.0 * SIZE))


def test_a_variable_assigned_a_fused_result_keeps_its_value():
    var = tf.Variable(tf.zeros([6]))
    var.assign(kd.grouped_allreduce([tf.fill([6], 1.0), tf.fill([2], 5.0)], op=kd.Sum)[0])
    for step in range(8):  # later cycles reuse the buffer the assigned value came from
        kd.grouped_allreduce([tf.fill([6], float(step)), tf.fill([2], 0.0)], op=kd.Sum)
    np.testing.assert_array_equal(var.numpy(), np.full(6, float(SIZE)))


@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_larger_than_the_fusion_threshold_is_right_in_every_piece(mode):
    threshold = Knobs.from_environment().fusion_threshold_bytes
    n = threshold // 4 * 2 + 1001 if threshold else 1 << 20  # two pieces and a ragged end
    x = tf.range(n, dtype=tf.float32) % 1000 + RANK
    out = run(mode, lambda t: kd.allreduce(t, op=kd.Average, prescale_factor=2.0), x)
    expected = 2.0 * (np.arange(n) % 1000 + (SIZE - 1) / 2)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)


# ------------------------------------------- large tensors on huge pages

# MPI moves a large message over shared memory faster through 2 MiB pages than through 4 KiB ones,
# so the engine asks the kernel for transparent huge pages on the memory a tensor of 4 MiB or
# more is reduced in, as NumPy does for its large arrays.
TRANSPARENT_HUGE_PAGES = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGE = 2 << 20


def _data_address(tensor):
    """Where a CPU tensor's values are (through DLPack: .numpy() copies them)."""
    capsule = tf.experimental.dlpack.to_dlpack(tensor)
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return ctypes.cast(get_pointer(capsule, b"dltensor"), ctypes.POINTER(ctypes.c_void_p))[0]  # DLTensor.data


def _mapping_flags(address):
    """The VmFlags of the mapping of this process that holds `address` (proc(5): hg = huge pages
    advised)."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if not first.endswith(":"):  # a mapping's header: start-end perms ...
            start, end = (int(bound, 16) for bound in first.split("-"))
            inside = start <= address < end
        elif inside and first == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not TRANSPARENT_HUGE_PAGES.exists() or "[never]" in TRANSPARENT_HUGE_PAGES.read_text(),
    reason="this kernel grants no transparent huge pages",
)
@pytest.mark.parametrize("mode", MODES)
def test_a_large_tensor_is_reduced_in_memory_advised_for_huge_pages(mode):
    n = 2 * HUGE_PAGE  # 8 MiB of float32: at least one whole huge page inside, wherever it starts
    threshold = Knobs.from_environment().fusion_threshold_bytes
    if 0 < threshold < 4 * n:
        pytest.skip(f"a fusion threshold of {threshold} bytes reduces this tensor in pieces")
    x = tf.range(n, dtype=tf.float32) % 1000 + RANK
    out = run(mode, lambda t: kd.allreduce(t, op=kd.Sum), x)
    np.testing.assert_array_equal(out.numpy(), SIZE * (np.arange(n) % 1000) + SIZE * (SIZE - 1) / 2)
    first_whole_page = -(-_data_address(out) // HUGE_PAGE) * HUGE_PAGE
    assert "hg" in _mapping_flags(first_whole_page)


# ------------------------------------------------------ ordering race

_N_INDEPENDENT = 300


def _race_spec(i):
    dtype = [tf.float32, tf.float32, tf.int32, tf.float64][i % 4]
    n = 50_000 if i % 50 == 7 else 1 + (i * 37) % 701
    op_name = "Max" if i % 5 == 0 else "Sum"
    return dtype, n, op_name


def _race_input(i, rank):
    dtype, n, _ = _race_spec(i)
    return tf.cast((rank + 1) * (i + 1) + tf.range(n) % 11, dtype)


def _race_expected(i):
    _, n, op_name = _race_spec(i)
    ramp = np.arange(n) % 11
    if op_name == "Max":
        return SIZE * (i + 1) + ramp
    return (i + 1) * SIZE * (SIZE + 1) // 2 + SIZE * ramp


def test_300_independent_allreduces_in_one_tf_function_are_each_exact():
    @tf.function
    def many():
        # No data or control dependency between the collectives: TF may start
        # them in a different order on every rank.
        return [kd.allreduce(_race_input(i, RANK), op=reduce_op(_race_spec(i)[2])) for i in range(_N_INDEPENDENT)]

    wrong = []
    for call in range(3):
        outs = many()
        for i, out in enumerate(outs):
            dtype = _race_spec(i)[0]
            if out.dtype != dtype or not np.array_equal(out.numpy(), _race_expected(i)):
                wrong.append((call, i))
    assert not wrong, f"{len(wrong)} wrong results (call, tensor index): {wrong[:20]}"


def test_independent_collectives_of_every_kind_in_one_tf_function():
    n_each = 20

    @tf.function
    def mixed():
        outs = []
        for i in range(n_each):
            x = tf.fill([SIZE * 2, 3], float((RANK + 1) * (i + 1)))
            outs.append(kd.allreduce(x, op=kd.Sum))
            outs.append(kd.allgather(x[: RANK + 1]))
            outs.append(kd.broadcast(x, root_rank=i % SIZE))
            outs.append(kd.reducescatter(x, op=kd.Sum))
            outs.append(kd.alltoall(x))
        return outs

    outs = mixed()
    for i in range(n_each):
        value = lambda r, i=i: float((r + 1) * (i + 1))  # noqa: E731
        sum_all = sum(value(r) for r in range(SIZE))
        allreduce, allgather, broadcast, reducescatter, alltoall = outs[5 * i : 5 * i + 5]
        np.testing.assert_array_equal(allreduce.numpy(), np.full((SIZE * 2, 3), sum_all))
        np.testing.assert_array_equal(
            allgather.numpy(), np.concatenate([np.full((r + 1, 3), value(r)) for r in range(SIZE)])
        )
        np.testing.assert_array_equal(broadcast.numpy(), np.full((SIZE * 2, 3), value(i % SIZE)))
        np.testing.assert_array_equal(reducescatter.numpy(), np.full((2, 3), sum_all))
        np.testing.assert_array_equal(
            alltoall.numpy(), np.concatenate([np.full((2, 3), value(r)) for r in range(SIZE)])
        )


def _rank_slices(dtype):
    """Rank r's embedding-gradient-like slices: rows [r+1, 10(r+1)] at indices [r, 0]."""
    values = np.array([[RANK + 1], [10 * (RANK + 1)]], dtype)
    return tf.IndexedSlices(tf.constant(values), tf.constant([RANK, 0], tf.int64), tf.constant([8, 1], tf.int64))


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_indexed_slices_are_gathered_with_every_rank_s_rows(op):
    reduced = kd.allreduce(_rank_slices(np.float32), op=getattr(kd, op), name=f"slices.{op}")
    divisor = SIZE if op == "Average" else 1
    expected = np.concatenate([np.array([[r + 1], [10 * (r + 1)]], np.float32) for r in range(SIZE)]) / divisor
    np.testing.assert_allclose(reduced.values.numpy(), expected, rtol=1e-6)
    assert reduced.indices.numpy().tolist() == [i for r in range(SIZE) for i in (r, 0)]
    # Summed densely, they are the dense allreduce of the same rows.
    dense = tf.math.unsorted_segment_sum(reduced.values, reduced.indices, 8).numpy()
    np.testing.assert_allclose(
        dense,
        tf.convert_to_tensor(kd.allreduce(tf.convert_to_tensor(_rank_slices(np.float32)), op=getattr(kd, op))).numpy(),
        rtol=1e-6,
    )


def test_integer_indexed_slices_sum_gathers_the_rows_and_average_is_refused():
    summed = kd.allreduce(_rank_slices(np.int32), op=kd.Sum, name="int_slices.sum")
    assert summed.values.numpy().ravel().tolist() == [v for r in range(SIZE) for v in (r + 1, 10 * (r + 1))]
    # Each row divided by the rank count in its own integer dtype would be 1/size = 0: all zeros.
    with pytest.raises(ValueError, match=r"integer IndexedSlices \(int32\) with Average.*tf.convert_to_tensor"):
        kd.allreduce(_rank_slices(np.int32), op=kd.Average, name="int_slices.average")
