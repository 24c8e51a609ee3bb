"""broadcast and broadcast_variables: every rank ends with the root's values."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from kd_testutil import ALL_DTYPES, RANK, SHAPES, SIZE, as_tensor, check, dtype_id, rank_values, run, shape_id, to_numpy

import kerasdist as kd

ROOTS = ["first", "last"]


def _root_rank(root):
    return 0 if root == "first" else SIZE - 1


@pytest.mark.parametrize("root", ROOTS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_broadcast_returns_the_root_value(dtype, shape, root):
    root_rank = _root_rank(root)
    out = kd.broadcast(as_tensor(rank_values(RANK, dtype, shape), dtype), root_rank)
    check(out, rank_values(root_rank, dtype, shape), dtype)


@pytest.mark.parametrize("dtype", [tf.int8, tf.float64, tf.bool], ids=dtype_id)
def test_broadcast_of_a_scalar(dtype):
    out = kd.broadcast(as_tensor(rank_values(RANK, dtype, ()), dtype), root_rank=SIZE - 1)
    check(out, rank_values(SIZE - 1, dtype, ()), dtype)


@pytest.mark.parametrize("root", ROOTS)
@pytest.mark.parametrize("dtype", [tf.uint8, tf.float16, tf.float32, tf.bool], ids=dtype_id)
def test_broadcast_in_tf_function(dtype, root):
    root_rank = _root_rank(root)
    out = run(
        "function",
        lambda x: kd.broadcast(x, root_rank=root_rank),
        as_tensor(rank_values(RANK, dtype, (4, 3), salt="fn"), dtype),
    )
    check(out, rank_values(root_rank, dtype, (4, 3), salt="fn"), dtype)


_VARIABLE_SPECS = [(tf.float32, (3, 4)), (tf.float64, (5,)), (tf.int32, (2, 2)), (tf.bfloat16, (3,)), (tf.float32, ())]


@pytest.mark.parametrize("root", ROOTS)
def test_broadcast_variables_assigns_the_root_values_in_place(root):
    root_rank = _root_rank(root)
    variables = [
        tf.Variable(as_tensor(rank_values(RANK, dtype, shape, salt=i), dtype))
        for i, (dtype, shape) in enumerate(_VARIABLE_SPECS)
    ]
    before = [id(v) for v in variables]
    kd.broadcast_variables(variables, root_rank=root_rank)
    assert [id(v) for v in variables] == before
    for i, (v, (dtype, shape)) in enumerate(zip(variables, _VARIABLE_SPECS)):
        check(v.read_value(), rank_values(root_rank, dtype, shape, salt=i), dtype)


def test_broadcast_variables_defaults_to_root_zero():
    v = tf.Variable([float(RANK)] * 3)
    kd.broadcast_variables([v])
    np.testing.assert_array_equal(v.numpy(), [0.0, 0.0, 0.0])


def test_broadcast_variables_of_a_keras_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])

    def weights_of(r):
        return [rank_values(r, tf.float32, w.shape, salt=f"k{i}") for i, w in enumerate(model.weights)]

    model.set_weights([w.astype(np.float32) for w in weights_of(RANK)])
    kd.broadcast_variables(model.variables, root_rank=SIZE - 1)
    for got, expected in zip(model.get_weights(), weights_of(SIZE - 1)):
        np.testing.assert_array_equal(got, expected)
    # And the model computes with the broadcast weights.
    out = to_numpy(model(tf.ones((1, 4))))
    w = weights_of(SIZE - 1)
    np.testing.assert_allclose(out, (np.ones((1, 4)) @ w[0] + w[1]) @ w[2] + w[3], rtol=1e-5, atol=1e-3)
