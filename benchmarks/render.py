"""Makes the measurement tables of the docs pages, and their plots, from the result files.

How to run (`make bench` and `make bench-net` run it after their benchmarks; `make
results-pages` runs it alone):

  .venv/bin/python benchmarks/render.py            # rewrite the pages' tables
  .venv/bin/python benchmarks/render.py --plots    # and redraw the plots the result files allow
  .venv/bin/python benchmarks/render.py --check    # exit 1 naming each page that differs

A page marks each generated block with a pair of comments; everything between them is this
script's, and a hand edit there is undone by the next run (tests/test_results_pages.py fails on
one meanwhile):

  <!-- results:allreduce#sizes -->
  ...table, and the line saying which run it comes from...
  <!-- /results -->

The name before `#` is a result file of benchmarks/results/ (or a block of several: see
BLOCKS), the name after it one of its tables. Files a benchmark measured are laid out here from
their numbers; transcribed files, and the expensive benchmarks that lay out their own tables,
carry them as {"columns", "rows"}. Every block ends with its provenance: measured (date, commit,
machine, load, command) or recorded (when, and from which page it was transcribed). The output
depends only on the result files, so the same files always make the same pages.

A value no measurement can give stops the run (and --check), naming the file, where in it, and the
value: a time that is zero, negative, NaN (written as null) or infinite; a ratio of times or rates
that is not positive; a share outside [0, 1]; a median outside its own samples' range; a laid-out
cell stating a time that is not positive; and a cost the tables derive (a difference of two
medians, such as the negotiation paths' slow − fast) that comes out negative.
"""

import argparse
import math
import pathlib
import re
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import results as result_files  # noqa: E402  (benchmarks/results.py)

REPO = result_files.REPO
RESULTS_DIR = result_files.RESULTS_DIR
PAGES = [
    REPO / "docs" / name for name in ("performance.md", "network.md", "experiments.md", "scale.md", "reliability.md")
]
BLOCK = re.compile(r"(<!-- results:(?P<name>[^>\n]+?) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


# ---- formatting -------------------------------------------------------------------------------


def duration(seconds, phase=False):
    """A time per op as the tables show it: µs below a millisecond, else ms, 2-3 digits. A time is
    finite and positive; the time spent in one ``phase`` of an op may be zero."""
    if not (math.isfinite(seconds) and (seconds >= 0 if phase else seconds > 0)):
        raise ValueError(f"{seconds!r} s is no time a table can show (a time is finite and positive)")
    micros = seconds * 1e6
    if micros < 10:
        return f"{micros:.1f} µs"
    if micros < 1000:
        return f"{micros:.0f} µs"
    millis = micros / 1e3
    return f"{millis:.2f} ms" if millis < 10 else f"{millis:.1f} ms" if millis < 100 else f"{millis:.0f} ms"


def size(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def markdown(columns, rows):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(record):
    """One line: where the numbers of ``record`` come from."""
    if record["source"] != result_files.MEASURED:
        line = f"Recorded {record['recorded']} ({record['source']}; not re-run since)"
    else:
        git, machine = record["git"], record["machine"]
        commit = (git["commit"] or "unknown")[:7] + (" with uncommitted changes" if git["dirty"] else "")
        load = machine["load_average_at_start"][0]
        line = (
            f"Measured {record['date'].replace('T', ' ').replace('+00:00', ' UTC')} at commit {commit}, "
            f"{machine['cores']} × {machine['cpu']}, load average {load:.1f} at the start"
        )
    note = f" {record['notes'][0].upper()}{record['notes'][1:]}." if record.get("notes") else ""
    return f"*{line}.{note} Command: `{record['command']}`*"


def load(name):
    path = RESULTS_DIR / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"no result file {path.relative_to(REPO)}: a page shows it; run its benchmark with --json")
    record = result_files.read(path)
    problems = impossible_values(record)
    if problems:
        raise SystemExit(
            f"benchmarks/results/{name}.json holds values no measurement can give; not rendering it "
            "(re-run its benchmark, or fix the transcription):\n" + "\n".join(f"  {problem}" for problem in problems)
        )
    return record


# ---- values no measurement can give -------------------------------------------------------------

# Keys of a result file by what their numbers are. A time (or a list of time samples, or a dict of
# times by label) is finite and positive; a breakdown of a time into phases may hold zeros (a phase
# the run never entered); a ratio is positive; a share is a fraction.
TIME_KEY = re.compile(r"(_s|_ms|_us|seconds|samples)$")
BREAKDOWN_KEY = re.compile(r"phases_s$|_per_step$")
RATIO_KEY = re.compile(r"(^|_)ratio(_low|_high)?$|_over_|efficiency")
SHARE_KEY = re.compile(r"(^|_)(share|probability)$")
# model_us: negotiation_scaling.py's least-squares fits ([intercept, slope] in µs), whose intercept
# may be negative; derived from the rows, which are checked.
NOT_MEASURED = ("machine", "git", "config", "setup", "tables", "model_us")
# A laid-out table's cell that states a time: "-2247.7 µs" is refused, "12 ms" is not.
TIME_CELL = re.compile(r"(?<![\w.])([−-]?\d[\d,]*(?:\.\d+)?)\s?(µs|ms|s)\b")
NOT_A_NUMBER_CELL = re.compile(r"\b(nan|inf|infinity)\b", re.I)


def impossible_values(record):
    """What in ``record`` no measurement can give, one line each naming where it is and its value."""
    problems = []

    def where(path):
        return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")

    def check(value, path, kind):
        if isinstance(value, dict):
            for key, item in value.items():
                if key in NOT_MEASURED and not path:
                    continue
                check(item, [*path, key], kind_of(key, kind))
            check_summaries_within_samples(value, path)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                check(item, [*path, index], kind)
        elif kind and kind != "phase time" and value is None:  # a run without the engine has no phases
            problems.append(f"{where(path)} = null: a {kind} that was not a number (NaN is written as null)")
        elif kind and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                problems.append(f"{where(path)} = {value}: a {kind} must be finite")
            elif kind == "time" and value <= 0:
                problems.append(f"{where(path)} = {value}: a time must be positive")
            elif kind == "phase time" and value < 0:
                problems.append(f"{where(path)} = {value}: a time spent in a phase cannot be negative")
            elif kind == "ratio" and value <= 0:
                problems.append(f"{where(path)} = {value}: a ratio of two times or rates must be positive")
            elif kind == "share" and not 0 <= value <= 1:
                problems.append(f"{where(path)} = {value}: a share must lie in [0, 1]")

    def kind_of(key, inherited):
        if inherited == "phase time" or BREAKDOWN_KEY.search(str(key)):
            return "phase time"
        if TIME_KEY.search(str(key)):
            return "time"
        if RATIO_KEY.search(str(key)):
            return "ratio"
        if SHARE_KEY.search(str(key)):
            return "share"
        return inherited

    def check_summaries_within_samples(row, path):
        # A median (or best, or any one summary) of samples lies within their range.
        for key, value in row.items():
            stem = re.sub(r"_(s|ms)$", "", str(key))
            if stem == key or not isinstance(value, (int, float)):
                continue
            for samples_key in (f"{stem}_samples", f"{stem}_samples_ms", *(["samples"] if stem == "op" else [])):
                samples = row.get(samples_key)
                if not (isinstance(samples, list) and samples and all(isinstance(x, (int, float)) for x in samples)):
                    continue
                if not min(samples) <= value <= max(samples):
                    problems.append(
                        f"{where([*path, key])} = {value}: outside its own samples' range "
                        f"[{min(samples)}, {max(samples)}] ({where([*path, samples_key])})"
                    )

    check(record, [], None)
    for table_name, table in record.get("tables", {}).items():
        for row_number, row in enumerate(table["rows"], start=1):
            for column, cell in zip(table["columns"], row):
                text = str(cell)
                values = [float(number.replace("−", "-").replace(",", "")) for number, _ in TIME_CELL.findall(text)]
                if NOT_A_NUMBER_CELL.search(text) or any(value <= 0 for value in values):
                    problems.append(
                        f"tables.{table_name} row {row_number} ({row[0]}), {column!r} = {text!r}: not a time"
                    )
    return problems


# ---- blocks made from measured numbers ----------------------------------------------------------


def allreduce_sizes():
    record = load("allreduce")
    rows = [
        [
            size(row["size_bytes"]),
            duration(row["raw_s"]),
            duration(row["ours_s"]),
            f"{row['ratio']:.2f} ({row['ratio_low']:.2f}–{row['ratio_high']:.2f})",
        ]
        for row in record["sizes"]
    ]
    columns = ["float32 size", "raw MPI", "kerasdist", "kerasdist / raw bandwidth (range over repeats)"]
    return markdown(columns, rows), [record]


FUSION_CASES = (
    ("many", "kerasdist: kd.grouped_allreduce", "one `grouped_allreduce`"),
    ("many", None, "one `allreduce` op per tensor"),
    ("resnet50", "kerasdist: kd.grouped_allreduce", "one `grouped_allreduce`"),
)


def allreduce_fusion():
    """Fused (default threshold) against unfused (threshold 0): two runs, so each kerasdist time
    is also given against raw per-tensor MPI of its own run, which cancels drift between them."""
    fused_run, unfused_run = load("allreduce"), load("allreduce_unfused")
    rows = []
    for section, label, shown in FUSION_CASES:
        fused, unfused = fused_run[section], unfused_run[section]
        if label is None:
            label = f"kerasdist: {fused['tensors']} kd.allreduce per step"
        raw = "raw: one Allreduce per tensor"
        what = (
            f"{fused['tensors']} × {size(fused['bytes'] // fused['tensors'])}"
            if section == "many"
            else f"ResNet-50's {fused['tensors']} gradients ({size(fused['bytes'])})"
        )
        fused_share = fused["step_seconds"][label] / fused["step_seconds"][raw]
        unfused_share = unfused["step_seconds"][label] / unfused["step_seconds"][raw]
        rows.append(
            [
                f"{what}, {shown}",
                duration(fused["step_seconds"][raw]),
                duration(fused["step_seconds"]["raw: one flat buffer"]),
                f"{duration(fused['step_seconds'][label])} ({fused_share:.2f})",
                f"{duration(unfused['step_seconds'][label])} ({unfused_share:.2f})",
                f"{unfused_share / fused_share:.2f}×",
            ]
        )
    columns = [
        "per step",
        "raw: per tensor",
        "raw: one flat buffer",
        "kerasdist, default threshold (÷ raw per tensor)",
        "kerasdist, threshold 0 (÷ raw per tensor of its run)",
        "fused speed-up",
    ]
    return markdown(columns, rows), [fused_run, unfused_run]


KERAS_ROWS = (
    ("plain", "plain Keras, 1 process"),
    ("kerasdist-1", "kerasdist, 1 process"),
    ("kerasdist-N", "kerasdist, {n} ranks"),
    ("independent-N", "{n} independent plain processes"),
)


# The thread roles of examples/keras_synthetic_benchmark.py's CPU split, as the pages name them.
KERAS_THREAD_ROLES = {"python": "Keras loop", "tensorflow": "TensorFlow", "kerasdist": "kerasdist engine"}


def keras_throughput(name="keras_scaling"):
    record = load(name)
    summary, ranks = record["summary"], record["setup"]["ranks"]
    by_thread = summary.get("cpu_ms_per_step_by_thread", {})
    split = all(by_thread.get(name) for name, _ in KERAS_ROWS)
    rows = [
        [
            shown.format(n=ranks),
            f"{summary['images_per_second']['median'][name]:.0f}",
            f"{summary['images_per_second']['best'][name]:.0f}",
            f"{summary['step_ms'][name]:.1f}",
            f"{summary['cpu_ms_per_step_per_rank'][name]:.1f}",
            *([f"{by_thread[name][role]:.2f}" for role in KERAS_THREAD_ROLES] if split else []),
        ]
        for name, shown in KERAS_ROWS
    ]
    columns = ["configuration", "median img/s", "best run", "step ms", "CPU ms/step/rank"]
    if split:
        columns += [f"of which {shown}" for shown in KERAS_THREAD_ROLES.values()]
    return markdown(columns, rows), [record]


def keras_ratios(name="keras_scaling"):
    record = load(name)
    estimates, n = record["summary"]["ratios"], record["setup"]["ranks"]
    shown = (
        ("size1_overhead", "size-1 overhead, 1 − thr(kd, 1) / thr(plain)", "{:+.1%}", "≤ 3 %"),
        ("efficiency_vs_kerasdist_1", f"E({n}) = thr(kd, {n}) / ({n} · thr(kd, 1))", "{:.3f}", "≥ 0.9"),
        ("efficiency_vs_plain", f"E({n}) against plain Keras at 1 process", "{:.3f}", ""),
        ("ceiling_efficiency", f"ceiling E({n}), {n} independent processes", "{:.3f}", ""),
        ("efficiency_over_ceiling", f"E({n}) / ceiling: the share of the machine's own scaling kept", "{:.3f}", ""),
    )
    order = ("median", "per round", "best run", "CPU time")
    rows = [
        [label, *(fmt.format(estimates[way][key]).replace("-", "−") for way in order), target]
        for key, label, fmt, target in shown
    ]
    return markdown(["ratio", *order, "target"], rows), [record]


PHASE_COLUMNS = (
    ("negotiation", "negotiation"),
    ("copy_in", "copy in"),
    ("transfer", "transfer (MPI)"),
    ("outputs", "outputs"),
    ("hand_back", "hand back"),
    ("other", "other"),
    ("outside", "outside the engine"),
)


def allreduce_phases():
    """kerasdist's time per op split by the engine thread's phases (benchmarks/allreduce.py)."""
    record = load("allreduce")
    cases = [
        (f"{size(row['size_bytes'])}, chained", row["raw_s"], row["ours_s"], row["phases_s"]) for row in record["sizes"]
    ]
    many = record["many"]
    flat = many["step_seconds"]["raw: one flat buffer"]
    for label, phases in many["step_phases_s"].items():
        shown = label.removeprefix("kerasdist: ").replace("kd.", "")
        cases.append(
            (
                f"{many['tensors']} × {size(many['bytes'] // many['tensors'])}: {shown}",
                flat,
                many["step_seconds"][label],
                phases,
            )
        )
    rows = []
    for label, raw_s, ours_s, phases in cases:
        other = phases["other"] + phases["slow_path"]
        cells = [duration(other if key == "other" else phases[key], phase=True) for key, _ in PHASE_COLUMNS]
        rows.append([label, duration(raw_s), duration(ours_s), *cells])
    columns = [
        "per op (per step for the 160)",
        "raw MPI, same bytes",
        "kerasdist",
        *(name for _, name in PHASE_COLUMNS),
    ]
    return markdown(columns, rows), [record]


def negotiation_one_host():
    """The two paths' costs are differences between two jobs (the cache capacity is fixed at
    init), so a load change between them can outweigh what is measured: refused, not shown."""
    fast, slow = load("negotiation_fast_path"), load("negotiation_slow_path")
    if slow["cache_capacity"] != 1 or fast["cache_capacity"] == 1:
        raise SystemExit(
            "negotiation_slow_path.json must be the run with KERASDIST_CACHE_CAPACITY=1 and "
            f"negotiation_fast_path.json one with the default cache; they say cache_capacity "
            f"{slow['cache_capacity']} and {fast['cache_capacity']}"
        )
    raw = statistics.median(fast["raw_samples"] + slow["raw_samples"])
    costs = {"fast − raw": fast["ours_s"] - raw, "slow − fast": slow["ours_s"] - fast["ours_s"]}
    for label, cost in costs.items():
        if cost <= 0:
            raise SystemExit(
                f"negotiation: {label} = {cost * 1e6:.1f} µs (fast path {fast['ours_s'] * 1e6:.1f} µs in "
                f"negotiation_fast_path.json, slow path {slow['ours_s'] * 1e6:.1f} µs in negotiation_slow_path.json, "
                f"raw {raw * 1e6:.1f} µs): a cost cannot be negative. The paths are timed in two jobs, and the "
                "machine's load changed between them by more than the cost; re-run both of make bench's "
                "negotiation lines on a quiet machine"
            )
    row = [
        f"{fast['ranks']} (one host)",
        duration(raw),
        duration(fast["ours_s"]),
        duration(slow["ours_s"]),
        *(duration(cost) for cost in costs.values()),
    ]
    columns = ["ranks", "raw MPI 4-byte allreduce", "kerasdist, fast path", "kerasdist, slow path"]
    return markdown([*columns, "fast − raw", "slow − fast"], [row]), [fast, slow]


def op_floor():
    """kerasdist's fixed cost per op against the budget a target ratio leaves, and TensorFlow's own
    per-op cost beneath it (benchmarks/op_floor.py), at 2 ranks and at 1."""
    records = [load("op_floor"), load("op_floor_one_rank")]
    rows = []
    for record in records:
        agreement = record["agreement"]["op_s"]
        alone = record["ranks"] == 1  # nothing to transfer: no budget to speak of
        for row in record["sizes"]:
            cases = row["cases"]
            raw, ours = cases["raw"]["op_s"], cases["kerasdist"]["op_s"]
            floor_share = "" if alone else f" ({row['floor_s'] / row['budget_s']:.2f})"
            rows.append(
                [
                    record["ranks"],
                    size(row["size_bytes"]),
                    duration(raw),
                    duration(ours) if alone else f"{duration(ours)} ({raw / ours:.2f})",
                    duration(row["fixed_s"]),
                    "—" if alone else duration(row["budget_s"]),
                    duration(cases["TensorFlow, sync"]["op_s"]),
                    duration(cases["TensorFlow, async"]["op_s"]),
                    duration(agreement),
                    duration(row["floor_s"]) + floor_share,
                ]
            )
    target = records[0]["target"]
    columns = [
        "ranks",
        "float32 size",
        "raw MPI",
        "kerasdist (/ raw)",
        "fixed: kerasdist − raw",
        f"budget at {target} × raw",
        "TensorFlow, sync kernel",
        "TensorFlow, async kernel",
        "raw agreement (8 bytes)",
        "floor: async + agreement (/ budget)",
    ]
    return markdown(columns, rows), records


def replica_check():
    """What one replica check costs against an epoch of the Keras benchmark (benchmarks/replica_check.py)."""
    record = load("replica_check")
    rows = [
        [
            row["model"],
            f"{row['parameters']:,}",
            row["variables_checked"],
            duration(row["check_ms"] / 1e3),
            duration(row["epoch_ms"] / 1e3),
            f"{100 * row['share']:.2f} %",
            f"{row['epoch_on_over_off']:.3f}",
        ]
        for row in record["models"]
    ]
    columns = [
        "model",
        "parameters",
        "variables checked",
        "one check",
        f"epoch of {record['batches_per_epoch']} batches (check off)",
        "check / epoch",
        "epoch with check / without",
    ]
    return markdown(columns, rows), [record]


def summary_allreduce():
    """kerasdist against raw MPI per size: on one host (allreduce.json, measured by `make bench`)
    and between 2 hosts at 1 Gbit/s (network.json's Sum rows)."""
    one_host, network = load("allreduce"), load("network")
    two_hosts = {
        row[1]: row[5] for row in network["tables"]["allreduce 1 Gbit"]["rows"] if row[0] == "Sum"
    }  # size -> "ratio (range)"
    rows = [
        [
            size(row["size_bytes"]),
            f"{row['ratio']:.2f} ({row['ratio_low']:.2f}–{row['ratio_high']:.2f})",
            two_hosts.get(size(row["size_bytes"]), "not measured"),
            "allreduce.json, network.json",
        ]
        for row in one_host["sizes"]
    ]
    columns = [
        "float32 allreduce",
        f"one host, {one_host['ranks']} ranks: raw MPI time / kerasdist time (range)",
        "2 hosts at 1 Gbit/s: raw MPI time / kerasdist time (range)",
        "from benchmarks/results/",
    ]
    return markdown(columns, rows), [one_host, network]


def summary_keras():
    """model.fit scaling at 2 ranks on one host against plain Keras, per model (median of rounds)."""
    records = [load("keras_scaling"), load("keras_scaling_mlp")]
    rows = []
    for record, file in zip(records, ("keras_scaling.json", "keras_scaling_mlp.json")):
        ratios, n = record["summary"]["ratios"]["median"], record["setup"]["ranks"]
        model = record["setup"]["model"]
        rows.append(
            [
                f"`{model}`, {n} ranks",
                f"{ratios['efficiency_vs_plain']:.3f}",
                f"{ratios['efficiency_vs_kerasdist_1']:.3f}",
                f"{ratios['ceiling_efficiency']:.3f}",
                f"{ratios['efficiency_over_ceiling']:.3f}",
                file,
            ]
        )
    n = records[0]["setup"]["ranks"]
    columns = [
        "model.fit, one host",
        f"E({n}) against plain Keras at 1 process",
        f"E({n}) against kerasdist at 1 process",
        f"ceiling: {n} plain processes that never communicate",
        f"E({n}) / ceiling",
        "from benchmarks/results/",
    ]
    return markdown(columns, rows), records


def summary_network():
    """What a user decides from across hosts, one figure a row, each naming its result file: the
    allreduce against raw MPI at 1 Gbit/s, the share of communication gradient buckets hide, and
    each slow-link method's accuracy and training time."""
    network, overlap, slow_links = load("network"), load("network_overlap"), load("slow_links_cluster")
    ratios = {row[1]: row[5] for row in network["tables"]["allreduce 1 Gbit"]["rows"] if row[0] == "Sum"}
    middle = [float(ratios[size].split()[0]) for size in ("64 KiB", "1 MiB", "4 MiB", "16 MiB")]
    rows = [
        [
            "allreduce at 1 Gbit/s (Sum), raw MPI time / kerasdist time",
            f"{min(middle):.2f}–{max(middle):.2f} from 64 KiB to 16 MiB; {ratios['4 KiB'].split()[0]} at 4 KiB",
            "network.json",
        ]
    ]
    for row in overlap["tables"]["overlap"]["rows"]:
        if row[2].startswith(("automatic", "default")):  # the default buckets, as recorded and as network.py names them
            rows.append(
                [
                    f"share of the communication that gradient buckets hide, {row[0]} over {row[1]}",
                    row[-1].strip("*"),
                    "network_overlap.json",
                ]
            )
    table = slow_links.get("tables", {}).get("results") or {"columns": [], "rows": []}
    column = {name: index for index, name in enumerate(table["columns"])}
    for row in table["rows"]:
        seconds, _, against_synchronous = row[column["training s, median"]].partition(" ")
        rows.append(
            [
                f"{row[0]} at 1 Gbit/s: final test accuracy; training time (medians of 3 seeds)",
                f"{row[column['final test acc, median']]}; {seconds} s {against_synchronous}".strip(),
                "slow_links_cluster.json",
            ]
        )
    return markdown(["2 hosts, one rank each", "figure", "from benchmarks/results/"], rows), [
        network,
        overlap,
        slow_links,
    ]


def summary_experiments():
    """The two experiments' answers, one row each, naming the result file: per batch, the best
    method against the small-batch baseline; per setting, the updates noise-scale growth
    needed to reach 99 % of the baseline's accuracy."""
    rows, records = [], []
    for file in ("large_batch_16x", "large_batch"):
        record = load(file)
        records.append(record)
        table = record["tables"]["results"]
        baseline = next(row for row in table["rows"] if "(baseline)" in row[0])
        accuracy = table["columns"].index("test acc, BN recomputed")

        def median(row, accuracy=accuracy):
            return float(re.match(r"\**([\d.]+)", row[accuracy]).group(1))

        for batch in sorted({row[1] for row in table["rows"] if row is not baseline}, key=int):
            best = max((row for row in table["rows"] if row[1] == batch and row is not baseline), key=median)
            scale = int(batch) // int(baseline[1])
            points = f"{100 * (median(best) - median(baseline)):+.1f}".replace("-", "−")
            rows.append(
                [
                    f"batch {batch} ({scale}× the baseline's {baseline[1]}), same epochs: the best method, points "
                    "of test accuracy against the baseline (BatchNorm statistics recomputed)",
                    f"{best[0]}: {points} points",
                    f"{file}.json",
                ]
            )
    for file, where in (
        ("batch_growth", "one process, generated task"),
        ("batch_growth_digits", "one process, digits"),
        ("batch_growth_cluster", "2 hosts at 1 Gbit/s"),
    ):
        record = load(file)
        records.append(record)
        table = record["tables"]["results"]
        column = {name: index for index, name in enumerate(table["columns"])}
        growth = next(row for row in table["rows"] if row[0] == "growth: noise scale")
        steps = column.get("updates to 99 %", column.get("steps to 99 %"))
        answer = growth[steps]
        seconds, _, faster = growth[column["s to 99 %"]].partition(" ") if "s to 99 %" in column else ("", "", "")
        if "faster" in faster:  # across hosts; in one process growth saves updates, not seconds
            answer += f"; {seconds} s {faster}"
        rows.append(
            [
                f"noise-scale batch growth, {where}: updates to 99 % of the fixed batch's accuracy",
                answer,
                f"{file}.json",
            ]
        )
    return markdown(["question", "answer", "from benchmarks/results/"], rows), records


# The negotiation model's assumptions (docs/network.md says why): a small allreduce's latency per
# round on TCP Ethernet and on InfiniBand, ResNet-50's grouped request, rank 0's receive bandwidth
# and its time to check one rank's copy.
ROUND_LATENCY_S = {"TCP": 30e-6, "InfiniBand": 3e-6}
REQUEST_BYTES = 6000
RECEIVE_BITS_PER_S = 10e9
CHECK_PER_RANK_S = 5e-6


def negotiation_model():
    """What the negotiation model predicts at scale: arithmetic from the 2-rank, 2-host row of
    negotiation_scaling.json (c_fast = fast − raw, c_slow = slow − fast, µs) and the assumptions
    above, not a measurement."""
    record = load("negotiation_scaling")
    table = record["tables"]["negotiation"]
    row = dict(zip(table["columns"], next(row for row in table["rows"] if row[0] == "2 (2)")))
    fast_s, slow_s = float(row["fast - raw"]) * 1e-6, float(row["slow - fast"]) * 1e-6
    per_rank_s = REQUEST_BYTES * 8 / RECEIVE_BITS_PER_S + CHECK_PER_RANK_S
    rows = [
        [
            f"{ranks:,}",
            "; ".join(duration(fast_s + latency * math.log2(ranks)) for latency in ROUND_LATENCY_S.values()),
            duration(slow_s + ranks * per_rank_s),
        ]
        for ranks in (16, 1024, 4096)
    ]
    latencies = "; ".join(f"{name} α = {duration(latency)}" for name, latency in ROUND_LATENCY_S.items())
    columns = [
        "ranks",
        f"fast path per cycle ({latencies})",
        f"slow path extra, ResNet-50's grouped request (m = {REQUEST_BYTES / 1000:.0f} KB, "
        f"B = {RECEIVE_BITS_PER_S / 1e9:.0f} Gbit/s, v = {duration(CHECK_PER_RANK_S)})",
    ]
    return markdown(columns, rows), [record]


BLOCKS = {
    "summary#experiments": summary_experiments,
    "summary#network": summary_network,
    "large_batch#results": lambda: accuracy_against_baseline("large_batch#results"),
    "large_batch_16x#results": lambda: accuracy_against_baseline("large_batch_16x#results"),
    "negotiation_scaling#model": negotiation_model,
    "summary#allreduce": summary_allreduce,
    "summary#keras": summary_keras,
    "allreduce#sizes": allreduce_sizes,
    "allreduce#fusion": allreduce_fusion,
    "allreduce#phases": allreduce_phases,
    "keras_scaling#throughput": keras_throughput,
    "keras_scaling#ratios": keras_ratios,
    "keras_scaling_mlp#throughput": lambda: keras_throughput("keras_scaling_mlp"),
    "keras_scaling_mlp#ratios": lambda: keras_ratios("keras_scaling_mlp"),
    "negotiation#one_host": negotiation_one_host,
    "op_floor#sizes": op_floor,
    "replica_check#models": replica_check,
}


def accuracy_against_baseline(name):
    """A transcribed accuracy table with, per row, how many points each accuracy column lies from
    the baseline row's (medians as the cells give them), so that no page works them out by hand."""
    file, _, key = name.partition("#")
    record = load(file)
    table = record["tables"][key]
    accuracy_columns = [index for index, column in enumerate(table["columns"]) if column.startswith("test acc")]

    def median(cell):
        return float(re.match(r"\**([\d.]+)", cell).group(1))

    baseline = next(row for row in table["rows"] if "(baseline)" in row[0])
    rows = []
    for row in table["rows"]:
        points = [
            "—" if row is baseline else f"{100 * (median(row[i]) - median(baseline[i])):+.1f}".replace("-", "−")
            for i in accuracy_columns
        ]
        rows.append([*row, *points])
    labels = [
        "points against the baseline" + (", BN recomputed" if "BN recomputed" in table["columns"][i] else "")
        for i in accuracy_columns
    ]
    columns = [*table["columns"], *labels]
    return markdown(columns, rows), [record]


def laid_out_table(name):
    """A table a result file carries laid out (transcribed, or printed by its benchmark)."""
    file, _, key = name.partition("#")
    record = load(file)
    tables = record.get("tables", {})
    if key not in tables:
        raise SystemExit(f"{file}.json has no table {key!r} (it has {sorted(tables)}); fix the page's marker")
    return markdown(tables[key]["columns"], tables[key]["rows"]), [record]


def block(name):
    """The generated text between a block's markers."""
    try:
        table, records = BLOCKS.get(name, lambda: laid_out_table(name))()
    except ValueError as error:  # a value derived from the files (a difference, a quotient) is impossible
        raise SystemExit(f"block results:{name}: {error}; not rendering it") from error
    return table + "\n\n" + "\n\n".join(provenance(record) for record in records) + "\n"


def render_page(text):
    """``text`` with every block's body made anew from the result files."""
    return BLOCK.sub(lambda m: m.group(1) + block(m.group("name")) + m.group(4), text)


def expected_pages():
    """Each page as the result files in the repository make it."""
    return {page: render_page(page.read_text(encoding="utf-8")) for page in PAGES}


# ---- plots --------------------------------------------------------------------------------------


def plot_allreduce(path):
    """The summary's allreduce table as a plot: kerasdist against raw MPI per size on one host
    (allreduce.json, with the range over repeats) and between 2 hosts at 1 Gbit/s (network.json's
    Sum rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record, network = load("allreduce"), load("network")
    rows = record["sizes"]
    sizes = [row["size_bytes"] for row in rows]
    ratios = [row["ratio"] for row in rows]
    below = [row["ratio"] - row["ratio_low"] for row in rows]
    above = [row["ratio_high"] - row["ratio"] for row in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.errorbar(sizes, ratios, yerr=[below, above], marker="o", capsize=3, label=f"one host, {record['ranks']} ranks")
    two_hosts = {row[1]: row[5] for row in network["tables"]["allreduce 1 Gbit"]["rows"] if row[0] == "Sum"}
    how = "measured" if network["source"] == result_files.MEASURED else "recorded"
    shown = [(s, two_hosts[size(s)]) for s in sizes if size(s) in two_hosts]
    if shown:
        medians, lows, highs = zip(*(map(float, re.findall(r"[\d.]+", cell)[:3]) for _, cell in shown))
        ax.errorbar(
            [s for s, _ in shown],
            medians,
            yerr=[[m - lo for m, lo in zip(medians, lows)], [hi - m for m, hi in zip(medians, highs)]],
            marker="s",
            capsize=3,
            label=f"2 hosts at 1 Gbit/s ({how})",
        )
    ax.axhline(1.0, color="grey", ls=":", lw=1, label="parity with raw MPI")
    ax.set(
        xscale="log",
        xlabel="float32 tensor size (bytes)",
        ylabel="raw MPI time / kerasdist time",
        title="allreduce against raw MPI (median; bars: range over repeats)",
    )
    ax.set_xticks(sizes, [size(s) for s in sizes])
    ax.legend(fontsize=8)
    fig.text(
        0.01,
        0.01,
        f"one host: {record['date']}, {record['machine']['cores']} cores, shared machine; "
        f"2 hosts: {how} {network.get('recorded', network.get('date'))}",
        fontsize=7,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def plot_with_benchmark(module_name, draw):
    """A plot the benchmark itself draws from its own runs' data, which only measured result
    files hold (a transcribed file keeps the tables only, and the page keeps its recorded plot)."""

    def plot(record, path):
        import argparse as argparse_module
        import importlib

        module = importlib.import_module(module_name)
        draw(module, record, argparse_module.Namespace(**record["config"]), path)

    return plot


PLOTS = {
    "docs/allreduce_one_host.png": ("allreduce", lambda record, path: plot_allreduce(path)),
    "docs/large_batch_32x_64x.png": (
        "large_batch",
        plot_with_benchmark("large_batch", lambda m, r, args, path: m.save_plot(r["results"], args, path)),
    ),
    "docs/large_batch.png": (
        "large_batch_16x",
        plot_with_benchmark("large_batch", lambda m, r, args, path: m.save_plot(r["results"], args, path)),
    ),
    "docs/batch_growth.png": (
        "batch_growth",
        plot_with_benchmark(
            "batch_growth", lambda m, r, args, path: m.save_plot(r["results"], r["targets"], args, path)
        ),
    ),
    "docs/slow_links_accuracy.png": (
        "slow_links_cluster",
        plot_with_benchmark(
            "slow_links_cluster",
            lambda m, r, args, path: m.save_plot(r["results"], r["targets"], args, r["link_tcp_gbits"], path),
        ),
    ),
}


def draw_plots(say):
    for png, (name, draw) in PLOTS.items():
        record = load(name)
        if record["source"] != result_files.MEASURED:
            say(f"  {png}: kept as drawn ({name}.json is transcribed: it holds the tables, not the runs' curves)")
            continue
        draw(record, REPO / png)
        say(f"  {png}: drawn from {name}.json")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is not as generated")
    parser.add_argument("--plots", action="store_true", help="also redraw the plots from the result files")
    args = parser.parse_args()
    stale = []
    for page, text in expected_pages().items():
        if page.read_text(encoding="utf-8") == text:
            continue
        stale.append(page.relative_to(REPO))
        if not args.check:
            page.write_text(text, encoding="utf-8")
    if args.check:
        for page in stale:
            print(f"{page}: not what benchmarks/render.py makes of benchmarks/results/; run it (make results-pages)")
        return 1 if stale else 0
    print("rewrote " + (", ".join(map(str, stale)) if stale else "nothing: the pages were up to date"))
    if args.plots:
        draw_plots(print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
