"""Adds the optimizer's layer-wise trust ratios to the epoch logs."""

import keras
import numpy as np


class TrustRatioLogger(keras.callbacks.Callback):
    """Adds `trust_ratio/min`, `trust_ratio/median` and `trust_ratio/max` to the epoch logs.

    The values are the trust ratios the optimizer's adapted layers used in their last update of
    the epoch (`optimizer.trust_ratios()` of `kerasdist.optimizers.LARS` or `LAMB`). They are
    written into the `logs` dict that later callbacks receive, so `History`, `CSVLogger` and
    `TensorBoard` record them when this callback comes before them in `callbacks=[...]`
    (`History` always comes last). With `per_layer=True` it also adds `trust_ratio/<path>` for
    every adapted variable, e.g. `trust_ratio/sequential/dense/kernel`.

    Only epoch hooks are used: reading the ratios per batch would make Keras wait for every
    batch. An optimizer wrapper (`keras.optimizers.LossScaleOptimizer`, a distributed wrapper)
    is looked through via its `inner_optimizer`. The ratios are identical on every rank after
    gradients are averaged, so the callback does no communication.

    Args:
        per_layer: Whether to add one key per adapted variable as well. Defaults to `False`.

    Raises:
        ValueError: At the start of training, when the model's optimizer (or any optimizer it
            wraps) has no `trust_ratios()` method.

    Example:

    ```python
    import keras
    import numpy as np
    from kerasdist.callbacks.trust_ratio_logger import TrustRatioLogger
    from kerasdist.optimizers import LARS

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=LARS(learning_rate=0.5), loss="mse")
    history = model.fit(np.ones((16, 4)), np.ones((16, 1)), epochs=2, verbose=0,
                        callbacks=[TrustRatioLogger(per_layer=True)])
    print(history.history["trust_ratio/max"])
    ```
    """

    def __init__(self, per_layer=False):
        super().__init__()
        self.per_layer = per_layer

    def on_train_begin(self, logs=None):
        self._find_trust_ratio_source()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        ratios = self._find_trust_ratio_source().trust_ratios()
        if not ratios:
            return
        values = np.asarray(list(ratios.values()), dtype=np.float64)
        logs["trust_ratio/min"] = float(values.min())
        logs["trust_ratio/median"] = float(np.median(values))
        logs["trust_ratio/max"] = float(values.max())
        if self.per_layer:
            for path, value in ratios.items():
                logs[f"trust_ratio/{path}"] = value

    def _find_trust_ratio_source(self):
        optimizer = getattr(self.model, "optimizer", None)
        seen = []
        while optimizer is not None:
            if callable(getattr(optimizer, "trust_ratios", None)):
                return optimizer
            seen.append(type(optimizer).__name__)
            optimizer = getattr(optimizer, "inner_optimizer", None)
        raise ValueError(
            "TrustRatioLogger needs an optimizer with `trust_ratios()` "
            f"(kerasdist.optimizers.LARS or LAMB); the model's optimizer chain is {seen or [None]}. "
            "Compile the model with LARS or LAMB, or remove the callback."
        )
