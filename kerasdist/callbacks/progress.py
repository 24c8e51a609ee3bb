"""Keras's progress bar, shown by one rank only."""

import keras

from kerasdist import runtime


class Rank0ProgbarLogger(keras.callbacks.ProgbarLogger):
    """The progress bar on `root_rank` only; other ranks are silent whatever `verbose` says.

    Keras adds a `ProgbarLogger` by itself unless the callback list has one: this is that one,
    so a script written for one process prints one progress bar, not one per rank.

    Example:

    ```python
    import keras, kerasdist, numpy as np
    kerasdist.init()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(kerasdist.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    logger = kerasdist.callbacks.Rank0ProgbarLogger()
    model.fit(np.ones((8, 3)), np.ones((8, 1)), verbose=2, callbacks=[logger, *kerasdist.callbacks()])
    print(logger.verbose == (2 if kerasdist.rank() == 0 else 0))  # True
    ```
    """

    def __init__(self, root_rank=0):
        super().__init__()
        self.root_rank = root_rank

    def set_params(self, params):
        super().set_params(params)
        if runtime.state().rank != self.root_rank:
            self.verbose = 0
