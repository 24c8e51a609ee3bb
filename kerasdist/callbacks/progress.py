"""Keras's progress bar, shown by one rank only."""

import keras

from kerasdist import runtime


class Rank0ProgbarLogger(keras.callbacks.ProgbarLogger):
    """The progress bar on `root_rank` only; other ranks are silent whatever `verbose` says.

    Keras adds a `ProgbarLogger` by itself unless the callback list has one: this is that one,
    so a script written for one process prints one progress bar, not one per rank.
    """

    def __init__(self, root_rank=0):
        super().__init__()
        self.root_rank = root_rank

    def set_params(self, params):
        super().set_params(params)
        if runtime.state().rank != self.root_rank:
            self.verbose = 0
