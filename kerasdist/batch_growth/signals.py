"""What tells `AdaptiveBatchGrowth` to grow: each signal measures one number and judges it.

A signal gets the model once (`set_model`), is measured at every check (`measure`, the same
float on every rank) and says whether a finite measurement calls for the grown batch
(`wants_more_batch`); it hears when the batch did grow (`batch_grew`), for whatever reason.
"""

from kerasdist.curvature import HessianPowerIteration


class GrowthSignal:
    """The interface `AdaptiveBatchGrowth` uses; see the module docstring.

    Attributes:
        name: the `signal=` name that selects it.
        log_key: the key of its measurement in the epoch logs and the callback's `history`.

    Example:

    `AdaptiveBatchGrowth(signal="curvature", ...)` does this at each check, and grows the batch
    when the signal wants it to. A linear model's loss has the same Hessian (2/n AᵀA) whatever
    its weights, so its eigenvalue never halves and the batch never grows:

    ```python
    import keras, numpy as np, kerasdist
    from kerasdist.batch_growth import CurvatureSignal

    kerasdist.init()
    x = np.random.default_rng(kerasdist.rank()).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    signal = CurvatureSignal(curvature_data=(x[:32], y[:32]))
    signal.set_model(model, batch_size=16)  # before training
    for epoch in range(2):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=kerasdist.callbacks())
        value = signal.measure()  # the same float on every rank
        # The first check only sets the reference eigenvalue.
        print(signal.wants_more_batch(value, grown_batch=2 * 16 * kerasdist.size()))  # False
    print(signal.log_key, signal.reference_eigenvalue == value)  # hessian_top_eigenvalue True
    ```
    """

    name = None
    log_key = None

    def set_model(self, model, batch_size):
        """Takes the compiled model before training; `batch_size` is the per-rank batch of `fit`.

        Example:

        `NoiseScaleSignal` attaches the optimizer's `GradientNoiseScale` here, so that every
        update of the coming training feeds it.

        ```python
        import keras, kerasdist
        from kerasdist.batch_growth import NoiseScaleSignal

        kerasdist.init()
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01), backward_passes_per_step=2),
                      loss="mse")
        signal = NoiseScaleSignal()
        print(model.optimizer.gradient_noise_scale)  # None
        signal.set_model(model, batch_size=16)
        print(signal.model is model, model.optimizer.gradient_noise_scale.batch_size)  # True 16
        ```
        """
        self.model = model

    def measure(self):
        """The current value, identical on every rank; nan when there is none yet.

        Example:

        B_noise needs an update's statistics first: nan before training, a number after.

        ```python
        import math
        import keras, numpy as np, kerasdist
        from kerasdist.batch_growth import NoiseScaleSignal

        kerasdist.init()
        x = np.random.default_rng(kerasdist.rank()).normal(size=(64, 4)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01), backward_passes_per_step=2),
                      loss="mse")
        signal = NoiseScaleSignal()
        signal.set_model(model, batch_size=16)
        print(signal.measure())  # nan
        model.fit(x, y, batch_size=16, verbose=0, callbacks=kerasdist.callbacks())  # 2 updates of 2 x 16 rows
        value = signal.measure()
        print(math.isfinite(value), len(set(kerasdist.allgather_object(value))))  # True 1
        ```
        """
        raise NotImplementedError

    def wants_more_batch(self, value, grown_batch):
        """Whether the finite measurement `value` calls for growing the effective batch to `grown_batch`.

        Example:

        ```python
        import numpy as np
        from kerasdist.batch_growth import CurvatureSignal, NoiseScaleSignal

        # Noise scale: grow while the grown batch stays at or below B_noise.
        noise = NoiseScaleSignal()
        print([noise.wants_more_batch(300.0, grown_batch) for grown_batch in (256, 512)])  # [True, False]
        # Curvature: the first value is the reference; grow once the eigenvalue has halved.
        sample = (np.ones((8, 4), "float32"), np.ones((8, 1), "float32"))
        curvature = CurvatureSignal(curvature_data=sample)
        print([curvature.wants_more_batch(value, grown_batch=256) for value in (8.0, 5.0, 4.0)])  # [False, False, True]
        ```
        """
        raise NotImplementedError

    def batch_grew(self, value):
        """Told after the batch grew at a check that measured `value`.

        Example:

        `CurvatureSignal` takes the eigenvalue at growth as its new reference: the next growth
        waits until it has halved again.

        ```python
        import numpy as np
        from kerasdist.batch_growth import CurvatureSignal

        curvature = CurvatureSignal(curvature_data=(np.ones((8, 4), "float32"), np.ones((8, 1), "float32")))
        print(curvature.wants_more_batch(8.0, grown_batch=256))  # False
        print(curvature.wants_more_batch(4.0, grown_batch=256))  # True
        curvature.batch_grew(4.0)  # AdaptiveBatchGrowth grew the batch
        print(curvature.reference_eigenvalue, curvature.wants_more_batch(3.0, grown_batch=512))  # 4.0 False
        ```
        """


class NoiseScaleSignal(GrowthSignal):
    """The critical batch B_noise (McCandlish et al. 2018) from the optimizer's gradient statistics.

    Grows while the grown batch stays at or below B_noise. The statistics are the optimizer's
    `gradient_statistics()`: its `GradientNoiseScale`, attached if it has none yet.

    Example:

    The default signal of `AdaptiveBatchGrowth`; its checks log B_noise as "noise_scale".

    ```python
    import keras, numpy as np, kerasdist

    kerasdist.init()
    x = np.random.default_rng(kerasdist.rank()).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01), backward_passes_per_step=2),
                  loss="mse")
    growth = kerasdist.callbacks.AdaptiveBatchGrowth(signal="noise_scale", batch_size=16)
    model.fit(x, y, batch_size=16, verbose=0, callbacks=kerasdist.callbacks(extra=[growth]))
    check = growth.history[0]
    print(check["noise_scale"] == model.optimizer.gradient_statistics().noise_scale())  # True
    # It grew if and only if the doubled batch is at most B_noise.
    print(check["grew"] == (2 * check["batch_size"] <= check["noise_scale"]))  # True
    ```
    """

    name = "noise_scale"
    log_key = "noise_scale"

    def set_model(self, model, batch_size):
        super().set_model(model, batch_size)
        self.statistics = model.optimizer.gradient_statistics(batch_size)

    def measure(self):
        return self.statistics.noise_scale()

    def wants_more_batch(self, value, grown_batch):
        return grown_batch <= value


class CurvatureSignal(GrowthSignal):
    """The top Hessian eigenvalue λ of the loss on a fixed sample (Yao et al. 2018, ABS).

    The first value is the reference λ_ref; the batch grows when λ ≤ λ_ref / 2, and whenever it
    grows λ_ref ← λ. Each rank evaluates on its own sample; the products are averaged
    (`HessianPowerIteration`).

    Args:
        curvature_data: `(x, y)`, a sample of this rank's data.
        loss_fn: the loss; defaults to the model's compiled loss.
        iterations, tolerance: the power-iteration budget.

    Example:

    What `AdaptiveBatchGrowth(signal="curvature", curvature_data=(x, y))` measures: λ of the
    loss over every rank's sample together. For a linear model and MSE that is the largest
    eigenvalue of 2/N AᵀA, where A = [x 1] holds the N rows of all ranks:

    ```python
    import keras, numpy as np, kerasdist
    from kerasdist.batch_growth import CurvatureSignal

    kerasdist.init()
    x = np.random.default_rng(kerasdist.rank()).normal(loc=1.0, size=(32, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    signal = CurvatureSignal(curvature_data=(x, y), iterations=50, tolerance=1e-6)
    signal.set_model(model, batch_size=16)
    every_x = np.concatenate(kerasdist.allgather_object(x))
    design = np.hstack([every_x, np.ones((len(every_x), 1))])
    exact = np.linalg.eigvalsh(2 / len(design) * design.T @ design).max()
    print(abs(signal.measure() - exact) / exact < 1e-5)  # True
    ```
    """

    name = "curvature"
    log_key = "hessian_top_eigenvalue"

    def __init__(self, curvature_data, loss_fn=None, iterations=10, tolerance=1e-2):
        if curvature_data is None:
            raise ValueError("signal='curvature' needs curvature_data=(x, y), a sample of this rank's data")
        self.curvature_data = curvature_data
        self.loss_fn = loss_fn
        self.iterations = iterations
        self.tolerance = tolerance
        self.reference_eigenvalue = None
        self._power_iteration = None

    def measure(self):
        if self._power_iteration is None:  # kept: it traces its tf.function once
            self._power_iteration = HessianPowerIteration(self.model, self.loss_fn or self.model.loss)
        x, y = self.curvature_data
        return self._power_iteration(x, y, iterations=self.iterations, tolerance=self.tolerance).eigenvalue

    def wants_more_batch(self, value, grown_batch):
        if self.reference_eigenvalue is None:
            self.reference_eigenvalue = value
            return False
        return value <= self.reference_eigenvalue / 2

    def batch_grew(self, value):
        self.reference_eigenvalue = value


def named_signal(name, curvature_data=None, loss_fn=None, iterations=10, tolerance=1e-2):
    """The built-in signal called `name` ("noise_scale" or "curvature"); the rest is the curvature's."""
    if name == NoiseScaleSignal.name:
        return NoiseScaleSignal()
    if name == CurvatureSignal.name:
        return CurvatureSignal(curvature_data, loss_fn, iterations, tolerance)
    raise ValueError(f"signal={name!r}; expected one of {(CurvatureSignal.name, NoiseScaleSignal.name)}")
