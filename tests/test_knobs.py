"""KERASDIST_* settings: declared once, checked by one rule that init() and kerasdist-run share,
and a bad value names its variable, the text and what is allowed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kerasdist import knobs
from kerasdist.knobs import KNOBS, Knobs
from kerasdist.run import launcher


def test_defaults_when_nothing_is_set():
    assert Knobs.from_environment({}) == Knobs()
    assert Knobs().tf_threads == "auto"
    assert Knobs().stall_timeout_s == 1800.0 and Knobs().mismatch_timeout_s == 5.0
    assert Knobs().bucket_bytes == "auto"
    assert Knobs().malloc == "auto"
    assert Knobs().notice_signal == "USR1"


def test_values_are_read_from_the_environment():
    got = Knobs.from_environment(
        {
            "KERASDIST_FUSION_THRESHOLD": "0",
            "KERASDIST_CYCLE_TIME_MS": "2.5",
            "KERASDIST_LOG_LEVEL": "DEBUG",
            "KERASDIST_TF_THREADS": " Off ",
            "KERASDIST_MISMATCH_TIMEOUT_S": "0",
            "KERASDIST_CACHE_CAPACITY": "8",
            "KERASDIST_BUCKET_BYTES": "65536",
            "KERASDIST_MALLOC": "OFF",
        }
    )
    assert (got.fusion_threshold_bytes, got.cycle_time_ms, got.mismatch_timeout_s) == (0, 2.5, 0.0)
    assert (got.log_level, got.tf_threads, got.cache_capacity) == ("debug", "off", 8)
    assert got.bucket_bytes == 65536 and got.malloc == "off"
    assert Knobs.from_environment({"KERASDIST_BUCKET_BYTES": "AUTO"}).bucket_bytes == "auto"
    assert Knobs.from_environment({"KERASDIST_NOTICE_SIGNAL": "sigusr2"}).notice_signal == "USR2"
    assert Knobs.from_environment({"KERASDIST_NOTICE_SIGNAL": "OFF"}).notice_signal == "off"


_BAD_VALUES = [
    ("KERASDIST_FUSION_THRESHOLD", "16MB", "is not an integer"),
    ("KERASDIST_FUSION_THRESHOLD", str(2**40), "must be between 0 and 2147483647 bytes"),
    ("KERASDIST_FUSION_THRESHOLD", str(2**63), "must be between 0 and 2147483647 bytes"),
    ("KERASDIST_FUSION_THRESHOLD", str(2**64), "must be between 0 and 2147483647 bytes"),
    ("KERASDIST_FUSION_THRESHOLD", "-1", "must be between 0"),
    ("KERASDIST_CYCLE_TIME_MS", "inf", "must be a number between 0 and 1000 ms"),
    ("KERASDIST_STALL_WARNING_S", "nan", "must be a number between 0"),
    ("KERASDIST_STALL_TIMEOUT_S", "nan", "must be a number between 0"),
    ("KERASDIST_STALL_TIMEOUT_S", "-1", "must be a number between 0"),
    ("KERASDIST_STALL_TIMEOUT_S", "1e300", "must be a number between 0"),
    ("KERASDIST_MISMATCH_TIMEOUT_S", "soon", "is not a number"),
    ("KERASDIST_CACHE_CAPACITY", "0", "must be between 1 and 1048576"),
    ("KERASDIST_CACHE_CAPACITY", "lots", "is not an integer"),
    ("KERASDIST_LOG_LEVEL", "loud", "must be one of debug, info, warning, error"),
    ("KERASDIST_TF_THREADS", "4", "must be one of auto, off"),
    ("KERASDIST_MALLOC", "glibc", "must be one of auto, off"),
    ("KERASDIST_ALLREDUCE_ALGORITHM", "rabenseifner", "must be one of auto, mpi, ring, hierarchical"),
    ("KERASDIST_AUTOTUNE", "on", "must be one of auto, off"),
    ("KERASDIST_BUCKET_BYTES", "4MB", "must be auto or a whole number of bytes between 0 and 1099511627776"),
    ("KERASDIST_BUCKET_BYTES", "-1", "must be auto or a whole number of bytes between 0"),
    ("KERASDIST_REPLICA_CHECK", "sometimes", "must be epoch, off or a whole number of steps between 1 and"),
    ("KERASDIST_REPLICA_CHECK", "0", "must be epoch, off or a whole number of steps between 1 and"),
    ("KERASDIST_REPLICA_CHECK", "2.5", "must be epoch, off or a whole number of steps between 1 and"),
    ("KERASDIST_NOTICE_SIGNAL", "TERM", "must be off or one of USR1, USR2, HUP, ALRM, XCPU"),
    ("KERASDIST_NOTICE_SIGNAL", "9", "must be off or one of USR1, USR2, HUP, ALRM, XCPU"),
]


@pytest.mark.parametrize("variable, value, reason", _BAD_VALUES)
def test_init_refuses_a_bad_value_naming_the_variable_and_the_rule(variable, value, reason):
    with pytest.raises(ValueError) as error:
        Knobs.from_environment({variable: value})
    assert str(error.value).startswith(f"{variable}={value!r} {reason}")


@pytest.mark.parametrize("variable, value, reason", _BAD_VALUES)
def test_the_launcher_refuses_what_init_refuses_from_the_environment(variable, value, reason, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(["-np", "2", "--dry-run", "python", "t.py"], environ={variable: value})
    assert exit_info.value.code == launcher.USAGE_ERROR
    assert f"{variable}={value!r} {reason}" in capsys.readouterr().err


@pytest.mark.parametrize("knob", KNOBS, ids=lambda knob: knob.flag)
def test_every_knob_has_a_flag_that_sets_its_variable_on_every_rank(knob, capsys):
    text = {
        "timeline_path": "/tmp/trace.json",
        "autotune_file": "/tmp/tuning.tsv",
        "autotune": "off",
        "log_level": "INFO",
        "tf_threads": "off",
        "malloc": "off",
        "fusion_tuning": "off",
        "allreduce_algorithm": "ring",
        "notice_signal": "USR2",
    }.get(knob.field, "7")
    status = launcher.main(
        ["-np", "2", "--dry-run", knob.flag, text, "python", "t.py"], environ={"KERASDIST_MPI_FLAVOUR": "mpich"}
    )
    assert status == 0
    expected = {"fusion_threshold_bytes": str(7 * 2**20), "bucket_bytes": str(7 * 2**20), "log_level": "info"}.get(
        knob.field, text
    )
    assert f"-genv {knob.variable} {expected} " in capsys.readouterr().out


@pytest.mark.parametrize("knob", KNOBS, ids=lambda knob: knob.flag)
def test_every_knob_already_in_the_environment_is_forwarded(knob, capsys):
    value = str(knob.default) if knob.default != "" else "/tmp/t.json"
    launcher.main(
        ["-np", "2", "--dry-run", "python", "t.py"], environ={"KERASDIST_MPI_FLAVOUR": "mpich", knob.variable: value}
    )
    assert f"-genv {knob.variable} {value} " in capsys.readouterr().out


@pytest.mark.parametrize("knob", [k for k in KNOBS if isinstance(k.default, (int, float))], ids=lambda k: k.flag)
def test_a_flag_refuses_nan_as_its_variable_would(knob, capsys):
    with pytest.raises(SystemExit):
        launcher.main(["-np", "2", "--dry-run", knob.flag, "nan", "python", "t.py"], environ={})
    assert f"argument {knob.flag}:" in capsys.readouterr().err


def test_the_declaration_and_the_settings_have_the_same_fields():
    assert [knob.field for knob in KNOBS] == list(Knobs.__dataclass_fields__)
    assert len({knob.variable for knob in KNOBS}) == len({knob.flag for knob in KNOBS}) == len(KNOBS)
    assert all(knob.variable.startswith("KERASDIST_") for knob in KNOBS)


# The engine's half of "declared once": kerasdist_start takes the knobs by name and refuses a
# start that misses one, repeats one or names one it does not have. Run in a fresh process, where
# MPI is not initialized: a start that gets past the settings stops at that check instead.
_ENGINE_START = """
import ctypes, sys
import tensorflow as tf
from kerasdist import knobs, op_library
path = op_library.library_path()
tf.load_op_library(path)
engine = ctypes.CDLL(path)
def start(settings):
    names = (ctypes.c_char_p * len(settings))(*(n.encode() for n, _ in settings))
    values = (ctypes.c_char_p * len(settings))(*(t.encode() for _, t in settings))
    error = ctypes.create_string_buffer(1024)
    engine.kerasdist_start(len(settings), names, values, error, len(error))
    print("START:", error.value.decode(), flush=True)
every = knobs.engine_settings(knobs.Knobs())
start(every)
start(every[1:])
start(every + [("bucket_bytes", "65536")])
start(every + every[:1])
start([(n, "soon" if n == "stall_timeout_s" else t) for n, t in every])
"""


def test_the_engine_takes_every_engine_knob_by_name_and_refuses_the_rest():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "KERASDIST_"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", _ENGINE_START], env=env, capture_output=True, text=True, timeout=120)
    results = [line[len("START: ") :] for line in done.stdout.splitlines() if line.startswith("START: ")]
    first = KNOBS[0].field
    assert results == [
        "kerasdist: MPI is not initialized",
        f"kerasdist: engine setting {first} was not given",
        "kerasdist: the engine has no setting bucket_bytes",
        f"kerasdist: engine setting {first} given twice",
        "kerasdist: engine setting stall_timeout_s=soon is not valid",
    ], done.stderr[-3000:]


def test_a_misspelt_knob_is_named_with_the_closest_known_variable():
    message = knobs.unknown_variables_message({"KERASDIST_FUSIONTHRESHOLD": "0", "PATH": "/bin"})
    assert "KERASDIST_FUSIONTHRESHOLD (did you mean KERASDIST_FUSION_THRESHOLD?)" in message


def test_known_kerasdist_variables_and_other_variables_raise_no_warning():
    environ = {knob.variable: "x" for knob in KNOBS}
    environ.update({name: "x" for name in knobs.OTHER_VARIABLES}, HOROVOD_FUSION_THRESHOLD="0", HOME="/")
    assert knobs.unknown_variables_message(environ) is None


def test_init_warns_once_about_an_unknown_kerasdist_variable(tmp_path):
    script = (
        "import warnings, kerasdist\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    kerasdist.init()\n"
        "print('WARNINGS', sum('KERASDIST_FUSIONTHRESHOLD' in str(w.message) for w in caught))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERASDIST_", "PMI_", "OMPI_", "HYDRA_"))}
    env.update(KERASDIST_FUSIONTHRESHOLD="0", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(Path(__file__).parents[1]))
    finished = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert "WARNINGS 1" in finished.stdout, finished.stdout + finished.stderr
