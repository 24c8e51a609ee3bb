"""Large-batch training at a fixed epoch budget: scaled SGD, warmup, LARS, LARC and LAMB.

How to run (one process per training; the large batch is simulated, no MPI):

  .venv/bin/python benchmarks/large_batch.py --jobs 2   # full run: 32x and 64x, 66 trainings
  .venv/bin/python benchmarks/large_batch.py --quick    # smoke version, about a minute
  .venv/bin/python benchmarks/large_batch.py --replot bench-results/large_batch.json

The first experiment (16x, issue #4; its table is in docs/experiments.md) is this script with
  --batch_scales 16 --n_train 65536 --epochs 10 --warmup_epochs 2 \
  --methods sgd_small sgd_scaled sgd_scaled_warmup lars lamb

Each training runs on one TensorFlow thread; --jobs N trains N at a time in worker processes
(results do not depend on N: every training is seeded). It prints the tuning table and the
results table (markdown), writes a result file (benchmarks/results.py) to --json (default
<out_dir>/large_batch.json; docs/experiments.md shows benchmarks/results/large_batch.json and
large_batch_16x.json, and benchmarks/render.py --plots draws the pages' plots from them) and, when
matplotlib is installed, <out_dir>/large_batch.png (--out_dir defaults to bench-results/).

The task (generated, offline, fixed by --data_seed)
  Inputs x ~ N(0, I) in --dim (32) dimensions. A fixed random "teacher" MLP
  dim -> 32 -> 32 -> 10 (--teacher_widths; ReLU, He-normal weights, N(0, 0.1^2)
  biases) gives logits; each class's logit is standardised over the whole
  generated pool (so the 10 classes are about equally frequent: 7-13 %) and the
  label is the argmax. Then --label_noise (5 %) of the labels, in every split,
  are replaced by a uniformly drawn class, so the best possible accuracy is
  1 - 0.05 * 9/10 = 0.955. Splits: --n_train (262,144) train, 8,192 validation
  (for tuning only), 16,384 test.
  Why this size: the teacher was made small once, because a first design (dim
  64, teacher 64 -> 128 -> 128 -> 10) was limited by the sample, not by
  optimisation (every method, tuned, ended at 0.56-0.58). The 262,144 training
  rows make the 64x batch (8,192) 1/32 of an epoch, the fraction the 16x batch
  had of 65,536 rows, and near ImageNet's at a batch of 32k (1/39): an epoch
  still holds 32 updates, so the large batches are short of steps, as in the
  papers, but each batch is still a small sample of the data.

The student and the budget
  MLP dim -> 3 x [Dense(256, no bias) -> BatchNorm -> ReLU] -> Dense(10), softmax
  cross-entropy, no weight decay for any method (only the update rule differs).
  Every run gets the same --epochs (5) over the training set, and the same
  schedule shape: cosine decay of the rate to 0 over the whole budget; runs
  with warmup first ramp it linearly, per step, over --warmup_epochs (1).
  Small batch 128 (10,240 steps); large batches 128 x k for each k in
  --batch_scales (32, 64): 4,096 (320 steps) and 8,192 (160 steps).

The methods (k = batch scale)
  sgd_small          baseline: SGD (momentum 0.9) at batch 128, rate = base.
  sgd_scaled         SGD (momentum 0.9) at batch 128k, rate = k x base (linear
                     scaling rule, Goyal et al. 2017), no warmup.
  sgd_scaled_warmup  as above, with Goyal's gradual warmup from base to k x base.
  lars               kerasdist.optimizers.LARS at batch 128k: momentum 0.9,
                     trust coefficient 0.001 (the paper's default), no weight
                     decay, warmup from peak/k to the peak rate.
  larc               kerasdist.optimizers.LARC (clip mode, trust coefficient
                     0.02, Apex's defaults) around sgd_scaled_warmup's SGD: the
                     same base rates, k x base at the peak, the same warmup;
                     each layer moves at min(its trust ratio rate, the global
                     rate).
  lamb               kerasdist.optimizers.LAMB at batch 128k: beta_1 0.9,
                     beta_2 0.999, eps 1e-6 (the paper's defaults), no weight
                     decay, warmup from peak/k to the peak rate.
  LARS, LARC and LAMB get warmup because their papers and users train with it.

The tuning budget (equal: 4 rates per method and batch, nothing else tuned)
  A grid of 4 rates, a factor of 3 apart, per method (see GRIDS): the base
  (batch-128) rate for the SGD methods and LARC, the peak rate for LARS and
  LAMB. Each grid point is trained once with seed 0; the rate with the best
  final validation accuracy is chosen, then run with seeds 1 .. --seeds-1 as
  well (seed 0's run is reused). Reported: final test accuracy, median [min,
  max] over the seeds. The test set is never used for choosing.

Two test accuracies per run
  "test acc" is the model as trained, evaluated the Keras way (BatchNorm uses
  its moving statistics, momentum 0.99, so they average over the last ~100
  steps, which at a large batch span epochs in which the weights still move).
  "BN recomputed" evaluates the same final model after replacing every
  BatchNorm's moving mean and variance by statistics of the first 16,384
  training examples, which removes that lag. Training and the choice of rate
  are the same for both.

Not done: Goyal's momentum correction (scaling the velocity when the rate
jumps); the warmup ramp changes the rate smoothly per step, so it is left out.
"""

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import results as result_files  # noqa: E402  (benchmarks/results.py, beside this script)
import tensorflow as tf  # noqa: E402

from kerasdist.optimizers import LAMB, LARC, LARS  # noqa: E402

BASELINE = "sgd_small"
LARGE_BATCH_METHODS = ("sgd_scaled", "sgd_scaled_warmup", "lars", "larc", "lamb")
METHODS = (BASELINE,) + LARGE_BATCH_METHODS
LABELS = {
    "sgd_small": "SGD, small batch (baseline)",
    "sgd_scaled": "SGD + linear scaling",
    "sgd_scaled_warmup": "SGD + linear scaling + warmup",
    "lars": "LARS + warmup",
    "larc": "LARC (clip) + linear scaling + warmup",
    "lamb": "LAMB + warmup",
}
# Four rates a factor of 3 apart around each method's customary value. SGD and LARC: the base
# (small-batch) rate, multiplied by the batch scale at the large batch. LARS, LAMB: the peak rate
# at the large batch.
SGD_BASE_GRID = [0.01, 0.03, 0.1, 0.3]
GRIDS = {
    "sgd_small": SGD_BASE_GRID,
    "sgd_scaled": SGD_BASE_GRID,
    "sgd_scaled_warmup": SGD_BASE_GRID,
    "lars": [1.0, 3.0, 10.0, 30.0],
    "larc": SGD_BASE_GRID,
    "lamb": [0.001, 0.003, 0.01, 0.03],
}
SCALED_BASE_RATE = ("sgd_scaled", "sgd_scaled_warmup", "larc")
CLASSES = 10


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5, help="epoch budget of every run")
    parser.add_argument(
        "--seeds", type=int, default=3, help="seeds per chosen configuration (seed 0 is also the tuning seed)"
    )
    parser.add_argument("--warmup_epochs", type=float, default=1.0)
    parser.add_argument("--small_batch", type=int, default=128)
    parser.add_argument(
        "--batch_scales", type=int, nargs="+", default=[32, 64], help="large batches, as multiples of the small one"
    )
    parser.add_argument("--n_train", type=int, default=262144)
    parser.add_argument("--n_val", type=int, default=8192)
    parser.add_argument("--n_test", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument(
        "--teacher_widths", type=int, nargs="*", default=[32, 32], help="hidden widths of the random teacher MLP"
    )
    parser.add_argument("--width", type=int, default=256, help="student hidden width")
    parser.add_argument("--depth", type=int, default=3, help="student hidden layers")
    parser.add_argument("--label_noise", type=float, default=0.05)
    parser.add_argument("--data_seed", type=int, default=1234)
    parser.add_argument(
        "--grid_points", type=int, default=None, help="use only the first N rates of each grid (default: all)"
    )
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow intra-op threads per training")
    parser.add_argument("--jobs", type=int, default=1, help="trainings run at once, in worker processes")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (about a minute); overrides the sizes: 8k examples, width 64, "
        "batch 16 vs 128 and 256, 2 epochs, 2 rates per grid, 1 seed",
    )
    parser.add_argument("--out_dir", default="bench-results")
    parser.add_argument(
        "--json",
        default=None,
        help="the result file (benchmarks/results.py; default <out_dir>/large_batch.json; "
        "benchmarks/results/large_batch.json is the one docs/experiments.md shows)",
    )
    parser.add_argument(
        "--replot",
        metavar="JSON",
        default=None,
        help="train nothing: print the tables and redraw the plot of a saved JSON",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.n_train, args.n_val, args.n_test = 8192, 1024, 1024
        args.small_batch, args.batch_scales, args.epochs, args.warmup_epochs = 16, [8, 16], 2, 0.5
        args.seeds, args.width = 1, 64
        args.grid_points = args.grid_points or 2
    if min(args.batch_scales) < 2:
        parser.error(f"--batch_scales must all be >= 2; got {args.batch_scales}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1; got {args.jobs}")
    return args


class GradualWarmupCosineDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Goyal et al.'s gradual warmup, then cosine decay to 0 over the rest of the budget.

    For step `t` (from 0): `start + (peak - start) * t / warmup_steps` while `t < warmup_steps`,
    then `peak * (1 + cos(pi * (t - warmup_steps) / (total_steps - warmup_steps))) / 2`. With
    `warmup_steps = 0` it is plain cosine decay from `peak`.
    """

    def __init__(self, peak, start, warmup_steps, total_steps):
        self.peak = float(peak)
        self.start = float(start)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)

    def __call__(self, step):
        t = keras.ops.cast(step, "float32")
        warm = max(self.warmup_steps, 1)
        ramp = self.start + (self.peak - self.start) * t / warm
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        progress = keras.ops.clip((t - self.warmup_steps) / decay_steps, 0.0, 1.0)
        cosine = self.peak * 0.5 * (1.0 + keras.ops.cos(math.pi * progress))
        return keras.ops.where(t < self.warmup_steps, ramp, cosine)

    def get_config(self):
        return {
            "peak": self.peak,
            "start": self.start,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
        }


def make_teacher_task(args):
    """(x, y) for train, val and test: labels from a fixed random teacher MLP, with label noise."""
    rng = np.random.default_rng(args.data_seed)
    n = args.n_train + args.n_val + args.n_test
    x = rng.standard_normal((n, args.dim)).astype("float32")
    h = x
    for fan_out in args.teacher_widths:
        w = rng.standard_normal((h.shape[1], fan_out)) * math.sqrt(2.0 / h.shape[1])
        h = np.maximum(h @ w + 0.1 * rng.standard_normal(fan_out), 0.0)
    logits = h @ rng.standard_normal((h.shape[1], CLASSES)) + 0.1 * rng.standard_normal(CLASSES)
    # Standardise each class's logit so that no class dominates the argmax.
    logits = (logits - logits.mean(axis=0)) / logits.std(axis=0)
    y = logits.argmax(axis=1)
    noisy = rng.random(n) < args.label_noise
    y[noisy] = rng.integers(0, CLASSES, noisy.sum())
    y = y.astype("int32")
    cuts = np.cumsum([args.n_train, args.n_val])
    return {name: (xs, ys) for name, xs, ys in zip(("train", "val", "test"), np.split(x, cuts), np.split(y, cuts))}


def build_student(args):
    layers = [keras.Input((args.dim,))]
    for _ in range(args.depth):
        layers += [
            keras.layers.Dense(args.width, use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
        ]
    layers.append(keras.layers.Dense(CLASSES))
    return keras.Sequential(layers)


def make_optimizer(method, rate, scale, steps_per_epoch, args):
    """The optimizer of `method` at grid value `rate` and batch scale `scale`, with its schedule
    over the whole budget."""
    k = scale
    total = args.epochs * steps_per_epoch
    warmup = int(round(args.warmup_epochs * steps_per_epoch))
    if method == "sgd_small":
        schedule = GradualWarmupCosineDecay(rate, rate, 0, total)
    elif method == "sgd_scaled":
        schedule = GradualWarmupCosineDecay(k * rate, k * rate, 0, total)
    else:  # warmup from the small-batch rate (SGD, LARC) or peak / k (LARS, LAMB) to the peak
        peak = k * rate if method in SCALED_BASE_RATE else rate
        schedule = GradualWarmupCosineDecay(peak, peak / k, warmup, total)
    if method.startswith("sgd"):
        return keras.optimizers.SGD(schedule, momentum=0.9)
    if method == "larc":
        return LARC(keras.optimizers.SGD(schedule, momentum=0.9), trust_coefficient=0.02, mode="clip")
    if method == "lars":
        return LARS(schedule, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001)
    return LAMB(schedule, beta_1=0.9, beta_2=0.999, epsilon=1e-6, weight_decay=0.0)


def accuracy(model, x, y):
    logits = np.concatenate(
        [keras.ops.convert_to_numpy(model(x[i : i + 8192], training=False)) for i in range(0, len(x), 8192)]
    )
    return float(np.mean(logits.argmax(axis=1) == y))


def recompute_batchnorm_statistics(model, x):
    """Sets every BatchNorm's moving mean and variance to the statistics of `x` (one batch)."""
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    momenta = [layer.momentum for layer in norms]
    for layer in norms:
        layer.momentum = 0.0  # moving = momentum * moving + (1 - momentum) * batch statistic
    model(x, training=True)
    for layer, momentum in zip(norms, momenta):
        layer.momentum = momentum


class EpochAccuracies(keras.callbacks.Callback):
    """Records validation and test accuracy after every epoch."""

    def __init__(self, data):
        super().__init__()
        self.data = data
        self.val, self.test = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.val.append(accuracy(self.model, *self.data["val"]))
        self.test.append(accuracy(self.model, *self.data["test"]))


def train(method, scale, rate, seed, data, args):
    """One run; returns its final accuracies and per-epoch curves."""
    keras.utils.set_random_seed(seed)
    batch = args.small_batch * scale
    x, y = data["train"]
    steps_per_epoch = math.ceil(len(x) / batch)
    model = build_student(args)
    model.compile(
        optimizer=make_optimizer(method, rate, scale, steps_per_epoch, args),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    recorder = EpochAccuracies(data)
    start = time.perf_counter()
    history = model.fit(
        x, y, batch_size=batch, epochs=args.epochs, verbose=0, callbacks=[keras.callbacks.TerminateOnNaN(), recorder]
    )
    seconds = time.perf_counter() - start
    loss = [float(v) for v in history.history["loss"]]
    diverged = not all(math.isfinite(v) for v in loss) or len(loss) < args.epochs
    # A run stopped on NaN keeps its last (broken) model's accuracies for the remaining epochs.
    for curve in (loss, recorder.val, recorder.test):
        curve += [curve[-1]] * (args.epochs - len(curve))
    recomputed = recorder.test[-1]
    if not diverged:  # after the curves: this changes the model's moving statistics
        recompute_batchnorm_statistics(model, x[:16384])
        recomputed = accuracy(model, *data["test"])
    return {
        "seed": seed,
        "rate": rate,
        "batch_size": batch,
        "steps": steps_per_epoch * args.epochs,
        "val_acc": recorder.val[-1],
        "test_acc": recorder.test[-1],
        "test_acc_bn_recomputed": recomputed,
        "diverged": diverged,
        "seconds": round(seconds, 1),
        "curves": {
            "train_loss": [v if math.isfinite(v) else None for v in loss],
            "val_acc": recorder.val,
            "test_acc": recorder.test,
        },
    }


# A worker process's task and arguments, made once by `_start_worker`.
_worker = {}


def _start_worker(args):
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    _worker["args"] = args
    _worker["data"] = make_teacher_task(args)


def _train_in_worker(job):
    return train(*job, _worker["data"], _worker["args"])


def train_all(jobs, args, pool, say):
    """Trains every (method, scale, rate, seed) of `jobs`; returns {job: run}, reporting each."""
    done = {}
    if pool is None:
        futures = None
        outcomes = ((job, _train_in_worker(job)) for job in jobs)
    else:
        futures = {pool.submit(_train_in_worker, job): job for job in jobs}
        outcomes = ((futures[f], f.result()) for f in concurrent.futures.as_completed(futures))
    for job, run in outcomes:
        done[job] = run
        method, scale, rate, seed = job
        say(
            f"  {config_name(method, scale):22s} rate {rate:<6g} seed {seed}: val {run['val_acc']:.4f} "
            f"test {run['test_acc']:.4f}{' DIVERGED' if run['diverged'] else ''} ({run['seconds']:.0f} s)"
        )
    return done


def config_name(method, scale):
    return method if method == BASELINE else f"{method}@{scale}"


def configurations(args):
    """(method, scale) pairs to run: the baseline once, every other method at every scale."""
    pairs = [(BASELINE, 1)] if BASELINE in args.methods else []
    return pairs + [(m, k) for k in args.batch_scales for m in args.methods if m != BASELINE]


def grid_of(method, args):
    return GRIDS[method][: args.grid_points] if args.grid_points else GRIDS[method]


def summarise(method, scale, tuning, runs, args):
    grid = grid_of(method, args)
    best = runs[0]
    tests = [r["test_acc"] for r in runs]
    recomputed = [r["test_acc_bn_recomputed"] for r in runs]
    return {
        "method": method,
        "batch_scale": scale,
        "label": LABELS[method],
        "batch_size": best["batch_size"],
        "steps": best["steps"],
        "grid": grid,
        "chosen_rate": best["rate"],
        "chosen_at_grid_edge": best["rate"] in (grid[0], grid[-1]),
        "tuning": [{k: r[k] for k in ("rate", "val_acc", "test_acc", "diverged")} for r in tuning],
        "runs": runs,
        "test_acc_median": statistics.median(tests),
        "test_acc_min": min(tests),
        "test_acc_max": max(tests),
        "test_acc_bn_recomputed_median": statistics.median(recomputed),
        "test_acc_bn_recomputed_min": min(recomputed),
        "test_acc_bn_recomputed_max": max(recomputed),
        "val_acc_median": statistics.median(r["val_acc"] for r in runs),
        "diverged_runs": sum(r["diverged"] for r in runs),
    }


def run_experiment(args, pool, say):
    """Tunes every configuration's rate on seed 0, then runs the chosen rates on the other seeds."""
    pairs = configurations(args)
    # The small batch's runs take longest: submitted first, they do not end the run alone.
    tuning_jobs = [(m, k, rate, 0) for m, k in pairs for rate in grid_of(m, args)]
    tuned = train_all(tuning_jobs, args, pool, say)
    tuning = {(m, k): [tuned[(m, k, rate, 0)] for rate in grid_of(m, args)] for m, k in pairs}
    best = {pair: max(runs, key=lambda r: r["val_acc"]) for pair, runs in tuning.items()}
    seed_jobs = [(m, k, best[(m, k)]["rate"], seed) for m, k in pairs for seed in range(1, args.seeds)]
    seeded = train_all(seed_jobs, args, pool, say)
    results = {}
    for m, k in pairs:
        runs = [best[(m, k)]] + [seeded[(m, k, best[(m, k)]["rate"], seed)] for seed in range(1, args.seeds)]
        results[config_name(m, k)] = summarise(m, k, tuning[(m, k)], runs, args)
    return results


def chosen_rate_cell(r):
    chosen = f"{r['chosen_rate']:g}"
    if r["method"] in SCALED_BASE_RATE:
        chosen += f" (peak {r['chosen_rate'] * r['batch_scale']:g})"
    return chosen + (" (edge)" if r["chosen_at_grid_edge"] and len(r["grid"]) > 1 else "")


def results_table(results):
    lines = [
        "| method | batch | steps | rate grid | chosen rate | test acc, median [min, max] | "
        "val acc (median) | test acc, BN recomputed |",
        "|---|---:|---:|---|---:|---|---:|---|",
    ]
    for r in results.values():
        div = f", {r['diverged_runs']} diverged" if r["diverged_runs"] else ""
        lines.append(
            f"| {r['label']} | {r['batch_size']} | {r['steps']} | "
            f"{', '.join(f'{g:g}' for g in r['grid'])} | {chosen_rate_cell(r)} | "
            f"{r['test_acc_median']:.4f} [{r['test_acc_min']:.4f}, {r['test_acc_max']:.4f}]{div} | "
            f"{r['val_acc_median']:.4f} | {r['test_acc_bn_recomputed_median']:.4f} "
            f"[{r['test_acc_bn_recomputed_min']:.4f}, {r['test_acc_bn_recomputed_max']:.4f}] |"
        )
    return "\n".join(lines)


def tuning_table(results):
    width = max(len(r["grid"]) for r in results.values())
    lines = [
        "| method | batch | " + " | ".join(f"rate {i + 1}" for i in range(width)) + " |",
        "|---|---:|" + "---|" * width,
    ]
    for r in results.values():
        cells = [f"{t['rate']:g}: {t['val_acc']:.4f}" + (" (div.)" if t["diverged"] else "") for t in r["tuning"]]
        lines.append(f"| {r['label']} | {r['batch_size']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def save_plot(results, args, path):
    """One panel per large batch (test accuracy per epoch, beside the baseline) and one of the
    final accuracy against the batch size, per method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    scales = sorted({r["batch_scale"] for r in results.values() if r["method"] != BASELINE})
    fig, axes = plt.subplots(1, len(scales) + 1, figsize=(5 * (len(scales) + 1), 4.5), squeeze=False)
    axes = axes[0]
    colours = {m: f"C{i}" for i, m in enumerate(METHODS)}
    epochs = np.arange(1, args.epochs + 1)
    baseline = results.get(BASELINE)
    for ax, scale in zip(axes, scales):
        for r in results.values():
            if r["method"] != BASELINE and r["batch_scale"] != scale:
                continue
            test = np.array([run["curves"]["test_acc"] for run in r["runs"]])
            colour = colours[r["method"]]
            ax.plot(epochs, np.median(test, axis=0), marker="o", ms=3, color=colour, label=r["label"])
            ax.fill_between(epochs, test.min(axis=0), test.max(axis=0), color=colour, alpha=0.15)
        ax.set(xlabel="epoch", ylabel="test accuracy", title=f"batch {args.small_batch} vs {args.small_batch * scale}")
    summary = axes[-1]
    for method in LARGE_BATCH_METHODS:
        rows = sorted((r for r in results.values() if r["method"] == method), key=lambda r: r["batch_size"])
        if rows:
            summary.plot(
                [r["batch_size"] for r in rows],
                [r["test_acc_bn_recomputed_median"] for r in rows],
                marker="D",
                color=colours[method],
            )
    if baseline:
        summary.axhline(baseline["test_acc_bn_recomputed_median"], color=colours[BASELINE], ls="--", lw=1)
    summary.set(
        xscale="log",
        xlabel="batch size",
        ylabel="final test accuracy, BatchNorm recomputed (median)",
        title="final accuracy against batch",
    )
    bayes = 1 - args.label_noise * (CLASSES - 1) / CLASSES
    for ax in axes:
        ax.axhline(bayes, color="grey", ls=":", lw=1)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(
        f"Teacher-student MLP, {args.n_train} examples, {args.epochs} epochs, {args.seeds} seed(s); "
        f"dotted: best possible ({bayes:.3f}); dashed: baseline",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def print_tables(results, args, say):
    say("\nTuning (seed 0, final validation accuracy per grid rate):\n")
    say(tuning_table(results))
    say(f"\nResults ({args.epochs} epochs, final test accuracy over {args.seeds} seed(s)):\n")
    say(results_table(results))


def replot(json_path, out_dir):
    with open(json_path) as f:
        saved = json.load(f)
    args = argparse.Namespace(**saved["config"])
    print_tables(saved["results"], args, print)
    os.makedirs(out_dir, exist_ok=True)
    png = os.path.join(out_dir, "large_batch.png")
    if save_plot(saved["results"], args, png):
        print(f"wrote {png}")


def main(args):
    if args.replot:
        return replot(args.replot, args.out_dir)

    def say(*parts):
        print(*parts, flush=True)

    for scale in args.batch_scales:
        large = args.small_batch * scale
        if large * 20 > args.n_train:
            say(f"warning: the large batch {large} is more than 1/20 of the {args.n_train} training examples")
    run = result_files.start_run("large_batch")
    start = time.perf_counter()
    _start_worker(args)
    counts = np.bincount(_worker["data"]["train"][1], minlength=CLASSES)
    say(
        f"task: {args.n_train}/{args.n_val}/{args.n_test} examples, dim {args.dim}, class frequencies "
        f"{counts.min() / args.n_train:.3f}..{counts.max() / args.n_train:.3f}; batch {args.small_batch} vs "
        f"{', '.join(str(args.small_batch * k) for k in args.batch_scales)}; {args.epochs} epochs; "
        f"{args.seeds} seed(s); {args.jobs} at a time"
    )
    if args.jobs == 1:
        results = run_experiment(args, None, say)
    else:
        with concurrent.futures.ProcessPoolExecutor(
            args.jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker, initargs=(args,)
        ) as pool:
            results = run_experiment(args, pool, say)
    wall = time.perf_counter() - start

    print_tables(results, args, say)
    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, "large_batch.png")
    plotted = save_plot(results, args, png)
    out = {
        "config": dict(vars(args)),
        "grids": {m: GRIDS[m] for m in args.methods},
        "wall_seconds": round(wall, 1),
        "results": results,
    }
    tables = {"results": results_table(results), "tuning": tuning_table(results)}
    json_path = args.json or os.path.join(args.out_dir, "large_batch.json")
    record = result_files.finish_run(
        run, **out, tables={key: result_files.markdown_tables(table)[0] for key, table in tables.items()}
    )
    result_files.write(json_path, record)
    say(
        f"\nwall time {wall:.0f} s; wrote {json_path}"
        + (f" and {png}" if plotted else " (matplotlib not installed: no plot)")
    )
    return out


if __name__ == "__main__":
    main(parse_args())
