"""`kerasdist.default_callbacks` is a plain function, the home the reference and tools see; the
callable package `kerasdist.callbacks(...)`, the older spelling, returns the same list, and the
callback classes stay attributes of that package."""

import importlib
import inspect

import kerasdist as kd
from kerasdist.callbacks import (
    BroadcastGlobalState,
    Join,
    LearningRateWarmup,
    MetricAverage,
    Rank0ProgbarLogger,
    ReplicaCheck,
    StopAgreement,
)

kd.init()

# The order default_callbacks' docstring promises for these arguments.
EXPECTED_ORDER = [
    BroadcastGlobalState,
    Join,
    MetricAverage,
    LearningRateWarmup,
    Rank0ProgbarLogger,
    StopAgreement,
    ReplicaCheck,
]


def test_default_callbacks_is_a_function_of_the_top_level_package():
    assert inspect.isfunction(kd.default_callbacks)
    assert kd.default_callbacks.__module__ == "kerasdist.callbacks"
    assert "default_callbacks" in kd.__all__
    assert "warmup_epochs" in inspect.signature(kd.default_callbacks).parameters


def test_it_returns_the_callbacks_in_their_documented_order():
    callbacks = kd.default_callbacks(warmup_epochs=1, uneven_steps=True)
    assert [type(callback) for callback in callbacks] == EXPECTED_ORDER


def test_the_callable_package_returns_the_same_list():
    callbacks = kd.callbacks(warmup_epochs=1, uneven_steps=True)
    assert [type(callback) for callback in callbacks] == EXPECTED_ORDER


def test_the_package_keeps_its_classes_and_the_function_survives_importing_it_again():
    package = importlib.import_module("kerasdist.callbacks")
    assert kd.callbacks is package
    assert kd.callbacks.Join is Join and kd.callbacks.Rank0ProgbarLogger is Rank0ProgbarLogger
    assert kd.default_callbacks is package.default_callbacks
