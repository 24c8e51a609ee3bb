"""The top Hessian eigenvalue by power iteration, at 1, 2 and 3 ranks.

Each rank holds its own shard (of unequal size), and every expected value is computed on the
union of all shards, which each rank builds itself: in closed form for a linear model with
MSE, from the full Hessian (`GradientTape.jacobian` of the gradient) and `np.linalg.eigh` for
an MLP.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasdist as kd
from kerasdist.curvature import HessianPowerIteration, top_hessian_eigenvalue

kd.init()
RANK, SIZE = kd.rank(), kd.size()
FEATURES, OUTPUTS = 3, 2


def shard(rank, seed, with_weights=False):
    """Rank r holds 20 + 3r rows, so an unweighted average of per-rank Hessians would be wrong."""
    rng = np.random.default_rng([seed, rank])
    # Off-centre inputs separate the top eigenvalue from the next (|λ₂/λ₁| ≤ 0.55 for these
    # seeds), so power iteration converges in a few steps.
    x = rng.normal(loc=1.5, size=(20 + 3 * rank, FEATURES))
    y = x @ rng.normal(size=(FEATURES, OUTPUTS)) + rng.normal(scale=0.3, size=(len(x), OUTPUTS))
    weights = rng.uniform(0.2, 2.0, size=len(x)) if with_weights else None
    return x, y, weights


def union(seed, with_weights=False):
    shards = [shard(r, seed, with_weights) for r in range(SIZE)]
    weights = np.concatenate([s[2] for s in shards]) if with_weights else None
    return np.concatenate([s[0] for s in shards]), np.concatenate([s[1] for s in shards]), weights


def mse():
    return keras.losses.MeanSquaredError(dtype="float64")


def linear_model(l2=0.0):
    keras.utils.set_random_seed(1)
    regularizer = keras.regularizers.L2(l2) if l2 else None
    return keras.Sequential(
        [
            keras.Input((FEATURES,), dtype="float64"),
            keras.layers.Dense(OUTPUTS, kernel_regularizer=regularizer, dtype="float64"),
        ]
    )


def linear_mse_hessian(x, l2=0.0):
    """Loss (1/nm) Σ (x·W + b − y)² (+ l2‖W‖²) over kernel (row-major) then bias: (2/nm) A'A ⊗ I_m."""
    design = np.hstack([x, np.ones((len(x), 1))])
    hessian = 2.0 / (len(x) * OUTPUTS) * np.kron(design.T @ design, np.eye(OUTPUTS))
    hessian[: FEATURES * OUTPUTS, : FEATURES * OUTPUTS] += 2.0 * l2 * np.eye(FEATURES * OUTPUTS)
    return hessian


def mlp():
    """Frozen first layer and batch normalization: trainable and non-trainable variables mixed."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,), dtype="float64"),
            keras.layers.Dense(4, activation="tanh", trainable=False, dtype="float64"),
            keras.layers.Dense(6, activation="relu", dtype="float64"),
            keras.layers.BatchNormalization(dtype="float64"),
            keras.layers.Dense(OUTPUTS, dtype="float64"),
        ]
    )
    model.layers[2].moving_mean.assign(np.full(6, 0.1))  # so inference normalization is not the identity
    return model


def full_hessian(model, loss, x, y, sample_weight=None):
    """The Hessian w.r.t. the flattened trainable variables, by differentiating the gradient."""
    variables = model.trainable_variables
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            value = loss(y, model(x, training=False), sample_weight=sample_weight)
        gradient = tf.concat([tf.reshape(g, [-1]) for g in inner.gradient(value, variables)], axis=0)
    blocks = outer.jacobian(gradient, variables)
    return np.concatenate([tf.reshape(b, [gradient.shape[0], -1]).numpy() for b in blocks], axis=1)


def dominant_eigenvalue(hessian):
    """Power iteration's limit: the eigenvalue of largest magnitude, with its sign."""
    eigenvalues = np.linalg.eigvalsh(hessian)
    return eigenvalues[np.argmax(np.abs(eigenvalues))]


def flat(arrays):
    return np.concatenate([np.ravel(a) for a in arrays])


def test_linear_mse_matches_the_closed_form_hessian():
    x, y, _ = shard(RANK, seed=10)
    result = HessianPowerIteration(linear_model(), mse())(x, y, iterations=300, tolerance=1e-12)

    hessian = linear_mse_hessian(union(seed=10)[0])
    assert result.converged
    assert result.eigenvalue == pytest.approx(np.linalg.eigvalsh(hessian).max(), rel=1e-9)
    vector = flat(result.eigenvector)
    assert np.linalg.norm(vector) == pytest.approx(1.0, rel=1e-12)
    np.testing.assert_allclose(hessian @ vector, result.eigenvalue * vector, atol=1e-5 * result.eigenvalue)


def test_regularization_losses_are_part_of_the_objective():
    l2 = 0.5
    x, y, _ = shard(RANK, seed=11)
    eigenvalue = top_hessian_eigenvalue(linear_model(l2), mse(), x, y, iterations=300, tolerance=1e-12)
    expected = np.linalg.eigvalsh(linear_mse_hessian(union(seed=11)[0], l2)).max()
    assert eigenvalue == pytest.approx(expected, rel=1e-9)


def test_mlp_within_one_percent_of_the_full_hessian_at_the_default_tolerance():
    model = mlp()
    x, y, _ = shard(RANK, seed=12)
    eigenvalue = top_hessian_eigenvalue(model, mse(), x, y)

    all_x, all_y, _ = union(seed=12)
    expected = dominant_eigenvalue(full_hessian(model, mse(), all_x, all_y))
    assert eigenvalue == pytest.approx(expected, rel=1e-2)


def test_unequal_weighted_shards_give_the_eigenvalue_of_their_union():
    model = mlp()
    x, y, weights = shard(RANK, seed=13, with_weights=True)
    eigenvalue = top_hessian_eigenvalue(model, mse(), x, y, weights, iterations=500, tolerance=1e-10)

    all_x, all_y, all_weights = union(seed=13, with_weights=True)
    expected = dominant_eigenvalue(full_hessian(model, mse(), all_x, all_y, all_weights))
    assert eigenvalue == pytest.approx(expected, rel=1e-7)


def test_every_rank_gets_the_same_float_and_stops_at_the_same_iteration():
    x, y, _ = shard(RANK, seed=14)
    result = HessianPowerIteration(mlp(), mse())(x, y, iterations=40, tolerance=1e-3, seed=5)

    everyone = kd.allgather_object((result.eigenvalue, result.iterations, result.converged))
    assert everyone == [everyone[0]] * SIZE
    assert result.converged and 2 <= result.iterations < 40


def test_stops_at_the_iteration_limit_without_converging():
    x, y, _ = shard(RANK, seed=15)
    estimate = HessianPowerIteration(mlp(), mse())
    assert estimate(x, y, iterations=1).iterations == 1  # one value: nothing to compare it with
    capped = estimate(x, y, iterations=3, tolerance=0.0)
    assert (capped.iterations, capped.converged) == (3, False)


def test_a_zero_hessian_gives_zero_not_nan():
    # The model's output is linear in its weights, and the loss linear in the output.
    def mean_output(y_true, y_pred):
        return tf.reduce_mean(y_pred, axis=-1)

    x, y, _ = shard(RANK, seed=16)
    result = HessianPowerIteration(linear_model(), mean_output)(x, y)
    assert (result.eigenvalue, result.converged) == (0.0, True)


def test_loss_given_as_a_name_a_function_or_an_object_agree():
    keras.utils.set_random_seed(4)
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(OUTPUTS)]
    )
    x, y, _ = shard(RANK, seed=17)
    x, y = x.astype("float32"), y.astype("float32")
    values = [
        top_hessian_eigenvalue(model, loss, x, y, iterations=5)
        for loss in ("mse", keras.losses.mean_squared_error, keras.losses.MeanSquaredError())
    ]
    assert values[0] == values[1] == values[2]


def test_a_summed_loss_is_refused():
    with pytest.raises(ValueError, match="reduction='sum'"):
        HessianPowerIteration(linear_model(), keras.losses.MeanSquaredError(reduction="sum"))


def test_training_mode_leaves_the_batch_norm_statistics_unchanged():
    model = mlp()
    before = [v.numpy() for v in model.non_trainable_variables]
    x, y, _ = shard(RANK, seed=18)
    in_training = top_hessian_eigenvalue(model, mse(), x, y, training=True, iterations=5)
    in_inference = top_hessian_eigenvalue(model, mse(), x, y, iterations=5)

    assert np.isfinite(in_training) and in_training != in_inference  # batch statistics were used
    for was, variable in zip(before, model.non_trainable_variables):
        np.testing.assert_array_equal(variable.numpy(), was)


def test_repeated_estimates_reuse_one_trace_until_the_trainable_variables_change():
    model = mlp()
    estimate = HessianPowerIteration(model, mse())
    x, y, _ = shard(RANK, seed=19)
    first = estimate(x, y, iterations=3)
    again = estimate(x, y, iterations=3)
    assert (again.eigenvalue, estimate._power_step.experimental_get_tracing_count()) == (first.eigenvalue, 1)

    model.layers[-1].trainable = False
    frozen = estimate(x, y, iterations=3)
    assert [v.shape for v in frozen.eigenvector] == [tuple(v.shape) for v in model.trainable_variables]
