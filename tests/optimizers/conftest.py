"""Fixtures for the optimizer tests."""

import os
import sys

import keras
import pytest

# The tests import their shared drivers from optimizer_testing.py next to this file; make that
# work under any pytest import mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def float64():
    """Runs the test with Keras's floatx at float64 (so the learning-rate variable is exact)."""
    previous = keras.config.floatx()
    keras.config.set_floatx("float64")
    yield "float64"
    keras.config.set_floatx(previous)
