"""LARC against an independent NumPy transcription of its two modes around SGD and Adam."""

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
    run_optimizer,
    tf_function_step,
    tiny_data,
    tiny_model,
)

from kerasdist.optimizers import LARC

BIAS = "net/dense/bias"


def adapted_gradient(w, g, lr, trust_coefficient, mode, weight_decay, epsilon):
    """(g', λ): λ = η‖w‖/(‖g‖ + β‖w‖ + ε); clip: g' = min(λ/γ, 1)(g + βw); scale: g' = λ(g + βw);
    g' = g and λ = 1 when ‖w‖ = 0 or ‖g‖ = 0."""
    w_norm, g_norm = np.linalg.norm(w), np.linalg.norm(g)
    if w_norm == 0 or g_norm == 0:
        return g, 1.0
    ratio = trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + epsilon)
    factor = min(ratio / lr, 1.0) if mode == "clip" else ratio
    return factor * (g + weight_decay * w), ratio


def as_keras_casts(value):
    """Keras casts some Python-float constants to the variable's dtype through float32 (SGD's
    momentum, Adam's β₁ and β₂ in the bias corrections); others (Adam's 1 − β, ε) enter as they
    are, and the learning rate is a variable of its own dtype."""
    return float(np.float32(value))


def larc_reference(weights, grad_steps, inner, lr, momentum=0.0, excluded=(BIAS,), **larc):
    """LARC around SGD (with momentum) or Adam (Keras's defaults β₁ 0.9, β₂ 0.999, ε 1e-7), in float64."""
    momentum, cast_beta_1, cast_beta_2 = map(as_keras_casts, (momentum, 0.9, 0.999))
    w = {k: np.array(v, dtype=np.float64) for k, v in weights.items()}
    first = {k: np.zeros_like(v) for k, v in w.items()}
    second = {k: np.zeros_like(v) for k, v in w.items()}
    ratios = {}
    for step, grads in enumerate(grad_steps):
        for k in w:
            g = np.asarray(grads[k], dtype=np.float64)
            if k not in excluded:
                g, ratios[k] = adapted_gradient(w[k], g, lr, **larc)
            if inner == "sgd":
                first[k] = momentum * first[k] - lr * g
                w[k] = w[k] + first[k]
            else:
                t = step + 1
                first[k] = first[k] + (g - first[k]) * (1 - 0.9)
                second[k] = second[k] + (g * g - second[k]) * (1 - 0.999)
                alpha = lr * np.sqrt(1 - cast_beta_2**t) / (1 - cast_beta_1**t)
                w[k] = w[k] - alpha * first[k] / (np.sqrt(second[k]) + 1e-7)
    return w, ratios


CASES = {
    "clip-sgd-momentum": dict(inner="sgd", lr=0.5, momentum=0.9, trust_coefficient=0.02, mode="clip"),
    "clip-sgd-small-rate": dict(inner="sgd", lr=0.012, momentum=0.0, trust_coefficient=0.02, mode="clip"),
    "scale-sgd-decay": dict(inner="sgd", lr=0.5, momentum=0.9, trust_coefficient=0.02, mode="scale", weight_decay=0.01),
    "clip-adam-decay": dict(inner="adam", lr=0.01, trust_coefficient=0.05, mode="clip", weight_decay=0.001),
}


def make_larc(inner, lr, momentum=0.0, **larc):
    wrapped = keras.optimizers.SGD(lr, momentum=momentum) if inner == "sgd" else keras.optimizers.Adam(lr)
    return LARC(wrapped, **larc)


def check(case, dtype, rtol, atol, step_fn=None):
    settings = {"weight_decay": 0.0, "epsilon": 1e-8, **CASES[case]}
    weights, grads = initial_weights(), gradient_steps()
    actual, ratios = run_optimizer(make_larc(**settings), weights, grads, dtype, step_fn=step_fn)
    expected, expected_ratios = larc_reference(rounded(weights, dtype), [rounded(g, dtype) for g in grads], **settings)
    assert_weights_close(actual, expected, rtol=rtol, atol=atol)
    assert_ratios_close(ratios, expected_ratios, rtol=max(rtol, 1e-6), atol=atol)


@pytest.mark.parametrize("case", CASES)
def test_matches_the_reference_in_float64(float64, case):
    check(case, "float64", rtol=1e-9, atol=1e-12)


def test_matches_the_reference_in_float32():
    check("clip-sgd-momentum", "float32", rtol=1e-5, atol=1e-6)


def test_matches_the_reference_inside_tf_function(float64):
    check("scale-sgd-decay", "float64", rtol=1e-9, atol=1e-12, step_fn=tf_function_step())


def test_clip_mode_never_moves_a_layer_faster_than_the_global_rate(float64):
    # With η‖w‖/‖g‖ far above γ, clip takes a plain SGD step; scale would take a λ/γ times larger one.
    weights = {"net/dense/kernel": np.full((2, 2), 10.0)}
    grads = [{"net/dense/kernel": np.full((2, 2), 1e-3)}]
    clipped, _ = run_optimizer(LARC(keras.optimizers.SGD(0.1), trust_coefficient=1.0), weights, grads, "float64")
    np.testing.assert_allclose(clipped["net/dense/kernel"], 10.0 - 0.1 * 1e-3, rtol=1e-12)


def test_the_clipped_and_the_zero_gradient_cases_are_in_the_reference_run():
    # The "clip-sgd-small-rate" case has λ/γ > 1 for some layers (the min takes 1) and < 1 for
    # others, and every case has a step with ‖g‖ = 0 and a zero-initialised kernel.
    weights, grads = initial_weights(), gradient_steps()
    lr = CASES["clip-sgd-small-rate"]["lr"]
    factors = []
    for path in ("net/dense/kernel", "net/conv/kernel"):
        _, ratio = adapted_gradient(weights[path], grads[0][path], lr, 0.02, "clip", 0.0, 1e-8)
        factors.append(ratio / lr)
    assert min(factors) < 1 < max(factors), factors
    assert not grads[ZERO_GRADIENT_STEP]["net/dense/kernel"].any()
    assert not weights["net/zero/kernel"].any()


def test_rejects_bad_arguments_naming_them():
    with pytest.raises(ValueError, match="mode='clipped'"):
        LARC(keras.optimizers.SGD(), mode="clipped")
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARC(keras.optimizers.SGD(), trust_coefficient=0)
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        LARC(object())


def test_keras_file_round_trip_restores_the_wrapped_state(tmp_path):
    x, y = tiny_data()
    model = tiny_model()
    model.compile(LARC(keras.optimizers.SGD(0.1, momentum=0.9), mode="scale", trust_coefficient=0.01), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "larc.keras")
    restored = keras.saving.load_model(tmp_path / "larc.keras")
    assert isinstance(restored.optimizer, LARC) and restored.optimizer.mode == "scale"
    assert int(restored.optimizer.iterations) == int(model.optimizer.iterations) == 2
    for a, b in zip(model.optimizer.variables, restored.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    restored.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), restored.get_weights()):
        np.testing.assert_array_equal(a, b)
