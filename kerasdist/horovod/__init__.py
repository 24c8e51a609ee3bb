"""Horovod's TensorFlow 2 / Keras API, with Horovod's semantics, on kerasdist.

A Horovod script runs with its import line changed:

    import kerasdist.horovod.tensorflow.keras as hvd   # was: import horovod.tensorflow.keras as hvd
    import kerasdist.horovod.tensorflow as hvd         # was: import horovod.tensorflow as hvd

Names, arguments and results follow Horovod 0.28, including where they differ from
kerasdist's own API: `LearningRateWarmupCallback(initial_lr)` takes the already scaled rate,
a constant `LearningRateScheduleCallback` multiplier decays exponentially,
`backward_passes_per_step` sums its micro-batch gradients unless
`average_aggregated_gradients=True`, and `alltoall` returns `(tensor, received_splits)`.
What Horovod has and kerasdist does not (elastic training, process sets, Adasum, Gloo,
start_timeline) raises an error naming the nearest kerasdist feature. `HOROVOD_*` settings are
read when the matching `KERASDIST_*` one is unset. docs/horovod.md has the whole table.
"""
