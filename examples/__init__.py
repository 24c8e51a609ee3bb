"""kerasdist's examples, installed with it as `kerasdist.examples`: each runs as a module.

`pip install 'kerasdist[examples]'` adds what they need beyond kerasdist (scikit-learn, whose
bundled 8x8 digits they train on: nothing is downloaded). Then, from any directory::

    kerasdist-run -np 2 python -m kerasdist.examples.keras_digits           # model.fit, a small CNN
    kerasdist-run -np 2 python -m kerasdist.examples.custom_loop            # DistributedGradientTape
    kerasdist-run -np 2 python -m kerasdist.examples.estimator_digits       # model_fn / input_fn
    kerasdist-run -np 2 python -m kerasdist.examples.horovod_keras_digits   # a Horovod script
    kerasdist-run -np 2 python -m kerasdist.examples.keras_synthetic_benchmark   # throughput
    python -m kerasdist.examples.keras_digits --helpfull                    # every flag

In a clone they are the files of `examples/`, which run as scripts as well.
"""
