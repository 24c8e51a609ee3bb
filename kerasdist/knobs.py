"""The engine's settings, declared once.

Each `Knob` names its environment variable, its `kerasdist-run` flag, its default, how its
text is checked and what it means. `runtime.init()` reads them through `Knobs.from_environment`,
the launcher builds its flags and the variables it forwards from `KNOBS`, and the knob table of
docs/configuration.md says the same: a value one of them accepts, all of them accept. Standard library only, so
the launcher starts without TensorFlow or MPI.
"""

import dataclasses
import difflib
import math
import os

LOG_LEVELS = {"debug": 0, "info": 1, "warning": 2, "error": 3}
AUTO_OR_OFF = ("auto", "off")
ALLREDUCE_ALGORITHMS = ("auto", "mpi", "ring", "hierarchical")

# One MPI call moves an int count of elements; a fusion buffer bigger than this buys nothing
# and may not be allocatable at all.
MAX_FUSION_THRESHOLD_BYTES = 2**31 - 1
# The negotiation bit vector grows by a bit per cached request, reduced every cycle.
MAX_CACHE_CAPACITY = 2**20
# A replica check every this many steps or more is one an epoch for any real data set.
MAX_REPLICA_CHECK_STEPS = 10**9


def _integer(low, high, unit=""):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise ValueError("is not an integer") from None
        if not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}{unit}")
        return value

    return parse


def _seconds_or_milliseconds(high, unit):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise ValueError("is not a number") from None
        if math.isnan(value) or not 0 <= value <= high:  # nan compares false: name it
            raise ValueError(f"must be a number between 0 and {high:g}{unit}")
        return value

    return parse


def _one_of(choices):
    def parse(text):
        value = text.lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return parse


def _bytes_or_auto(high):
    as_bytes = _integer(0, high)

    def parse(text):
        if text.lower() == "auto":
            return "auto"
        try:
            return as_bytes(text)
        except ValueError:
            raise ValueError(f"must be auto or a whole number of bytes between 0 and {high}") from None

    return parse


def _epoch_off_or_steps(text):
    value = text.lower()
    if value in ("epoch", "off"):
        return value
    try:
        steps = int(value)
    except ValueError:
        steps = 0
    if not 1 <= steps <= MAX_REPLICA_CHECK_STEPS:
        raise ValueError(f"must be epoch, off or a whole number of steps between 1 and {MAX_REPLICA_CHECK_STEPS}")
    return steps


def _text(text):
    return text


# Signals a notice may come as: catchable, and not the launcher's stops (SIGINT, SIGTERM).
NOTICE_SIGNALS = ("USR1", "USR2", "HUP", "ALRM", "XCPU")
# What a job that stopped on notice exits with (EX_TEMPFAIL: "try again later"); the launcher
# starts it again without counting a failure. The line the noticed rank prints names its host.
NOTICE_EXIT_STATUS = 75
NOTICE_LINE = "kerasdist: notice received on rank {rank}, host {host}"


def _notice_signal(text):
    value = text.upper().removeprefix("SIG")
    if text.lower() == "off":
        return "off"
    if value not in NOTICE_SIGNALS:
        raise ValueError(f"must be off or one of {', '.join(NOTICE_SIGNALS)} (with or without SIG)")
    return value


def _log_level_number(level):
    return str(LOG_LEVELS[level])


@dataclasses.dataclass(frozen=True)
class Knob:
    """One engine setting: where it is read from, its default, and how its text is checked."""

    field: str  # attribute of `Knobs`
    variable: str  # environment variable every rank reads
    flag: str  # kerasdist-run option that sets the variable
    default: object
    parse: object  # text -> value; raises ValueError saying what is allowed
    help: str
    metavar: str = "VALUE"
    # kerasdist-run flags given in friendlier units say how to turn them into the variable's text,
    # and what the default is in those units.
    flag_to_text: object = None
    flag_default: str = None
    # How the C++ engine receives the value, as text (`engine_settings`); None: Python uses it alone.
    to_engine: object = None

    def default_text(self):
        """The default as the flag spells it."""
        if self.flag_default is not None:
            return self.flag_default
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default or "none")

    def read(self, environ):
        """This knob's value in `environ` (its default when unset or blank)."""
        text = environ.get(self.variable)
        if text is None or not text.strip():
            return self.default
        try:
            return self.parse(text.strip())
        except ValueError as error:
            raise ValueError(f"{self.variable}={text!r} {error}") from None


def _mebibytes_to_bytes(text):
    try:
        return str(int(float(text) * 2**20))
    except (ValueError, OverflowError):  # "big", "nan", "inf": the variable's check explains
        return text


_A_YEAR_S = 86400.0 * 365  # "never" is spelled 0, not a huge number

KNOBS = (
    Knob(
        "fusion_threshold_bytes",
        "KERASDIST_FUSION_THRESHOLD",
        "--fusion-threshold-mb",
        16 * 2**20,
        _integer(0, MAX_FUSION_THRESHOLD_BYTES, " bytes"),
        "the most bytes one MPI call reduces: allreduces of up to 256 KiB that are ready together are "
        "fused up to it, larger tensors are reduced in pieces of it; 0 turns both off",
        metavar="MB",
        flag_to_text=_mebibytes_to_bytes,
        flag_default="16",
        to_engine=repr,
    ),
    Knob(
        "autotune",
        "KERASDIST_AUTOTUNE",
        "--autotune",
        "auto",
        _one_of(AUTO_OR_OFF),
        "auto: rank 0 times the first cycles that reduce 64 KiB or more with each allreduce algorithm this "
        "job's hosts allow (when KERASDIST_ALLREDUCE_ALGORITHM is auto and there is more than one: 3 or more "
        "hosts under MPICH, or hosts of several ranks each), then the first cycles that fuse more than 1 MiB "
        "with the fusion threshold and with calls of at most 1 MiB (KERASDIST_FUSION_TUNING), 8 cycles each, "
        "and every rank keeps the fastest; results are the same to rounding either way; off: no tuning",
        metavar="MODE",
        flag_to_text=str.lower,
        to_engine=lambda mode: "1" if mode == "auto" else "0",
    ),
    Knob(
        "autotune_file",
        "KERASDIST_AUTOTUNE_FILE",
        "--autotune-file",
        "",
        _text,
        "a text file where rank 0 saves what tuning chose, one line per layout of hosts and ranks; a later "
        "job of a layout listed there runs its choice from the start without tuning (the launcher makes the "
        "path absolute)",
        metavar="FILE",
        flag_to_text=os.path.abspath,
        to_engine=_text,
    ),
    Knob(
        "fusion_tuning",
        "KERASDIST_FUSION_TUNING",
        "--fusion-tuning",
        "auto",
        _one_of(AUTO_OR_OFF),
        "auto: with KERASDIST_AUTOTUNE=auto, rank 0 times the first fused steps with the fusion threshold and "
        "with calls of at most 1 MiB (faster over slow links), and every rank keeps the faster; off: always "
        "the threshold",
        metavar="MODE",
        flag_to_text=str.lower,
        to_engine=lambda mode: "1" if mode == "auto" else "0",
    ),
    Knob(
        "allreduce_algorithm",
        "KERASDIST_ALLREDUCE_ALGORITHM",
        "--allreduce-algorithm",
        "auto",
        _one_of(ALLREDUCE_ALGORITHMS),
        "which algorithm the engine's allreduces run with. auto: on 2 or more hosts of the same number (2 or "
        "more) of ranks, the hierarchy for calls of at least 4 MiB; otherwise, under an MPI that lets a program "
        "choose per call (MPICH, through MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM), MPICH's ring when the job spans 3 "
        "or more hosts, for calls of at least 64 KiB (12 MiB when the ranks are a power of two), where MPICH's "
        "own choice is far from the link; ring: MPICH's ring always; hierarchical: the hierarchy (reduce-scatter "
        "within each host, allreduce across hosts, allgather within) for every call where the hosts allow it, "
        "else what auto runs; mpi: MPI's own choice. Allgathers follow it: as the hierarchy under hierarchical, "
        "and under auto from 4 MiB. Ring sets MPICH's process-wide variable for the length of "
        "each call: if the program makes MPI allreduces of its own on another thread meanwhile, set mpi",
        metavar="ALGORITHM",
        flag_to_text=str.lower,
        to_engine=_text,
    ),
    Knob(
        "bucket_bytes",
        "KERASDIST_BUCKET_BYTES",
        "--bucket-mb",
        "auto",
        _bytes_or_auto(2**40),
        "DistributedOptimizer and DistributedGradientTape reduce gradients in buckets of about this many "
        "bytes, last layers first, so each starts while backprop goes on; auto: an eighth of the "
        "gradients' bytes, at least 64 KiB and at most 4 MiB, but one bucket when every rank is on one "
        "host without a GPU (nothing to hide behind there); 0: one bucket after backprop",
        metavar="MB",
        flag_to_text=_mebibytes_to_bytes,
    ),
    Knob(
        "piggyback_bytes",
        "KERASDIST_PIGGYBACK_BYTES",
        "--piggyback-bytes",
        4096,
        _integer(0, 2**20, " bytes"),
        "float32 Sum and Average allreduces of up to this many bytes in all that repeat cycle after cycle "
        "(a step's small tensors, metrics) travel with the negotiation that agrees on them: one exchange "
        "instead of two; a cycle where some rank lacks them sends these bytes for nothing; 0: never",
        metavar="BYTES",
        to_engine=repr,
    ),
    Knob(
        "cycle_time_ms",
        "KERASDIST_CYCLE_TIME_MS",
        "--cycle-time-ms",
        0.0,
        _seconds_or_milliseconds(1000.0, " ms"),
        "after new work wakes the idle engine, wait this long so more requests join one reduction",
        metavar="MS",
        to_engine=repr,
    ),
    Knob(
        "timeline_path",
        "KERASDIST_TIMELINE",
        "--timeline",
        "",
        _text,
        "Chrome-trace JSON that rank 0 writes (the launcher makes the path absolute)",
        metavar="FILE",
        flag_to_text=os.path.abspath,
        to_engine=_text,
    ),
    Knob(
        "stall_warning_s",
        "KERASDIST_STALL_WARNING_S",
        "--stall-warning-s",
        60.0,
        _seconds_or_milliseconds(_A_YEAR_S, " s"),
        "warn when a collective has waited this long for other ranks; 0: never",
        metavar="S",
        to_engine=repr,
    ),
    Knob(
        "stall_timeout_s",
        "KERASDIST_STALL_TIMEOUT_S",
        "--stall-timeout-s",
        1800.0,
        _seconds_or_milliseconds(_A_YEAR_S, " s"),
        "fail collectives some rank has not submitted after this long; the job then ends non-zero; 0: wait for ever",
        metavar="S",
        to_engine=repr,
    ),
    Knob(
        "mismatch_timeout_s",
        "KERASDIST_MISMATCH_TIMEOUT_S",
        "--mismatch-timeout-s",
        5.0,
        _seconds_or_milliseconds(_A_YEAR_S, " s"),
        "fail collectives when every rank has been blocked this long in a different call, so none can "
        "complete (eager calls, or a tf.function step on some ranks against an eager call on others); "
        "0: never (set 0 if several threads of a rank make eager collectives)",
        metavar="S",
        to_engine=repr,
    ),
    Knob(
        "collective_timeout_s",
        "KERASDIST_COLLECTIVE_TIMEOUT_S",
        "--collective-timeout-s",
        600.0,
        _seconds_or_milliseconds(_A_YEAR_S, " s"),
        "end the job when a collective every rank has agreed to run moves no data for this long, or an MPI "
        "call of the negotiation does not return (a rank or the network between ranks is gone); waiting "
        "for a rank that has not submitted yet never counts; 0: never",
        metavar="S",
        to_engine=repr,
    ),
    Knob(
        "cache_capacity",
        "KERASDIST_CACHE_CAPACITY",
        "--cache-capacity",
        1024,
        _integer(1, MAX_CACHE_CAPACITY),
        "requests remembered for the one-allreduce negotiation fast path",
        metavar="N",
        to_engine=repr,
    ),
    Knob(
        "log_level",
        "KERASDIST_LOG_LEVEL",
        "--log-level",
        "warning",
        _one_of(tuple(LOG_LEVELS)),
        "engine messages on stderr: " + ", ".join(LOG_LEVELS),
        metavar="LEVEL",
        flag_to_text=str.lower,
        to_engine=_log_level_number,
    ),
    Knob(
        "tf_threads",
        "KERASDIST_TF_THREADS",
        "--tf-threads",
        "auto",
        _one_of(AUTO_OR_OFF),
        "auto: when ranks on a host share CPUs, size TensorFlow's thread pools to each rank's share; "
        "off: leave them to TensorFlow",
        metavar="MODE",
        flag_to_text=str.lower,
    ),
    Knob(
        "replica_check",
        "KERASDIST_REPLICA_CHECK",
        "--replica-check",
        "epoch",
        _epoch_off_or_steps,
        "epoch: kerasdist.callbacks() checks that every rank holds the same model (epoch, step counts, "
        "learning rates, every shared variable) when training starts, at every epoch end and when it ends, "
        "and stops training with an error naming the first difference; N: also every N steps; off: never",
        metavar="WHEN",
        flag_to_text=str.lower,
    ),
    Knob(
        "malloc",
        "KERASDIST_MALLOC",
        "--malloc",
        "auto",
        _one_of(AUTO_OR_OFF),
        "auto: glibc's malloc keeps freed memory for the next step instead of handing it back to the "
        "system and faulting it in again (unless MALLOC_*_ variables tune it); off: leave malloc alone",
        metavar="MODE",
        flag_to_text=str.lower,
    ),
    Knob(
        "notice_signal",
        "KERASDIST_NOTICE_SIGNAL",
        "--notice-signal",
        "USR1",
        _notice_signal,
        "the signal that gives a rank notice to leave (a preemption notice, scancel --signal): every rank "
        "stops fit at the same step boundary, Rank0Checkpoint saves that step and the job exits with status "
        f"{NOTICE_EXIT_STATUS}; kerasdist-run forwards it and restarts without the noticed host; off: not handled",
        metavar="SIGNAL",
    ),
)


# KERASDIST_* variables that are not engine knobs: the launcher's, the ones it sets on each rank,
# and the build's (setup.py).
OTHER_VARIABLES = (
    "KERASDIST_MPIEXEC",
    "KERASDIST_MPI_FLAVOUR",
    "KERASDIST_RESTART",
    "KERASDIST_PLANNED_SIZE",
    "KERASDIST_MPI_HOME",
    "KERASDIST_WITH_NCCL",
)
_PREFIX = "KERASDIST_"


def unknown_variables_message(environ):
    """A warning naming each ``KERASDIST_*`` variable in ``environ`` that kerasdist does not read,
    with the closest known name, or None when there is none: a misspelt knob is otherwise
    silently left at its default."""
    known = [knob.variable for knob in KNOBS] + list(OTHER_VARIABLES)
    unknown = sorted(name for name in environ if name.startswith(_PREFIX) and name not in known)
    if not unknown:
        return None
    described = []
    for name in unknown:
        closest = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        described.append(f"{name} (did you mean {closest[0]}?)" if closest else name)
    return (
        f"kerasdist does not read {', '.join(described)}: unknown KERASDIST_* variable(s) are ignored; "
        f"the known ones are listed in docs/configuration.md"
    )


def engine_settings(knobs):
    """(name, text) of every knob the engine reads: what `runtime.init()` hands to C++, in one call."""
    return [(knob.field, knob.to_engine(getattr(knobs, knob.field))) for knob in KNOBS if knob.to_engine]


def _from_environment(cls, environ=None):
    """Every knob from `environ` (default `os.environ`); a bad value raises `ValueError`
    naming its variable, the text and what is allowed."""
    environ = os.environ if environ is None else environ
    return cls(**{knob.field: knob.read(environ) for knob in KNOBS})


# The settings as one frozen value, its fields made from `KNOBS` so the two cannot drift.
Knobs = dataclasses.make_dataclass(
    "Knobs",
    [(knob.field, type(knob.default), dataclasses.field(default=knob.default)) for knob in KNOBS],
    frozen=True,
    namespace={
        "__doc__": "Engine settings, read once from `KERASDIST_*` variables at `init()`.",
        "from_environment": classmethod(_from_environment),
    },
)
Knobs.__module__ = __name__
