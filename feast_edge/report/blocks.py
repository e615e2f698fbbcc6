"""The blocks a report is made of (rendered by feast_edge.report.summary as Markdown or HTML), and number formats."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    left: int = 1  # leading columns aligned left; the rest are numbers, aligned right


@dataclass(frozen=True)
class Image:
    file: str  # PNG beside the report
    title: str


Block = Heading | Text | Table | Image


def count(n: float) -> str:
    """``1.23G``, ``45.6M``, ``789K``: a parameter count for people."""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def percent(value: float | None) -> str:
    """``61.23`` (a fraction in percent), ``—`` for none."""
    return "—" if value is None else f"{100 * value:.2f}"
