"""Batch growth on two hosts over a 1 Gbit/s link: fixed batch vs noise-scale growth, in wall time
and gradient allreduces to a target accuracy (issue #21).

How to run (as root: the hosts are network namespaces; `make bench-net` runs it after
benchmarks/network.py):

  .venv/bin/python benchmarks/batch_growth_cluster.py           # 2 configurations x 3 seeds, ~12 min
  .venv/bin/python benchmarks/batch_growth_cluster.py --quick   # smoke version, well under a minute

It makes a 2-host cluster with scripts/netns_cluster.sh (benchmarks/emulated_hosts.py, as
benchmarks/network.py does; removed at the end, on Ctrl-C and on SIGTERM), shapes both directions
of each host's link to --link_rate (tc htb, 1gbit) and measures the link with one TCP stream.
Then, seed by seed, each configuration trains once as 2 ranks, one per host (kerasdist-run with
the cluster's launcher, UCX_TLS=tcp, one TensorFlow math thread per rank; every job under
`timeout` --job_timeout_s). The rank side is this script with --rank_side. It prints a results
table, a per-epoch timing table and the growth decisions (markdown), and writes a result file
(benchmarks/results.py) to --json (bench-results/batch_growth_cluster.json; `make bench-net`:
benchmarks/results/) with every run's epochs and the tables.

The task, model and recorder are those of benchmarks/batch_growth.py (the one-process
experiment), imported from it: the teacher-student MLP with a pool of 262,144 training rows,
epochs of 65,536 rows, 10 epochs, SGD with momentum 0.9 at the constant rate that experiment
tuned for batch 128 (--lr 0.1; not re-tuned here), a `kerasdist.GradientNoiseScale` on every run.
Here each rank takes its half of the pool (`kerasdist.data.shard`) and fits micro-batches of
--micro_batch (64) rows: the global batch starts at 64 x 2 ranks = 128 with
backward_passes_per_step k = 1, the same batch, rate and micro-batch as the one-process
experiment, so its tuning carries over; the cap is --max_batch (2,048, k = 16), as there.
(With 2 ranks the noise scale needs no accumulation: the two ranks' micro-batch gradients are
the small batch, their average the big one.)

Configurations
  fixed_small   k = 1 all along: global batch 128, 512 updates per epoch (the baseline).
  noise_scale   AdaptiveBatchGrowth(signal="noise_scale", factor 2, linear rate scaling, cap
                2,048, no safeguard): at each epoch end k doubles while 2 x batch <= B_noise.
                Raising k from 1 creates the accumulators and retraces the train step once
                (kerasdist documents it); that trace is in the wall time, as a user pays it.

Measured by rank 0 after every epoch (kerasdist's EpochRecorder of batch_growth.py): training
wall time since fit began, optimizer updates (`optimizer.iterations`: each update is one
allreduce of the gradients, carrying the noise statistics in the same grouped request; the
accumulating micro-batches in between do not communicate), global batch, rate, B_noise, and
validation and test accuracy. The evaluation runs on rank 0 outside the clock, and both ranks
then meet in a barrier whose wait is kept off the clock too, so that no rank waits for it
inside the next epoch's first allreduce. The clock does include the first trace, the growth
check and kerasdist's per-epoch metric averaging. The driver also times each whole job (launch,
imports, data generation, training, evaluation, exit).
Reported, medians over --seeds (3) seeds: updates and training seconds until the first epoch
end whose test accuracy reaches 95 % and 99 % of the baseline's final test accuracy (median
over seeds; epoch resolution, as in the one-process experiment), updates and seconds over all
epochs, job seconds, final batch, final test accuracy; and seconds per epoch at each batch.

Time: measured 2026-12-02 on this 2-vCPU machine, idle: a baseline job 64-70 s, a growth job
50-52 s, the whole run (6 jobs) 6 min; under another experiment's load about twice that. --quick
about 45 s. Table and reading in docs/experiments.md.
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

STARTED = time.perf_counter()  # before TensorFlow's import, which is much of a job's start-up
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import batch_growth  # noqa: E402  (the task, the model, the recorder and the summaries)
import results as result_files  # noqa: E402  (benchmarks/results.py)
from emulated_hosts import REPO, measure_link, two_hosts  # noqa: E402

CONFIGS = ("fixed_small", "noise_scale")
LABELS = {"fixed_small": "fixed batch 128 (baseline)", "noise_scale": "growth: noise scale"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link_rate", default="1gbit", help="tc rate of each host's link, or none (unshaped)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--pool", type=int, default=262144, help="training rows generated (both ranks together)")
    parser.add_argument("--epoch_rows", type=int, default=65536, help="rows per epoch, both ranks together")
    parser.add_argument("--micro_batch", type=int, default=64, help="rows per micro-batch on each rank")
    parser.add_argument("--max_batch", type=int, default=2048, help="cap on the grown global batch")
    parser.add_argument(
        "--lr", type=float, default=0.1, help="constant rate at the start batch (tuned in batch_growth.py)"
    )
    parser.add_argument("--lr_scaling", choices=("linear", "sqrt", "none"), default="linear")
    parser.add_argument(
        "--noise_safeguard",
        type=int,
        default=None,
        help="grow anyway after this many checks without growth (default: never)",
    )
    parser.add_argument("--width", type=int, default=256, help="student hidden width")
    parser.add_argument("--depth", type=int, default=3, help="student hidden layers")
    parser.add_argument("--job_timeout_s", type=int, default=600, help="bound on each 2-rank job")
    parser.add_argument(
        "--json",
        default=str(REPO / "bench-results" / "batch_growth_cluster.json"),
        help="the result file (benchmarks/results.py; `make bench-net`: benchmarks/results/)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 16,384 rows, epochs of 8,192, 3 epochs, width 64, 1 seed, cap 512, growth forced "
        "after every check without growth, 1,024 validation and test rows",
    )
    # The rank side, started by the driver inside the cluster.
    parser.add_argument("--rank_side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.pool, args.epoch_rows, args.epochs, args.seeds, args.width = 16384, 8192, 3, 1, 64
        args.max_batch, args.noise_safeguard = 512, 1
    if "fixed_small" not in args.configs:
        parser.error("--configs must include fixed_small: it defines the targets")
    # The rank side's names for what batch_growth.py's helpers read.
    args.curvature_samples = args.curvature_safeguard = None
    return args


def rank_argv(args, config, seed, out):
    """The rank side's command line for one run, carrying the driver's settings."""
    argv = [sys.executable, os.path.abspath(__file__), "--rank_side", "--config", config, "--seed", seed, "--out", out]
    for name in ("epochs", "pool", "epoch_rows", "micro_batch", "max_batch", "lr", "lr_scaling", "width", "depth"):
        argv += [f"--{name}", getattr(args, name)]
    if args.noise_safeguard is not None:
        argv += ["--noise_safeguard", args.noise_safeguard]
    if args.quick:
        argv.append("--quick")
    return [str(a) for a in argv]


# ---- the rank side ----------------------------------------------------------------------------


class EvaluationOffTheClock(batch_growth.EpochRecorder):
    """batch_growth's EpochRecorder on rank 0 (batch = micro-batch x ranks x k); on every rank a
    barrier after rank 0's evaluation, the time to reach it kept off the clock."""

    def __init__(self, data, micro_batch, rank):
        super().__init__(data, micro_batch)
        self.rank = rank

    def on_epoch_end(self, epoch, logs=None):
        untimed = self._untimed
        if self.rank == 0:
            super().on_epoch_end(epoch, logs)
        waited = time.perf_counter()
        batch_growth.kerasdist.barrier()
        self._untimed += time.perf_counter() - waited
        if self.rank == 0:
            self.rows[-1]["off_clock_seconds"] = round(self._untimed - untimed, 3)


def train_on_rank(args):
    kerasdist, keras = batch_growth.kerasdist, batch_growth.keras
    kerasdist.init()
    rank, size = kerasdist.rank(), kerasdist.size()
    data = batch_growth.load_task(args)  # every rank generates the same split, then takes its rows
    x, y = kerasdist.data.shard(data["train"])
    keras.utils.set_random_seed(args.seed)
    model = batch_growth.compile_student(args, args.lr, passes=1)
    growth = batch_growth.growth_callback(args.config, args.seed, x, y, args) if args.config != "fixed_small" else None
    recorder = EvaluationOffTheClock(data, args.micro_batch * size, rank)
    callbacks = kerasdist.callbacks(batch_growth=growth, extra=[keras.callbacks.TerminateOnNaN(), recorder])
    steps_per_epoch = args.epoch_rows // (args.micro_batch * size)
    fit_begin = time.perf_counter()
    batch_growth.fit_stream(model, x, y, args.seed, callbacks, args, steps_per_epoch)
    if rank == 0:
        run = batch_growth.run_record(args.config, args.seed, args.lr, args.lr, recorder, growth, args)
        run.update(
            ranks=size,
            micro_batches_per_epoch=steps_per_epoch,
            # rank 0's process: from its start to fit (imports, init, data, model), and in fit
            setup_seconds=round(fit_begin - STARTED, 1),
            fit_seconds=round(time.perf_counter() - fit_begin, 1),
        )
        pathlib.Path(args.out).write_text(json.dumps(batch_growth._finite(run), indent=1))


# ---- the driver -------------------------------------------------------------------------------


def say(*parts):
    print(*parts, flush=True)


def run_on_two_hosts(args, benchmark, headline, argv_for, record):
    """The driver of the cluster benchmarks (this one and slow_links_cluster.py): two emulated
    hosts joined by a link shaped to ``args.link_rate``, every configuration of ``args.configs``
    and seed of ``args.seeds`` one job (see interleaved_jobs). Prints ``headline(started, gbits)``
    first, then for every job what ``record(config, seed, written, job)`` returns, which keeps
    the run. Returns (the result file's header, the start as text, the link's measured Gbit/s,
    the wall seconds)."""
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    run_header = result_files.start_run(benchmark)
    begin = time.perf_counter()
    with two_hosts(args.job_timeout_s) as cluster:
        cluster.shape(args.link_rate)
        gbits = measure_link(cluster, args.link_rate)
        say(headline(started, gbits))
        for config, seed, written, job in interleaved_jobs(cluster, args.configs, args.seeds, argv_for):
            say(record(config, seed, written, job))
    return run_header, started, gbits, time.perf_counter() - begin


def write_results(args, run_header, out, tables):
    """Writes the result file (benchmarks/results.py) with ``tables`` laid out; returns its path."""
    laid_out = {key: result_files.markdown_tables(table)[0] for key, table in tables.items()}
    return result_files.write(args.json, result_files.finish_run(run_header, **out, tables=laid_out))


def interleaved_jobs(cluster, configs, seeds, argv_for):
    """Seed by seed, every configuration once, so that background load falls on all of them
    alike: runs ``argv_for(config, seed, out)`` on ``cluster`` and yields (config, seed, the JSON
    the rank side wrote to ``out``, {"job_seconds", "load_before", "load_after"}), the loads being
    the machine's load averages (1, 5 and 15 minutes) at the job's start and end."""
    with tempfile.TemporaryDirectory() as scratch:
        for seed in range(seeds):
            for config in configs:
                out = pathlib.Path(scratch, f"{config}-{seed}.json")
                load_before = os.getloadavg()
                job_begin = time.perf_counter()
                cluster.launch(argv_for(config, seed, out))
                written = json.loads(out.read_text())
                job = {"job_seconds": round(time.perf_counter() - job_begin, 1), "load_before": load_before}
                yield config, seed, written, {**job, "load_after": os.getloadavg()}


def epoch_timing(results):
    """Per configuration and global batch: the epochs trained at it, and the median seconds and
    updates of such an epoch. Apart: epoch 1 (the first trace of the train step and the initial
    broadcast) and a growth run's first epoch past the start batch (the retrace when k leaves 1)."""
    rows = []
    for config, r in results.items():
        by_kind = {}
        for run in r["runs"]:
            previous = {"seconds": 0.0, "steps": 0}
            start_batch = run["epochs"][0]["batch_size"]
            retraced = False
            for row in run["epochs"]:
                if row["epoch"] == 1:
                    kind = "1st (first trace)"
                elif row["batch_size"] != start_batch and not retraced:
                    kind, retraced = "first grown (retrace)", True
                else:
                    kind = "others"
                by_kind.setdefault((row["batch_size"], kind), []).append(
                    (row["seconds"] - previous["seconds"], row["steps"] - previous["steps"])
                )
                previous = row
        for (batch, kind), values in sorted(by_kind.items()):
            seconds = statistics.median(v[0] for v in values)
            updates = statistics.median(v[1] for v in values)
            rows.append(
                {
                    "config": config,
                    "epoch": kind,
                    "batch": batch,
                    "epochs": len(values),
                    "seconds": seconds,
                    "updates": updates,
                    "ms_per_update": 1e3 * seconds / updates,
                }
            )
    return rows


def results_table(results, targets, n_seeds):
    names = list(targets)
    lines = [
        "| configuration | final batch | "
        + " | ".join(f"updates to {n} | s to {n}".replace("%", " %") for n in names)  # as the page names them
        + " | updates (all) | s (all) | job s | final test acc, median [min, max] |",
        "|---|---:|" + "---:|---:|" * len(names) + "---:|---:|---:|---|",
    ]
    base = results["fixed_small"]["summary"]
    for config, r in results.items():
        s = r["summary"]
        cells = []
        for n in names:
            t, b = s["to_target"][n], base["to_target"][n]
            fewer = faster = ""
            if config != "fixed_small" and t["steps_median"] and b["steps_median"]:
                fewer = f" ({b['steps_median'] / t['steps_median']:.1f}x fewer)"
                faster = f" ({b['seconds_median'] / t['seconds_median']:.2f}x faster)"
            reached = f" [{t['reached']}/{n_seeds}]" if t["reached"] < n_seeds else ""
            cells += [
                f"{batch_growth._fmt(t['steps_median'], '.0f')}{fewer}{reached}",
                f"{batch_growth._fmt(t['seconds_median'], '.1f')}{faster}",
            ]
        div = f", {s['diverged_runs']} diverged" if s["diverged_runs"] else ""
        lines.append(
            f"| {LABELS[config]} | {s['final_batch_median']:.0f} | "
            + " | ".join(cells)
            + f" | {s['steps_median']:.0f} | {s['seconds_median']:.1f} | {s['job_seconds_median']:.0f} | "
            f"{s['test_acc_median']:.4f} [{s['test_acc_min']:.4f}, {s['test_acc_max']:.4f}]{div} |"
        )
    return "\n".join(lines)


def timing_table(rows):
    lines = [
        "| configuration | epoch | global batch | epochs | s per epoch (median) | updates per epoch | ms per update |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {LABELS[row['config']]} | {row['epoch']} | {row['batch']} | {row['epochs']} | {row['seconds']:.2f} | "
            f"{row['updates']:.0f} | {row['ms_per_update']:.1f} |"
        )
    return "\n".join(lines)


def main(args):
    results = {config: {"label": LABELS[config], "runs": []} for config in args.configs}

    def headline(started, gbits):
        return (
            f"{started}: 2 emulated hosts x 1 rank, link {args.link_rate} (one TCP stream {gbits:.2f} Gbit/s); "
            f"global batch {2 * args.micro_batch} at the start, cap {args.max_batch}; {args.epochs} epochs of "
            f"{args.epoch_rows} rows; {args.seeds} seed(s); load {os.getloadavg()[0]:.1f}"
        )

    def record(config, seed, run, job):
        run.update(job, load_before=job["load_before"][0], load_after=job["load_after"][0])
        results[config]["runs"].append(run)
        last = run["epochs"][-1]
        return (
            f"  seed {seed} {config:12s}: test {last['test_acc']:.4f}, {last['steps']} updates, final "
            f"batch {last['batch_size']}, training {last['seconds']:.1f} s (in fit "
            f"{run['fit_seconds']:.0f} s, before it {run['setup_seconds']:.0f} s), "
            f"job {run['job_seconds']:.0f} s "
            f"(load {run['load_before']:.1f} -> {run['load_after']:.1f})" + (" DIVERGED" if run["diverged"] else "")
        )

    run_header, started, gbits, wall = run_on_two_hosts(
        args, "batch_growth_cluster", headline, lambda c, s, out: rank_argv(args, c, s, out), record
    )

    baseline_final = statistics.median(r["epochs"][-1]["test_acc"] for r in results["fixed_small"]["runs"])
    targets = {f"{round(f * 100)}%": f * baseline_final for f in batch_growth.TARGET_FRACTIONS}
    for r in results.values():
        r["summary"] = batch_growth.summarise(r["runs"], targets)
        r["summary"]["job_seconds_median"] = statistics.median(run["job_seconds"] for run in r["runs"])
    timing = epoch_timing(results)
    say(
        f"\nResults (medians over {args.seeds} seed(s); training seconds on rank 0's clock, evaluation excluded; "
        "updates = gradient allreduces; targets: "
        + ", ".join(
            f"{n} of the baseline's final test accuracy {baseline_final:.4f} = {t:.4f}" for n, t in targets.items()
        )
        + "):\n"
    )
    say(results_table(results, targets, args.seeds))
    say("\nSeconds per epoch at each global batch (all seeds):\n")
    say(timing_table(timing))
    if "noise_scale" in results:
        say("\nGrowth decisions:\n")
        say(batch_growth.decisions_table(results, LABELS))
    out = {
        "started": started,  # the header's "date" (ISO, benchmarks/results.py) stays the run's date
        "config": {k: v for k, v in vars(args).items() if k not in ("rank_side", "config", "seed", "out")},
        "link_tcp_gbits": gbits,
        "baseline_final_test_acc": baseline_final,
        "targets": targets,
        "wall_seconds": round(wall, 1),
        "epoch_timing": timing,
        "results": results,
    }
    tables = {"results": results_table(results, targets, args.seeds), "timing": timing_table(timing)}
    path = write_results(args, run_header, out, tables)
    say(f"\nwall time {wall:.0f} s; wrote {path}")
    return out


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.rank_side:
        train_on_rank(ARGS)
    else:
        main(ARGS)
