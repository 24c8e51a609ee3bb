"""How much of a training step the gradient buckets spread over while backprop goes on.

A 2-rank model.fit of six 512-wide Dense layers (1 MiB of kernel each) in 1 MiB buckets, so six
buckets, with kerasdist's thread-pool defaults, writes rank 0's timeline; from it, per step: the
time from the first bucket's allreduce being queued to the last's (the spread), and the time
from one step's first bucket to the next step's (the period). If every bucket waited for the end
of backprop, the spread would be a few ms (3 ms of a 57 ms step measured with one inter-op
thread); with overlap the first leaves while the layers below are still differentiated (30-35 ms
of a 60-66 ms step on an idle 2-core host). A share of a step's time depends on how busy the
machine is, so it is this figure, not tests/launch/test_overlap.py's verdict (which is an order
of events). Rank 0 prints OVERLAP {"ranks", "steps", "spread_ms", "period_ms", "spread_share",
"per_step"}, and with --json writes the same as a result file (benchmarks/results.py). `make
bench` runs it at 2 ranks:

  .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/overlap.py --json benchmarks/results/overlap.json
"""

import argparse
import json
import os
import statistics
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Read by init(); only rank 0 writes the file, and reads it after training.
TIMELINE = os.path.join(tempfile.gettempdir(), f"kerasdist-overlap-{os.getpid()}.json")
os.environ["KERASDIST_TIMELINE"] = TIMELINE
os.environ["KERASDIST_BUCKET_BYTES"] = str(2**20)  # on one CPU host the automatic size is one bucket

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerasdist as kd  # noqa: E402

kd.init()
import results as result_files  # noqa: E402  (benchmarks/results.py, beside this script)

WIDTH, LAYERS, BATCH = 512, 6, 512
BUCKETS = LAYERS  # a 1 MiB kernel (and its bias) per bucket


def _is_gradient_bucket(tensor_name):
    # The Allreduce reduction's unnamed grouped allreduces, named after their line in its file.
    return tensor_name.startswith("allreduce@") and "/allreduce.py:" in tensor_name


def bucket_queue_times(timeline_path):
    """Per step, when each gradient bucket was queued (µs), in queue order."""
    with open(timeline_path) as f:
        events = json.load(f)
    queued = sorted(e["ts"] for e in events if e.get("name") == "queued" and _is_gradient_bucket(e["args"]["tensor"]))
    return [queued[i : i + BUCKETS] for i in range(0, len(queued) - BUCKETS + 1, BUCKETS)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps, the first two (tracing) left out")
    parser.add_argument("--json", default=None, help="rank 0 also writes a result file here")
    args = parser.parse_args()
    run = result_files.start_run("overlap", launcher=["mpiexec", "-n", str(kd.size())]) if kd.rank() == 0 else None

    keras.utils.set_random_seed(kd.rank())
    model = keras.Sequential(
        [keras.Input((WIDTH,))] + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(LAYERS)]
    )
    model.compile(kd.DistributedOptimizer(keras.optimizers.SGD(1e-3)), loss="mse")
    x = np.random.default_rng(kd.rank()).normal(size=(BATCH * args.steps, WIDTH)).astype("float32")
    model.fit(x, x, batch_size=BATCH, epochs=1, verbose=0, callbacks=kd.callbacks())
    if kd.rank() != 0:
        return
    steps = bucket_queue_times(TIMELINE)[2:]
    os.remove(TIMELINE)
    spreads = [(step[-1] - step[0]) / 1e3 for step in steps]
    periods = [(b[0] - a[0]) / 1e3 for a, b in zip(steps, steps[1:])]
    report = {
        "ranks": kd.size(),
        "steps": len(steps),
        "spread_ms": statistics.median(spreads),
        "period_ms": statistics.median(periods),
        "spread_share": statistics.median(spreads) / statistics.median(periods),
        "per_step": [{"spread_ms": s, "period_ms": p} for s, p in zip(spreads, periods + [None])],
    }
    print("OVERLAP " + json.dumps({k: v for k, v in report.items() if k != "per_step"}), flush=True)
    if args.json:
        result_files.write(args.json, result_files.finish_run(run, **report))


if __name__ == "__main__":
    main()
