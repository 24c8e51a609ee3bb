"""Adaptive batch growth at a fixed epoch budget: fixed small batch vs growth from each signal (issue #5).

How to run (one process; kerasdist at size 1, so growth raises `backward_passes_per_step`):

  .venv/bin/python benchmarks/batch_growth.py            # the full run, about 10 min on 2 busy cores
  .venv/bin/python benchmarks/batch_growth.py --quick    # smoke version, under a minute

It prints the tuning table, the results table and each growth run's decisions (markdown), writes
a result file (benchmarks/results.py) to --json (default <out_dir>/batch_growth.json;
docs/experiments.md shows benchmarks/results/batch_growth.json and batch_growth_digits.json) and,
when matplotlib is installed, <out_dir>/batch_growth.png.

The task: the generator and student of the LARS/LAMB experiment, with a larger pool
  `make_teacher_task` and `build_student` are imported from benchmarks/large_batch.py (read
  only) with its settings (data seed 1234, inputs N(0, I) in 32 dimensions, labels from a random
  teacher MLP 32 -> 32 -> 32 -> 10, 5 % label noise, so the best possible accuracy is 0.955;
  8,192 validation and 16,384 test rows; student MLP 3 x [Dense(256, no bias) -> BatchNorm ->
  ReLU] -> Dense(10)), except that it generates a --pool of 262,144 training rows instead of
  65,536. The generator draws the teacher after the inputs, so this is a different random
  teacher of the same family. An epoch is --epoch_rows (65,536) rows drawn from the pool,
  reshuffled on every pass: 10 epochs are 2.5 passes.
  Why: on 65,536 rows (10 passes) the constant-rate baseline overfitted from epoch 4 to 6 on
  (test accuracy 0.69 at best, 0.68 at the end; on 32,768 rows 0.655, then 0.616), so every
  configuration met a target set from its final accuracy within two epochs and the step counts
  said nothing. With the larger pool the baseline still improves at epoch 10.

Every run
  SGD with momentum 0.9 and a constant rate (the growth callback sets a float rate, so no
  schedule), wrapped in `kerasdist.DistributedOptimizer` with a `kerasdist.GradientNoiseScale`
  (so B_noise is recorded for every configuration), softmax cross-entropy, micro-batches of
  --micro_batch (64) rows, --epochs (10) of --epoch_rows rows. All runs start, or stay, at
  `backward_passes_per_step` = --start_passes (2): effective batch 128, the same as the
  LARS/LAMB experiment's small batch. (One process needs k >= 2 for the noise signal; using
  the same micro-batch everywhere also keeps every configuration's per-sample cost and batch
  norm statistics equal.)

Configurations (k = backward_passes_per_step)
  fixed_small   k = 2 all along: batch 128 at the base rate (the baseline).
  noise_scale   AdaptiveBatchGrowth(signal="noise_scale"): at each epoch end, double k while
                2 x batch <= B_noise.
  curvature     AdaptiveBatchGrowth(signal="curvature", curvature_data = a fixed sample of
                --curvature_samples (2,048) training rows): at each epoch end, the top Hessian
                eigenvalue by power iteration (10 products at most, tolerance 1e-2); the first is
                the reference, and k doubles when it has halved. With ABS's safeguard: it
                doubles anyway after --curvature_safeguard (3) checks without growth.
  curvature_unguarded
                the same signal without the safeguard: k grows only when the eigenvalue has
                halved (on digits it does; one run then gives both curvature rows).
                (In every run so far, here and on 32,768 fixed rows, the eigenvalue never
                halved by itself; without the safeguard the run is the baseline's, bit for bit.)
  fixed_large   k = 16 all along: batch --large_batch (1,024) at base x 8 (linear scaling, no
                warmup), as a reference.
  Growth: factor 2, --lr_scaling (linear: the rate doubles with the batch, velocities rescaled),
  capped at --max_batch (2,048); the noise-scale runs grow on their signal alone
  (--noise_safeguard: none). The decisions table marks each growth as signal or forced.

The tuning budget
  Only the baseline is tuned: one constant rate from --lr_grid (0.03, 0.1, 0.3), seed 0,
  chosen by final validation accuracy. The growth runs and the reference reuse that rate
  (scaled as above) with no tuning of their own. The chosen configuration runs with seeds
  0 .. --seeds-1 (seed 0's tuning run is reused); the seed sets the weights and the shuffles.

Measured, after every epoch: test and validation accuracy (evaluated outside the timed part),
optimizer steps (`optimizer.iterations`), training wall time (including the signal's own
cost, excluding the evaluation), effective batch, rate, B_noise and (curvature runs) the top
eigenvalue. Reported: steps and wall time to a target test accuracy, at epoch resolution (the
first epoch end at or above it), for targets 95 % and 99 % of the baseline's final test
accuracy (median over seeds), the final and the best (over epochs) test accuracy; medians over
seeds. At one process growth cannot save wall time (every configuration computes the same
micro-batch gradients); in a data-parallel run each saved step is a saved allreduce.
"""

import argparse
import math
import os
import statistics
import sys
import time
import types

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerasdist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results as result_files  # noqa: E402  (benchmarks/results.py)
from large_batch import build_student, make_teacher_task  # noqa: E402  (the shared task)

CONFIGS = ("fixed_small", "noise_scale", "curvature", "curvature_unguarded", "fixed_large")
CURVATURE_CONFIGS = ("curvature", "curvature_unguarded")
LABELS = {
    "fixed_small": "fixed small batch (baseline)",
    "noise_scale": "growth: noise scale",
    "curvature": "growth: curvature, ABS safeguard",
    "curvature_unguarded": "growth: curvature, no safeguard",
    "fixed_large": "fixed large batch",
}
# large_batch.py's task defaults; the split is generated in full, then the training rows are cut.
TASK = dict(data_seed=1234, n_val=8192, n_test=16384, dim=32, teacher_widths=[32, 32], label_noise=0.05)
TARGET_FRACTIONS = (0.95, 0.99)
DIGITS_SPLIT, DIGITS_SPLIT_SEED = (1077, 360, 360), 0
INPUT_DIMS = {"teacher": TASK["dim"], "digits": 64}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10, help="epoch budget of every run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per configuration (seed 0 also tunes)")
    parser.add_argument("--pool", type=int, default=262144, help="training rows generated")
    parser.add_argument(
        "--epoch_rows",
        type=int,
        default=65536,
        help="rows per epoch, drawn from the reshuffled pool (one pass = pool / epoch_rows epochs)",
    )
    parser.add_argument("--micro_batch", type=int, default=64, help="rows per micro-batch (fit's batch_size)")
    parser.add_argument("--start_passes", type=int, default=2, help="backward_passes_per_step at the start")
    parser.add_argument("--max_batch", type=int, default=2048, help="cap on the grown effective batch")
    parser.add_argument("--large_batch", type=int, default=1024, help="fixed_large's effective batch")
    parser.add_argument(
        "--lr_grid", type=float, nargs="+", default=[0.03, 0.1, 0.3], help="constant base rates tried for the baseline"
    )
    parser.add_argument("--lr_scaling", choices=("linear", "sqrt", "none"), default="linear")
    parser.add_argument(
        "--noise_safeguard",
        type=int,
        default=None,
        help="noise-scale runs: grow anyway after this many checks without growth (default: never)",
    )
    parser.add_argument(
        "--curvature_safeguard",
        type=int,
        default=3,
        help="curvature runs: grow anyway after this many checks without growth (ABS's safeguard)",
    )
    parser.add_argument("--curvature_samples", type=int, default=2048)
    parser.add_argument("--width", type=int, default=256, help="student hidden width")
    parser.add_argument("--depth", type=int, default=3, help="student hidden layers")
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=None,
        help="default: all; on the teacher task all but curvature_unguarded, which there is the baseline bit for bit",
    )
    parser.add_argument(
        "--task",
        choices=tuple(INPUT_DIMS),
        default="teacher",
        help="digits: scikit-learn's 8x8 digits, where the top eigenvalue falls by itself; overrides the "
        "sizes: every epoch one pass over 1,077 rows, micro-batch 16, batch 32 to 512, fixed large 256, "
        "30 epochs, rates 0.01 0.03 0.1, 512-row curvature sample",
    )
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow intra-op threads")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (<1 min): 4,096 rows, micro-batch 32, 3 epochs, one rate, 1 seed, "
        "cap 256, growth forced after 1 check",
    )
    parser.add_argument("--out_dir", default="bench-results")
    parser.add_argument(
        "--json",
        default=None,
        help="the result file (benchmarks/results.py; default <out_dir>/batch_growth.json; "
        "benchmarks/results/batch_growth[_digits].json are the ones docs/experiments.md shows)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.pool, args.epoch_rows, args.micro_batch, args.epochs, args.seeds = 8192, 4096, 32, 3, 1
        args.max_batch = args.large_batch = 256
        args.lr_grid, args.width, args.curvature_samples = [0.03], 64, 512
        args.noise_safeguard = args.curvature_safeguard = 1
    if args.task == "digits":
        args.pool = args.epoch_rows = DIGITS_SPLIT[0]
        args.micro_batch, args.max_batch, args.large_batch, args.epochs = 16, 512, 256, 30
        args.lr_grid, args.curvature_samples = [0.01, 0.03, 0.1], 512
    if args.configs is None:
        args.configs = [c for c in CONFIGS if args.task == "digits" or c != "curvature_unguarded"]
    if "fixed_small" not in args.configs:
        parser.error("--configs must include fixed_small: it is tuned and defines the targets")
    if args.start_passes < 2:
        parser.error("--start_passes must be >= 2: one process measures the noise scale from its micro-batches")
    return args


def load_task(args, task="teacher"):
    """{"train", "val", "test"}: (x, y) of the generated teacher task, or of scikit-learn's digits
    (`task="digits"`: 1,797 images as 64 features in [0, 1], shuffled once by a fixed seed,
    split 1,077 / 360 / 360)."""
    if task == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        order = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(digits.target))
        x, y = (digits.data[order] / 16.0).astype("float32"), digits.target[order].astype("int32")
        cuts = np.cumsum(DIGITS_SPLIT[:2])
        return dict(zip(("train", "val", "test"), zip(np.split(x, cuts), np.split(y, cuts))))
    data = make_teacher_task(types.SimpleNamespace(**TASK, n_train=args.pool))
    quick_rows = 1024 if args.quick else None
    return {
        "train": data["train"],
        "val": tuple(a[:quick_rows] for a in data["val"]),
        "test": tuple(a[:quick_rows] for a in data["test"]),
    }


def accuracy(model, x, y):
    logits = np.concatenate(
        [keras.ops.convert_to_numpy(model(x[i : i + 8192], training=False)) for i in range(0, len(x), 8192)]
    )
    return float(np.mean(logits.argmax(axis=1) == y))


class EpochRecorder(keras.callbacks.Callback):
    """Per epoch: accuracies, optimizer steps, training seconds, batch, rate and signals.

    Placed after `AdaptiveBatchGrowth`, so its end-of-epoch time includes the signal's cost;
    its own evaluation is kept out of the clock. With an optimizer that accumulates nothing or
    has no `GradientNoiseScale` (a plain Keras optimizer, or delayed or 1-bit gradients), the
    batch is one micro-batch per update and the noise scale None.
    """

    def __init__(self, data, micro_batch):
        super().__init__()
        self.data = data
        self.micro_batch = micro_batch
        self.rows = []

    def on_train_begin(self, logs=None):
        self._start = time.perf_counter()
        self._untimed = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        optimizer = self.model.optimizer
        self._passes = getattr(optimizer, "backward_passes_per_step", 1)
        self._rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate))

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self._start - self._untimed
        begin_eval = time.perf_counter()
        optimizer = self.model.optimizer
        noise = getattr(optimizer, "gradient_noise_scale", None)
        logs = logs or {}
        self.rows.append(
            {
                "epoch": epoch + 1,
                "steps": int(keras.ops.convert_to_numpy(optimizer.iterations)),
                "seconds": round(seconds, 2),
                "batch_size": self.micro_batch * self._passes,
                "learning_rate": self._rate,
                "train_loss": float(logs.get("loss", math.nan)),
                "noise_scale": noise.noise_scale() if noise is not None else None,
                "hessian_top_eigenvalue": logs.get("hessian_top_eigenvalue"),
                "val_acc": accuracy(self.model, *self.data["val"]),
                "test_acc": accuracy(self.model, *self.data["test"]),
            }
        )
        self._untimed += time.perf_counter() - begin_eval


def growth_decisions(growth):
    """Each check of an AdaptiveBatchGrowth, with why it grew: the signal, the safeguard, or not
    (the cap). Recomputed from its history with the rule the callback documents."""
    reference, out = None, []
    for record in growth.history:
        key = "noise_scale" if growth.signal == "noise_scale" else "hessian_top_eigenvalue"
        value, batch = record[key], record["batch_size"]
        if not math.isfinite(value):
            wanted = False
        elif growth.signal == "noise_scale":
            wanted = batch * growth.growth_factor <= value
        elif reference is None:
            wanted, reference = False, value
        else:
            wanted = value <= reference / 2
        if record["grew"]:
            reference = value if growth.signal == "curvature" else reference
            reason = "signal" if wanted else "forced"
        else:
            reason = "capped" if wanted else None
        out.append(
            {
                "epoch": record["epoch"] + 1,
                "batch_size": batch,
                "signal": value,
                "grew": record["grew"],
                "reason": reason,
            }
        )
    return out


def compile_student(args, rate, passes, input_dim=TASK["dim"]):
    """The student (on ``input_dim`` features), compiled with SGD (momentum 0.9, constant ``rate``) in a
    `kerasdist.DistributedOptimizer` accumulating ``passes`` micro-batches per update, with a
    `kerasdist.GradientNoiseScale` (so B_noise is recorded whatever the configuration)."""

    def make_optimizer():
        return kerasdist.DistributedOptimizer(
            keras.optimizers.SGD(rate, momentum=0.9),
            backward_passes_per_step=passes,
            gradient_noise_scale=kerasdist.GradientNoiseScale(batch_size=args.micro_batch),
        )

    return compile_with(args, make_optimizer, input_dim)


def compile_with(args, make_optimizer, input_dim=TASK["dim"]):
    """The student (--width, --depth, on ``input_dim`` features), built first, then compiled with
    ``make_optimizer()`` and softmax cross-entropy, without XLA."""
    student = types.SimpleNamespace(dim=input_dim, width=args.width, depth=args.depth)
    model = build_student(student)
    model.compile(
        make_optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False
    )
    return model


def growth_callback(config, seed, x, y, args):
    """The `AdaptiveBatchGrowth` of a growth configuration ("noise_scale", "curvature" or
    "curvature_unguarded"), whose curvature sample is drawn from (x, y)."""
    curvature_data = None
    safeguard = {"noise_scale": args.noise_safeguard, "curvature": args.curvature_safeguard}.get(config)
    if config in CURVATURE_CONFIGS:
        sample = np.random.default_rng(seed).choice(len(x), args.curvature_samples, replace=False)
        curvature_data = (x[sample], y[sample])
    return kerasdist.callbacks.AdaptiveBatchGrowth(
        signal="noise_scale" if config == "noise_scale" else "curvature",
        batch_size=args.micro_batch,
        growth_factor=2,
        max_batch_size=args.max_batch,
        lr_scaling=args.lr_scaling,
        max_epochs_without_growth=safeguard,
        curvature_data=curvature_data,
    )


def fit_stream(model, x, y, seed, callbacks, args, steps_per_epoch):
    """`fit` for --epochs epochs of ``steps_per_epoch`` micro-batches drawn from (x, y), which is
    reshuffled on every pass."""
    stream = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
        .repeat()
        .batch(args.micro_batch, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )
    model.fit(
        stream,
        steps_per_epoch=steps_per_epoch,
        epochs=args.epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )


def run_record(config, seed, base_rate, rate, recorder, growth, args):
    """One run's report: its per-epoch rows and, for growth runs, the decisions."""
    rows = recorder.rows
    diverged = len(rows) < args.epochs or not all(math.isfinite(r["train_loss"]) for r in rows)
    return {
        "config": config,
        "seed": seed,
        "base_rate": base_rate,
        "rate": rate,
        "diverged": diverged,
        "epochs": rows,
        "decisions": growth_decisions(growth) if growth else None,
    }


def train(config, base_rate, seed, data, args):
    """One run; returns its per-epoch rows and, for growth runs, the decisions."""
    keras.utils.set_random_seed(seed)
    passes = args.start_passes
    rate = base_rate
    if config == "fixed_large":
        passes = args.large_batch // args.micro_batch
        rate = (
            base_rate
            * {"linear": passes / args.start_passes, "sqrt": math.sqrt(passes / args.start_passes), "none": 1.0}[
                args.lr_scaling
            ]
        )
    model = compile_student(args, rate, passes, INPUT_DIMS[args.task])
    x, y = data["train"]
    growth = growth_callback(config, seed, x, y, args) if config in ("noise_scale", *CURVATURE_CONFIGS) else None
    recorder = EpochRecorder(data, args.micro_batch)
    callbacks = kerasdist.callbacks(batch_growth=growth, extra=[keras.callbacks.TerminateOnNaN(), recorder])
    fit_stream(model, x, y, seed, callbacks, args, steps_per_epoch=args.epoch_rows // args.micro_batch)
    return run_record(config, seed, base_rate, rate, recorder, growth, args)


def reach(run, target):
    """(steps, seconds, epoch) at the first epoch end with test accuracy >= target, else None."""
    for row in run["epochs"]:
        if row["test_acc"] >= target:
            return row["steps"], row["seconds"], row["epoch"]
    return None


def median_or_none(values):
    """Median with unreached (None) counted as infinitely late; None if that median is unreached."""
    keyed = sorted(values, key=lambda v: math.inf if v is None else v)
    if not keyed:
        return None
    n = len(keyed)
    middle = keyed[(n - 1) // 2 : n // 2 + 1]
    if any(v is None for v in middle):
        return None
    return statistics.mean(middle)


def summarise(runs, targets):
    final = [r["epochs"][-1] for r in runs]
    out = {
        "test_acc_median": statistics.median(f["test_acc"] for f in final),
        "test_acc_min": min(f["test_acc"] for f in final),
        "test_acc_max": max(f["test_acc"] for f in final),
        "best_test_acc_median": statistics.median(max(e["test_acc"] for e in r["epochs"]) for r in runs),
        "steps_median": statistics.median(f["steps"] for f in final),
        "seconds_median": statistics.median(f["seconds"] for f in final),
        "final_batch_median": statistics.median(f["batch_size"] for f in final),
        "diverged_runs": sum(r["diverged"] for r in runs),
        "to_target": {},
    }
    for name, target in targets.items():
        hits = [reach(r, target) for r in runs]
        out["to_target"][name] = {
            "target": target,
            "reached": sum(h is not None for h in hits),
            "steps_median": median_or_none([h and h[0] for h in hits]),
            "seconds_median": median_or_none([h and h[1] for h in hits]),
            "epoch_median": median_or_none([h and h[2] for h in hits]),
            "per_seed": [None if h is None else {"steps": h[0], "seconds": h[1], "epoch": h[2]} for h in hits],
        }
    return out


def _fmt(value, spec):
    return "not reached" if value is None else format(value, spec)


def configuration_label(config, args):
    """A row's name in the tables: the batch and rate of a fixed large batch, the safeguard's
    checks of a guarded curvature run."""
    if config == "fixed_large":
        return f"fixed batch {args.large_batch}, rate ×{args.large_batch // (args.micro_batch * args.start_passes)}"
    if config == "fixed_small":
        return f"fixed batch {args.micro_batch * args.start_passes} (baseline)"
    if config == "curvature":
        return f"{LABELS[config]} ({args.curvature_safeguard})"
    return LABELS[config]


def growths(runs):
    """Growths by signal / forced by the safeguard, medians over the runs; – for a fixed batch."""
    if not any(run["decisions"] for run in runs):
        return "–"
    by = {
        reason: statistics.median(sum(d["reason"] == reason for d in run["decisions"]) for run in runs)
        for reason in ("signal", "forced")
    }
    return f"{by['signal']:g} / {by['forced']:g}"


def results_table(results, targets, n_seeds, args):
    """Medians over the seeds: updates and training seconds to each target (with how many times
    fewer updates than the baseline), in all, and the final accuracy."""
    names = [f"{name[:-1]} %" for name in targets]
    head = (
        "| configuration | final batch | "
        + " | ".join(f"steps to {n} | s to {n}" for n in names)
        + " | steps (all) | s (all) | final test acc, median [min, max] | growths by signal / forced |"
    )
    lines = [head, "|---|---:|" + "---:|---:|" * len(names) + "---:|---:|---|---|"]
    base = results["fixed_small"]["summary"]
    for config, r in results.items():
        s = r["summary"]
        cells = []
        for n in targets:
            t, b = s["to_target"][n], base["to_target"][n]
            ratio = ""
            if config != "fixed_small" and t["steps_median"] and b["steps_median"]:
                fewer = b["steps_median"] / t["steps_median"]
                ratio = f" ({fewer:.1f}× fewer)" if fewer > 1 else f" ({fewer:.1f}×)"
            reached = f" ({t['reached']} of {n_seeds} seeds)" if t["reached"] < n_seeds else ""
            cells += [f"{_fmt(t['steps_median'], '.0f')}{ratio}{reached}", _fmt(t["seconds_median"], ".0f")]
        div = f", {s['diverged_runs']} diverged" if s["diverged_runs"] else ""
        lines.append(
            f"| {configuration_label(config, args)} | {s['final_batch_median']:.0f} | "
            + " | ".join(cells)
            + f" | {s['steps_median']:.0f} | {s['seconds_median']:.0f} | {s['test_acc_median']:.4f} "
            f"[{s['test_acc_min']:.4f}, {s['test_acc_max']:.4f}]{div} | {growths(r['runs'])} |"
        )
    return "\n".join(lines)


def decisions_table(results, labels=LABELS):
    """Each growth run's batch per epoch, marked where it grew and why, and its signal per epoch."""
    lines = [
        "| configuration | seed | batch per epoch (* = grew after it: s signal, f forced) | signal per epoch |",
        "|---|---:|---|---|",
    ]
    for config, r in results.items():
        for run in r["runs"]:
            if not run["decisions"]:
                continue
            batches = " ".join(
                f"{d['batch_size']}{'*' + d['reason'][0] if d['grew'] else ''}" for d in run["decisions"]
            )
            signals = " ".join(f"{d['signal']:.3g}" for d in run["decisions"])
            lines.append(f"| {labels[config]} | {run['seed']} | {batches} | {signals} |")
    return "\n".join(lines)


def save_plot(results, targets, args, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    (ax_steps, ax_epoch, ax_time), (ax_batch, ax_rate, ax_signal) = axes
    colors = dict(zip(CONFIGS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    ax_curv = ax_signal.twinx()
    for config, r in results.items():
        for i, run in enumerate(r["runs"]):
            rows = run["epochs"]
            label = LABELS[config] if i == 0 else None
            style = dict(
                color=colors[config], marker="o", ms=3, lw=1.2 if i == 0 else 0.7, alpha=1.0 if i == 0 else 0.5
            )
            epoch = [row["epoch"] for row in rows]
            test = [row["test_acc"] for row in rows]
            ax_steps.plot([row["steps"] for row in rows], test, label=label, **style)
            ax_epoch.plot(epoch, test, label=label, **style)
            ax_time.plot([row["seconds"] for row in rows], test, label=label, **style)
            ax_batch.plot(epoch, [row["batch_size"] for row in rows], label=label, **style)
            ax_rate.plot(epoch, [row["learning_rate"] for row in rows], label=label, **style)
            ax_signal.plot(epoch, [row["noise_scale"] for row in rows], label=label, **style)
            if config in CURVATURE_CONFIGS:
                ax_curv.plot(
                    epoch,
                    [row["hessian_top_eigenvalue"] for row in rows],
                    color=colors[config],
                    ls="--",
                    marker="s",
                    ms=3,
                    lw=style["lw"],
                    alpha=style["alpha"],
                    label="top Hessian eigenvalue (right axis)" if i == 0 else None,
                )
    for ax in (ax_steps, ax_epoch, ax_time):
        for (name, target), ls in zip(targets.items(), (":", "--")):
            ax.axhline(target, color="grey", ls=ls, lw=0.8, label=f"target {name} = {target:.3f}")
        ax.set_ylabel("test accuracy")
    ax_steps.set(xlabel="optimizer steps", xscale="log", title="Test accuracy vs optimizer steps")
    ax_epoch.set(xlabel="epoch", title="Test accuracy vs epoch")
    ax_time.set(xlabel="training wall time (s)", title="Test accuracy vs wall time")
    ax_batch.set(xlabel="epoch", ylabel="effective batch", yscale="log", title="Batch used in each epoch")
    ax_rate.set(xlabel="epoch", ylabel="learning rate", yscale="log", title="Learning rate in each epoch")
    ax_signal.set(xlabel="epoch", ylabel="B_noise (samples)", yscale="log", title="Signals at epoch end")
    ax_curv.set_ylabel("top Hessian eigenvalue")
    ax_steps.legend(fontsize=7, loc="lower right")
    handles = ax_signal.get_legend_handles_labels()[0] + ax_curv.get_legend_handles_labels()[0]
    if handles:
        ax_signal.legend(handles=handles, fontsize=7, loc="best")
    seeds = len(next(iter(results.values()))["runs"])
    fig.suptitle(
        f"Adaptive batch growth, {'teacher-student' if args.task == 'teacher' else 'digits'} MLP, "
        f"{args.pool}-row pool, {args.epochs} epochs of "
        f"{args.epoch_rows} rows, "
        f"micro-batch {args.micro_batch}, start batch {args.micro_batch * args.start_passes}, cap "
        f"{args.max_batch}, fixed large {args.large_batch}\nSGD momentum 0.9 at base rate "
        f"{results['fixed_small']['base_rate']:g}, lr_scaling={args.lr_scaling}, {seeds} seed(s) "
        "(thick: seed 0)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _finite(value):
    """The report with NaN and infinities as null, so that the JSON is strict."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def main(args):
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    kerasdist.init()
    if kerasdist.size() != 1:
        raise SystemExit("run benchmarks/batch_growth.py as one process: growth is simulated with accumulation")

    def say(*parts):
        print(*parts, flush=True)

    run_header = result_files.start_run("batch_growth")
    start = time.perf_counter()
    data = load_task(args, args.task)
    say(
        f"task: {len(data['train'][0])}/{len(data['val'][0])}/{len(data['test'][0])} rows, {args.epoch_rows} per "
        f"epoch; micro-batch "
        f"{args.micro_batch}, start batch {args.micro_batch * args.start_passes}, cap {args.max_batch}; "
        f"{args.epochs} epochs; {args.seeds} seed(s); configs {' '.join(args.configs)}"
    )

    def run(config, rate, seed):
        result = train(config, rate, seed, data, args)
        last = result["epochs"][-1]
        say(
            f"  {config:12s} rate {rate:<6g} seed {seed}: val {last['val_acc']:.4f} test {last['test_acc']:.4f} "
            f"steps {last['steps']} batch {last['batch_size']} ({last['seconds']:.0f} s)"
            + (" DIVERGED" if result["diverged"] else "")
        )
        return result

    tuning = [run("fixed_small", rate, 0) for rate in args.lr_grid]
    best = max(tuning, key=lambda r: (not r["diverged"], r["epochs"][-1]["val_acc"]))
    base_rate = best["base_rate"]
    results = {}
    for config in args.configs:
        runs = [best if config == "fixed_small" else run(config, base_rate, 0)]
        runs += [run(config, base_rate, seed) for seed in range(1, args.seeds)]
        results[config] = {"label": LABELS[config], "base_rate": base_rate, "runs": runs}
    baseline_final = statistics.median(r["epochs"][-1]["test_acc"] for r in results["fixed_small"]["runs"])
    targets = {f"{round(f * 100)}%": f * baseline_final for f in TARGET_FRACTIONS}
    for r in results.values():
        r["summary"] = summarise(r["runs"], targets)
    wall = time.perf_counter() - start

    edge = " (at the grid's edge)" if base_rate in (args.lr_grid[0], args.lr_grid[-1]) and len(args.lr_grid) > 1 else ""
    say(
        "\nTuning the baseline (seed 0, final validation accuracy per constant rate): "
        + ", ".join(
            f"{t['base_rate']:g}: {t['epochs'][-1]['val_acc']:.4f}" + (" (div.)" if t["diverged"] else "")
            for t in tuning
        )
        + f"; chosen {base_rate:g}{edge}"
    )
    say(
        f"\nResults ({args.epochs} epochs, medians over {args.seeds} seed(s); targets: "
        + ", ".join(
            f"{n} of the baseline's final test accuracy {baseline_final:.4f} = {t:.4f}" for n, t in targets.items()
        )
        + "):\n"
    )
    say(results_table(results, targets, args.seeds, args))
    say("\nGrowth decisions:\n")
    say(decisions_table(results))
    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, "batch_growth.png")
    plotted = save_plot(results, targets, args, png)
    out = {
        "config": vars(args),
        "task": TASK if args.task == "teacher" else {"digits_split": DIGITS_SPLIT, "split_seed": DIGITS_SPLIT_SEED},
        "base_rate": base_rate,
        "baseline_final_test_acc": baseline_final,
        "targets": targets,
        "wall_seconds": round(wall, 1),
        "tuning": [
            {
                "rate": t["base_rate"],
                "val_acc": t["epochs"][-1]["val_acc"],
                "test_acc": t["epochs"][-1]["test_acc"],
                "diverged": t["diverged"],
            }
            for t in tuning
        ],
        "results": results,
    }
    tables = {"results": results_table(results, targets, args.seeds, args), "decisions": decisions_table(results)}
    json_path = args.json or os.path.join(args.out_dir, "batch_growth.json")
    laid_out = {key: result_files.markdown_tables(table)[0] for key, table in tables.items()}
    result_files.write(json_path, result_files.finish_run(run_header, **out, tables=laid_out))
    say(
        f"\nwall time {wall:.0f} s; wrote {json_path}"
        + (f" and {png}" if plotted else " (matplotlib not installed: no plot)")
    )
    return out


if __name__ == "__main__":
    main(parse_args())
