"""What local SGD, delayed and 1-bit gradients cost in accuracy on the digits example, at 2 ranks.

How to run (one host; it starts each 2-rank job itself, ~10 min on 2 cores; `make bench` runs it):

  .venv/bin/python benchmarks/digits_methods.py --json benchmarks/results/digits_methods.json
  .venv/bin/python benchmarks/digits_methods.py --seeds 1 --epochs 3   # quick look

Each configuration is `kerasdist-run -np 2 examples/keras_digits.py` (a small CNN on
scikit-learn's digits, 20 epochs, a batch of 32 per rank, the example's warmup and rate) with one
flag more, for seeds 0 .. --seeds-1 (the seed sets the split, the weights and the shuffles):

  synchronous        no flag: one gradient allreduce per step
  average every N    --average_models_every N (kerasdist.callbacks.ModelAveraging, local SGD)
  delayed            --delay_gradients (each step applies the previous step's allreduce)
  1-bit              --one_bit_gradients (signs with error feedback)

Seeds take turns through the configurations, so that every configuration of a seed runs under
about the same load. Reported: the example's final test accuracy (evaluated over every rank's
part of the held-out images) per seed and the median. docs/network.md shows the two tables of
the result file (benchmarks/results.py): local SGD against synchronous, and delayed and 1-bit
against synchronous, from the same synchronous runs.
"""

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results as result_files  # noqa: E402  (benchmarks/results.py)

REPO = result_files.REPO
EXAMPLE = REPO / "examples" / "keras_digits.py"
CONFIGURATIONS = {
    "synchronous": [],
    "average every 4": ["--average_models_every=4"],
    "average every 16": ["--average_models_every=16"],
    "delayed": ["--delay_gradients"],
    "1-bit": ["--one_bit_gradients"],
}
TABLES = {
    "local_sgd": ["synchronous", "average every 4", "average every 16"],
    "delayed_one_bit": ["synchronous", "delayed", "1-bit"],
}
ACCURACY = re.compile(r"test accuracy (\d\.\d+)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20, help="the example's --epochs")
    parser.add_argument("--np", type=int, default=2, help="ranks of every job")
    parser.add_argument("--job_timeout_s", type=int, default=600)
    parser.add_argument("--json", default=str(REPO / "bench-results" / "digits_methods.json"))
    return parser.parse_args(argv)


def test_accuracy(configuration, seed, args):
    """The final test accuracy rank 0 prints for one job; a failed job stops the benchmark with its output."""
    launcher = pathlib.Path(sys.executable).parent / "kerasdist-run"
    command = [
        str(launcher),
        "-np",
        str(args.np),
        str(EXAMPLE),
        f"--seed={seed}",
        f"--epochs={args.epochs}",
        *CONFIGURATIONS[configuration],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.job_timeout_s)
    found = ACCURACY.findall(done.stdout)
    if done.returncode != 0 or len(found) != 1:
        raise SystemExit(
            f"{configuration}, seed {seed}: exit status {done.returncode}, {len(found)} accuracy lines "
            f"(one expected): {' '.join(command)}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
        )
    return float(found[0])


def accuracy_table(accuracies, columns, seeds):
    """Rows per seed and a median row, test accuracy per configuration."""
    rows = [[str(seed), *(f"{accuracies[c][seed]:.4f}" for c in columns)] for seed in range(seeds)]
    rows.append(["median", *(f"{statistics.median(accuracies[c]):.4f}" for c in columns)])
    return {"columns": ["seed", *columns], "rows": rows}


def main(args):
    run = result_files.start_run("digits_methods")
    accuracies = {configuration: [] for configuration in CONFIGURATIONS}
    for seed in range(args.seeds):
        for configuration in CONFIGURATIONS:
            accuracy = test_accuracy(configuration, seed, args)
            accuracies[configuration].append(accuracy)
            print(f"seed {seed} {configuration:16s} test accuracy {accuracy:.4f} (load {os.getloadavg()[0]:.1f})")
    tables = {name: accuracy_table(accuracies, columns, args.seeds) for name, columns in TABLES.items()}
    for table in tables.values():
        print("\n" + "\n".join(" | ".join(row) for row in [table["columns"], *table["rows"]]))
    record = result_files.finish_run(
        run,
        setup={"ranks": args.np, "epochs": args.epochs, "seeds": args.seeds, "example": "examples/keras_digits.py"},
        test_accuracy=accuracies,
        load_average_at_end=[round(value, 2) for value in os.getloadavg()],
        tables=tables,
    )
    print(f"wrote {result_files.write(args.json, record)}")


if __name__ == "__main__":
    main(parse_args())
