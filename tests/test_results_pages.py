"""The measurement tables of docs/performance.md, network.md and experiments.md are what
benchmarks/render.py makes of the result files in benchmarks/results/: a hand edit, or a result
file changed without `make results-pages`, fails here. Every result file says where its numbers
come from, and the pages say it after each table."""

import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import render  # noqa: E402  (benchmarks/render.py)

RESULT_FILES = sorted((ROOT / "benchmarks" / "results").glob("*.json"))


def blocks(text):
    return {match.group("name"): match.group("body") for match in render.BLOCK.finditer(text)}


@pytest.mark.parametrize("page", render.PAGES, ids=lambda page: page.name)
def test_page_is_what_the_generator_makes_of_the_result_files(page):
    expected = render.expected_pages()[page]
    assert page.read_text(encoding="utf-8") == expected, (
        f"docs/{page.name} differs from what benchmarks/render.py makes of benchmarks/results/: "
        "run `make results-pages` (and do not edit the tables between the results markers by hand)"
    )


def test_a_hand_edited_table_is_made_anew():
    page = ROOT / "docs" / "performance.md"
    original = page.read_text(encoding="utf-8")
    body = blocks(original)["allreduce#sizes"]
    edited = original.replace(body, body.replace("|", "| 9.99 |", 3), 1)
    assert edited != original
    assert render.render_page(edited) == render.render_page(original)


def test_allreduce_rows_are_the_result_files_numbers():
    record = json.loads((ROOT / "benchmarks" / "results" / "allreduce.json").read_text())
    table = blocks((ROOT / "docs" / "performance.md").read_text(encoding="utf-8"))["allreduce#sizes"]
    rows = [line for line in table.splitlines() if re.match(r"\| \d", line)]
    assert len(rows) == len(record["sizes"])
    for line, row in zip(rows, record["sizes"]):
        ratio = row["raw_s"] / row["ours_s"]  # raw time over ours: the bandwidth ratio
        assert abs(ratio - row["ratio"]) < 1e-9 and row["ratio_low"] <= ratio <= row["ratio_high"], row
        assert f"| {ratio:.2f} ({row['ratio_low']:.2f}–{row['ratio_high']:.2f}) |" in line, (line, ratio)
        assert line.startswith(
            f"| {row['size_bytes'] // 1024 if row['size_bytes'] < 1 << 20 else row['size_bytes'] >> 20} "
        )


def test_every_result_file_says_where_its_numbers_come_from():
    for path in RESULT_FILES:
        record = json.loads(path.read_text())
        assert {"benchmark", "source", "command", "machine"} <= set(record), path.name
        if record["source"] == "measured":
            assert re.fullmatch(r"[0-9a-f]{40}", record["git"]["commit"]), path.name
            assert isinstance(record["git"]["dirty"], bool), path.name
            assert re.match(r"\d{4}-\d\d-\d\dT", record["date"]), path.name
            assert record["machine"]["cores"] >= 1 and len(record["machine"]["load_average_at_start"]) == 3
        else:
            assert re.fullmatch(
                r"transcribed from docs/\w+\.md as of commit [0-9a-f]{7}, measured .+", record["source"]
            )
            assert record["recorded"] in record["source"], path.name
            assert record["tables"], path.name


def files_read(monkeypatch, make):
    """The result files ``make()`` reads, by name."""
    read, load = [], render.load
    monkeypatch.setattr(render, "load", lambda file: read.append(file) or load(file))
    make()
    return read


def test_pages_mark_recorded_tables_as_recorded_and_measured_ones_as_measured(monkeypatch):
    for page in render.PAGES:
        for name, body in blocks(page.read_text(encoding="utf-8")).items():
            for file in files_read(monkeypatch, lambda name=name: render.block(name)):
                record = json.loads((ROOT / "benchmarks" / "results" / f"{file}.json").read_text())
                measured = record["source"] == "measured"
                said = f"*Measured {record['date'][:10]}" if measured else f"*Recorded {record['recorded']}"
                assert said in body, (page.name, name, said)


BENCH_TARGETS = ("bench", "bench-net", "bench-experiments")


def files_make_writes(makefile):
    """The result files (by name) that the recipes of ``BENCH_TARGETS`` write with --json."""
    recipes, target = {}, None
    for line in makefile.replace("\\\n", " ").splitlines():
        header = re.match(r"^([\w-]+):", line)
        if header:
            target = header.group(1)
        elif target and line.startswith("\t"):
            recipes.setdefault(target, []).append(line)
        elif not line.strip():
            target = None
    return {
        name
        for target in BENCH_TARGETS
        for line in recipes.get(target, [])
        for name in re.findall(r"--json \$\(RESULTS\)/(\w+)\.json", line)
    }


def test_every_result_file_is_written_by_a_make_bench_target():
    # A file no command writes can only have been copied from somewhere: it cannot be re-measured.
    written = files_make_writes((ROOT / "Makefile").read_text())
    unwritten = sorted({path.stem for path in RESULT_FILES} - written)
    assert not unwritten, (
        f"no recipe of make {', '.join(BENCH_TARGETS)} writes benchmarks/results/{{{', '.join(unwritten)}}}.json: "
        "give each a command (--json $(RESULTS)/<name>.json), or drop the file and its table"
    )


def test_the_recipe_reader_finds_continued_and_quoted_lines():
    makefile = (
        "bench: build\n\t$(PY) a.py --json $(RESULTS)/a.json\n\t$(PY) b.py --x 1 \\\n"
        "\t    --json $(RESULTS)/b.json\n\nother:\n\t$(PY) c.py --json $(RESULTS)/c.json\n"
        "bench-net: build\n\t$(PY) d.py --compare_to $(RESULTS)/a.json --json $(RESULTS)/d.json\n"
    )
    assert files_make_writes(makefile) == {"a", "b", "d"}


def test_every_result_file_is_shown_on_a_page(monkeypatch):
    shown = set(files_read(monkeypatch, render.expected_pages))
    assert {path.stem for path in RESULT_FILES} == shown


def test_every_result_file_holds_only_values_a_measurement_can_give():
    for path in RESULT_FILES:
        assert render.impossible_values(json.loads(path.read_text())) == [], path.name


def results_with(monkeypatch, tmp_path, name, change):
    """The repository's result files in ``tmp_path``, ``name``.json changed by ``change(record)``;
    render reads them from there, and writes copies of the pages there, never the repository's."""
    for path in RESULT_FILES:
        (tmp_path / path.name).write_text(path.read_text())
    pages = tmp_path / "pages"
    pages.mkdir()
    for page in render.PAGES:
        (pages / page.name).write_text(page.read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.setattr(render, "PAGES", [pages / page.name for page in render.PAGES])
    record = json.loads((tmp_path / f"{name}.json").read_text())
    change(record)
    (tmp_path / f"{name}.json").write_text(json.dumps(record))  # NaN stays NaN: json writes it as is
    monkeypatch.setattr(render, "RESULTS_DIR", tmp_path)


def refusal(monkeypatch, *argv):
    """What `render.py *argv` exits with."""
    monkeypatch.setattr(sys, "argv", ["render.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        render.main()
    return exit_.value.code


def set_in(path, value):
    def change(record):
        *parents, last = path
        for key in parents:
            record = record[key]
        record[last] = value

    return change


@pytest.mark.parametrize(
    "name, path, value, says",
    [
        ("allreduce", ("sizes", 2, "ours_s"), -2.2477e-3, "sizes[2].ours_s = -0.0022477: a time must be positive"),
        ("allreduce", ("sizes", 0, "raw_s"), 0.0, "sizes[0].raw_s = 0.0: a time must be positive"),
        ("allreduce", ("sizes", 1, "raw_s"), float("nan"), "sizes[1].raw_s = nan: a time must be finite"),
        ("allreduce", ("sizes", 1, "ours_s"), None, "sizes[1].ours_s = null: a time that was not a number"),
        ("allreduce", ("sizes", 3, "ratio"), -0.4, "sizes[3].ratio = -0.4: a ratio of two times or rates must be"),
        ("replica_check", ("models", 1, "share"), 1.5, "models[1].share = 1.5: a share must lie in [0, 1]"),
        ("negotiation_fast_path", ("ours_s",), 1.0, "ours_s = 1.0: outside its own samples' range"),
        ("op_floor", ("sizes", 0, "cases", "raw", "op_s"), 1e-9, "sizes[0].cases.raw.op_s = 1e-09: outside"),
        (
            "network",
            ("tables", "allreduce 1 Gbit", "rows", 0, 3),
            "-0.039 ms",
            "tables.allreduce 1 Gbit row 1 (Sum), 'raw MPI' = '-0.039 ms': not a time",
        ),
    ],
)
def test_render_refuses_a_value_no_measurement_can_give(monkeypatch, tmp_path, name, path, value, says):
    results_with(monkeypatch, tmp_path, name, set_in(path, value))
    for argv in ([], ["--check"]):
        message = refusal(monkeypatch, *argv)
        assert isinstance(message, str) and f"benchmarks/results/{name}.json" in message, message
        assert says in message, message


def test_render_refuses_a_negotiation_path_cost_below_zero(monkeypatch, tmp_path):
    # The fast-path job ran under more load than the slow-path one: its median is the larger.
    slow = json.loads((ROOT / "benchmarks" / "results" / "negotiation_slow_path.json").read_text())
    fast_median = slow["ours_s"] + 2.2477e-3

    def slower_fast_path(record):
        record["ours_samples"] = [fast_median, *record["ours_samples"][1:]]
        record["ours_s"] = fast_median

    results_with(monkeypatch, tmp_path, "negotiation_fast_path", slower_fast_path)
    message = refusal(monkeypatch, "--check")
    assert "negotiation: slow − fast = -2247.7 µs" in message, message
    assert "negotiation_fast_path.json" in message and "negotiation_slow_path.json" in message
    assert "two jobs" in message


def test_render_refuses_negotiation_files_of_the_wrong_cache(monkeypatch, tmp_path):
    results_with(monkeypatch, tmp_path, "negotiation_slow_path", set_in(("cache_capacity",), 1024))
    assert "must be the run with KERASDIST_CACHE_CAPACITY=1" in refusal(monkeypatch, "--check")


def test_a_table_never_shows_an_impossible_derived_time():
    for impossible in (-2.2477e-3, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="no time a table can show"):
            render.duration(impossible)
    assert render.duration(0.0, phase=True) == "0.0 µs"


# ---- figures in prose ---------------------------------------------------------------------------

# A measured figure: a number (or range) with a unit of time, rate, share or speed-up; an E(n)
# value; a bare ratio said against raw MPI or another configuration. Sizes (KiB, MiB) and counts
# are what a run was given, not what it measured.
NUMBER = r"[−+±-]?\d[\d,]*(?:\.\d+)?"
RANGE = rf"{NUMBER}(?:\s?[–-]\s?{NUMBER})?"
FIGURE = re.compile(
    rf"(?<![\w.(]){RANGE}\s?(?:µs|ms|s|%|Gbit/s|Mbit/s|MB/s|GB/s|GiB/s|img/s|images/s|points?)(?![\w/])"
    rf"|(?<![\w.(]){NUMBER}\.\d+(?:\s?[–-]\s?{NUMBER})?\s?×(?!\s?\d)"  # 1.3×: an integer, 16×, is a scale chosen
    rf"|(?<![\w.(])\d+\s?[–-]\s?\d+\s?×(?!\s?\d)"
    rf"|E\(\d+\)[^.;:\n]{{0,40}}?(?<![\w.(]){RANGE}(?![\w.])"
    rf"|(?<![\w.(]){RANGE}(?= (?:of|against) (?:raw|the|twice|its|their|a|one)\b)"
    r"|(?<![\w.])[0-2]\.\d\d+(?![\d.])"  # a ratio or an efficiency, as the tables give them
)
# What a figure may be without a result file: a target, a limit or a setting the reader chooses,
# or a version, told by the words just before it; a link's speed (Gbit/s, Mbit/s) is a setting of
# the emulated hosts when said as "at/over N Gbit/s" or "an N Mbit/s link".
SETTING_BEFORE = re.compile(
    r"(?:\btargets?\b[^.]{0,40}|\btimeout\b[^.]{0,20}|\bbudget\b[^.]{0,20}|\bdefault\b[^.]{0,20}"
    r"|(?:\b|_)(?:momentum|coefficient|decay|rates?|best possible accuracy)[ =(](?:[\d.]+ / )*"
    r"|\b(?:at least|at most|every|after|within|for)\s|KERASDIST_\w+=|--[\w-]+[ =]|[<>≤≥]=?\s?"
    r"|\b(?:Python|TensorFlow|TF|Keras|Slurm|NumPy|mpi4py|MPICH|MPI) )$"
)
LINK_BEFORE = re.compile(r"(?:\bat|\bover(?: an?)?|shaped to|\ban?)\s$")
LINK_AFTER = re.compile(r"\s(?:links?|Ethernet)\b")


def is_setting(line, match):
    before, after = line[: match.start()], line[match.end() :]
    if match.group(0).endswith("bit/s"):
        return bool(LINK_BEFORE.search(before) or LINK_AFTER.match(after))
    return bool(SETTING_BEFORE.search(before))


# reliability.md's fault table and Slurm times are still written by hand from test runs (only its
# notice and growth times come from a result file, benchmarks/elastic.py): not checked until a
# benchmark measures them.
PROSE_PAGES = [page for page in render.PAGES if page.name != "reliability.md"] + [ROOT / "README.md"]


def prose_lines(page):
    """(line number, text) of what a page says by hand: outside the generated blocks and code, and
    of the README only its Status section."""
    text = page.read_text(encoding="utf-8")
    text = render.BLOCK.sub(lambda match: "\n" * match.group(0).count("\n"), text)
    fenced, section = False, None
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
        if line.startswith("## "):
            section = line[3:].strip()
        if fenced or line.startswith("```") or (page.name == "README.md" and section != "Status"):
            continue
        yield number, line


def hand_figures(page):
    """The measured figures a page states by hand that none of its generated blocks holds."""
    text = page.read_text(encoding="utf-8")
    generated = "".join(match.group("body") for match in render.BLOCK.finditer(text))
    found = []
    for number, line in prose_lines(page):
        for match in FIGURE.finditer(line):
            figure = match.group(0)
            if is_setting(line, match):
                continue
            values = re.findall(r"\d[\d,]*(?:\.\d+)?", figure.split(")")[-1] if "E(" in figure else figure)
            if generated and all(re.search(rf"(?<![\d.]){re.escape(value)}(?!\d)", generated) for value in values):
                continue  # the same figure as a table of this page: they cannot disagree unnoticed
            found.append(f"{page.relative_to(ROOT)}:{number}: {figure!r}")
    return found


@pytest.mark.parametrize("page", PROSE_PAGES, ids=lambda page: page.name)
def test_prose_quotes_no_figure_that_no_result_file_holds(page):
    found = hand_figures(page)
    assert not found, (
        "measured figures written by hand, which no results block of the page holds: point at the table's "
        "row instead, or generate the sentence as a results block (benchmarks/render.py's BLOCKS):\n" + "\n".join(found)
    )


def test_points_against_the_baseline_are_the_medians_difference():
    table = json.loads((ROOT / "benchmarks" / "results" / "large_batch_16x.json").read_text())["tables"]["results"]
    body = blocks((ROOT / "docs" / "experiments.md").read_text(encoding="utf-8"))["large_batch_16x#results"]
    accuracy = [index for index, column in enumerate(table["columns"]) if column.startswith("test acc")]
    assert len(accuracy) == 2, table["columns"]  # as Keras evaluates it, and with BatchNorm recomputed
    baseline = [float(table["rows"][0][index].split()[0]) for index in accuracy]
    for row in table["rows"][1:]:
        medians = [float(row[index].strip("*").split()[0].strip("*")) for index in accuracy]
        points = [round(100 * (median - base), 1) for median, base in zip(medians, baseline)]
        shown = " | ".join(f"{point:+.1f}".replace("-", "−") for point in points)
        assert f"| {' | '.join(row)} | {shown} |" in body, (row, shown)


def test_the_network_summary_gives_the_hidden_share_of_each_model_with_default_buckets():
    # network.py names the default "default (KERASDIST_BUCKET_BYTES)"; the summary once matched
    # only the transcribed file's "automatic (8)" and dropped these rows without a word.
    overlap = json.loads((ROOT / "benchmarks" / "results" / "network_overlap.json").read_text())["tables"]["overlap"]
    defaults = [row for row in overlap["rows"] if row[2] != "buckets off"]
    assert defaults, overlap["rows"]
    summary, _ = render.summary_network()
    for row in defaults:
        model, link, share = row[0], row[1], row[-1].strip("*")
        assert f"| share of the communication that gradient buckets hide, {model} over {link} | {share} |" in summary
