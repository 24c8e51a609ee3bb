"""The layer-wise trust ratio and the parameter masks that LARS and LAMB share.

Both optimizers scale each layer's step by a ratio of norms and skip some variables (biases,
normalisation parameters, anything matched by a path regex) for weight decay and for that
ratio. The math and the masks live here once; `lars.py` and `lamb.py` only say which norms go in.
"""

import re

import tensorflow as tf
from keras import ops


def to_dtype(value, dtype):
    """Returns `value` (a Python number or a tensor) as a tensor of `dtype`.

    A Python float goes straight to `dtype`: `ops.cast(0.1, "float64")` would round it through
    float32 first and cost float64 training eight digits.
    """
    if isinstance(value, (int, float)):
        return ops.convert_to_tensor(value, dtype=dtype)
    return ops.cast(value, dtype)


def l2_norm(x):
    """Returns the Euclidean (Frobenius) norm of all entries of `x` as a scalar tensor."""
    return ops.sqrt(ops.sum(ops.square(x)))


def trust_ratio(weight_norm, update_norm, denominator=None, coefficient=1.0, clip=None):
    """Returns the layer-wise trust ratio `coefficient * weight_norm / denominator`.

    The ratio is 1.0 when `weight_norm` or `update_norm` is 0: a zero-initialised layer, or a
    layer whose gradient vanished, then takes a plain step instead of a zero or infinite one
    (every published LARS/LAMB implementation does this).

    Args:
        weight_norm: Scalar tensor, `‖w‖`.
        update_norm: Scalar tensor, the norm of the direction the layer moves in (`‖g‖` for
            LARS, `‖u‖` for LAMB). Only its being zero matters when `denominator` is given.
        denominator: Scalar tensor or `None`. Defaults to `update_norm`; LARS passes
            `‖g‖ + β‖w‖ + ε`.
        coefficient: Python float or scalar tensor multiplied into the ratio (LARS's trust
            coefficient η; 1.0 for LAMB).
        clip: `None` or a pair `(lo, hi)`: the computed ratio is clipped to `[lo, hi]`. The
            1.0 of a zero norm is not clipped, since it means "no layer adaptation".

    Returns:
        A scalar tensor of the dtype of `weight_norm`.

    Example:

    ```python
    from keras import ops
    from kerasdist.optimizers.trust_ratio import trust_ratio

    ratio = trust_ratio(ops.convert_to_tensor(3.0), ops.convert_to_tensor(4.0))
    assert abs(float(ratio) - 0.75) < 1e-7
    zero = trust_ratio(ops.convert_to_tensor(0.0), ops.convert_to_tensor(4.0))
    assert float(zero) == 1.0
    ```
    """
    if denominator is None:
        denominator = update_norm
    both_nonzero = ops.logical_and(ops.greater(weight_norm, 0), ops.greater(update_norm, 0))
    # The unselected branch of `where` is still evaluated: keep it finite.
    safe_denominator = ops.where(ops.greater(denominator, 0), denominator, ops.ones_like(denominator))
    ratio = to_dtype(coefficient, weight_norm.dtype) * weight_norm / safe_denominator
    if clip is not None:
        lo, hi = clip
        ratio = ops.clip(ratio, to_dtype(lo, ratio.dtype), to_dtype(hi, ratio.dtype))
    return ops.where(both_nonzero, ratio, ops.ones_like(ratio))


def dense_gradient(gradient, dtype):
    """Returns `gradient` as a dense tensor of `dtype`.

    An embedding's gradient arrives as `tf.IndexedSlices` whose rows may repeat; a layer norm
    must be taken over the summed dense gradient, not over the slices.
    """
    if isinstance(gradient, tf.IndexedSlices):
        gradient = tf.convert_to_tensor(gradient)
    return ops.cast(gradient, dtype)


def variable_path(variable):
    """Returns the path a variable is matched by: `variable.path` ("dense_1/kernel") in Keras 3,
    `variable.name` for a plain `tf.Variable`."""
    return getattr(variable, "path", None) or variable.name


def compile_patterns(patterns, argument_name):
    """Validates an exclusion list of regexes and returns it as a tuple of strings.

    Args:
        patterns: `None`, one regex string, or a list/tuple of regex strings.
        argument_name: The constructor argument, named in errors.

    Returns:
        A tuple of pattern strings (empty for `None`), which is what `get_config` stores.

    Raises:
        ValueError: A pattern is not a string or not a valid regex.
    """
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        patterns = [patterns]
    result = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(
                f"`{argument_name}` must hold regex strings matched against `variable.path` "
                f"(e.g. 'dense_1/kernel' or 'bias$'); got {pattern!r} of type {type(pattern).__name__}."
            )
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"`{argument_name}` holds an invalid regex {pattern!r}: {error}.") from None
        result.append(pattern)
    return tuple(result)


def is_excluded(variable, patterns, exclude_biases_and_norms=True):
    """Returns whether `variable` is excluded by an exclusion list.

    A variable is excluded when `exclude_biases_and_norms` is on and it has `ndim <= 1` (biases,
    normalisation scales and offsets, scalars), or when `re.search` finds any of `patterns` in its
    path. Keras 3's `variable.name` is only the short name ("kernel"), so patterns are matched
    against `variable.path` ("sequential/dense_1/kernel"): "bias" excludes every bias,
    "dense_1/kernel$" one kernel. Do not anchor a pattern on the model's name: the prefix can
    change (a Sequential reloaded from a `.keras` file has paths like "dense_1/kernel").

    Args:
        variable: A model variable.
        patterns: A tuple of regex strings, as returned by `compile_patterns`.
        exclude_biases_and_norms: Whether `ndim <= 1` excludes a variable.

    Returns:
        A Python bool (decided once, when the optimizer is built).
    """
    if exclude_biases_and_norms and len(variable.shape) <= 1:
        return True
    path = variable_path(variable)
    return any(re.search(pattern, path) for pattern in patterns)


def validate_clip(clip):
    """Returns `clip` as `None` or a tuple `(lo, hi)` of floats with `0 <= lo <= hi`."""
    if clip is None:
        return None
    try:
        lo, hi = (float(c) for c in clip)
    except (TypeError, ValueError):
        raise ValueError(f"`trust_ratio_clip` must be None or a pair (lo, hi) of floats; got {clip!r}.") from None
    if not 0.0 <= lo <= hi:
        raise ValueError(f"`trust_ratio_clip` must satisfy 0 <= lo <= hi; got ({lo}, {hi}).")
    return (lo, hi)
