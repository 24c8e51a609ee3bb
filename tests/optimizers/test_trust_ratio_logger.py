"""TrustRatioLogger puts the optimizer's trust ratios into the epoch logs."""

import csv

import keras
import numpy as np
import pytest
from optimizer_testing import tiny_data, tiny_model

from kerasdist.callbacks.trust_ratio_logger import TrustRatioLogger
from kerasdist.optimizers import LAMB, LARS

SUMMARY_KEYS = ["trust_ratio/min", "trust_ratio/median", "trust_ratio/max"]


def fit(optimizer, callbacks, epochs=2):
    model = tiny_model()
    model.compile(optimizer=optimizer, loss="mse")
    x, y = tiny_data()
    history = model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=callbacks)
    return model, history


def test_adds_min_median_max_of_the_last_ratios_to_epoch_logs():
    model, history = fit(LARS(learning_rate=0.5), [TrustRatioLogger()])
    ratios = list(model.optimizer.trust_ratios().values())
    assert len(ratios) == 2  # conv and head kernels; biases are excluded
    for key in SUMMARY_KEYS:
        assert len(history.history[key]) == 2
    assert history.history["trust_ratio/min"][-1] == min(ratios)
    assert history.history["trust_ratio/median"][-1] == pytest.approx(float(np.median(ratios)))
    assert history.history["trust_ratio/max"][-1] == max(ratios)


def test_per_layer_adds_one_key_per_adapted_variable():
    model, history = fit(LAMB(learning_rate=1e-2), [TrustRatioLogger(per_layer=True)], epochs=1)
    per_layer = {k for k in history.history if k.startswith("trust_ratio/") and k not in SUMMARY_KEYS}
    assert per_layer == {f"trust_ratio/{path}" for path in model.optimizer.trust_ratios()}
    assert all(k.endswith("/kernel") for k in per_layer)


def test_csv_logger_after_it_records_the_keys(tmp_path):
    path = tmp_path / "log.csv"
    fit(LAMB(learning_rate=1e-2), [TrustRatioLogger(), keras.callbacks.CSVLogger(str(path))], epochs=1)
    with open(path) as f:
        row = next(csv.DictReader(f))
    for key in SUMMARY_KEYS:
        assert float(row[key]) > 0


def test_looks_through_a_loss_scale_optimizer():
    optimizer = keras.optimizers.LossScaleOptimizer(LARS(learning_rate=0.5))
    _, history = fit(optimizer, [TrustRatioLogger()], epochs=1)
    assert "trust_ratio/max" in history.history


def test_rejects_an_optimizer_without_trust_ratios():
    with pytest.raises(ValueError, match="TrustRatioLogger needs an optimizer with `trust_ratios\\(\\)`.*Adam"):
        fit(keras.optimizers.Adam(), [TrustRatioLogger()], epochs=1)


def test_overrides_no_batch_hooks():
    # A batch hook would make Keras wait for every batch.
    batch_hooks = [name for name in dir(keras.callbacks.Callback) if "batch" in name and name.startswith("on_")]
    assert batch_hooks
    for name in batch_hooks:
        assert getattr(TrustRatioLogger, name) is getattr(keras.callbacks.Callback, name), name
