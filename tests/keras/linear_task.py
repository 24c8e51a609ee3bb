"""The task of the tests that check DistributedOptimizer's update rules (delayed gradients,
1-bit gradients) against a NumPy simulation of every rank: a linear model, 8 rows of its own
per rank, batches of 2, shuffling off, so step t of every rank together is one global batch."""

import keras
import numpy as np

import kerasdist as kd

FEATURES, ROWS, BATCH, LR, MOMENTUM = 3, 8, 2, 0.05, 0.5
STEPS_PER_EPOCH = ROWS // BATCH
INITIAL_KERNEL = np.array([[0.2], [-0.1], [0.3]])


def shard(rank):
    rng = np.random.default_rng([rank, 29])
    x = rng.normal(size=(ROWS, FEATURES))
    y = x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3 + 0.1 * rng.normal(size=(ROWS, 1))
    return x.astype("float32"), y.astype("float32")


def compiled_model(**optimizer_options):
    """The linear model at INITIAL_KERNEL, compiled with DistributedOptimizer(SGD(LR, MOMENTUM))."""
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    model.set_weights([INITIAL_KERNEL.astype("float32"), np.zeros(1, "float32")])
    optimizer = kd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=MOMENTUM), **optimizer_options)
    model.compile(optimizer, loss="mse")
    return model


def fit(model, epochs):
    x, y = shard(kd.rank())
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)


def assert_weights(model, expected, rtol=1e-5, atol=1e-6):
    kernel, bias = model.get_weights()
    np.testing.assert_allclose(kernel, expected[0], rtol=rtol, atol=atol)
    np.testing.assert_allclose(bias, expected[1], rtol=rtol, atol=atol)


def simulated_error_feedback_weights(epochs, size, send):
    """The weights after `epochs` of SGD(LR, MOMENTUM) on `size` ranks that each add the residual
    they kept to their gradient, send `send(corrected)` of each tensor and keep `corrected - sent`;
    every rank applies the mean of what all ranks sent (NumPy, independent of kerasdist)."""
    w, b = INITIAL_KERNEL.astype("float32"), np.zeros(1, "float32")
    vw, vb = np.zeros_like(w), np.zeros_like(b)
    residuals = [[np.zeros_like(w), np.zeros_like(b)] for _ in range(size)]
    shards = [shard(r) for r in range(size)]
    for _ in range(epochs):
        for step in range(STEPS_PER_EPOCH):
            sent = []
            for r, (x, y) in enumerate(shards):
                xb, yb = x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]
                error = xb @ w + b - yb
                gradient = [2 / BATCH * xb.T @ error, 2 / BATCH * error.sum(0)]
                corrected = [g + e for g, e in zip(gradient, residuals[r])]
                sent.append([send(c) for c in corrected])
                residuals[r] = [c - q for c, q in zip(corrected, sent[-1])]
            gw, gb = np.mean([s[0] for s in sent], axis=0), np.mean([s[1] for s in sent], axis=0)
            vw, vb = MOMENTUM * vw - LR * gw, MOMENTUM * vb - LR * gb
            w, b = w + vw, b + vb
    return w, b
