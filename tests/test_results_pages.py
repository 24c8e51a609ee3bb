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


def test_every_result_file_is_shown_on_a_page(monkeypatch):
    shown = set(files_read(monkeypatch, render.expected_pages))
    assert {path.stem for path in RESULT_FILES} == shown
