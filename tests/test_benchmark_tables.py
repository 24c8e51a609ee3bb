"""The tables the benchmarks lay out for the pages, from runs made up here: each cell is what the
runs give when computed independently (NumPy medians, counts by hand)."""

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import digits_methods  # noqa: E402  (benchmarks/digits_methods.py)


def test_digits_table_gives_each_seed_and_the_median_of_the_seeds():
    accuracies = {
        "synchronous": [0.9822, 0.9644, 0.9800],
        "delayed": [0.9800, 0.9733, 0.9711],
        "1-bit": [0.9844, 0.9667, 0.9778],
    }
    table = digits_methods.accuracy_table(accuracies, ["synchronous", "delayed", "1-bit"], seeds=3)
    assert table["columns"] == ["seed", "synchronous", "delayed", "1-bit"]
    assert table["rows"][1] == ["1", "0.9644", "0.9733", "0.9667"]
    medians = [f"{np.median(accuracies[name]):.4f}" for name in ("synchronous", "delayed", "1-bit")]
    assert table["rows"][-1] == ["median", *medians] == ["median", "0.9800", "0.9733", "0.9778"]


def test_keras_scaling_settings_are_name_value_words():
    keras_scaling = pytest.importorskip("keras_scaling")  # absl, as the benchmark needs
    assert keras_scaling.setting_environment("KERASDIST_MALLOC=off KERASDIST_BUCKET_BYTES=0") == {
        "KERASDIST_MALLOC": "off",
        "KERASDIST_BUCKET_BYTES": "0",
    }
    with pytest.raises(keras_scaling.app.UsageError, match=r"--settings 'KERASDIST_MALLOC off'.*\['KERASDIST_MALLOC'"):
        keras_scaling.setting_environment("KERASDIST_MALLOC off")


def test_growths_count_signal_and_forced_per_seed_as_the_median_over_seeds():
    batch_growth = pytest.importorskip("batch_growth")  # TensorFlow and kerasdist, as the benchmark needs

    def run(reasons):
        return {"decisions": [{"reason": reason} for reason in reasons]}

    runs = [run(["signal", "signal", None, "forced"]), run(["signal", None, None]), run(["signal"] * 3 + ["capped"])]
    # signal: 2, 1, 3 -> median 2; forced: 1, 0, 0 -> median 0
    assert batch_growth.growths(runs) == "2 / 0"
    assert batch_growth.growths([{"decisions": None}] * 3) == "–"
