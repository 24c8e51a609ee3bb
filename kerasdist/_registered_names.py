"""Lets `keras.saving.load_model` find kerasdist's classes after a bare `import kerasdist`.

Keras finds a saved object's class by its registered name ("kerasdist>DistributedOptimizer") in
the dict `keras.saving.get_custom_objects()`, which `@register_keras_serializable` fills when the
defining module is imported. Those modules import TensorFlow, and `import kerasdist` must not,
so each name gets a stand-in as soon as Keras itself is imported: Keras calls its
`from_config`, which imports the defining module (whose decorator puts the real class in the
stand-in's place) and builds the object with the real class. Nothing else is imported early.
The stand-ins go in at `import kerasdist` when Keras is already imported, else through a
`sys.meta_path` finder that wraps the `keras` package's loading, once.
"""

import importlib
import importlib.abc
import importlib.util
import sys

# Registered name -> the module whose import registers it; tests/launch/test_load_model_import.py
# checks that importing every kerasdist module registers exactly these names.
REGISTERED_NAMES = {
    "kerasdist>DistributedOptimizer": "kerasdist.distributed_optimizer",
    "kerasdist>LAMB": "kerasdist.optimizers.lamb",
    "kerasdist>LARC": "kerasdist.optimizers.larc",
    "kerasdist>LARS": "kerasdist.optimizers.lars",
    "kerasdist>LossScalingDistributedOptimizer": "kerasdist.distributed_optimizer",
    "kerasdist>SyncBatchNormalization": "kerasdist.layers.sync_batch_normalization",
    "kerasdist>ZeroPaddedShortcut": "kerasdist.models.resnet",
}


class _StandIn:
    """Holds a registered name's place in Keras's registry until Keras first deserializes it."""

    def __init__(self, registered_name, module):
        self.registered_name = registered_name
        self.module = module

    def from_config(self, config):
        custom_objects = sys.modules["keras"].saving.get_custom_objects()
        importlib.import_module(self.module)
        real = custom_objects[self.registered_name]
        if real is self:
            raise TypeError(f"kerasdist: importing {self.module} did not register {self.registered_name!r}")
        return real.from_config(config)

    def __repr__(self):
        return f"<stand-in for {self.registered_name!r} until {self.module} is imported>"


def register_stand_ins(keras_module):
    custom_objects = keras_module.saving.get_custom_objects()
    for registered_name, module in REGISTERED_NAMES.items():
        custom_objects.setdefault(registered_name, _StandIn(registered_name, module))


class _RegisterWhenKerasIsImported(importlib.abc.MetaPathFinder):
    """Runs `register_stand_ins` right after the `keras` package has been executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "keras":
            return None
        sys.meta_path.remove(self)  # once; and find_spec below asks the other finders
        spec = importlib.util.find_spec("keras")
        if spec is None:
            return None
        execute_keras = spec.loader.exec_module

        def exec_module(module):
            execute_keras(module)
            register_stand_ins(module)

        spec.loader.exec_module = exec_module
        return spec


def register_when_keras_is_imported():
    if "keras" in sys.modules:
        register_stand_ins(sys.modules["keras"])
    elif not any(isinstance(finder, _RegisterWhenKerasIsImported) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWhenKerasIsImported())
