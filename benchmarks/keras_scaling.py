"""Keras `model.fit` throughput: plain Keras, kerasdist at 1 rank, kerasdist at 2 ranks.

How to run (one process; it starts the measured ones itself):

  .venv/bin/python benchmarks/keras_scaling.py                # what `make bench` runs, ~6-8 min
  .venv/bin/python benchmarks/keras_scaling.py --rounds=2 --num_iters=3   # quick look

It prints a table of medians and ratios and writes a result file to --json (benchmarks/results.py;
default bench-results/keras_scaling.json, `make bench`: benchmarks/results/keras_scaling.json).

What is measured
  Each configuration is one run of examples/keras_synthetic_benchmark.py (a model
  from kerasdist.models trained with model.fit on one fixed random batch per
  rank, so input costs nothing), which reports the median over its timed
  iterations of the images per second of all ranks together:
    plain          plain Keras, one process (--nouse_kerasdist)
    kerasdist-1    kerasdist.DistributedOptimizer + kerasdist.callbacks(), one process
    kerasdist-N    the same under `mpiexec -n --ranks` (default 2)
    independent-N  N plain-Keras processes at once that never communicate, their
                   throughputs added: what the machine gives N processes at all
                   (shared caches, memory bandwidth, other users), the ceiling
                   for kerasdist-N
  The configurations take turns, --rounds times, each round starting one
  configuration later than the previous (plain, kd-1, kd-N, ind-N / kd-1, kd-N,
  ind-N, plain / ...), so that a slow spell of a shared machine hits all alike.

  size-1 overhead  1 - thr(kerasdist-1) / thr(plain); target <= 3 %.
  E(N)             thr(kerasdist-N) / (N * thr(1)), with thr(1) from kerasdist-1
                   and, separately, from plain Keras; target >= 0.9.
  ceiling E(N)     thr(independent-N) / (N * thr(plain)): E(N) without any
                   communication. E(N) / ceiling is the part kerasdist keeps.
  Each ratio is estimated four ways:
    median     from each configuration's median over the rounds;
    best run   from each configuration's fastest run: other processes on the
               machine only ever slow a run down, so the fastest run is the
               closest to having the cores to oneself;
    per round  the median over rounds of the ratio within a round;
    CPU time   from CPU time per step (all threads of a rank's process), which
               other processes disturb far less than wall time: the work
               kerasdist adds, including communicating and waiting for peers.
  CPU/wall     a rank's CPU time over wall time per step: about 1 when each rank
               had a core to itself; well below 1 when other processes took the
               cores, and the wall-time figures then understate us.

Threads: every rank runs TensorFlow with --intra_op_threads (1) math threads and
--inter_op_threads (1) op-scheduling threads (TF_NUM_INTRAOP_THREADS,
TF_NUM_INTEROP_THREADS, OMP_NUM_THREADS are set for the runs). On a machine with
N cores, N ranks of one thread against one process of one thread is the fair
comparison: each rank has a core, as the single process had. kerasdist's engine
thread is extra; it sleeps while no collective is pending.

Settings (--settings): kerasdist-1 and kerasdist-N once per setting, each a group of environment
variables ("KERASDIST_BUCKET_BYTES=0", "KERASDIST_MALLOC=off KERASDIST_BUCKET_BYTES=0"), in the
same rounds as one plain and one independent-N, so that every setting meets the same load and
the same baselines. The result file holds each setting's summary and a table of them ("settings"):

  .venv/bin/python benchmarks/keras_scaling.py --settings KERASDIST_BUCKET_BYTES=0 \
      KERASDIST_BUCKET_BYTES=auto --json benchmarks/results/keras_scaling_buckets.json

Thread pools (--thread_pools): what a user gets who sets no thread variables.
Every process starts with OMP_NUM_THREADS, TF_NUM_INTRAOP_THREADS and
TF_NUM_INTEROP_THREADS unset, and three configurations take turns:
    plain              plain Keras, one process, TensorFlow's own pools
    kerasdist-N off    kerasdist-N with KERASDIST_TF_THREADS=off: every rank has
                       TensorFlow's pools, each as large as all the CPUs
    kerasdist-N        kerasdist-N as shipped: init() sizes the pools to each
                       rank's share of the CPUs
It prints the medians and kerasdist-N against kerasdist-N off and plain.

Every run is bounded by `timeout` (--run_timeout_s); a failed run stops the
benchmark with its output and a non-zero exit.
"""

import json
import os
import pathlib
import shlex
import shutil
import statistics
import subprocess
import sys
import time

import results as result_files  # benchmarks/results.py, beside this script
from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "keras_synthetic_benchmark.py"

MODEL = flags.DEFINE_enum(
    "model", "small_cnn", ["small_cnn", "cifar_resnet20", "resnet50", "mlp"], "Model from kerasdist.models."
)
BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Images per batch on each rank.")
RANKS = flags.DEFINE_integer("ranks", 2, "Ranks of the multi-process configuration.")
ROUNDS = flags.DEFINE_integer("rounds", 5, "Times every configuration runs, in turns.")
NUM_WARMUP_BATCHES = flags.DEFINE_integer("num_warmup_batches", 10, "Untimed batches per run.")
NUM_BATCHES_PER_ITER = flags.DEFINE_integer("num_batches_per_iter", 10, "Batches per timed iteration.")
NUM_ITERS = flags.DEFINE_integer("num_iters", 8, "Timed iterations per run (each run reports their median).")
INTRA_OP_THREADS = flags.DEFINE_integer("intra_op_threads", 1, "TensorFlow math threads per rank.")
INTER_OP_THREADS = flags.DEFINE_integer("inter_op_threads", 1, "TensorFlow op-scheduling threads per rank.")
RUN_TIMEOUT_S = flags.DEFINE_integer("run_timeout_s", 240, "Wall-clock limit of one run.")
MPIEXEC = flags.DEFINE_string(
    "mpiexec", None, "mpiexec to launch with; default: the one next to this Python (the venv's), else the one on PATH."
)
JSON_PATH = flags.DEFINE_string(
    "json",
    str(REPO / "bench-results" / "keras_scaling.json"),
    "Where to write the runs and the summary (with --thread_pools: "
    "bench-results/keras_thread_pools.json unless given).",
)
THREAD_POOLS = flags.DEFINE_bool(
    "thread_pools",
    False,
    "Instead of the scaling table, compare TensorFlow's own "
    "thread pools with the ones kerasdist.init() sizes (see the docstring).",
)

SETTINGS = flags.DEFINE_multi_string(
    "settings",
    None,
    "Environment settings to run kerasdist-1 and kerasdist-N under, each 'NAME=VALUE [NAME=VALUE ...]', "
    "in the same rounds (see the docstring).",
)

PLAIN, KERASDIST_1, KERASDIST_N, INDEPENDENT_N = "plain", "kerasdist-1", "kerasdist-N", "independent-N"
KERASDIST_N_POOLS_OFF = "kerasdist-N off"


def mpiexec_path():
    if MPIEXEC.value:
        return MPIEXEC.value
    beside_python = pathlib.Path(sys.executable).parent / "mpiexec"
    return str(beside_python) if beside_python.exists() else shutil.which("mpiexec") or "mpiexec"


def commands():
    """Configuration name -> command line, each bounded by `timeout`."""
    example = [
        sys.executable,
        str(EXAMPLE),
        f"--model={MODEL.value}",
        f"--batch_size={BATCH_SIZE.value}",
        f"--num_warmup_batches={NUM_WARMUP_BATCHES.value}",
        f"--num_batches_per_iter={NUM_BATCHES_PER_ITER.value}",
        f"--num_iters={NUM_ITERS.value}",
    ]
    bounded = ["timeout", "--kill-after=10", str(RUN_TIMEOUT_S.value)]
    n_processes = [mpiexec_path(), "-n", str(RANKS.value)]
    return {
        PLAIN: bounded + example + ["--nouse_kerasdist"],
        KERASDIST_1: bounded + example,
        KERASDIST_N: bounded + n_processes + example,
        # Without kerasdist each process is a world of its own and prints its own RESULT.
        INDEPENDENT_N: bounded + n_processes + example + ["--nouse_kerasdist"],
    }


def thread_environment():
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(INTRA_OP_THREADS.value),
        TF_NUM_INTRAOP_THREADS=str(INTRA_OP_THREADS.value),
        TF_NUM_INTEROP_THREADS=str(INTER_OP_THREADS.value),
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    return env


def unset_thread_environment(**extra):
    """This environment without any thread-pool setting: TensorFlow's and kerasdist's defaults."""
    unset = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "KERASDIST_TF_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", **extra)
    return env


def run_once(name, command, env):
    """Runs one configuration; returns its throughput, step and CPU times, wall time and load.

    Several RESULT lines (independent processes) add up their throughputs and average their
    step and CPU times."""
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    results = [json.loads(line[len("RESULT ") :]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not results:
        reason = "timed out" if done.returncode in (124, 137) else f"exit status {done.returncode}"
        sys.stderr.write(
            f"\n{name} failed ({reason}): {' '.join(command)}\n--- stdout\n{done.stdout[-3000:]}"
            f"\n--- stderr\n{done.stderr[-3000:]}\n"
        )
        raise SystemExit(1)
    return {
        "configuration": name,
        "images_per_second": sum(r["images_per_second"] for r in results),
        "step_ms": statistics.mean(r["step_ms"] for r in results),
        "cpu_ms_per_step_per_rank": statistics.mean(r["cpu_ms_per_step_per_rank"] for r in results),
        "cpu_ms_per_step_by_thread": {
            role: statistics.mean(r["cpu_ms_per_step_by_thread"][role] for r in results)
            for role in results[0].get("cpu_ms_per_step_by_thread", {})
        },
        "wall_s": wall_s,
        "load_average_1min_before": load_before,
        "engine_ms_per_step": results[0].get("engine_ms_per_step"),
        "results": results,
    }


def ratios(throughput):
    """Overhead and scaling efficiencies from a {configuration: images/s of all ranks} mapping."""
    ranks = RANKS.value
    return {
        "size1_overhead": 1 - throughput[KERASDIST_1] / throughput[PLAIN],
        "efficiency_vs_kerasdist_1": throughput[KERASDIST_N] / (ranks * throughput[KERASDIST_1]),
        "efficiency_vs_plain": throughput[KERASDIST_N] / (ranks * throughput[PLAIN]),
        "ceiling_efficiency": throughput[INDEPENDENT_N] / (ranks * throughput[PLAIN]),
        "efficiency_over_ceiling": throughput[KERASDIST_N] / throughput[INDEPENDENT_N],
    }


def run_rounds(configurations, environments):
    """Every configuration once per round, each round starting one configuration later."""
    names = list(configurations)
    runs = []
    for round_index in range(ROUNDS.value):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            run = {**run_once(name, configurations[name], environments[name]), "round": round_index}
            runs.append(run)
            print(
                f"  round {round_index + 1}: {name:<13} {run['images_per_second']:8.1f} img/s  "
                f"step {run['step_ms']:6.1f} ms  CPU {run['cpu_ms_per_step_per_rank']:6.1f} ms/step/rank  "
                f"(run {run['wall_s']:.0f} s, load {run['load_average_1min_before']:.1f})",
                flush=True,
            )
    return runs


def median_by_role(splits):
    """{role: median over the runs} of per-run {role: CPU ms per step} splits (empty if any is)."""
    if not all(splits):
        return {}
    return {role: statistics.median(split[role] for split in splits) for role in splits[0]}


def summarize(runs, names):
    """Per-configuration medians and the ratios, estimated four ways (see the module docstring)."""

    def of(name, key):
        return [r[key] for r in runs if r["configuration"] == name]

    ranks = {PLAIN: 1, KERASDIST_1: 1, KERASDIST_N: RANKS.value, INDEPENDENT_N: RANKS.value}
    median = {name: statistics.median(of(name, "images_per_second")) for name in names}
    best = {name: max(of(name, "images_per_second")) for name in names}
    step_ms = {name: statistics.median(of(name, "step_ms")) for name in names}
    cpu_ms = {name: statistics.median(of(name, "cpu_ms_per_step_per_rank")) for name in names}
    by_thread = {name: median_by_role(of(name, "cpu_ms_per_step_by_thread")) for name in names}
    # Images per CPU-second of all ranks together: throughput had every rank a core of its own.
    per_cpu_second = {name: ranks[name] * BATCH_SIZE.value / (cpu_ms[name] / 1e3) for name in names}
    per_round = [
        ratios({r["configuration"]: r["images_per_second"] for r in runs if r["round"] == i})
        for i in range(ROUNDS.value)
    ]
    engine = [r["engine_ms_per_step"] for r in runs if r["configuration"] == KERASDIST_N]
    return {
        # kerasdist-N's engine thread per step, median over the rounds (kerasdist.engine_times()).
        "engine_ms_per_step": {key: statistics.median(e[key] for e in engine) for key in engine[0]},
        "images_per_second": {
            "median": median,
            "best": best,
            "worst": {name: min(of(name, "images_per_second")) for name in names},
        },
        "step_ms": step_ms,
        "cpu_ms_per_step_per_rank": cpu_ms,
        # Where a rank's CPU goes per step, by thread role (median over the rounds of each role).
        "cpu_ms_per_step_by_thread": by_thread,
        "ratios": {
            "median": ratios(median),
            "best run": ratios(best),
            "per round": {key: statistics.median(r[key] for r in per_round) for key in per_round[0]},
            "CPU time": ratios(per_cpu_second),
        },
    }


def print_summary(summary, names):
    throughput = summary["images_per_second"]
    print(
        f"\n{'configuration':<14} {'median img/s':>12} {'best':>8} {'worst':>8} {'step ms':>8} "
        f"{'CPU ms/step/rank':>17} {'CPU/wall':>9}"
    )
    for name in names:
        step_ms, cpu_ms = summary["step_ms"][name], summary["cpu_ms_per_step_per_rank"][name]
        print(
            f"{name:<14} {throughput['median'][name]:12.1f} {throughput['best'][name]:8.1f} "
            f"{throughput['worst'][name]:8.1f} {step_ms:8.1f} {cpu_ms:17.1f} {cpu_ms / step_ms:9.2f}"
        )
    for name in names:
        split = summary["cpu_ms_per_step_by_thread"][name]
        if split:
            print(f"{name:<14} CPU ms/step/rank by thread: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
    engine = summary["engine_ms_per_step"]
    phases = {key: value for key, value in engine.items() if key not in ("cycles", "rode")}
    print(
        f"\n{KERASDIST_N}: the engine thread per step (ms, median of rounds; step "
        f"{summary['step_ms'][KERASDIST_N]:.1f} ms, {engine['cycles']:.1f} negotiation cycles, "
        f"{engine['rode']:.1f} collectives rode with them): "
        + ", ".join(f"{key} {value:.2f}" for key, value in phases.items())
        + f"; busy {sum(phases.values()):.2f}"
    )
    estimates = summary["ratios"]
    n = RANKS.value
    print(f"\n{'':<22}" + "".join(f"{label:>11}" for label in estimates))
    rows = (
        ("size1_overhead", "size-1 overhead", "{:+.1%}", "target <= 3 %"),
        ("efficiency_vs_kerasdist_1", f"E({n}) vs kerasdist-1", "{:.3f}", "target >= 0.9"),
        ("efficiency_vs_plain", f"E({n}) vs plain Keras", "{:.3f}", ""),
        ("ceiling_efficiency", f"ceiling E({n})", "{:.3f}", "no communication"),
        ("efficiency_over_ceiling", f"E({n}) / ceiling", "{:.3f}", ""),
    )
    for key, label, fmt, target in rows:
        print(
            f"{label:<22}" + "".join(f"{fmt.format(values[key]):>11}" for values in estimates.values()) + f"   {target}"
        )


def compare_thread_pools():
    """The --thread_pools comparison; returns what goes into the JSON."""
    every = commands()
    configurations = {PLAIN: every[PLAIN], KERASDIST_N_POOLS_OFF: every[KERASDIST_N], KERASDIST_N: every[KERASDIST_N]}
    environments = {
        PLAIN: unset_thread_environment(),
        KERASDIST_N_POOLS_OFF: unset_thread_environment(KERASDIST_TF_THREADS="off"),
        KERASDIST_N: unset_thread_environment(),
    }
    print(
        f"{MODEL.value}, batch {BATCH_SIZE.value} per rank, no thread settings, {os.cpu_count()} CPU(s); "
        f"{ROUNDS.value} rounds of {', '.join(configurations)} (N = {RANKS.value})",
        flush=True,
    )
    runs = run_rounds(configurations, environments)
    median = {
        name: statistics.median(r["images_per_second"] for r in runs if r["configuration"] == name)
        for name in configurations
    }
    print(f"\n{'configuration':<16} {'median img/s':>12}")
    for name in configurations:
        print(f"{name:<16} {median[name]:12.1f}")

    def pool_ratios(throughput):
        return {
            "kerasdist-N / kerasdist-N off": throughput[KERASDIST_N] / throughput[KERASDIST_N_POOLS_OFF],
            "kerasdist-N off / plain": throughput[KERASDIST_N_POOLS_OFF] / throughput[PLAIN],
            "kerasdist-N / plain": throughput[KERASDIST_N] / throughput[PLAIN],
        }

    per_round = [
        pool_ratios({r["configuration"]: r["images_per_second"] for r in runs if r["round"] == i})
        for i in range(ROUNDS.value)
    ]
    estimates = {
        "median": pool_ratios(median),
        "per round": {key: statistics.median(r[key] for r in per_round) for key in per_round[0]},
    }
    print(f"\n{'':<32}" + "".join(f"{label:>11}" for label in estimates))
    for key in estimates["median"]:
        print(f"{key:<32}" + "".join(f"{values[key]:11.3f}" for values in estimates.values()))
    return {
        "commands": {name: " ".join(command) for name, command in configurations.items()},
        "summary": {"median_images_per_second": median, "ratios": estimates},
        "runs": runs,
    }


def setting_environment(setting):
    """The variables of one --settings entry, as a dict; a word without '=' is refused by name."""
    words = shlex.split(setting)
    wrong = [word for word in words if "=" not in word]
    if not words or wrong:
        raise app.UsageError(f"--settings {setting!r}: expected NAME=VALUE words, got {wrong or 'nothing'}")
    return dict(word.split("=", 1) for word in words)


def compare_settings():
    """The --settings comparison: per setting, the summary of plain, kerasdist-1 and kerasdist-N
    under it and independent-N, all from the same rounds; returns what goes into the JSON."""
    every, base_env = commands(), thread_environment()
    configurations = {PLAIN: every[PLAIN], INDEPENDENT_N: every[INDEPENDENT_N]}
    environments = {PLAIN: base_env, INDEPENDENT_N: base_env}
    # configuration label -> (its setting, or None for the shared baselines; what it stands for)
    under = {PLAIN: (None, PLAIN), INDEPENDENT_N: (None, INDEPENDENT_N)}
    for setting in SETTINGS.value:
        variables = setting_environment(setting)
        for name in (KERASDIST_1, KERASDIST_N):
            label = f"{name} [{setting}]"
            configurations[label], environments[label] = every[name], {**base_env, **variables}
            under[label] = (setting, name)
    print(
        f"{MODEL.value}, batch {BATCH_SIZE.value} per rank, {os.cpu_count()} CPU(s); {ROUNDS.value} rounds of "
        f"{', '.join(configurations)} (N = {RANKS.value})",
        flush=True,
    )
    runs = run_rounds(configurations, environments)
    names = [PLAIN, KERASDIST_1, KERASDIST_N, INDEPENDENT_N]
    summaries = {}
    for setting in SETTINGS.value:
        mine = [
            {**run, "configuration": under[run["configuration"]][1]}
            for run in runs
            if under[run["configuration"]][0] in (None, setting)
        ]
        summaries[setting] = summarize(mine, names)
        print(f"\n== {setting}")
        print_summary(summaries[setting], names)
    return {
        "commands": {name: " ".join(command) for name, command in every.items()},
        "settings": summaries,
        "runs": runs,
        "tables": {"settings": settings_table(summaries)},
    }


def settings_table(summaries):
    """One row per setting: kerasdist-N's throughput (median, range over rounds) and CPU per
    step, and the ratios (medians; per round; by CPU time)."""
    n = RANKS.value
    rows = []
    for setting, summary in summaries.items():
        throughput, ratios_of = summary["images_per_second"], summary["ratios"]
        rows.append(
            [
                f"`{setting}`",
                f"{throughput['median'][KERASDIST_N]:.0f} ({throughput['worst'][KERASDIST_N]:.0f}–"
                f"{throughput['best'][KERASDIST_N]:.0f})",
                f"{summary['cpu_ms_per_step_per_rank'][KERASDIST_N]:.1f}",
                f"{summary['engine_ms_per_step']['cycles']:.1f}",
                *(f"{ratios_of[way]['efficiency_vs_kerasdist_1']:.3f}" for way in ("median", "per round", "CPU time")),
                f"{ratios_of['median']['ceiling_efficiency']:.3f}",
                f"{ratios_of['median']['size1_overhead']:+.1%}".replace("-", "−"),
            ]
        )
    columns = [
        "setting",
        f"kerasdist, {n} ranks: img/s, median (range over rounds)",
        "CPU ms/step/rank",
        "engine cycles per step",
        f"E({n}) median",
        "per round",
        "by CPU time",
        f"ceiling E({n})",
        "size-1 overhead",
    ]
    return {"columns": columns, "rows": rows}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if SETTINGS.value:
        run = result_files.start_run("keras_settings")
        result = compare_settings()
        result_files.write(
            JSON_PATH.value, result_files.finish_run(run, model=MODEL.value, ranks=RANKS.value, **result)
        )
        print(f"wrote {JSON_PATH.value}")
        return
    run = result_files.start_run("keras_thread_pools" if THREAD_POOLS.value else "keras_scaling")
    if THREAD_POOLS.value:
        result = compare_thread_pools()
        path = pathlib.Path(
            JSON_PATH.value if flags.FLAGS["json"].present else REPO / "bench-results" / "keras_thread_pools.json"
        )
        result_files.write(path, result_files.finish_run(run, model=MODEL.value, ranks=RANKS.value, **result))
        print(f"wrote {path}")
        return
    configurations = commands()
    names = list(configurations)
    print(
        f"{MODEL.value}, batch {BATCH_SIZE.value} per rank, {INTRA_OP_THREADS.value} intra-op / "
        f"{INTER_OP_THREADS.value} inter-op TF thread(s) per rank, {os.cpu_count()} CPU(s); "
        f"{ROUNDS.value} rounds of {', '.join(names)} (N = {RANKS.value}), "
        f"{NUM_ITERS.value} x {NUM_BATCHES_PER_ITER.value} timed batches per run",
        flush=True,
    )
    runs = run_rounds(configurations, {name: thread_environment() for name in names})
    summary = summarize(runs, names)
    print_summary(summary, names)

    setup = {
        "model": MODEL.value,
        "batch_size_per_rank": BATCH_SIZE.value,
        "ranks": RANKS.value,
        "rounds": ROUNDS.value,
        "num_warmup_batches": NUM_WARMUP_BATCHES.value,
        "num_batches_per_iter": NUM_BATCHES_PER_ITER.value,
        "num_iters": NUM_ITERS.value,
        "intra_op_threads": INTRA_OP_THREADS.value,
        "inter_op_threads": INTER_OP_THREADS.value,
        "cpus": os.cpu_count(),
        "commands": {name: " ".join(command) for name, command in configurations.items()},
    }
    path = result_files.write(JSON_PATH.value, result_files.finish_run(run, setup=setup, summary=summary, runs=runs))
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
