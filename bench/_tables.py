"""Benchmark records as Markdown tables: the vocabulary a table spec is written in, and the rendering.

A bench script writes a record (bench/_records.py); its tables are declared once, in ``bench/tables/<script>.py``:
which records they read (``RECORDS``), and per table (``TABLES``) what a row is and which figure becomes which
column, formatted how. ``python -m docs_hooks.bench_tables`` puts them between the markers of docs/benchmarks.md:

    TABLES = {
        "devices": Table(
            label="device",
            rows=lambda figures: figures["devices"].items(),
            columns=(Column("served", lambda d: d["test"]["served"], percent), ...),
        )
    }

Every rendered table is followed by the line that names its record (``provenance``): its file, the command, the CPU,
the date and the commit, and never a folder of the machine it ran on.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

MINUS = "\N{MINUS SIGN}"
MISSING = "\N{EN DASH}"  # a figure the run did not measure (null in the record)
SYSTEM_FOLDERS = ("/usr/", "/etc/", "/opt/", "/dev/")  # absolute paths every reader has; any other is the machine's


def percent(fraction: float) -> str:
    """0.8386 -> ``83.86 %``."""
    return f"{100 * fraction:.2f} %"


def points(difference: float) -> str:
    """A difference of two fractions in percentage points: 0.0029 -> ``+0.29``, -0.0035 -> ``−0.35``, 0 -> ``0.00``."""
    return signed(100 * difference, 2)


def signed(number: float, digits: int = 0) -> str:
    """A difference with its sign and a true minus sign: ``+6``, ``−6``; one that rounds to zero has none: ``0``."""
    rounded = round(number, digits)
    if rounded == 0:
        return f"{0:.{digits}f}"
    return f"{rounded:+.{digits}f}".replace("-", MINUS)


def seconds(value: float) -> str:
    """5.3686 -> ``5.37 s``."""
    return f"{value:.2f} s"


def megabytes(size: float) -> str:
    """Bytes in MB (10⁶ bytes): 9832456 -> ``9.83 MB``."""
    return f"{size / 1e6:.2f} MB"


def macs(count: float) -> str:
    """Multiply-accumulates in millions: 2e6 -> ``2M``, 1446832 -> ``1.45M``."""
    return f"{count / 1e6:.3g}M"


def number_range(numbers: Iterable[int]) -> str:
    """Sorted integers as runs: [0, 1, 2, 3, 7] -> ``0–3, 7``."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}\N{EN DASH}{r[-1]}" for r in runs) or "none"


@dataclass(frozen=True)
class Column:
    """One column: its header (formatted with the table's ``names``), the row's figure, and how it is written."""

    header: str
    figure: Callable[[Any], Any]  # the row's figures -> the figure this column shows
    format: Callable[[Any], str] = str
    align: str = "right"  # "right" for numbers, "left" for words


@dataclass(frozen=True)
class Table:
    """A Markdown table of one record: a row per ``(label, figures)`` pair ``rows`` yields, then one cell per column.

    ``transposed``: a row per column and a column per row, for a few sides (before, after) of many figures.
    """

    label: str  # the first column's header: what a row is ("device", "seed")
    rows: Callable[[dict], Iterable[tuple[Any, Any]]]  # the record's figures -> (row label, the row's figures)
    columns: tuple[Column, ...]
    names: Callable[[dict], dict[str, Any]] = dict  # figures -> the names headers may use: the figures' own by default
    transposed: bool = False


def render(table: Table, figures: dict) -> list[str]:
    """The Markdown lines of ``table`` drawn from a record's ``figures``."""
    names = table.names(figures)
    headers = [column.header.format(**names) for column in table.columns]
    rows = list(table.rows(figures))
    cells = [[_cell(column, row) for column in table.columns] for _, row in rows]
    if table.transposed:
        lines = [_line([table.label, *(str(label) for label, _ in rows)]), _rule(["---"] * (len(rows) + 1))]
        lines += [_line([header, *(r[i] for r in cells)]) for i, header in enumerate(headers)]
        return lines
    rule = ["---", *("---:" if column.align == "right" else "---" for column in table.columns)]
    lines = [_line([table.label, *headers]), _rule(rule)]
    lines += [_line([str(label), *row_cells]) for (label, _), row_cells in zip(rows, cells)]
    return lines


def _cell(column: Column, row: Any) -> str:
    value = column.figure(row)
    return MISSING if value is None else column.format(value)


def _line(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _rule(alignments: list[str]) -> str:
    return "|" + "|".join(alignments) + "|"


def provenance(record: dict, path: PurePosixPath) -> str:
    """The line under a table: the record's file (``path``, relative to the repository), command, CPU, date, commit."""
    if path.is_absolute():
        raise ValueError(f"{path}: give the record's path relative to the repository, not the machine's")
    command = public_command(record.get("command", "?"))
    torch = f", torch {record['torch']}" if record.get("torch") else ""
    commit = record.get("commit", "?").replace("+changes", " with uncommitted changes")
    return (
        f"Record: `{path}` \N{EM DASH} `{command}`, {cpu_words(record.get('cpu', {}))}{torch}, "
        f"{record.get('date', '?')}, commit {commit}"
    )


def cpu_words(cpu: dict) -> str:
    """``AMD EPYC family 25 model 1 (no AVX-512), 2 cores, KVM``: what a reader needs to compare a CPU with theirs."""
    name = cpu.get("model_name") or cpu.get("vendor") or "an unknown CPU"
    words = f"{name} family {cpu.get('family', '?')} model {cpu.get('model', '?')}"
    words += " (AVX-512)" if cpu.get("avx512") else " (no AVX-512)"
    if cpu.get("cores"):
        words += f", {cpu['cores']} cores"
    if cpu.get("hypervisor"):
        words += f", {cpu['hypervisor']}"
    return words


def public_command(command: str) -> str:
    """``command`` with every folder of the machine it ran on written ``DIR``: ``--out /work/x`` -> ``--out DIR``."""
    try:
        words = shlex.split(command)
    except ValueError:  # unbalanced quotes: hide every absolute-looking word of the raw text
        words = command.split()
    return " ".join(shlex.quote(_public(word)) for word in words)


def _public(word: str) -> str:
    option, equals, value = word.partition("=")
    if equals and option.startswith("-"):
        return f"{option}={_public(value)}"
    if word.startswith("/") and not word.startswith(SYSTEM_FOLDERS):
        return "DIR"
    return word
