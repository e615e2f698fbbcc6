"""The benchmark tables of the docs are the records' (docs/development.md, "Benchmark records"): every table between
bench-table markers is what ``python -m docs_hooks.bench_tables`` renders from ``bench/results/``, and the renderer
formats figures as its specs say and names each record without a path of the machine it ran on.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
STEP = REPO / "docs_hooks" / "bench_tables.py"
MACHINE_PATH = re.compile(r"/(?:work|tmp|root|home)/")


def _step() -> ModuleType:
    """The docs build step, loaded from its file (it puts bench/ on the path for the table specs)."""
    spec = importlib.util.spec_from_file_location("bench_tables_step", STEP)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


STEP_MODULE = _step()
_tables = importlib.import_module("_tables")  # bench/_tables.py, on the path once the step is loaded


def _record(folder: Path, name: str, date: str, commit: str, figures: dict, **fields) -> Path:
    record = {
        "benchmark": name,
        "command": "python bench/bench_toy.py --out /work/runs/toy --data /usr/share/datasets/toy --cache=/root/c",
        "date": date,
        "commit": commit,
        "cpu": {"vendor": "AuthenticAMD", "model_name": "AMD EPYC", "family": "25", "model": "1", "avx512": False},
        "figures": figures,
        **fields,
    }
    path = folder / f"{name}-{date}-{commit}.json"
    path.write_text(json.dumps(record), encoding="utf-8")
    return path


TOY = _tables.Table(
    label="device",
    rows=lambda figures: figures["devices"].items(),
    columns=(
        _tables.Column("round {rounds}'s own", lambda d: d["own"], _tables.percent),
        _tables.Column("served − own", lambda d: d["difference"], _tables.points),
        _tables.Column("images", lambda d: d["images"], _tables.signed),
        _tables.Column("payload", lambda d: d["bytes"], _tables.megabytes),
        _tables.Column("evaluation", lambda d: d["seconds"], _tables.seconds),
        _tables.Column("note", lambda d: d.get("note"), align="left"),
    ),
)
FIGURES = {
    "rounds": 6,
    "devices": {
        "pi": {"own": 0.8386, "difference": 0.0029, "images": 6, "bytes": 9832456, "seconds": 5.3686, "note": "a|b"},
        "nano": {"own": 0.7, "difference": -0.0035, "images": -6, "bytes": 430000, "seconds": 2.0, "note": None},
        "laptop": {"own": 0.5, "difference": -0.00001, "images": 0, "bytes": 0, "seconds": 0.004},
    },
}
PAGE = "Before.\n\n<!-- bench-table: toy/devices -->\nstale\n<!-- /bench-table -->\n\nAfter.\n"


def _rows(markdown: str) -> dict[str, list[str]]:
    """First cell -> the other cells, for every table row of ``markdown``."""
    rows = {}
    for line in markdown.splitlines():
        if line.startswith("| "):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[cells[0]] = cells[1:]
    return rows


def test_the_docs_tables_are_what_the_records_render() -> None:
    step = STEP_MODULE
    specs = step.Specs.load()
    page = REPO / "docs" / "benchmarks.md"
    text = page.read_text(encoding="utf-8")
    addresses = step.MARKERS.findall(text)
    assert len(addresses) >= 7, "docs/benchmarks.md lost its bench-table markers"
    stale = {p.name: step.render_page(p.read_text(encoding="utf-8"), specs)[1] for p in (REPO / "docs").glob("*.md")}
    assert {name: changed for name, changed in stale.items() if changed} == {}, (
        "tables differ from what their records render; run `python -m docs_hooks.bench_tables` and commit the pages"
    )


def test_a_record_becomes_a_formatted_table_and_a_line_without_a_machine_path(tmp_path: Path) -> None:
    _record(tmp_path, "toy", "2026-01-02", "0123456789ab", FIGURES, torch="2.14.1")
    specs = STEP_MODULE.Specs({"toy": {"devices": TOY}})
    text, changed = STEP_MODULE.render_page(PAGE, specs, tmp_path)
    assert changed == ["toy/devices"] and text.startswith("Before.\n\n<!-- bench-table: toy/devices -->\n\n|")
    assert text.endswith("\n\n<!-- /bench-table -->\n\nAfter.\n") and "stale" not in text
    rows = _rows(text)
    assert rows["device"] == ["round 6's own", "served − own", "images", "payload", "evaluation", "note"]
    assert rows["pi"] == ["83.86 %", "+0.29", "+6", "9.83 MB", "5.37 s", "a\\|b"]
    assert rows["nano"] == ["70.00 %", "−0.35", "−6", "0.43 MB", "2.00 s", "–"]  # true minus signs; null: a dash
    assert rows["laptop"][:2] == ["50.00 %", "0.00"]  # a difference that rounds to zero has no sign
    assert rows["laptop"][2] == "0" and rows["laptop"][5] == "–"  # a figure the row lacks is a missing one
    assert "|---|---:|---:|---:|---:|---:|---|" in text.splitlines()
    line = next(line for line in text.splitlines() if line.startswith("Record: "))
    assert line == (
        "Record: `toy-2026-01-02-0123456789ab.json` — `python bench/bench_toy.py --out DIR --data "
        "/usr/share/datasets/toy --cache=DIR`, AMD EPYC family 25 model 1 (no AVX-512), torch 2.14.1, 2026-01-02, "
        "commit 0123456789ab"
    )
    assert not MACHINE_PATH.search(text)
    assert STEP_MODULE.render_page(text, specs, tmp_path) == (text, [])  # rendered once, nothing left to change


def test_a_transposed_table_has_a_row_per_figure_and_a_column_per_side() -> None:
    table = _tables.Table(
        label="",
        rows=lambda figures: figures.items(),
        transposed=True,
        columns=(
            _tables.Column("variants", lambda side: side["variants"], _tables.number_range),
            _tables.Column("accuracy", lambda side: side["accuracy"], _tables.percent),
        ),
    )
    lines = _tables.render(table, {"before": {"variants": [0, 1, 2, 5], "accuracy": 0.487}, "after": {
        "variants": [], "accuracy": 0.5795}})  # fmt: skip
    assert lines == [
        "|  | before | after |",
        "|---|---|---|",
        "| variants | 0–2, 5 | none |",
        "| accuracy | 48.70 % | 57.95 % |",
    ]


def test_the_line_says_avx512_and_uncommitted_changes_and_refuses_an_absolute_record_path(tmp_path: Path) -> None:
    record = {"command": "python x.py", "date": "2026-01-02", "commit": "abc+changes", "cpu": {"avx512": True}}
    line = _tables.provenance(record, Path("bench/results/x.json"))
    assert "(AVX-512)" in line and "commit abc with uncommitted changes" in line
    with pytest.raises(ValueError, match="relative to the repository"):
        _tables.provenance(record, tmp_path / "x.json")


def test_a_benchmark_name_takes_its_newest_record_and_a_file_name_takes_that_one(tmp_path: Path) -> None:
    old = _record(tmp_path, "toy", "2026-01-02", "aaaaaaaaaaaa", FIGURES)
    new = _record(tmp_path, "toy", "2026-01-03", "bbbbbbbbbbbb", FIGURES)
    _record(tmp_path, "toy-other", "2026-01-04", "cccccccccccc", FIGURES)  # another benchmark whose name starts alike
    assert STEP_MODULE.find_record("toy", tmp_path) == new
    assert STEP_MODULE.find_record(old.stem, tmp_path) == old
    later = _record(tmp_path, "toy", "2026-01-03", "dddddddddddd", FIGURES, time="10:00:00")
    assert STEP_MODULE.find_record("toy", tmp_path) == later  # a day's records: the one with the later time


def test_two_records_of_one_day_without_a_time_or_a_wrong_address_say_what_to_write(tmp_path: Path) -> None:
    _record(tmp_path, "toy", "2026-01-02", "aaaaaaaaaaaa", FIGURES)
    _record(tmp_path, "toy", "2026-01-02", "bbbbbbbbbbbb", FIGURES)
    specs = STEP_MODULE.Specs({"toy": {"devices": TOY}})
    with pytest.raises(STEP_MODULE.TableError, match="name one in the marker by its file name"):
        STEP_MODULE.render_table("toy/devices", specs, tmp_path)
    with pytest.raises(STEP_MODULE.TableError, match="has no table 'rows' \\(it has: devices\\)"):
        STEP_MODULE.render_table("toy-2026-01-02-aaaaaaaaaaaa/rows", specs, tmp_path)
    with pytest.raises(STEP_MODULE.TableError, match="no record of benchmark nothing"):
        STEP_MODULE.render_table("nothing/devices", specs, tmp_path)
    with pytest.raises(STEP_MODULE.TableError, match="without its"):
        STEP_MODULE.render_page("<!-- bench-table: toy/devices -->\n", specs, tmp_path)


def test_check_fails_on_a_stale_page_and_the_rewrite_fixes_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n<!-- bench-table: served-demo/devices -->\n| old |\n<!-- /bench-table -->\n")
    assert STEP_MODULE.main(["--check", str(page)]) == 1
    assert "page.md: served-demo/devices" in capsys.readouterr().err and "| old |" in page.read_text()
    assert STEP_MODULE.main([str(page)]) == 0
    assert "| old |" not in page.read_text() and STEP_MODULE.main(["--check", str(page)]) == 0
