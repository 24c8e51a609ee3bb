"""The shared trust-ratio function and exclusion masks."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from optimizer_testing import make_variables

from kerasdist.optimizers import trust_ratio as tr


def scalar(x, dtype="float64"):
    return keras.ops.convert_to_tensor(x, dtype=dtype)


def test_ratio_is_weight_norm_over_update_norm():
    assert float(tr.trust_ratio(scalar(3.0), scalar(4.0))) == 0.75


def test_ratio_is_one_when_weight_norm_is_zero():
    assert float(tr.trust_ratio(scalar(0.0), scalar(4.0))) == 1.0


def test_ratio_is_one_when_update_norm_is_zero_even_with_a_denominator():
    # LARS: ‖g‖ = 0 gives λ = 1 although ‖g‖ + β‖w‖ + ε > 0.
    ratio = tr.trust_ratio(scalar(3.0), scalar(0.0), denominator=scalar(0.3), coefficient=0.001)
    assert float(ratio) == 1.0


def test_coefficient_and_denominator_give_the_lars_form():
    # η‖w‖/(‖g‖ + β‖w‖ + ε) with η = 0.001, ‖w‖ = 3, ‖g‖ = 4, β = 0.1, ε = 0.
    ratio = tr.trust_ratio(scalar(3.0), scalar(4.0), denominator=scalar(4.3), coefficient=0.001)
    np.testing.assert_allclose(float(ratio), 0.001 * 3.0 / 4.3, rtol=1e-15)


def test_clip_bounds_the_computed_ratio():
    assert float(tr.trust_ratio(scalar(100.0), scalar(1.0), clip=(0.01, 10.0))) == 10.0
    assert float(tr.trust_ratio(scalar(1.0), scalar(1000.0), clip=(0.01, 10.0))) == 0.01


def test_clip_does_not_move_the_zero_norm_ratio():
    assert float(tr.trust_ratio(scalar(0.0), scalar(1.0), clip=(2.0, 10.0))) == 1.0


def test_ratio_keeps_float32():
    ratio = tr.trust_ratio(scalar(3.0, "float32"), scalar(4.0, "float32"), coefficient=0.5)
    assert keras.backend.standardize_dtype(ratio.dtype) == "float32"


def test_l2_norm_covers_every_entry_of_a_4d_tensor():
    x = np.arange(24, dtype=np.float64).reshape(2, 3, 2, 2)
    np.testing.assert_allclose(float(tr.l2_norm(scalar(x))), np.sqrt(np.sum(x**2)), rtol=1e-15)


def test_python_floats_reach_float64_without_float32_rounding():
    assert float(tr.to_dtype(0.1, "float64")) == 0.1


def test_sparse_gradient_is_densified_with_repeated_rows_summed():
    slices = tf.IndexedSlices(
        values=tf.constant([[1.0, 2.0], [3.0, 4.0]]), indices=tf.constant([1, 1]), dense_shape=tf.constant([3, 2])
    )
    dense = tr.dense_gradient(slices, "float32")
    np.testing.assert_array_equal(np.asarray(dense), [[0, 0], [4, 6], [0, 0]])


def test_ndim_le_1_variables_are_excluded_by_default():
    variables = make_variables(
        {"net/dense/bias": np.zeros(3), "net/scale": np.zeros(()), "net/k": np.zeros((2, 2))}, "float32"
    )
    assert tr.is_excluded(variables["net/dense/bias"], ())
    assert tr.is_excluded(variables["net/scale"], ())
    assert not tr.is_excluded(variables["net/k"], ())


def test_ndim_rule_can_be_turned_off():
    variables = make_variables({"net/dense/bias": np.zeros(3)}, "float32")
    assert not tr.is_excluded(variables["net/dense/bias"], (), exclude_biases_and_norms=False)


def test_patterns_are_searched_in_the_variable_path_not_the_short_name():
    variables = make_variables(
        {"model/dense_1/kernel": np.zeros((2, 2)), "model/dense_2/kernel": np.zeros((2, 2))}, "float32"
    )
    patterns = tr.compile_patterns(["dense_1/kernel"], "exclude_from_weight_decay")
    assert tr.is_excluded(variables["model/dense_1/kernel"], patterns)
    assert not tr.is_excluded(variables["model/dense_2/kernel"], patterns)


def test_single_pattern_string_is_accepted():
    assert tr.compile_patterns("bias", "exclude_from_weight_decay") == ("bias",)


def test_invalid_pattern_is_rejected_naming_the_argument():
    with pytest.raises(ValueError, match="exclude_from_weight_decay.*invalid regex"):
        tr.compile_patterns(["dense_1/(kernel"], "exclude_from_weight_decay")


def test_non_string_pattern_is_rejected():
    with pytest.raises(ValueError, match="regex strings"):
        tr.compile_patterns([3], "exclude_from_layer_adaptation")
