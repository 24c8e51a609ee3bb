"""Training over a slow link: test accuracy against wall time, and at a fixed epoch budget, for
synchronous training, fp16 compression, delayed gradients, 1-bit gradients and model averaging
(issue #20), on two hosts over a 1 Gbit/s link.

How to run (as root: the hosts are network namespaces; `make bench-net` runs it last):

  .venv/bin/python benchmarks/slow_links_cluster.py           # 6 configurations x 3 seeds, ~26 min
  .venv/bin/python benchmarks/slow_links_cluster.py --quick   # smoke version, about 2.5 min

It makes a 2-host cluster as benchmarks/batch_growth_cluster.py does (benchmarks/emulated_hosts.py:
scripts/netns_cluster.sh, both directions of each host's link shaped to --link_rate, 1gbit, and
measured with one TCP stream; removed at the end, on Ctrl-C and on SIGTERM). Then, seed by seed,
every configuration trains once (seed 0: all configurations, then seed 1, ...: background load
falls on every configuration alike) as 2 ranks, one per host, through kerasdist-run with the
cluster's launcher, UCX_TLS=tcp, one TensorFlow math thread per rank, every job under `timeout`
--job_timeout_s. The machine's load averages are recorded at each job's start and end. The rank
side is this script with --rank_side (it can train several configurations in one job, one after
the other: the smoke test does so). It prints a results table and a per-seed table (markdown),
writes a result file (benchmarks/results.py) to --json (bench-results/slow_links_cluster.json;
--quick: ..._quick.json; `make bench-net`: benchmarks/results/) with every run's epochs, and draws --png
(docs/slow_links_accuracy.png; --quick: bench-results/slow_links_accuracy_quick.png).

The task, the model and the recorder are batch_growth_cluster.py's baseline (imported from it and
from batch_growth.py): the teacher-student MLP (3 x 256, BatchNorm, 142k parameters) on a pool of
262,144 rows, each rank its half (`kerasdist.data.shard`), epochs of --epoch_rows (65,536) rows,
micro-batches of --micro_batch (64) rows per rank: a global batch of 128 and 512 steps per epoch,
SGD with momentum 0.9 at the constant rate tuned for that batch (--lr 0.1), not re-tuned for any
configuration. Same epochs, data, seeds and rate for all.

Configurations (the optimizer is SGD(--lr, momentum=0.9) in all)
  synchronous  `DistributedOptimizer(sgd)`: one float32 gradient allreduce per step.
  fp16         `DistributedOptimizer(sgd, compression=kerasdist.Compression.fp16)`.
  delayed      `DistributedOptimizer(sgd, delay_gradients=True)`: each step applies the step
               before's gradients; the first step of the run applies nothing.
  one_bit      `DistributedOptimizer(sgd, one_bit_gradients=True)`: signs and a scale per tensor,
               with error feedback.
  average_4    the plain sgd and `kerasdist.callbacks(average_models_every=4)`: local SGD,
  average_16   weights and momenta averaged every 4 (16) steps and at each epoch's last step.

Measured by rank 0 after every epoch (batch_growth_cluster's EvaluationOffTheClock): training
wall seconds since fit began, with the evaluation on rank 0 and the barrier after it off the
clock; test and validation accuracy; optimizer updates (`optimizer.iterations`); for the
averaging configurations the averages made; and the bytes rank 0's host has sent since fit
began (its interfaces' transmit counters in /proc/net/dev, so TCP/IP headers and kerasdist's
negotiation are in; one rank per host here). Reported: final test accuracy (median over seeds,
and per seed), training seconds, and seconds to the first epoch end whose test accuracy reaches
95 % and 99 % of the synchronous configuration's final test accuracy (median over seeds; epoch
resolution), with medians counting a seed that never reaches it as infinitely late.

Time: measured 2026-12-03 on this 2-vCPU machine while another engineer's tests ran (load 2-8):
the full run (18 jobs of 6 epochs) 26 min, a job 37-169 s, of which 23-84 s training and 9-25 s
start-up before fit; --quick (6 jobs of 2 short epochs) about 2.5 min, 20-26 s a job. Under less
load expect less; the 6-epoch budget was chosen so that the run stays near 30 min under such
load. The smoke test (tests/multihost/test_slow_links_cluster.py) trains all six quick
configurations in one job, 20-30 s. Table and reading in docs/network.md.
"""

import argparse
import functools
import json
import math
import os
import pathlib
import statistics
import sys
import time

STARTED = time.perf_counter()  # before TensorFlow's import, which is much of a job's start-up
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import batch_growth  # noqa: E402  (the task, the model, fit_stream and the summaries)
import batch_growth_cluster  # noqa: E402  (the two-host driver; the recorder that keeps evaluation off the clock)
from emulated_hosts import REPO  # noqa: E402

CONFIGS = ("synchronous", "fp16", "delayed", "one_bit", "average_4", "average_16")
LABELS = {
    "synchronous": "synchronous",
    "fp16": "fp16 compression",
    "delayed": "delayed gradients",
    "one_bit": "1-bit gradients",
    "average_4": "model averaging every 4",
    "average_16": "model averaging every 16",
}
BASELINE = "synchronous"


def averaging_window(config):
    """The averaging window of an average_N configuration, else None."""
    return int(config.split("_")[1]) if config.startswith("average_") else None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--link_rate", default="1gbit", help="tc rate of each host's link, or none (unshaped)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--pool", type=int, default=262144, help="training rows generated (both ranks together)")
    parser.add_argument("--epoch_rows", type=int, default=65536, help="rows per epoch, both ranks together")
    parser.add_argument("--micro_batch", type=int, default=64, help="rows per step on each rank")
    parser.add_argument("--lr", type=float, default=0.1, help="constant rate of every configuration")
    parser.add_argument("--width", type=int, default=256, help="student hidden width")
    parser.add_argument("--depth", type=int, default=3, help="student hidden layers")
    parser.add_argument("--job_timeout_s", type=int, default=600, help="bound on each 2-rank job")
    parser.add_argument("--json", default=None, help="default: bench-results/slow_links_cluster[_quick].json")
    parser.add_argument("--png", default=None, help="the plot (default: docs/slow_links_accuracy.png)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 16,384 rows, epochs of 4,096, 2 epochs, width 64, 1 seed, 1,024 validation and test rows",
    )
    parser.add_argument(
        "--report", metavar="JSON", help="no run: print the tables of a run's --json and draw its plot to --png"
    )
    # The rank side, started by the driver inside the cluster (or by the smoke test).
    parser.add_argument("--rank_side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", nargs="+", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.pool, args.epoch_rows, args.epochs, args.seeds, args.width = 16384, 4096, 2, 1, 64
    if args.json is None:
        args.json = str(REPO / "bench-results" / f"slow_links_cluster{'_quick' if args.quick else ''}.json")
    if args.png is None:
        quick = REPO / "bench-results" / "slow_links_accuracy_quick.png"
        args.png = str(quick if args.quick else REPO / "docs" / "slow_links_accuracy.png")
    if BASELINE not in args.configs:
        parser.error(f"--configs must include {BASELINE}: it defines the targets")
    return args


def rank_argv(args, configs, seed, out):
    """The rank side's command line for the runs of ``configs`` (one after the other, one job)."""
    argv = [sys.executable, os.path.abspath(__file__), "--rank_side", "--config", *configs]
    argv += ["--seed", seed, "--out", out]
    for name in ("epochs", "pool", "epoch_rows", "micro_batch", "lr", "width", "depth"):
        argv += [f"--{name}", getattr(args, name)]
    if args.quick:
        argv.append("--quick")
    return [str(a) for a in argv]


# ---- the rank side ----------------------------------------------------------------------------


def sent_bytes():
    """Bytes sent so far by this network namespace's interfaces other than loopback (in the
    cluster: this host's link)."""
    total = 0
    for line in pathlib.Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, counters = line.split(":", 1)
        if name.strip() != "lo":
            total += int(counters.split()[8])
    return total


def make_optimizer(config, rate):
    """The optimizer of ``config``: SGD with momentum 0.9, wrapped or not (averaging)."""
    kerasdist, keras = batch_growth.kerasdist, batch_growth.keras
    sgd = keras.optimizers.SGD(rate, momentum=0.9)
    if averaging_window(config):
        return sgd  # ModelAveraging refuses a DistributedOptimizer
    options = {
        "synchronous": {},
        "fp16": {"compression": kerasdist.Compression.fp16},
        "delayed": {"delay_gradients": True},
        "one_bit": {"one_bit_gradients": True},
    }[config]
    return kerasdist.DistributedOptimizer(sgd, **options)


class SlowLinkRecorder(batch_growth_cluster.EvaluationOffTheClock):
    """The recorder of batch_growth_cluster (evaluation and barrier off the clock), adding to
    rank 0's epoch rows the bytes its host has sent since fit began and, when averaging, the
    averages made so far."""

    def __init__(self, data, global_batch, rank, averaging=None):
        super().__init__(data, global_batch, rank)
        self.averaging = averaging

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._sent_at_begin = sent_bytes()

    def on_epoch_end(self, epoch, logs=None):
        sent = sent_bytes() - self._sent_at_begin  # before the evaluation's barrier
        super().on_epoch_end(epoch, logs)
        if self.rank == 0:
            self.rows[-1]["sent_bytes"] = sent
            self.rows[-1]["averages"] = self.averaging.averages if self.averaging else None


def train_on_rank(args):
    kerasdist, keras = batch_growth.kerasdist, batch_growth.keras
    kerasdist.init()
    rank, size = kerasdist.rank(), kerasdist.size()
    data = batch_growth.load_task(args)  # every rank generates the same split, then takes its rows
    x, y = kerasdist.data.shard(data["train"])
    steps_per_epoch = args.epoch_rows // (args.micro_batch * size)
    runs = []
    for config in args.config:
        keras.utils.set_random_seed(args.seed)
        model = batch_growth.compile_with(args, functools.partial(make_optimizer, config, args.lr))
        recorder = SlowLinkRecorder(data, args.micro_batch * size, rank)
        callbacks = kerasdist.callbacks(
            average_models_every=averaging_window(config), extra=[keras.callbacks.TerminateOnNaN(), recorder]
        )
        recorder.averaging = next((c for c in callbacks if isinstance(c, kerasdist.callbacks.ModelAveraging)), None)
        fit_begin = time.perf_counter()
        batch_growth.fit_stream(model, x, y, args.seed, callbacks, args, steps_per_epoch)
        if rank == 0:
            run = batch_growth.run_record(config, args.seed, args.lr, args.lr, recorder, None, args)
            run.update(
                ranks=size,
                steps_per_epoch=steps_per_epoch,
                averaging_window=averaging_window(config),
                parameters=int(sum(math.prod(w.shape) for w in model.trainable_weights)),
                # rank 0's process: from its start to the first fit (imports, init, data), and in fit
                setup_seconds=round(fit_begin - STARTED, 1) if not runs else None,
                fit_seconds=round(time.perf_counter() - fit_begin, 1),
            )
            runs.append(run)
    if rank == 0:
        pathlib.Path(args.out).write_text(json.dumps(batch_growth._finite(runs), indent=1))


# ---- the driver -------------------------------------------------------------------------------


def _loads(runs):
    return " / ".join(f"{run['load_before'][0]:.1f}" for run in runs)


def results_table(results, targets, n_seeds):
    """Final accuracy (median and per seed), seconds, seconds to the targets, updates, bytes."""
    names = list(targets)
    seeds = " / ".join(str(s) for s in range(n_seeds))
    lines = [
        f"| configuration | final test acc, median | per seed ({seeds}) | training s, median | "
        + " | ".join(f"s to {n.replace('%', ' %')}" for n in names)  # the page's and render.py's names
        + " | updates | MB sent per epoch | load at job start (per seed) |",
        "|---|---:|---|---:|" + "---:|" * len(names) + "---:|---:|---|",
    ]
    base = results[BASELINE]["summary"]
    for config, r in results.items():
        s = r["summary"]
        per_seed = " / ".join(f"{run['epochs'][-1]['test_acc']:.4f}" for run in r["runs"])
        seconds = f"{s['seconds_median']:.1f}"
        if config != BASELINE:
            seconds += f" ({base['seconds_median'] / s['seconds_median']:.2f}x as fast)"
        cells = []
        for n in names:
            t = s["to_target"][n]
            reached = f" [{t['reached']}/{n_seeds}]" if t["reached"] < n_seeds else ""
            cells.append(f"{batch_growth._fmt(t['seconds_median'], '.1f')}{reached}")
        megabytes = statistics.median(run["epochs"][-1]["sent_bytes"] / len(run["epochs"]) / 1e6 for run in r["runs"])
        div = f", {s['diverged_runs']} diverged" if s["diverged_runs"] else ""
        lines.append(
            f"| {LABELS[config]} | {s['test_acc_median']:.4f}{div} | {per_seed} | {seconds} | "
            + " | ".join(cells)
            + f" | {s['steps_median']:.0f} | {megabytes:.1f} | {_loads(r['runs'])} |"
        )
    return "\n".join(lines)


def epochs_table(results):
    """Per configuration and epoch: median (over seeds) training seconds and test accuracy."""
    epochs = len(next(iter(results.values()))["runs"][0]["epochs"])
    lines = [
        "| configuration | " + " | ".join(f"epoch {e + 1}" for e in range(epochs)) + " |",
        "|---|" + "---|" * epochs,
    ]
    for config, r in results.items():
        cells = []
        for e in range(epochs):
            rows = [run["epochs"][e] for run in r["runs"] if len(run["epochs"]) > e]
            cells.append(
                f"{statistics.median(x['seconds'] for x in rows):.0f} s: "
                f"{statistics.median(x['test_acc'] for x in rows):.4f}"
            )
        lines.append(f"| {LABELS[config]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def median_curve(runs):
    """(seconds, accuracy) per epoch: the medians over seeds of each epoch's training seconds and
    test accuracy (over the seeds that reached the epoch)."""
    epochs = max(len(run["epochs"]) for run in runs)
    points = []
    for e in range(epochs):
        rows = [run["epochs"][e] for run in runs if len(run["epochs"]) > e]
        points.append((statistics.median(r["seconds"] for r in rows), statistics.median(r["test_acc"] for r in rows)))
    return points


def save_plot(results, targets, args, gbits, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_time, ax_epoch) = plt.subplots(1, 2, figsize=(13, 5.2))
    colors = dict(zip(CONFIGS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for config, r in results.items():
        for run in r["runs"]:
            rows = run["epochs"]
            faint = dict(color=colors[config], lw=0.7, alpha=0.35, marker=".", ms=3)
            ax_time.plot([0] + [x["seconds"] for x in rows], [None] + [x["test_acc"] for x in rows], **faint)
            ax_epoch.plot([x["epoch"] for x in rows], [x["test_acc"] for x in rows], **faint)
        curve = median_curve(r["runs"])
        strong = dict(color=colors[config], lw=1.8, marker="o", ms=4, label=LABELS[config])
        ax_time.plot([p[0] for p in curve], [p[1] for p in curve], **strong)
        ax_epoch.plot(range(1, len(curve) + 1), [p[1] for p in curve], **strong)
    for ax in (ax_time, ax_epoch):
        for (name, target), ls in zip(targets.items(), (":", "--")):
            ax.axhline(target, color="grey", ls=ls, lw=0.8, label=f"{name} of synchronous final = {target:.3f}")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    ax_time.set(xlabel="training wall time (s, evaluation excluded)", title="Test accuracy vs wall-clock time")
    ax_epoch.set(xlabel="epoch", title="Test accuracy vs epoch")
    ax_time.legend(fontsize=8, loc="lower right")
    seeds = len(next(iter(results.values()))["runs"])
    fig.suptitle(
        f"2 emulated hosts x 1 rank over a {args.link_rate} link (one TCP stream {gbits:.2f} Gbit/s), hosts sharing "
        f"2 vCPUs; teacher-student MLP {args.depth} x {args.width}, global batch {2 * args.micro_batch}, "
        f"SGD momentum 0.9 at {args.lr:g}\n"
        f"{args.epochs} epochs of {args.epoch_rows} rows; thick: median over {seeds} seed(s) of each epoch's "
        "seconds and accuracy, faint: each seed",
        fontsize=9,
    )
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(args):
    results = {config: {"label": LABELS[config], "runs": []} for config in args.configs}

    def headline(started, gbits):
        return (
            f"{started}: 2 emulated hosts x 1 rank, link {args.link_rate} (one TCP stream {gbits:.2f} Gbit/s); "
            f"global batch {2 * args.micro_batch}, rate {args.lr:g}; {args.epochs} epochs of {args.epoch_rows} rows; "
            f"{args.seeds} seed(s); load {' '.join(f'{v:.1f}' for v in os.getloadavg())}"
        )

    def record(config, seed, written, job):
        (run,) = written
        run.update(job)
        results[config]["runs"].append(run)
        last = run["epochs"][-1]
        return (
            f"  seed {seed} {config:12s}: test {last['test_acc']:.4f}, {last['steps']} updates, "
            f"training {last['seconds']:.1f} s, sent {last['sent_bytes'] / 1e6:.1f} MB, job "
            f"{run['job_seconds']:.0f} s (load {run['load_before'][0]:.1f} -> {run['load_after'][0]:.1f})"
            + (" DIVERGED" if run["diverged"] else "")
        )

    run_header, started, gbits, wall = batch_growth_cluster.run_on_two_hosts(
        args, "slow_links_cluster", headline, lambda c, s, out: rank_argv(args, [c], s, out), record
    )
    out = {
        "started": started,  # the header's "date" (ISO, benchmarks/results.py) stays the run's date
        "config": {k: v for k, v in vars(args).items() if k not in ("rank_side", "config", "seed", "out", "report")},
        "link_tcp_gbits": gbits,
        "wall_seconds": round(wall, 1),
        "load_at_end": os.getloadavg(),
        "results": results,
    }
    plotted = report(out, args.png, batch_growth_cluster.say)
    tables = {"results": results_table(results, out["targets"], args.seeds), "epochs": epochs_table(results)}
    path = batch_growth_cluster.write_results(args, run_header, out, tables)
    batch_growth_cluster.say(
        f"\nwall time {wall:.0f} s; wrote {path}" + (f" and {args.png}" if plotted else " (no matplotlib: no plot)")
    )
    return out


def report(out, png, say):
    """Adds the targets and each configuration's summary to ``out`` (a run's JSON), prints the
    tables and draws the plot to ``png``; returns whether it could draw."""
    config, results = argparse.Namespace(**out["config"]), out["results"]
    baseline_final = statistics.median(r["epochs"][-1]["test_acc"] for r in results[BASELINE]["runs"])
    targets = {f"{round(f * 100)}%": f * baseline_final for f in batch_growth.TARGET_FRACTIONS}
    for r in results.values():
        r["summary"] = batch_growth.summarise(r["runs"], targets)
    out.update(baseline_final_test_acc=baseline_final, targets=targets)
    say(
        f"\nResults ({config.epochs} epochs; medians over {config.seeds} seed(s); training seconds on rank 0's clock, "
        "evaluation excluded; targets: "
        + ", ".join(
            f"{n} of synchronous's final test accuracy {baseline_final:.4f} = {t:.4f}" for n, t in targets.items()
        )
        + "; MB sent per epoch by rank 0's host; 1-minute load average at each job's start):\n"
    )
    say(results_table(results, targets, config.seeds))
    say("\nTraining seconds of each run, and the 1-minute load average at its job's start and end:\n")
    say(seconds_table(results, config.seeds))
    say("\nMedian training seconds and test accuracy at each epoch's end:\n")
    say(epochs_table(results))
    return save_plot(results, targets, config, out["link_tcp_gbits"], png)


def seconds_table(results, n_seeds):
    lines = [
        "| configuration | " + " | ".join(f"seed {s}: s (load)" for s in range(n_seeds)) + " |",
        "|---|" + "---:|" * n_seeds,
    ]
    for config, r in results.items():
        cells = [
            f"{run['epochs'][-1]['seconds']:.1f} ({run['load_before'][0]:.1f} -> {run['load_after'][0]:.1f})"
            for run in r["runs"]
        ]
        lines.append(f"| {LABELS[config]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.rank_side:
        train_on_rank(ARGS)
    elif ARGS.report:
        report(json.loads(pathlib.Path(ARGS.report).read_text()), ARGS.png, batch_growth_cluster.say)
    else:
        main(ARGS)
