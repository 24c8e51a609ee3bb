"""kerasdist over a network: two emulated hosts joined by a 1 Gbit/s link and by an unshaped one.

How to run (as root; `make bench-net` runs it with the defaults, ~20 min):

  .venv/bin/python benchmarks/network.py
  .venv/bin/python benchmarks/network.py --rounds 1 --num_iters 3 --repeats 3   # quick look

It makes a 2-host cluster with scripts/netns_cluster.sh (through benchmarks/emulated_hosts.py;
removed at the end, on Ctrl-C and on SIGTERM), and for each link (tc htb at --rate, then
unshaped):
  link         the physical limit: one TCP stream between the hosts (Python sockets), median
               of 3; an allreduce of N bytes between 2 hosts sends and receives N bytes per
               host at best, so N / this rate is the fastest any allreduce can be.
  allreduce    benchmarks/network_allreduce.py across the hosts, one rank each: Sum and
               Average against raw mpi4py, 160 x 64 KiB fused (default threshold) against
               unfused (KERASDIST_FUSION_THRESHOLD=0), Compression none / fp16 / bf16.
  training     examples/keras_synthetic_benchmark.py (model.fit, 64 images per rank, one TF math
               thread per rank) for each --models, one process against 2 hosts x 1 rank on each
               link, taking turns --rounds times, with wall and CPU time per step; also local
               SGD (--average_models_every, default 4 and 16 steps), fp16, one-step-delayed and
               1-bit gradients beside synchronous training. The 2-host runs write a timeline:
               MPI time per step is the time some allreduce or allgather was in MPI (union of
               the timeline's "allreduce" and "allgather" phases) over the steps run, beside the
               collective requests negotiated per step.
Every job goes through kerasdist-run with the cluster's launcher program and interface and
UCX_TLS=tcp (between namespaces of one kernel UCX would otherwise use shared memory).
Results: printed tables, and a result file at --json (benchmarks/results.py; default
bench-results/network.json; `make bench-net`: benchmarks/results/network.json) holding every
measurement and the tables as printed.
"""

import argparse
import contextlib
import io
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results as result_files  # noqa: E402  (benchmarks/results.py)
from emulated_hosts import REPO, UNSHAPED, job_environment, measure_link, run, two_hosts  # noqa: E402

EXAMPLE = REPO / "examples" / "keras_synthetic_benchmark.py"
RANK_BENCH = REPO / "benchmarks" / "network_allreduce.py"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="tc rate of the shaped link (default: %(default)s)")
    parser.add_argument("--models", nargs="+", default=["mlp", "small_cnn", "cifar_resnet20"])
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="training runs per configuration, in turns")
    parser.add_argument("--num_iters", type=int, default=5, help="timed iterations of 10 batches per run")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of each allreduce case")
    parser.add_argument(
        "--bucket_mb",
        type=float,
        nargs="*",
        default=[],
        help="more gradient bucket sizes to train with in the overlap runs (MiB)",
    )
    parser.add_argument(
        "--average_models_every",
        type=int,
        nargs="*",
        default=[4, 16],
        help="local SGD runs (kerasdist.callbacks.ModelAveraging) averaging every N steps, beside the others",
    )
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["allreduce", "training", "overlap", "unshaped"],
        help="overlap: the training runs with gradient buckets off and without communication; "
        "unshaped: the unshaped link",
    )
    parser.add_argument(
        "--configs",
        nargs="*",
        default=[],
        help="train only these 2-host configurations, by their labels in the tables (e.g. kerasdist "
        "'1-bit gradients' 'no communication'); default: all",
    )
    parser.add_argument("--job_timeout_s", type=int, default=900)
    parser.add_argument("--json", default=str(REPO / "bench-results" / "network.json"), help="the result file")
    return parser.parse_args()


ARGS = parse_args()


# ---- allreduce --------------------------------------------------------------------------------


def bench_allreduce(cluster):
    with tempfile.TemporaryDirectory() as scratch:
        fused_json, unfused_json = pathlib.Path(scratch, "fused.json"), pathlib.Path(scratch, "unfused.json")
        common = [sys.executable, RANK_BENCH, "--repeats", str(ARGS.repeats)]
        print(cluster.launch([*common, "--json", fused_json]), flush=True)
        print(
            cluster.launch(
                [*common, "--only", "many", "--json", unfused_json], extra_flags=["--fusion-threshold-mb", "0"]
            ),
            flush=True,
        )
        fused, unfused = json.loads(fused_json.read_text()), json.loads(unfused_json.read_text())
    fused["many_unfused"] = unfused["many"]
    return fused


# ---- training ---------------------------------------------------------------------------------


def merged_seconds(intervals):
    """Total length of the union of (start, end) intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def read_timeline(path):
    text = pathlib.Path(path).read_text().rstrip()
    if not text.endswith("]"):  # a run that did not close its timeline
        text = text.rstrip(",") + "]"
    return json.loads(text)


def timeline_summary(timeline_path, steps):
    """MPI time per step (union of the "allreduce" and "allgather" phases: 1-bit gradients
    travel as an allgather) and collective requests per step (a request is one name negotiated:
    DistributedOptimizer sends one grouped request per gradient bucket, each as soon as backprop
    has produced its gradients)."""
    events = [e for e in read_timeline(timeline_path) if e.get("ph") == "X"]
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") in ("allreduce", "allgather")]
    return {
        "communication_ms_per_step": merged_seconds(intervals) / 1e3 / steps if intervals else None,
        "requests_per_step": sum(1 for e in events if e.get("name") == "queued") / steps,
    }


def example_command(model):
    return [
        sys.executable,
        EXAMPLE,
        f"--model={model}",
        f"--batch_size={ARGS.batch_size}",
        "--num_warmup_batches=10",
        "--num_batches_per_iter=10",
        f"--num_iters={ARGS.num_iters}",
    ]


def result_line(output):
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :])


def train_one_process(model):
    # On one CPU, as an emulated host has, with one inter-op thread: a lone process has nothing
    # to overlap.
    one_cpu = ["taskset", "-c", str(min(os.sched_getaffinity(0)))]
    return result_line(
        run(one_cpu + example_command(model), {**job_environment(), "TF_NUM_INTEROP_THREADS": "1"}, ARGS.job_timeout_s)
    )


def train_two_hosts(cluster, model, extra_flags=(), extra_command=()):
    with tempfile.TemporaryDirectory() as scratch:
        timeline = pathlib.Path(scratch, "timeline.json")
        result = result_line(
            cluster.launch(
                example_command(model) + list(extra_command), extra_flags=["--timeline", timeline, *extra_flags]
            )
        )
        steps = 10 + 10 * ARGS.num_iters  # warm-up batches, then the timed ones
        result.update(timeline_summary(timeline, steps))
    return result


def train_two_hosts_apart(cluster, model):
    """Both hosts train plain Keras at once, never communicating: the step time of the same
    processes without communication, against which the exposed communication is measured."""
    return result_line(cluster.launch(example_command(model) + ["--nouse_kerasdist"]))


# The 2-host configurations: label -> how to run them.
TWO_HOST_RUNS = {
    "kerasdist": train_two_hosts,
    "buckets off": lambda cluster, model: train_two_hosts(cluster, model, ["--bucket-mb", "0"]),
    **{
        f"buckets {mb:g} MiB": (lambda cluster, model, mb=mb: train_two_hosts(cluster, model, ["--bucket-mb", str(mb)]))
        for mb in ARGS.bucket_mb
    },
    **{
        f"average every {n}": (
            lambda cluster, model, n=n: train_two_hosts(cluster, model, extra_command=[f"--average_models_every={n}"])
        )
        for n in ARGS.average_models_every
    },
    "fp16 gradients": lambda cluster, model: train_two_hosts(cluster, model, extra_command=["--fp16_allreduce"]),
    "delayed gradients": lambda cluster, model: train_two_hosts(cluster, model, extra_command=["--delay_gradients"]),
    "1-bit gradients": lambda cluster, model: train_two_hosts(cluster, model, extra_command=["--one_bit_gradients"]),
    "no communication": train_two_hosts_apart,
}


def bench_training(cluster, links):
    runs = []
    configurations = ["kerasdist"] if "overlap" in ARGS.skip else list(TWO_HOST_RUNS)
    unknown = set(ARGS.configs) - set(TWO_HOST_RUNS)
    if unknown:
        raise SystemExit(f"--configs: no configuration {sorted(unknown)}; there are {list(TWO_HOST_RUNS)}")
    configurations = [c for c in configurations if not ARGS.configs or c in ARGS.configs]
    for round_index in range(ARGS.rounds):
        for model in ARGS.models:
            single = train_one_process(model)
            runs.append({"round": round_index, "model": model, "link": "one process", **single})
            print(
                f"  round {round_index + 1} {model:<15} one process  {single['step_ms']:7.1f} ms/step "
                f"(CPU {single['cpu_ms_per_step_per_rank']:.1f}; load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
            for label, rate in links:
                cluster.shape(rate)
                for configuration in configurations:
                    two = TWO_HOST_RUNS[configuration](cluster, model)
                    runs.append(
                        {"round": round_index, "model": model, "link": label, "configuration": configuration, **two}
                    )
                    comm = two.get("communication_ms_per_step")
                    print(
                        f"  round {round_index + 1} {model:<15} 2 hosts, {label:<9} {configuration:<16} "
                        f"{two['step_ms']:7.1f} ms/step (CPU {two['cpu_ms_per_step_per_rank']:.1f}), MPI "
                        f"{comm if comm is None else round(comm, 2)} ms/step, "
                        f"{two.get('requests_per_step', 0):.2f} requests per step",
                        flush=True,
                    )
    return runs


# ---- tables -----------------------------------------------------------------------------------


def human(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def print_allreduce_tables(label, gbits, results):
    print(f"\n### {label}: TCP stream {gbits:.2f} Gbit/s\n")
    print("| op | size | link limit | raw MPI | kerasdist | raw / kerasdist (range) | kerasdist, share of link limit |")
    print("|---|---|---|---|---|---|---|")
    for row in results["sizes"]:
        limit_s = row["bytes"] * 8 / (gbits * 1e9)
        print(
            f"| {row['op']} | {human(row['bytes'])} | {limit_s * 1e3:.3f} ms | {row['raw_s'] * 1e3:.3f} ms | "
            f"{row['ours_s'] * 1e3:.3f} ms | {row['ratio']:.2f} ({row['ratio_low']:.2f}–{row['ratio_high']:.2f}) | "
            f"{limit_s / row['ours_s']:.2f} |"
        )
    fused, unfused = results["many"], results["many_unfused"]
    print(f"\n| {fused['tensors']} × {human(fused['bytes'] // fused['tensors'])} per step | ms |")
    print("|---|---|")
    print(f"| link limit | {fused['bytes'] * 8 / (gbits * 1e9) * 1e3:.1f} |")
    for name in ("raw per tensor", "raw flat"):
        print(f"| {name} | {fused['seconds'][name] * 1e3:.1f} |")
    print(f"| kerasdist grouped, fused (default threshold) | {fused['seconds']['grouped'] * 1e3:.1f} |")
    print(f"| kerasdist grouped, unfused (threshold 0) | {unfused['seconds']['grouped'] * 1e3:.1f} |")
    speedup = unfused["seconds"]["grouped"] / fused["seconds"]["grouped"]
    print(f"| **fused speed-up** (unfused / fused) | **{speedup:.2f}×** |")
    print(
        "\n| size | link limit | raw MPI float32 | raw MPI 16-bit | none | fp16 | bf16 | fp16 speed-up "
        "| bf16 speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in results["compression"]:
        limit_ms = row["bytes"] * 8 / (gbits * 1e9) * 1e3
        print(
            f"| {human(row['bytes'])} | {limit_ms:.1f} ms | {row['raw'] * 1e3:.1f} ms | {row['raw16'] * 1e3:.1f} ms | "
            f"{row['none'] * 1e3:.1f} ms | "
            f"{row['fp16'] * 1e3:.1f} ms | {row['bf16'] * 1e3:.1f} ms | {row['none'] / row['fp16']:.2f}× | "
            f"{row['none'] / row['bf16']:.2f}× |"
        )


def print_training_table(runs, links, link_gbits):
    print("\n### Training: model.fit, 64 images per rank, medians over rounds\n")
    print(
        "step: wall ms per step (slowest rank); CPU: CPU ms per step of a rank (all its threads), which "
        "other processes on the machine disturb far less; MPI: union of the timeline's allreduce phases "
        "per step; added: 2-host step - one-process step; requests: collectives negotiated per step "
        "(one grouped request per gradient bucket); E(2) = 2-host "
        "throughput / (2 x one process).\n"
    )
    print(
        "| model | parameters | link | gradient at link rate | 1 process step (CPU) | 2 hosts step (CPU) | "
        "MPI | added | requests | E(2) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in ARGS.models:
        mine = [r for r in runs if r["model"] == model]

        def median_of(selected, key):
            values = [r[key] for r in selected if r.get(key) is not None]
            return statistics.median(values) if values else float("nan")

        alone = [r for r in mine if r["link"] == "one process"]
        single_step, single_cpu = median_of(alone, "step_ms"), median_of(alone, "cpu_ms_per_step_per_rank")
        parameters = mine[0]["parameters"]
        for label, _ in links:
            two = [r for r in mine if r["link"] == label and r.get("configuration", "kerasdist") == "kerasdist"]
            step, cpu, comm = (
                median_of(two, "step_ms"),
                median_of(two, "cpu_ms_per_step_per_rank"),
                median_of(two, "communication_ms_per_step"),
            )
            requests = median_of(two, "requests_per_step")
            efficiency = median_of(two, "images_per_second") / (2 * median_of(alone, "images_per_second"))
            wire_ms = parameters * 4 * 8 / (link_gbits[label] * 1e9) * 1e3
            print(
                f"| {model} | {parameters:,} | {label} | {wire_ms:.1f} ms | {single_step:.1f} ({single_cpu:.1f}) | "
                f"{step:.1f} ({cpu:.1f}) | {comm:.1f} | {step - single_step:.1f} | {requests:.2f} | "
                f"{efficiency:.2f} |"
            )


def print_overlap_table(runs, links):
    print("\n### Overlap: how much of the communication a step still waits for\n")
    print(
        "apart: both hosts training plain Keras at once, never communicating (the compute a step "
        "needs here); MPI: union of the timeline's allreduce and allgather phases per step; exposed: "
        "step - apart; hidden share: 1 - exposed / MPI (target >= 0.5). Medians over rounds.\n"
    )
    print("| model | link | gradient buckets | apart | step | MPI | max(apart, MPI) | exposed | hidden share |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in ARGS.models:
        for label, _ in links:

            def step(configuration, key="step_ms", model=model, label=label):
                return median_over_rounds(runs, model, label, configuration, key)

            apart = step("no communication")
            for configuration in TWO_HOST_RUNS:
                on, comm = step(configuration), step(configuration, "communication_ms_per_step")
                if configuration == "no communication" or math.isnan(on):
                    continue  # the baseline, or not run (--configs)
                shown = "default (KERASDIST_BUCKET_BYTES)" if configuration == "kerasdist" else configuration
                print(
                    f"| {model} | {label} | {shown} | {apart:.1f} | {on:.1f} | {comm:.1f} | {max(apart, comm):.1f} | "
                    f"{on - apart:.1f} | {1 - (on - apart) / comm:.2f} |"
                )


def median_over_rounds(runs, model, label, configuration, key="step_ms"):
    """The median of ``key`` over the rounds of one 2-host configuration (NaN if it did not run)."""
    values = [
        r[key]
        for r in runs
        if r["model"] == model
        and r["link"] == label
        and r.get("configuration") == configuration
        and r.get(key) is not None
    ]
    return statistics.median(values) if values else float("nan")


# The slow-link methods as the methods table names them, in its order.
METHOD_COLUMNS = {
    "kerasdist": "synchronous",
    "fp16 gradients": "fp16",
    "delayed gradients": "delayed",
    "1-bit gradients": "1-bit",
    **{f"average every {n}": f"average every {n}" for n in ARGS.average_models_every},
    "no communication": "apart",
}


def print_methods_table(runs, links):
    print("\n### Slow-link methods: wall ms per step, MPI ms per step in brackets, medians over rounds\n")
    shown = [c for c in METHOD_COLUMNS if any(r.get("configuration") == c for r in runs)]
    print("| model | link | " + " | ".join(METHOD_COLUMNS[c] for c in shown) + " | one process |")
    print("|---|---|" + "---|" * (len(shown) + 1))
    for model in ARGS.models:
        alone = [r["step_ms"] for r in runs if r["model"] == model and r["link"] == "one process"]
        for index, (label, _) in enumerate(links):
            cells = []
            for configuration in shown:
                step = median_over_rounds(runs, model, label, configuration)
                comm = median_over_rounds(runs, model, label, configuration, "communication_ms_per_step")
                cells.append(f"{step:.1f}" + ("" if math.isnan(comm) else f" [{comm:.1f}]"))
            one_process = f"{statistics.median(alone):.1f}" if index == 0 and alone else ""
            print(f"| {model} | {label} | " + " | ".join(cells) + f" | {one_process} |")


def print_bucket_table(runs, links):
    print("\n### Gradient bucket sizes: collective requests and ms per step, medians over rounds\n")
    settings = {
        "buckets off": "0 (off)",
        "kerasdist": "auto",
        **{f"buckets {mb:g} MiB": f"{mb:g}" for mb in ARGS.bucket_mb},
    }
    print("| model | link | `--bucket-mb` | requests per step | step | MPI | exposed | hidden share |")
    print("|---|---|---|---|---|---|---|---|")
    for model in ARGS.models:
        for label, _ in links:
            apart = median_over_rounds(runs, model, label, "no communication")
            for configuration, shown in settings.items():
                step = median_over_rounds(runs, model, label, configuration)
                if math.isnan(step):
                    continue  # not run (--configs)
                requests = median_over_rounds(runs, model, label, configuration, "requests_per_step")
                comm = median_over_rounds(runs, model, label, configuration, "communication_ms_per_step")
                exposed = step - apart
                print(
                    f"| {model} | {label} | {shown} | {requests:.2f} | {step:.1f} | {comm:.1f} | "
                    + ("— | — |" if math.isnan(apart) else f"{exposed:.1f} | {1 - exposed / comm:.2f} |")
                )


def time_cell(seconds):
    """µs below a millisecond, else ms, 2-3 significant digits (as the pages' other phase tables);
    a phase the op never spent time in is "—" ("outside" is 0 when the engine's phases, a mean of
    the ranks, fill the slowest rank's time per op)."""
    if seconds <= 0:
        return "—"
    micros = seconds * 1e6
    if micros < 1000:
        return f"{micros:.1f} µs" if micros < 10 else f"{micros:.0f} µs"
    return f"{micros / 1e3:.2f} ms" if micros < 1e4 else f"{micros / 1e3:.1f} ms"


def print_phase_table(label, results):
    print(
        f"\n### {label}: where kerasdist's time per op goes (Sum), µs per op, mean of the two ranks: the "
        "engine thread's phases (kerasdist.engine_times()); outside: the rest of the op's wall time, — if none\n"
    )
    columns = ["raw MPI", "kerasdist", "negotiation", "transfer (MPI)", "hand back", "outputs + other"]
    print("| Sum | " + " | ".join(columns) + " | outside the engine |")
    print("|---|---|---|---|---|---|---|---|")
    for row in results["sizes"]:
        if row["op"] != "Sum":
            continue
        phases = row["phases_s"]
        rest = phases["outputs"] + phases["other"] + phases["copy_in"] + phases["slow_path"]
        cells = [row["raw_s"], row["ours_s"], phases["negotiation"], phases["transfer"], phases["hand_back"], rest]
        print(
            f"| {human(row['bytes'])} | " + " | ".join(time_cell(value) for value in [*cells, phases["outside"]]) + " |"
        )


def printed_tables(print_them, keys):
    """Runs ``print_them``, prints what it printed, and returns its markdown tables under ``keys``."""
    with contextlib.redirect_stdout(io.StringIO()) as text:
        print_them()
    print(text.getvalue(), end="")
    return dict(zip(keys, result_files.markdown_tables(text.getvalue())))


def main():
    run_header = result_files.start_run("network")
    started = run_header["date"]
    links = [(ARGS.rate.replace("gbit", " Gbit").replace("mbit", " Mbit"), ARGS.rate)]
    links += [] if "unshaped" in ARGS.skip else [("unshaped", UNSHAPED)]
    results = {"cpus": os.cpu_count(), "links": {}, "training": []}  # the header holds the date, in UTC
    with two_hosts(ARGS.job_timeout_s) as cluster:
        for label, rate in links:
            cluster.shape(rate)
            gbits = measure_link(cluster, rate)
            print(f"\n== {label} link: one TCP stream {gbits:.2f} Gbit/s (load {os.getloadavg()[0]:.1f})", flush=True)
            results["links"][label] = {"rate": rate, "tcp_gbits": gbits}
            if "allreduce" not in ARGS.skip:
                results["links"][label]["allreduce"] = bench_allreduce(cluster)
        if "training" not in ARGS.skip:
            results["training"] = bench_training(cluster, links)
    results["load_average_at_end"] = os.getloadavg()

    print(f"\n## kerasdist over a network, {started}, 2 emulated hosts x 1 rank, {os.cpu_count()} CPUs")
    link_gbits = {label: data["tcp_gbits"] for label, data in results["links"].items()}
    tables = {}
    for label, data in results["links"].items():
        if "allreduce" in data:
            tables.update(
                printed_tables(
                    lambda label=label, data=data: print_allreduce_tables(label, data["tcp_gbits"], data["allreduce"]),
                    [f"allreduce {label}", f"fusion {label}", f"compression {label}"],
                )
            )
            tables.update(
                printed_tables(
                    lambda label=label, data=data: print_phase_table(label, data["allreduce"]), [f"phases {label}"]
                )
            )
    if results["training"]:
        tables.update(
            printed_tables(lambda: print_training_table(results["training"], links, link_gbits), ["training"])
        )
        if "overlap" not in ARGS.skip:
            tables.update(printed_tables(lambda: print_overlap_table(results["training"], links), ["overlap"]))
        methods = set(METHOD_COLUMNS) - {"kerasdist", "no communication"}
        if any(r.get("configuration") in methods for r in results["training"]):
            tables.update(printed_tables(lambda: print_methods_table(results["training"], links), ["methods"]))
        if ARGS.bucket_mb:
            tables.update(printed_tables(lambda: print_bucket_table(results["training"], links), ["bucket sizes"]))
    path = result_files.write(ARGS.json, result_files.finish_run(run_header, **results, tables=tables))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
