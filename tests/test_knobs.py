"""KERASDIST_* settings are parsed once, and a bad value names the variable."""
import pytest

from kerasdist.runtime import Knobs


def test_defaults_when_nothing_is_set():
    assert Knobs.from_environment({}) == Knobs()
    assert Knobs().tf_threads == "auto"


def test_values_are_read_from_the_environment():
    knobs = Knobs.from_environment({"KERASDIST_FUSION_THRESHOLD": "0", "KERASDIST_CYCLE_TIME_MS": "2.5",
                                    "KERASDIST_LOG_LEVEL": "DEBUG", "KERASDIST_TF_THREADS": " Off "})
    assert (knobs.fusion_threshold_bytes, knobs.cycle_time_ms) == (0, 2.5)
    assert (knobs.log_level, knobs.tf_threads) == ("debug", "off")


@pytest.mark.parametrize("variable, value", [
    ("KERASDIST_FUSION_THRESHOLD", "16MB"),
    ("KERASDIST_STALL_TIMEOUT_S", "-1"),
    ("KERASDIST_LOG_LEVEL", "loud"),
    ("KERASDIST_TF_THREADS", "4"),
])
def test_a_bad_value_names_its_variable(variable, value):
    with pytest.raises(ValueError, match=variable):
        Knobs.from_environment({variable: value})
