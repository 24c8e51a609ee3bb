"""LARS against an independent NumPy transcription of You, Gitman, Ginsburg 2017."""

import copy

import keras
import numpy as np
import pytest
from optimizer_testing import (
    ZERO_GRADIENT_STEP,
    assert_ratios_close,
    assert_weights_close,
    gradient_steps,
    initial_weights,
    rounded,
    rounded_settings,
    run_optimizer,
    tf_function_step,
    tiny_data,
    tiny_model,
)

from kerasdist.optimizers import LARS

BIAS = "net/dense/bias"
KERNELS = ["net/dense/kernel", "net/conv/kernel", "net/zero/kernel"]


def lars_reference(
    weights,
    grad_steps,
    learning_rate,
    momentum,
    weight_decay,
    trust_coefficient,
    epsilon,
    nesterov,
    no_decay,
    no_adaptation,
):
    """The paper's equations in float64.

    λ = η‖w‖/(‖g‖ + β‖w‖ + ε), 1 when ‖w‖ = 0 or ‖g‖ = 0 or w is not adapted;
    v ← m·v + γ_t·λ·(g + βw); w ← w − v (nesterov: w ← w − (m·v + γ_t·λ·(g + βw))).
    `learning_rate` is a float or a function of the 0-based step. Returns (weights, last λ of the
    adapted variables).
    """
    w = {k: np.array(v, dtype=np.float64) for k, v in weights.items()}
    velocity = {k: np.zeros_like(v) for k, v in w.items()}
    last_ratio = {}
    for step, grads in enumerate(grad_steps):
        lr = learning_rate(step) if callable(learning_rate) else learning_rate
        for k in w:
            g = np.asarray(grads[k], dtype=np.float64)
            beta = 0.0 if k in no_decay else weight_decay
            w_norm = np.sqrt(np.sum(w[k] ** 2))
            g_norm = np.sqrt(np.sum(g**2))
            if k in no_adaptation or w_norm == 0 or g_norm == 0:
                local = 1.0
            else:
                local = trust_coefficient * w_norm / (g_norm + beta * w_norm + epsilon)
            if k not in no_adaptation:
                last_ratio[k] = local
            scaled = lr * local * (g + beta * w[k])
            velocity[k] = momentum * velocity[k] + scaled
            if nesterov:
                w[k] = w[k] - (momentum * velocity[k] + scaled)
            else:
                w[k] = w[k] - velocity[k]
    return w, last_ratio


def check_against_reference(dtype, rtol, atol, lars_kwargs, no_decay=(BIAS,), no_adaptation=(BIAS,), step_fn=None):
    weights = initial_weights()
    grads = gradient_steps()
    actual, ratios = run_optimizer(LARS(**lars_kwargs), weights, grads, dtype, step_fn=step_fn)
    defaults = dict(
        learning_rate=0.01, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.001, epsilon=1e-9, nesterov=False
    )
    settings = {**defaults, **{k: v for k, v in lars_kwargs.items() if k in defaults}}
    settings = rounded_settings(settings, dtype)
    expected, expected_ratios = lars_reference(
        rounded(weights, dtype),
        [rounded(g, dtype) for g in grads],
        no_decay=set(no_decay),
        no_adaptation=set(no_adaptation),
        **settings,
    )
    assert_weights_close(actual, expected, rtol=rtol, atol=atol)
    assert_ratios_close(ratios, expected_ratios, rtol=max(rtol, 1e-6), atol=atol)


VARIANTS = {
    "sgd-no-momentum-no-decay": dict(learning_rate=0.5, momentum=0.0, weight_decay=0.0),
    "momentum-with-decay": dict(learning_rate=0.5, momentum=0.9, weight_decay=0.01),
    "nesterov-with-decay": dict(learning_rate=0.5, momentum=0.9, weight_decay=0.01, nesterov=True),
    "defaults": dict(),
    "large-trust-coefficient": dict(learning_rate=0.1, momentum=0.5, weight_decay=0.05, trust_coefficient=0.5),
}


@pytest.mark.parametrize("kwargs", VARIANTS.values(), ids=VARIANTS.keys())
def test_matches_paper_equations_in_float64(float64, kwargs):
    check_against_reference("float64", rtol=1e-9, atol=1e-12, lars_kwargs=kwargs)


@pytest.mark.parametrize("kwargs", [VARIANTS["momentum-with-decay"], VARIANTS["nesterov-with-decay"]])
def test_matches_paper_equations_in_float32(kwargs):
    check_against_reference("float32", rtol=1e-5, atol=1e-6, lars_kwargs=kwargs)


def test_matches_paper_equations_inside_tf_function(float64):
    check_against_reference(
        "float64", rtol=1e-9, atol=1e-12, lars_kwargs=VARIANTS["momentum-with-decay"], step_fn=tf_function_step()
    )


def test_zero_weights_take_a_full_rate_step(float64):
    optimizer = LARS(learning_rate=0.5, momentum=0.0, weight_decay=0.01)
    weights = {"net/zero/kernel": np.zeros((4, 2))}
    grads = [{"net/zero/kernel": np.full((4, 2), 2.0)}]
    actual, ratios = run_optimizer(optimizer, weights, grads, "float64")
    np.testing.assert_allclose(actual["net/zero/kernel"], np.full((4, 2), -1.0), rtol=0, atol=1e-15)
    assert ratios == {"net/zero/kernel": 1.0}


def test_zero_gradient_sets_trust_ratio_to_one(float64):
    weights = {"net/dense/kernel": np.ones((2, 2))}
    grads = [{"net/dense/kernel": np.zeros((2, 2))}]
    _, ratios = run_optimizer(LARS(weight_decay=0.0), weights, grads, "float64")
    assert ratios == {"net/dense/kernel": 1.0}


def test_weight_decay_is_applied_once(float64):
    # With g = 0 the trust ratio is 1, so one step is w·(1 − γβ) exactly; Keras's decoupled decay
    # applied on top would give w·(1 − γβ)².
    optimizer = LARS(learning_rate=0.5, momentum=0.0, weight_decay=0.1)
    weights = {"net/dense/kernel": np.full((2, 2), 3.0)}
    actual, _ = run_optimizer(optimizer, weights, [{"net/dense/kernel": np.zeros((2, 2))}], "float64")
    np.testing.assert_allclose(actual["net/dense/kernel"], np.full((2, 2), 3.0 * (1 - 0.05)), rtol=1e-15)
    assert optimizer.weight_decay is None
    assert optimizer.get_config()["weight_decay"] == 0.1


def test_bias_is_excluded_from_decay_and_adaptation_by_ndim(float64):
    optimizer = LARS(learning_rate=0.5, momentum=0.0, weight_decay=0.1)
    weights = {BIAS: np.full((3,), 2.0)}
    actual, ratios = run_optimizer(optimizer, weights, [{BIAS: np.ones((3,))}], "float64")
    np.testing.assert_allclose(actual[BIAS], np.full((3,), 1.5), rtol=1e-15)
    assert ratios == {}


def test_ndim_exclusion_can_be_turned_off(float64):
    check_against_reference(
        "float64",
        rtol=1e-9,
        atol=1e-12,
        lars_kwargs=dict(VARIANTS["momentum-with-decay"], exclude_biases_and_norms=False),
        no_decay=(),
        no_adaptation=(),
    )


def test_path_regex_excludes_from_weight_decay(float64):
    check_against_reference(
        "float64",
        rtol=1e-9,
        atol=1e-12,
        lars_kwargs=dict(VARIANTS["momentum-with-decay"], exclude_from_weight_decay=["conv/kernel"]),
        no_decay=(BIAS, "net/conv/kernel"),
    )


def test_path_regex_excludes_from_layer_adaptation(float64):
    check_against_reference(
        "float64",
        rtol=1e-9,
        atol=1e-12,
        lars_kwargs=dict(VARIANTS["momentum-with-decay"], exclude_from_layer_adaptation="dense/kernel$"),
        no_adaptation=(BIAS, "net/dense/kernel"),
    )


def test_follows_a_learning_rate_schedule(float64):
    # Powers of two, so the schedule's own float32 arithmetic is exact.
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay(boundaries=[1, 3], values=[0.5, 0.25, 0.125])
    weights = initial_weights()
    grads = gradient_steps()
    actual, _ = run_optimizer(LARS(learning_rate=schedule, weight_decay=0.01), weights, grads, "float64")

    def reference_rate(step):
        return 0.5 if step <= 1 else 0.25 if step <= 3 else 0.125

    expected, _ = lars_reference(
        weights, grads, reference_rate, 0.9, 0.01, 0.001, 1e-9, False, no_decay={BIAS}, no_adaptation={BIAS}
    )
    assert_weights_close(actual, expected, rtol=1e-9, atol=1e-12)


def test_zero_gradient_step_is_part_of_the_reference_run():
    # Guards the fixture the reference tests rely on: one step has ‖g‖ = 0, one kernel ‖w‖ = 0.
    assert not gradient_steps()[ZERO_GRADIENT_STEP]["net/dense/kernel"].any()
    assert not initial_weights()["net/zero/kernel"].any()


def test_trust_ratios_are_empty_before_build():
    assert LARS().trust_ratios() == {}


def test_rejects_momentum_outside_unit_interval():
    with pytest.raises(ValueError, match="momentum"):
        LARS(momentum=1.0)


def test_rejects_invalid_exclusion_regex_naming_the_argument():
    with pytest.raises(ValueError, match="exclude_from_layer_adaptation.*invalid regex"):
        LARS(exclude_from_layer_adaptation=["dense_1/(kernel"])


def test_get_config_round_trips():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.9)
    optimizer = LARS(
        learning_rate=schedule,
        momentum=0.8,
        weight_decay=5e-4,
        trust_coefficient=0.02,
        epsilon=1e-8,
        nesterov=True,
        exclude_from_weight_decay=["embedding"],
        exclude_from_layer_adaptation=["head/kernel"],
        exclude_biases_and_norms=False,
        clipnorm=1.0,
        name="my_lars",
    )
    config = optimizer.get_config()
    restored = LARS.from_config(copy.deepcopy(config))
    assert restored.get_config() == config
    assert isinstance(restored._learning_rate, keras.optimizers.schedules.ExponentialDecay)


def test_is_registered_for_keras_serialization():
    assert keras.saving.get_registered_name(LARS) == "kerasdist>LARS"
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(LARS(momentum=0.5)))
    assert isinstance(restored, LARS) and restored.momentum == 0.5


def test_keras_file_round_trip_restores_optimizer_state(tmp_path):
    model = tiny_model()
    model.compile(optimizer=LARS(learning_rate=0.5, weight_decay=1e-3, exclude_from_weight_decay="head"), loss="mse")
    x, y = tiny_data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "lars.keras"
    model.save(path)

    loaded = keras.saving.load_model(path)  # no custom_objects: LARS is registered

    assert isinstance(loaded.optimizer, LARS)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(saved.numpy(), restored.numpy(), err_msg=saved.path)
    assert sorted(loaded.optimizer.trust_ratios().values()) == sorted(model.optimizer.trust_ratios().values())


def test_keras_exclude_from_weight_decay_method_is_honoured(float64):
    optimizer = LARS(learning_rate=0.5, momentum=0.0, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_names=["kernel"])
    weights = {"net/dense/kernel": np.full((2, 2), 3.0)}
    actual, _ = run_optimizer(optimizer, weights, [{"net/dense/kernel": np.zeros((2, 2))}], "float64")
    np.testing.assert_array_equal(actual["net/dense/kernel"], np.full((2, 2), 3.0))
