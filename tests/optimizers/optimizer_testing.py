"""Helpers shared by the optimizer tests: they drive the optimizers and hold no optimizer math."""

import keras
import numpy as np
import tensorflow as tf

# Paths chosen to exercise every case: a 2-D kernel, a 4-D conv kernel, a 1-D bias, and a
# kernel that starts at zero (‖w‖ = 0 on the first step).
SHAPES = {
    "net/dense/kernel": (5, 3),
    "net/conv/kernel": (3, 3, 2, 4),
    "net/dense/bias": (3,),
    "net/zero/kernel": (4, 2),
}
STEPS = 6
ZERO_GRADIENT_STEP = 2  # on this step net/dense/kernel gets g = 0 (‖g‖ = 0)


def initial_weights(seed=0):
    rng = np.random.default_rng(seed)
    weights = {path: rng.normal(0.0, 0.5, shape) for path, shape in SHAPES.items()}
    weights["net/zero/kernel"][...] = 0.0
    return weights


def gradient_steps(seed=1, steps=STEPS):
    rng = np.random.default_rng(seed)
    result = []
    for step in range(steps):
        grads = {path: rng.normal(0.0, 1.0, shape) for path, shape in SHAPES.items()}
        if step == ZERO_GRADIENT_STEP:
            grads["net/dense/kernel"][...] = 0.0
        result.append(grads)
    return result


def make_variables(weights, dtype):
    """Returns {path: keras.Variable} whose `.path` is exactly the dict key."""
    variables = {}
    for path, value in weights.items():
        *scopes, name = path.split("/")
        scope_stack = [keras.name_scope(s) for s in scopes]
        for scope in scope_stack:
            scope.__enter__()
        try:
            variables[path] = keras.Variable(np.asarray(value, dtype=dtype), name=name, dtype=dtype)
        finally:
            for scope in reversed(scope_stack):
                scope.__exit__(None, None, None)
        assert variables[path].path == path
    return variables


def rounded(arrays, dtype):
    """The values as the optimizer sees them in `dtype`, back in float64 for the reference."""
    return {k: np.asarray(v, dtype=dtype).astype(np.float64) for k, v in arrays.items()}


def rounded_settings(settings, dtype):
    """Float hyperparameters as the optimizer holds them in `dtype` (β₂ = 0.999 is 0.99900001 in
    float32, which moves 1 − β₂ by 1e-5), so the reference differs only by arithmetic rounding."""
    return {k: float(np.asarray(v, dtype=dtype)) if isinstance(v, float) else v for k, v in settings.items()}


def run_optimizer(optimizer, weights, grad_steps, dtype, step_fn=None):
    """Applies `grad_steps` with `optimizer` and returns ({path: final weights}, trust_ratios()),
    the latter `{}` for an optimizer without `trust_ratios()` (e.g. `keras.optimizers.Lamb`).

    `step_fn(optimizer, grads, variables)` replaces the eager `optimizer.apply` (e.g. by one
    wrapped in `tf.function`).
    """
    variables = make_variables(weights, dtype)
    paths = list(variables)
    var_list = [variables[p] for p in paths]
    optimizer.build(var_list)
    for grads in grad_steps:
        grad_list = [keras.ops.convert_to_tensor(np.asarray(grads[p], dtype=dtype)) for p in paths]
        if step_fn is None:
            optimizer.apply(grad_list, var_list)
        else:
            step_fn(optimizer, grad_list, var_list)
    final = {p: np.asarray(variables[p].numpy(), dtype=np.float64) for p in paths}
    return final, getattr(optimizer, "trust_ratios", dict)()


def tf_function_step():
    """A `step_fn` for `run_optimizer` that runs `optimizer.apply` inside one `tf.function`."""
    traced = []

    def step(optimizer, grads, variables):
        # Close over the variables: passed as arguments they would arrive as tensors.
        if not traced:
            traced.append(tf.function(lambda g: optimizer.apply(g, variables)))
        traced[0](grads)

    return step


def assert_weights_close(actual, expected, rtol, atol):
    assert actual.keys() == expected.keys()
    for path in expected:
        np.testing.assert_allclose(actual[path], expected[path], rtol=rtol, atol=atol, err_msg=path)


def assert_ratios_close(actual, expected, rtol, atol=0.0):
    assert actual.keys() == expected.keys()
    for path in expected:
        np.testing.assert_allclose(actual[path], expected[path], rtol=rtol, atol=atol, err_msg=path)


def tiny_model():
    """A Dense+Conv model small enough to fit in well under a second."""
    return keras.Sequential(
        [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(2, 3, name="conv"),
            keras.layers.Flatten(),
            keras.layers.Dense(3, name="head"),
        ]
    )


def tiny_data(seed=0, n=16):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6, 6, 1)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")
