"""LAMB against an independent NumPy transcription of Algorithm 2 of You et al. 2019."""

import copy

import keras
import numpy as np
import pytest
from optimizer_testing import (
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

from kerasdist.optimizers import LAMB

BIAS = "net/dense/bias"


def lamb_reference(
    weights,
    grad_steps,
    learning_rate,
    beta_1,
    beta_2,
    epsilon,
    weight_decay,
    bias_correction,
    trust_ratio_clip,
    no_decay,
    no_adaptation,
):
    """Algorithm 2 in float64.

    m ← β₁m + (1−β₁)g; v ← β₂v + (1−β₂)g²; m̂ = m/(1−β₁ᵗ), v̂ = v/(1−β₂ᵗ) (or m, v);
    r = m̂/(√v̂ + ε); u = r + λw; w ← w − η_t·(‖w‖/‖u‖)·u with the ratio 1 when a norm is 0 or w
    is not adapted, else clipped to trust_ratio_clip. `learning_rate` is a float or a function
    of the 0-based step. Returns (weights, last ratio of the adapted variables).
    """
    w = {k: np.array(v, dtype=np.float64) for k, v in weights.items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v = {k: np.zeros_like(x) for k, x in w.items()}
    last_ratio = {}
    for t, grads in enumerate(grad_steps, start=1):
        lr = learning_rate(t - 1) if callable(learning_rate) else learning_rate
        for k in w:
            g = np.asarray(grads[k], dtype=np.float64)
            m[k] = beta_1 * m[k] + (1 - beta_1) * g
            v[k] = beta_2 * v[k] + (1 - beta_2) * g * g
            if bias_correction:
                m_hat, v_hat = m[k] / (1 - beta_1**t), v[k] / (1 - beta_2**t)
            else:
                m_hat, v_hat = m[k], v[k]
            r = m_hat / (np.sqrt(v_hat) + epsilon)
            lam = 0.0 if k in no_decay else weight_decay
            u = r + lam * w[k]
            w_norm = np.sqrt(np.sum(w[k] ** 2))
            u_norm = np.sqrt(np.sum(u**2))
            if k in no_adaptation or w_norm == 0 or u_norm == 0:
                ratio = 1.0
            else:
                ratio = w_norm / u_norm
                if trust_ratio_clip is not None:
                    ratio = min(max(ratio, trust_ratio_clip[0]), trust_ratio_clip[1])
            if k not in no_adaptation:
                last_ratio[k] = ratio
            w[k] = w[k] - lr * ratio * u
    return w, last_ratio


DEFAULTS = dict(
    learning_rate=0.001,
    beta_1=0.9,
    beta_2=0.999,
    epsilon=1e-6,
    weight_decay=0.01,
    bias_correction=True,
    trust_ratio_clip=None,
)


def check_against_reference(dtype, rtol, atol, lamb_kwargs, no_decay=(BIAS,), no_adaptation=(BIAS,), step_fn=None):
    weights = initial_weights()
    grads = gradient_steps()
    actual, ratios = run_optimizer(LAMB(**lamb_kwargs), weights, grads, dtype, step_fn=step_fn)
    settings = {**DEFAULTS, **{k: v for k, v in lamb_kwargs.items() if k in DEFAULTS}}
    settings = rounded_settings(settings, dtype)
    expected, expected_ratios = lamb_reference(
        rounded(weights, dtype),
        [rounded(g, dtype) for g in grads],
        no_decay=set(no_decay),
        no_adaptation=set(no_adaptation),
        **settings,
    )
    assert_weights_close(actual, expected, rtol=rtol, atol=atol)
    assert_ratios_close(ratios, expected_ratios, rtol=max(rtol, 1e-6), atol=atol)


VARIANTS = {
    "defaults": dict(),
    "large-rate-strong-decay": dict(learning_rate=0.05, weight_decay=0.1),
    "no-bias-correction": dict(learning_rate=0.05, weight_decay=0.1, bias_correction=False),
    "no-weight-decay": dict(learning_rate=0.05, weight_decay=0.0),
    "clipped-ratio": dict(learning_rate=0.05, weight_decay=0.1, trust_ratio_clip=(0.2, 0.6)),
    "other-betas": dict(learning_rate=0.05, beta_1=0.5, beta_2=0.9, epsilon=1e-3),
}


@pytest.mark.parametrize("kwargs", VARIANTS.values(), ids=VARIANTS.keys())
def test_matches_algorithm_2_in_float64(float64, kwargs):
    check_against_reference("float64", rtol=1e-9, atol=1e-12, lamb_kwargs=kwargs)


@pytest.mark.parametrize("kwargs", [VARIANTS["large-rate-strong-decay"], VARIANTS["no-bias-correction"]])
def test_matches_algorithm_2_in_float32(kwargs):
    check_against_reference("float32", rtol=1e-5, atol=1e-6, lamb_kwargs=kwargs)


def test_matches_algorithm_2_inside_tf_function(float64):
    check_against_reference(
        "float64", rtol=1e-9, atol=1e-12, lamb_kwargs=VARIANTS["large-rate-strong-decay"], step_fn=tf_function_step()
    )


def test_zero_weights_get_trust_ratio_one(float64):
    weights = {"net/zero/kernel": np.zeros((4, 2))}
    grads = [{"net/zero/kernel": np.full((4, 2), 2.0)}]
    actual, ratios = run_optimizer(LAMB(learning_rate=0.1), weights, grads, "float64")
    # Step 1 with bias correction: m̂ = g, v̂ = g², r = g/(|g| + ε) ≈ 1, u = r (w = 0).
    np.testing.assert_allclose(actual["net/zero/kernel"], np.full((4, 2), -0.1 * 2.0 / (2.0 + 1e-6)), rtol=1e-12)
    assert ratios == {"net/zero/kernel": 1.0}


def test_zero_gradient_without_decay_leaves_weights_unchanged(float64):
    weights = {"net/dense/kernel": np.ones((2, 2))}
    grads = [{"net/dense/kernel": np.zeros((2, 2))}]
    actual, ratios = run_optimizer(LAMB(learning_rate=0.1, weight_decay=0.0), weights, grads, "float64")
    np.testing.assert_array_equal(actual["net/dense/kernel"], np.ones((2, 2)))
    assert ratios == {"net/dense/kernel": 1.0}


def test_clip_bounds_the_trust_ratio(float64):
    # Step 1: r = g/(|g| + ε) ≈ 1 everywhere, so unclipped ‖w‖/‖u‖ = 200/2 ≈ 100.
    weights = {"net/dense/kernel": np.full((2, 2), 100.0)}
    grads = [{"net/dense/kernel": np.ones((2, 2))}]
    optimizer = LAMB(learning_rate=0.01, weight_decay=0.0, trust_ratio_clip=(0.01, 10.0))
    actual, ratios = run_optimizer(optimizer, weights, grads, "float64")
    assert ratios == {"net/dense/kernel": 10.0}
    np.testing.assert_allclose(actual["net/dense/kernel"], 100.0 - 0.01 * 10.0 / (1 + 1e-6), rtol=1e-12)


def test_clip_leaves_the_zero_norm_ratio_at_one(float64):
    weights = {"net/zero/kernel": np.zeros((4, 2))}
    grads = [{"net/zero/kernel": np.ones((4, 2))}]
    _, ratios = run_optimizer(LAMB(trust_ratio_clip=(2.0, 10.0)), weights, grads, "float64")
    assert ratios == {"net/zero/kernel": 1.0}


def test_base_decoupled_weight_decay_stays_off():
    optimizer = LAMB(weight_decay=0.05)
    assert optimizer.weight_decay is None
    assert optimizer.weight_decay_rate == 0.05
    assert optimizer.get_config()["weight_decay"] == 0.05


def test_equals_keras_lamb_when_weight_decay_is_zero(float64):
    # Without decay both compute the paper's update; they part only in where λw goes.
    weights = {"net/dense/kernel": initial_weights()["net/dense/kernel"]}
    grads = [{"net/dense/kernel": g["net/dense/kernel"]} for g in gradient_steps()]
    ours, _ = run_optimizer(LAMB(learning_rate=0.05, weight_decay=0.0, epsilon=1e-7), weights, grads, "float64")
    theirs, _ = run_optimizer(keras.optimizers.Lamb(learning_rate=0.05, epsilon=1e-7), weights, grads, "float64")
    assert_weights_close(ours, theirs, rtol=1e-9, atol=1e-12)


def test_differs_from_keras_lamb_when_weight_decay_is_on(float64):
    weights = {"net/dense/kernel": initial_weights()["net/dense/kernel"]}
    grads = [{"net/dense/kernel": g["net/dense/kernel"]} for g in gradient_steps()]
    ours, _ = run_optimizer(LAMB(learning_rate=0.05, weight_decay=0.1, epsilon=1e-7), weights, grads, "float64")
    theirs, _ = run_optimizer(
        keras.optimizers.Lamb(learning_rate=0.05, epsilon=1e-7, weight_decay=0.1), weights, grads, "float64"
    )
    assert not np.allclose(ours["net/dense/kernel"], theirs["net/dense/kernel"], rtol=1e-6, atol=0)


def test_ndim_exclusion_can_be_turned_off(float64):
    check_against_reference(
        "float64",
        rtol=1e-9,
        atol=1e-12,
        lamb_kwargs=dict(VARIANTS["large-rate-strong-decay"], exclude_biases_and_norms=False),
        no_decay=(),
        no_adaptation=(),
    )


def test_path_regex_excludes_from_weight_decay(float64):
    check_against_reference(
        "float64",
        rtol=1e-9,
        atol=1e-12,
        lamb_kwargs=dict(VARIANTS["large-rate-strong-decay"], exclude_from_weight_decay=["conv/kernel", "zero"]),
        no_decay=(BIAS, "net/conv/kernel", "net/zero/kernel"),
    )


def test_path_regex_excludes_from_layer_adaptation(float64):
    check_against_reference(
        "float64",
        rtol=1e-9,
        atol=1e-12,
        lamb_kwargs=dict(VARIANTS["large-rate-strong-decay"], exclude_from_layer_adaptation="dense/kernel$"),
        no_adaptation=(BIAS, "net/dense/kernel"),
    )


def test_follows_a_learning_rate_schedule(float64):
    # Powers of two, so the schedule's own float32 arithmetic is exact.
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay(boundaries=[1, 3], values=[0.0625, 0.03125, 0.015625])
    weights = initial_weights()
    grads = gradient_steps()
    actual, _ = run_optimizer(LAMB(learning_rate=schedule), weights, grads, "float64")

    def reference_rate(step):
        return 0.0625 if step <= 1 else 0.03125 if step <= 3 else 0.015625

    settings = dict(DEFAULTS, learning_rate=reference_rate)
    expected, _ = lamb_reference(weights, grads, no_decay={BIAS}, no_adaptation={BIAS}, **settings)
    assert_weights_close(actual, expected, rtol=1e-9, atol=1e-12)


def test_rejects_a_clip_with_lo_above_hi():
    with pytest.raises(ValueError, match="trust_ratio_clip"):
        LAMB(trust_ratio_clip=(10.0, 0.01))


def test_get_config_round_trips():
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-3, decay_steps=10, decay_rate=0.9)
    optimizer = LAMB(
        learning_rate=schedule,
        beta_1=0.8,
        beta_2=0.99,
        epsilon=1e-7,
        weight_decay=0.02,
        bias_correction=False,
        trust_ratio_clip=(0.01, 10.0),
        exclude_from_weight_decay=["LayerNorm", "embedding"],
        exclude_from_layer_adaptation=["head/kernel"],
        exclude_biases_and_norms=False,
        global_clipnorm=1.0,
        name="my_lamb",
    )
    config = optimizer.get_config()
    restored = LAMB.from_config(copy.deepcopy(config))
    assert restored.get_config() == config
    assert restored.trust_ratio_clip == (0.01, 10.0)


def test_is_registered_for_keras_serialization():
    assert keras.saving.get_registered_name(LAMB) == "kerasdist>LAMB"
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(LAMB(bias_correction=False)))
    assert isinstance(restored, LAMB) and restored.bias_correction is False


def test_keras_file_round_trip_restores_optimizer_state(tmp_path):
    model = tiny_model()
    model.compile(optimizer=LAMB(learning_rate=1e-2, trust_ratio_clip=(0.01, 10.0)), loss="mse")
    x, y = tiny_data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "lamb.keras"
    model.save(path)

    loaded = keras.saving.load_model(path)  # no custom_objects: LAMB is registered

    assert isinstance(loaded.optimizer, LAMB)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(saved.numpy(), restored.numpy(), err_msg=saved.path)
    assert sorted(loaded.optimizer.trust_ratios().values()) == sorted(model.optimizer.trust_ratios().values())
