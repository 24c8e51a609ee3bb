"""One-step-delayed gradients (`DistributedOptimizer(delay_gradients=True)`) against NumPy.

Every rank holds 8 rows of its own and trains a linear model with SGD (momentum 0.5) on batches
of 2, shuffling off, so step t of every rank together is one global batch of 2 × size rows. The
simulation, NumPy alone on every rank, computes at each step the mean gradient of that global
batch at the current weights, applies the one computed at the step before (nothing at the first
step), and keeps the new one: what the delayed optimizer must do at 1, 2 and 3 ranks.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from linear_task import BATCH, INITIAL_KERNEL, LR, MOMENTUM, STEPS_PER_EPOCH, assert_weights, compiled_model, fit, shard

import kerasdist as kd

kd.init()
RANK, SIZE = kd.rank(), kd.size()


def global_batch(step):
    """Rows `step` of every rank's epoch, stacked: the batch all ranks compute at once."""
    at = (step % STEPS_PER_EPOCH) * BATCH
    parts = [shard(r) for r in range(SIZE)]
    return np.concatenate([x[at : at + BATCH] for x, _ in parts]), np.concatenate(
        [y[at : at + BATCH] for _, y in parts]
    )


def simulated_weights(steps, delayed=True):
    """(kernel, bias) after `steps` updates of SGD with momentum, each applying the global-batch
    gradient of the step before (`delayed`) or of its own step."""
    w, b = INITIAL_KERNEL.copy(), np.zeros(1)
    vw, vb = np.zeros_like(w), np.zeros_like(b)
    held = None
    for step in range(steps):
        x, y = global_batch(step)
        error = x @ w + b - y
        gradient = (2 / len(x) * x.T @ error, 2 / len(x) * error.sum(0))
        applied, held = (held, gradient) if delayed else (gradient, None)
        if applied is None:
            continue
        vw, vb = MOMENTUM * vw - LR * applied[0], MOMENTUM * vb - LR * applied[1]  # Keras SGD
        w, b = w + vw, b + vb
    return w, b


@pytest.mark.parametrize("compression", [kd.Compression.none, kd.Compression.bf16], ids=["float32", "bf16"])
def test_each_update_applies_the_global_gradient_of_the_step_before(compression):
    model = compiled_model(delay_gradients=True, compression=compression)
    fit(model, epochs=3)
    expected = simulated_weights(3 * STEPS_PER_EPOCH)
    # bf16 on the wire rounds each gradient to 8 significant bits
    tolerance = {"rtol": 2e-2, "atol": 2e-3} if compression is kd.Compression.bf16 else {"rtol": 1e-5, "atol": 1e-6}
    kernel, bias = model.get_weights()
    np.testing.assert_allclose(kernel, expected[0], **tolerance)
    np.testing.assert_allclose(bias, expected[1], **tolerance)
    # one update fewer than steps: the first step had nothing to apply
    assert int(model.optimizer.iterations.numpy()) == 3 * STEPS_PER_EPOCH - 1


def test_the_simulation_tells_delayed_from_synchronous_updates():
    # Were the two alike, the test above could not fail on an optimizer that ignored the delay.
    delayed, synchronous = simulated_weights(12), simulated_weights(12, delayed=False)
    assert np.max(np.abs(delayed[0] - synchronous[0])) > 1e-3
    model = compiled_model()
    fit(model, epochs=3)
    assert_weights(model, synchronous)


def test_with_backward_passes_the_delay_is_one_update():
    # k = 2: an update every 2 steps applies the mean gradient of the window before.
    model = compiled_model(delay_gradients=True, backward_passes_per_step=2)
    fit(model, epochs=2)
    w, b = INITIAL_KERNEL.copy(), np.zeros(1)
    vw, vb = np.zeros_like(w), np.zeros_like(b)
    held, window = None, []
    for step in range(2 * STEPS_PER_EPOCH):
        x, y = global_batch(step)
        error = x @ w + b - y
        window.append((2 / len(x) * x.T @ error, 2 / len(x) * error.sum(0)))
        if len(window) < 2:
            continue
        mean = (np.mean([g[0] for g in window], 0), np.mean([g[1] for g in window], 0))
        window = []
        applied, held = held, mean
        if applied is not None:
            vw, vb = MOMENTUM * vw - LR * applied[0], MOMENTUM * vb - LR * applied[1]
            w, b = w + vw, b + vb
    assert_weights(model, (w, b))


def test_resumed_from_a_checkpoint_it_continues_as_an_uninterrupted_run(tmp_path):
    # The held gradient is optimizer state: a run saved after 5 steps and loaded into a new
    # process's model goes on as if it had never stopped.
    path = os.path.join(str(tmp_path), f"delayed_rank{RANK}.keras")
    model = compiled_model(delay_gradients=True)
    fit(model, epochs=1)
    model.save(path)
    resumed = keras.saving.load_model(path)
    assert resumed.optimizer.delay_gradients
    fit(resumed, epochs=2)
    assert_weights(resumed, simulated_weights(3 * STEPS_PER_EPOCH))


def test_inside_a_custom_loop_the_reduction_waits_for_nothing_the_step_computes():
    # The allreduce's inputs are the held gradients alone: in the traced step no path leads
    # to it from the forward pass, so TensorFlow may run it while the step computes.
    if SIZE == 1:
        pytest.skip("nothing is reduced in a world of one")
    model = compiled_model(delay_gradients=True)
    optimizer = model.optimizer
    x, y = (tf.constant(a[:BATCH]) for a in shard(RANK))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    graph = step.get_concrete_function().graph
    matmul = next(op for op in graph.get_operations() if op.type == "MatMul")
    reductions = [op for op in graph.get_operations() if op.type.startswith("Kerasdist")]
    assert reductions
    assert not any(_depends_on(op, matmul) for op in reductions)


def _depends_on(op, ancestor, seen=None):
    seen = set() if seen is None else seen
    for parent in [t.op for t in op.inputs] + list(op.control_inputs):
        if parent is ancestor:
            return True
        if parent.name not in seen:
            seen.add(parent.name)
            if _depends_on(parent, ancestor, seen):
                return True
    return False


def test_refuses_the_gradient_noise_scale():
    with pytest.raises(ValueError, match="delay_gradients"):
        kd.DistributedOptimizer(
            keras.optimizers.SGD(0.1), delay_gradients=True, gradient_noise_scale=kd.GradientNoiseScale()
        )
