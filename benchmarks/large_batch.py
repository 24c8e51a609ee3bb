"""Large-batch training at a fixed epoch budget: scaled SGD, warmup, LARS and LAMB (issue #4).

How to run (one process; the large batch is simulated, no MPI):

  .venv/bin/python benchmarks/large_batch.py            # full run: 35 trainings, ~7 CPU-minutes
  .venv/bin/python benchmarks/large_batch.py --quick    # smoke version, under a minute
  .venv/bin/python benchmarks/large_batch.py --replot bench-results/large_batch.json

The full run uses one TensorFlow thread (--threads); it took 15.5 min of wall time on a
shared 2-core machine under a load of about 4. It prints the tuning table and the results
table (markdown) and writes <out_dir>/large_batch.json and, when matplotlib is installed,
<out_dir>/large_batch.png (--out_dir defaults to bench-results/).

The task (generated, offline, fixed by --data_seed)
  Inputs x ~ N(0, I) in --dim (32) dimensions. A fixed random "teacher" MLP
  dim -> 32 -> 32 -> 10 (--teacher_widths; ReLU, He-normal weights, N(0, 0.1^2)
  biases) gives logits; each class's logit is standardised over the whole
  generated pool (so the 10 classes are about equally frequent: 7-13 %) and the
  label is the argmax. Then --label_noise (5 %) of the labels, in every split,
  are replaced by a uniformly drawn class, so the best possible accuracy is
  1 - 0.05 * 9/10 = 0.955. Splits: 65,536 train, 8,192 validation (for tuning
  only), 16,384 test.
  Why this size: a first design (dim 64, teacher 64 -> 128 -> 128 -> 10) was
  limited by the sample, not by optimisation: the small-batch baseline's test
  accuracy stopped at 0.56 after 4 epochs while its training loss kept falling,
  and every method, tuned, ended at 0.56-0.58. On this smaller teacher the
  baseline still gains about a point of test accuracy per epoch until epoch 9
  (0.76 at the end) and its training loss (0.48) stays well above the noise
  floor (0.28), so the number of useful steps matters.

The student and the budget
  MLP dim -> 3 x [Dense(256, no bias) -> BatchNorm -> ReLU] -> Dense(10), softmax
  cross-entropy, no weight decay for any method (only the update rule differs).
  Every run gets the same --epochs (10) over the training set, and the same
  schedule shape: cosine decay of the rate to 0 over the whole budget; runs
  with warmup first ramp it linearly, per step, over --warmup_epochs (2).
  Small batch 128; large batch 128 x --batch_scale (16) = 2048 = 1/32 of the
  training set, so the large batch makes 16x fewer steps (320 instead of 5120).

The methods (k = batch_scale)
  sgd_small          baseline: SGD (momentum 0.9) at batch 128, rate = base.
  sgd_scaled         SGD (momentum 0.9) at batch 128k, rate = k x base (linear
                     scaling rule, Goyal et al. 2017), no warmup.
  sgd_scaled_warmup  as above, with Goyal's gradual warmup from base to k x base.
  lars               kerasdist.optimizers.LARS at batch 128k: momentum 0.9,
                     trust coefficient 0.001 (the paper's default), no weight
                     decay, warmup from peak/k to the peak rate.
  lamb               kerasdist.optimizers.LAMB at batch 128k: beta_1 0.9,
                     beta_2 0.999, eps 1e-6 (the paper's defaults), no weight
                     decay, warmup from peak/k to the peak rate.
  LARS and LAMB get warmup because both papers train with it.

The tuning budget (equal: 4 rates per method, nothing else tuned)
  A grid of 4 rates, a factor of 3 apart, per method (see GRIDS): the base
  (batch-128) rate for the three SGD methods, the peak rate for LARS and LAMB.
  Each grid point is trained once with seed 0; the rate with the best final
  validation accuracy is chosen, then run with seeds 1 .. --seeds-1 as well
  (seed 0's run is reused). Reported: final test accuracy, median [min, max]
  over the seeds. The test set is never used for choosing.

Two test accuracies per run
  "test acc" is the model as trained, evaluated the Keras way (BatchNorm uses
  its moving statistics, momentum 0.99, so they average over the last ~100
  steps: 0.2 epochs at batch 128 but 3 epochs at batch 2048, during which the
  weights still move). "BN recomputed" evaluates the same final model after
  replacing every BatchNorm's moving mean and variance by statistics of the
  first 16,384 training examples, which removes that lag. Training and the
  choice of rate are the same for both.

Not done: Goyal's momentum correction (scaling the velocity when the rate
jumps); the warmup ramp changes the rate smoothly per step, so it is left out.
"""

import argparse
import json
import math
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from kerasdist.optimizers import LAMB, LARS  # noqa: E402

METHODS = ("sgd_small", "sgd_scaled", "sgd_scaled_warmup", "lars", "lamb")
LABELS = {
    "sgd_small": "SGD, small batch (baseline)",
    "sgd_scaled": "SGD + linear scaling",
    "sgd_scaled_warmup": "SGD + linear scaling + warmup",
    "lars": "LARS + warmup",
    "lamb": "LAMB + warmup",
}
# Four rates a factor of 3 apart around each method's customary value. SGD: the base (small-batch)
# rate, multiplied by batch_scale at the large batch. LARS, LAMB: the peak rate at the large batch.
SGD_BASE_GRID = [0.01, 0.03, 0.1, 0.3]
GRIDS = {
    "sgd_small": SGD_BASE_GRID,
    "sgd_scaled": SGD_BASE_GRID,
    "sgd_scaled_warmup": SGD_BASE_GRID,
    "lars": [1.0, 3.0, 10.0, 30.0],
    "lamb": [0.001, 0.003, 0.01, 0.03],
}
CLASSES = 10


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10, help="epoch budget of every run")
    parser.add_argument(
        "--seeds", type=int, default=3, help="seeds per chosen configuration (seed 0 is also the tuning seed)"
    )
    parser.add_argument("--warmup_epochs", type=float, default=2.0)
    parser.add_argument("--small_batch", type=int, default=128)
    parser.add_argument("--batch_scale", type=int, default=16, help="large batch / small batch")
    parser.add_argument("--n_train", type=int, default=65536)
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
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow intra-op threads")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (<1 min); overrides the sizes: 8k examples, width 64, "
        "batch 16 vs 256, 2 epochs, 2 rates per grid, 1 seed",
    )
    parser.add_argument("--out_dir", default="bench-results")
    parser.add_argument(
        "--replot",
        metavar="JSON",
        default=None,
        help="train nothing: print the tables and redraw the plot of a saved JSON",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.n_train, args.n_val, args.n_test = 8192, 1024, 1024
        args.small_batch, args.epochs, args.warmup_epochs = 16, 2, 0.5
        args.seeds, args.width = 1, 64
        args.grid_points = args.grid_points or 2
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


def make_optimizer(method, rate, steps_per_epoch, args):
    """The optimizer of `method` at grid value `rate`, with its schedule over the whole budget."""
    k = args.batch_scale
    total = args.epochs * steps_per_epoch
    warmup = int(round(args.warmup_epochs * steps_per_epoch))
    if method == "sgd_small":
        schedule = GradualWarmupCosineDecay(rate, rate, 0, total)
    elif method == "sgd_scaled":
        schedule = GradualWarmupCosineDecay(k * rate, k * rate, 0, total)
    else:  # warmup from the small-batch rate (SGD) or peak / k (LARS, LAMB) to the peak
        peak = k * rate if method == "sgd_scaled_warmup" else rate
        schedule = GradualWarmupCosineDecay(peak, peak / k, warmup, total)
    if method.startswith("sgd"):
        return keras.optimizers.SGD(schedule, momentum=0.9)
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


def train(method, rate, seed, data, args):
    """One run; returns its final accuracies and per-epoch curves."""
    keras.utils.set_random_seed(seed)
    batch = args.small_batch if method == "sgd_small" else args.small_batch * args.batch_scale
    x, y = data["train"]
    steps_per_epoch = math.ceil(len(x) / batch)
    model = build_student(args)
    model.compile(
        optimizer=make_optimizer(method, rate, steps_per_epoch, args),
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


def run_method(method, data, args, say):
    grid = GRIDS[method][: args.grid_points] if args.grid_points else GRIDS[method]
    tuning = []
    for rate in grid:
        run = train(method, rate, 0, data, args)
        tuning.append(run)
        say(
            f"  {method:18s} rate {rate:<6g} seed 0: val {run['val_acc']:.4f} "
            f"test {run['test_acc']:.4f}{' DIVERGED' if run['diverged'] else ''} ({run['seconds']:.0f} s)"
        )
    best = max(tuning, key=lambda r: r["val_acc"])
    runs = [best]
    for seed in range(1, args.seeds):
        runs.append(train(method, best["rate"], seed, data, args))
        say(
            f"  {method:18s} rate {best['rate']:<6g} seed {seed}: val {runs[-1]['val_acc']:.4f} "
            f"test {runs[-1]['test_acc']:.4f} ({runs[-1]['seconds']:.0f} s)"
        )
    tests = [r["test_acc"] for r in runs]
    recomputed = [r["test_acc_bn_recomputed"] for r in runs]
    return {
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


def results_table(results, args):
    lines = [
        "| method | batch | steps | rate grid | chosen rate | test acc, median [min, max] | "
        "val acc (median) | test acc, BN recomputed |",
        "|---|---:|---:|---|---:|---|---:|---|",
    ]
    for method, r in results.items():
        edge = " (edge)" if r["chosen_at_grid_edge"] and len(r["grid"]) > 1 else ""
        chosen = f"{r['chosen_rate']:g}" + (
            f" (peak {r['chosen_rate'] * args.batch_scale:g})" if method in ("sgd_scaled", "sgd_scaled_warmup") else ""
        )
        div = f", {r['diverged_runs']} diverged" if r["diverged_runs"] else ""
        lines.append(
            f"| {r['label']} | {r['batch_size']} | {r['steps']} | "
            f"{', '.join(f'{g:g}' for g in r['grid'])} | {chosen}{edge} | "
            f"{r['test_acc_median']:.4f} [{r['test_acc_min']:.4f}, {r['test_acc_max']:.4f}]{div} | "
            f"{r['val_acc_median']:.4f} | {r['test_acc_bn_recomputed_median']:.4f} "
            f"[{r['test_acc_bn_recomputed_min']:.4f}, {r['test_acc_bn_recomputed_max']:.4f}] |"
        )
    return "\n".join(lines)


def tuning_table(results):
    width = max(len(r["grid"]) for r in results.values())
    lines = ["| method | " + " | ".join(f"rate {i + 1}" for i in range(width)) + " |", "|---|" + "---|" * width]
    for r in results.values():
        cells = [f"{t['rate']:g}: {t['val_acc']:.4f}" + (" (div.)" if t["diverged"] else "") for t in r["tuning"]]
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def save_plot(results, args, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    epochs = np.arange(1, args.epochs + 1)
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results.values():
        test = np.array([run["curves"]["test_acc"] for run in r["runs"]])
        loss = np.array([[np.nan if v is None else v for v in run["curves"]["train_loss"]] for run in r["runs"]])
        label = f"{r['label']} (batch {r['batch_size']})"
        (line,) = ax_acc.plot(epochs, np.median(test, axis=0), marker="o", ms=3, label=label)
        ax_acc.fill_between(epochs, test.min(axis=0), test.max(axis=0), color=line.get_color(), alpha=0.15)
        ax_loss.plot(epochs, np.nanmedian(loss, axis=0), marker="o", ms=3, color=line.get_color())
        ax_acc.plot(
            [args.epochs + 0.3],
            [r["test_acc_bn_recomputed_median"]],
            marker="D",
            ms=5,
            ls="none",
            color=line.get_color(),
        )
    bayes = 1 - args.label_noise * (CLASSES - 1) / CLASSES
    ax_acc.axhline(bayes, color="grey", ls=":", lw=1, label=f"best possible ({bayes:.3f})")
    ax_acc.plot(
        [], [], marker="D", ms=5, ls="none", color="grey", label="final, BatchNorm statistics recomputed (median)"
    )
    ax_acc.set(
        xlabel="epoch",
        ylabel="test accuracy (BatchNorm moving statistics)",
        title="Test accuracy (median over seeds, band: min-max)",
    )
    ax_loss.set(xlabel="epoch", ylabel="training loss (epoch mean)", yscale="log", title="Training loss (median)")
    fig.legend(*ax_acc.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(
        f"Teacher-student MLP, {args.n_train} examples, {args.epochs} epochs, "
        f"batch {args.small_batch} vs {args.small_batch * args.batch_scale}, "
        f"{args.seeds} seed(s)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def replot(json_path, out_dir):
    with open(json_path) as f:
        saved = json.load(f)
    args = argparse.Namespace(**saved["config"])
    print(tuning_table(saved["results"]) + "\n\n" + results_table(saved["results"], args))
    os.makedirs(out_dir, exist_ok=True)
    png = os.path.join(out_dir, "large_batch.png")
    if save_plot(saved["results"], args, png):
        print(f"wrote {png}")


def main(args):
    if args.replot:
        return replot(args.replot, args.out_dir)
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    def say(*parts):
        print(*parts, flush=True)

    large = args.small_batch * args.batch_scale
    if large * 20 > args.n_train:
        say(f"warning: the large batch {large} is more than 1/20 of the {args.n_train} training examples")
    start = time.perf_counter()
    data = make_teacher_task(args)
    counts = np.bincount(data["train"][1], minlength=CLASSES)
    say(
        f"task: {args.n_train}/{args.n_val}/{args.n_test} examples, dim {args.dim}, class frequencies "
        f"{counts.min() / len(data['train'][1]):.3f}..{counts.max() / len(data['train'][1]):.3f}; "
        f"batch {args.small_batch} vs {large}; {args.epochs} epochs; {args.seeds} seed(s)"
    )
    results = {}
    for method in args.methods:
        results[method] = run_method(method, data, args, say)
    wall = time.perf_counter() - start

    say("\nTuning (seed 0, final validation accuracy per grid rate):\n")
    say(tuning_table(results))
    say(f"\nResults ({args.epochs} epochs, final test accuracy over {args.seeds} seed(s)):\n")
    say(results_table(results, args))
    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, "large_batch.png")
    plotted = save_plot(results, args, png)
    out = {
        "config": {k: v for k, v in vars(args).items()},
        "grids": {m: GRIDS[m] for m in args.methods},
        "wall_seconds": round(wall, 1),
        "results": results,
    }
    json_path = os.path.join(args.out_dir, "large_batch.json")
    with open(json_path, "w") as f:
        json.dump(out, f, indent=1)
    say(
        f"\nwall time {wall:.0f} s; wrote {json_path}"
        + (f" and {png}" if plotted else " (matplotlib not installed: no plot)")
    )
    return out


if __name__ == "__main__":
    main(parse_args())
