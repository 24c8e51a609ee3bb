"""A long run that looks for leaks: 5,000 `model.fit` steps of a small model on every rank, with
a timeline written, sampling the process as it goes.

How to run (what `make soak` runs, and `make test` at its end; 25 s here):

  .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/soak.py
  .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/soak.py --steps 500    # quick look

After a warm-up (--warmup_steps, when TensorFlow's pools and kerasdist's fusion buffers exist),
each rank samples its resident memory, threads and open file descriptors every --sample_every
steps, and rank 0 the size of the timeline it writes. At the end each rank prints one SOAK line
with what it found and checks it against these bounds, exiting non-zero past any of them:
  * resident memory at the end within --rss_bound_mib (8 MiB) of the first sample: it grew 1.0-1.4
    MiB in 4,800 steps here, while leaking one batch (4 KiB) a step would grow it 19 MiB;
  * the same number of threads and of open file descriptors at the last sample as at the first;
  * timeline bytes per step in the second half within 10 % of the first half's (the file grows
    with the steps, by a fixed amount per step, and by nothing else).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=5000)
parser.add_argument("--warmup_steps", type=int, default=200)
parser.add_argument("--sample_every", type=int, default=250)
parser.add_argument("--rss_bound_mib", type=float, default=8.0)
parser.add_argument("--batch_size", type=int, default=32)
args = parser.parse_args()
if args.steps < args.warmup_steps + 2 * args.sample_every:
    parser.error(
        "--steps must leave room for three samples after the warm-up: at least --warmup_steps + 2 * --sample_every"
    )

# The timeline's path must be known before kerasdist starts: rank 0 writes it.
timeline_dir = tempfile.mkdtemp(prefix="kerasdist-soak-")
os.environ.setdefault("KERASDIST_TIMELINE", os.path.join(timeline_dir, "timeline.json"))

import keras  # noqa: E402

import kerasdist as kd  # noqa: E402

kd.init()
STEPS_PER_EPOCH = 100


def resident_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def sample(step):
    return {
        "step": step,
        "rss_mib": round(resident_mib(), 1),
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "timeline_bytes": os.path.getsize(os.environ["KERASDIST_TIMELINE"]) if kd.rank() == 0 else None,
    }


class Sampler(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.step = 0
        self.samples = []

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step >= args.warmup_steps and (self.step - args.warmup_steps) % args.sample_every == 0:
            self.samples.append(sample(self.step))


rng = np.random.default_rng(kd.rank())
x = rng.normal(size=(STEPS_PER_EPOCH * args.batch_size, 32)).astype("float32")
y = (x[:, :1] > 0).astype("float32")
keras.utils.set_random_seed(0)
model = keras.Sequential(
    [
        keras.Input((32,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(1, activation="sigmoid"),
    ]
)
model.compile(optimizer=kd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="binary_crossentropy")
sampler = Sampler()
epochs = -(-args.steps // STEPS_PER_EPOCH)
model.fit(
    x, y, batch_size=args.batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=[*kd.callbacks(), sampler]
)

first, last = sampler.samples[0], sampler.samples[-1]
problems = []
if last["rss_mib"] - first["rss_mib"] > args.rss_bound_mib:
    problems.append(f"resident memory grew {last['rss_mib'] - first['rss_mib']:.1f} MiB (bound {args.rss_bound_mib})")
for what in ("threads", "fds"):
    if last[what] != first[what]:
        problems.append(f"{what}: {first[what]} at step {first['step']}, {last[what]} at step {last['step']}")
report = {
    "rank": kd.rank(),
    "steps": sampler.step,
    "rss_mib": [first["rss_mib"], last["rss_mib"]],
    "threads": [first["threads"], last["threads"]],
    "fds": [first["fds"], last["fds"]],
}
if kd.rank() == 0:
    middle = sampler.samples[len(sampler.samples) // 2]
    per_step = [
        (middle["timeline_bytes"] - first["timeline_bytes"]) / (middle["step"] - first["step"]),
        (last["timeline_bytes"] - middle["timeline_bytes"]) / (last["step"] - middle["step"]),
    ]
    report["timeline_bytes_per_step"] = [round(b) for b in per_step]
    if abs(per_step[1] - per_step[0]) > 0.1 * per_step[0]:
        problems.append(f"timeline bytes per step went from {per_step[0]:.0f} to {per_step[1]:.0f}")
report["problems"] = problems
print("SOAK " + json.dumps(report), flush=True)
shutil.rmtree(timeline_dir, ignore_errors=True)
sys.exit(1 if problems else 0)
