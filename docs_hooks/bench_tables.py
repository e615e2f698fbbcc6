"""The benchmark tables of the docs, rendered from the records in ``bench/results/``: a docs build step.

    python -m docs_hooks.bench_tables            # rewrite every table between markers in docs/*.md
    python -m docs_hooks.bench_tables --check    # exit 1, naming the tables, when a page differs from its records

A page asks for a table with a pair of markers; what lies between them is generated, never edited:

    <!-- bench-table: served-demo/devices -->
    <!-- /bench-table -->

The address is ``<record>/<table>``: a benchmark's name (its newest record) or a record's file name without
``.json`` (that record), then a table that ``bench/tables/*.py`` declares for that benchmark (bench/_tables.py says
how). ``make docs`` runs the rewrite before it builds the site; ``tests/cli/test_bench_tables.py`` runs the check.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # as the bench scripts import _records
from _tables import Table, provenance, render

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
RESULTS = BENCH / "results"
SPECS = BENCH / "tables"
DOCS = REPO / "docs"
MARKERS = re.compile(
    r"(?P<open><!-- bench-table: (?P<address>\S+) -->\n)(?P<body>.*?)(?P<close><!-- /bench-table -->)", re.DOTALL
)


class TableError(Exception):
    """A marker that names no record or no table, or a page whose markers do not pair up: what to fix."""


@dataclass(frozen=True)
class Specs:
    """Every benchmark's tables, as ``bench/tables/*.py`` declare them."""

    tables: dict[str, dict[str, Table]]  # benchmark name -> table name -> its spec

    @classmethod
    def load(cls, folder: Path = SPECS) -> Specs:
        tables: dict[str, dict[str, Table]] = {}
        for path in sorted(folder.glob("*.py")):
            module = _module(path)
            for benchmark in module.RECORDS:
                if benchmark in tables:
                    raise TableError(f"{_shown(path)}: benchmark {benchmark} already has tables in another module")
                tables[benchmark] = module.TABLES
        return cls(tables)

    def table(self, benchmark: str, name: str, address: str) -> Table:
        if benchmark not in self.tables:
            raise TableError(
                f"bench-table {address}: no module in bench/tables/ declares tables for benchmark {benchmark}; "
                f"add its name to a module's RECORDS (benchmarks with tables: {', '.join(sorted(self.tables))})"
            )
        if name not in self.tables[benchmark]:
            known = ", ".join(sorted(self.tables[benchmark]))
            raise TableError(f"bench-table {address}: benchmark {benchmark} has no table {name!r} (it has: {known})")
        return self.tables[benchmark][name]


def _module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_tables_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: a dataclass in it looks its module up there
    spec.loader.exec_module(module)
    return module


def _shown(path: Path) -> str:
    """A path as the docs and messages write it: relative to the repository."""
    return path.resolve().relative_to(REPO).as_posix() if path.resolve().is_relative_to(REPO) else path.name


def find_record(name: str, results: Path = RESULTS) -> Path:
    """The record a marker names: ``<name>.json`` itself, else the newest record of benchmark ``name``."""
    if (results / f"{name}.json").is_file():
        return results / f"{name}.json"
    records = [(json.loads(p.read_text(encoding="utf-8")), p) for p in sorted(results.glob("*.json"))]
    dated = sorted(((r.get("date", ""), r.get("time", "")), p) for r, p in records if r.get("benchmark") == name)
    if not dated:
        raise TableError(f"no record of benchmark {name} in {_shown(results)}/; run its bench script, which writes one")
    newest = [p for when, p in dated if when == dated[-1][0]]
    if len(newest) > 1:
        raise TableError(
            f"benchmark {name} has {len(newest)} records of {dated[-1][0][0]}: {', '.join(p.name for p in newest)}; "
            "name one in the marker by its file name without .json"
        )
    return newest[0]


def render_table(address: str, specs: Specs, results: Path = RESULTS) -> str:
    """The generated text between the markers of ``address``: the table, then the line naming its record."""
    record_name, slash, table_name = address.rpartition("/")
    if not slash or not record_name:
        raise TableError(f"bench-table {address}: write <benchmark or record>/<table>, e.g. served-demo/devices")
    path = find_record(record_name, results)
    record = json.loads(path.read_text(encoding="utf-8"))
    table = specs.table(record["benchmark"], table_name, address)
    try:
        lines = render(table, record["figures"])
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise TableError(
            f"bench-table {address}: {path.name} lacks a figure its table reads ({type(error).__name__}: {error}); "
            f"fix the table's spec in bench/tables/ or name a record that has it"
        ) from error
    return "\n" + "\n".join(lines) + "\n\n" + provenance(record, PurePosixPath(_shown(path))) + "\n\n"


def render_page(text: str, specs: Specs, results: Path = RESULTS) -> tuple[str, list[str]]:
    """``text`` with every table between markers rendered from its record, and the addresses whose table changed."""
    if text.count("<!-- bench-table:") != text.count("<!-- /bench-table -->"):
        raise TableError("a <!-- bench-table: ... --> marker without its <!-- /bench-table --> (or the other way)")
    changed: list[str] = []

    def replace(match: re.Match[str]) -> str:
        body = render_table(match["address"], specs, results)
        if body != match["body"]:
            changed.append(match["address"])
        return match["open"] + body + match["close"]

    return MARKERS.sub(replace, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a page's tables are stale")
    parser.add_argument("pages", nargs="*", type=Path, help="Markdown pages (default: every docs/*.md)")
    args = parser.parse_args(argv)
    pages = args.pages or sorted(DOCS.glob("*.md"))
    try:
        specs = Specs.load()
        stale = []
        for page in pages:
            text = page.read_text(encoding="utf-8")
            rendered, changed = render_page(text, specs)
            if changed and not args.check:
                page.write_text(rendered, encoding="utf-8")
                print(f"{_shown(page)}: rewrote {', '.join(changed)}")
            stale += [f"{_shown(page)}: {address}" for address in changed]
    except TableError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.check and stale:
        print(
            "error: these tables differ from what their records in bench/results/ render:\n  "
            + "\n  ".join(stale)
            + "\nrun `python -m docs_hooks.bench_tables` (or `make docs`) and commit the pages",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
