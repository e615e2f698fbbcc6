"""Compare finished ``feast-edge simulate`` runs: summary and per-variant tables, gaps to the centralized reference, plots.

Each run directory holds the ``results.json`` that ``simulate`` writes. Runs of
one method (same FEAST ``variants`` switch and method options) with different
seeds form a group, reported as mean ± sample standard deviation. A run with
method ``centralized`` is the reference: a gap is its accuracy minus the
method's, in points (SPEC §8). The document is a list of blocks rendered as
Markdown (PNG links) or HTML (PNGs embedded); :mod:`feast_edge.report.plots` draws.
"""

from __future__ import annotations

import base64
import html
import json
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feast_edge.errors import FeastError
from feast_edge.report.plots import draw_plots, require_matplotlib
from feast_edge.util.atomic import atomic_write_bytes

METHOD_ORDER = ("feast", "centralized", "heterofl", "scalefl", "fiarse", "sfn", "dfn")
REFERENCE = "centralized"
FORMATS = {"markdown": "report.md", "html": "report.html"}
SAME_LABELS = "the centralized accuracy of the same variant (same label)"
BY_MACS = "the centralized accuracy of its largest point with MACs ≤ this point's MACs (the variants differ; — where none is that small)"


# ------------------------------------------------------------------ run data
@dataclass(frozen=True)
class Point:
    """One operating point of a run: label, inference MACs, parameters and test accuracy (a fraction)."""

    label: str
    macs: int
    params: int
    accuracy: float


@dataclass(frozen=True)
class Run:
    """What the report reads from one run directory's ``results.json``."""

    directory: Path
    method: str
    variants: str
    options: tuple[tuple[str, str], ...]
    seed: int
    preset: str
    budgets: tuple[float, ...]
    population_accuracy: float
    best_val: float | None
    points: tuple[Point, ...]  # MAC-sorted
    params_sent: int  # both directions, all rounds
    train_macs: int
    seconds: float
    rounds: int
    validation: tuple[tuple[int, float], ...]  # (round, val accuracy) where validated

    @property
    def group(self) -> str:
        """The name runs are grouped under: the method, FEAST's ablation switch and the options, not the seed."""
        parts = [f"variants={self.variants}"] if self.method == "feast" and self.variants != "full" else []
        parts += [f"{k}={v}" for k, v in self.options]
        return f"{self.method} ({', '.join(parts)})" if parts else self.method


class _Malformed(Exception):
    """A results.json entry is missing or of the wrong kind."""


def _at(record: Any, *keys: str) -> Any:
    """``record[k0][k1]...``; a missing step names the dotted key."""
    value = record
    for i, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            raise _Malformed(f"lacks {'.'.join(keys[: i + 1])}")
        value = value[key]
    return value


def load_run(directory: Path) -> Run:
    """Read a run directory's ``results.json``; a missing or malformed file is a one-line :class:`FeastError`."""
    directory = Path(directory)
    fix = f"run feast-edge simulate --out {directory} to completion first"
    path = directory / "results.json"
    if not directory.is_dir():
        raise FeastError(f"run directory {directory} does not exist; {fix}")
    if not path.is_file():
        raise FeastError(f"run directory {directory} holds no results.json; {fix}")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FeastError(f"cannot read {path} ({exc}); {fix}") from None
    try:
        return _parse(directory, record)
    except _Malformed as exc:
        raise FeastError(f"{path} {exc}; {fix}") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise FeastError(f"{path} has a malformed entry ({exc}); {fix}") from None


def _parse(directory: Path, record: Any) -> Run:
    config = _at(record, "config")
    rounds = _at(record, "rounds")
    points = [
        Point(str(v.get("label", f"#{v.get('index', i)}")), int(_at(v, "macs")), int(_at(v, "params")), float(_at(v, "test_accuracy")))
        for i, v in enumerate(_at(record, "variants"))
    ]
    if not points:
        raise _Malformed("lists no variants")
    best = _at(record, "best").get("val_accuracy")
    seconds = record.get("seconds_total")
    return Run(
        directory=directory,
        method=str(record.get("method", config.get("method", "feast"))),  # results.json from before the method harness: FEAST
        variants=str(config.get("variants", "full")),
        options=tuple((str(k), str(v)) for k, v in config.get("method_options", ())),
        seed=int(_at(config, "seed")),
        preset=str(_at(record, "preset")),
        budgets=tuple(float(b) for b in _at(record, "population", "budgets")),
        population_accuracy=float(_at(record, "population_accuracy")),
        best_val=None if best is None else float(best),
        points=tuple(sorted(points, key=lambda p: p.macs)),
        params_sent=int(_at(record, "communication", "routed_params_total")),
        train_macs=int(_at(record, "compute", "train_macs_total")),
        seconds=float(seconds) if seconds is not None else sum(float(_at(r, "seconds")) for r in rounds),
        rounds=len(rounds),
        validation=tuple((int(_at(r, "round")), float(r["val_accuracy"])) for r in rounds if r.get("val_accuracy") is not None),
    )


# ------------------------------------------------------------------ groups and statistics
@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation (n − 1) of a quantity over the seeds of a group; no deviation for one seed."""

    mean: float
    std: float | None

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Stat | None:
        known = [v for v in values if v is not None]
        if not known:
            return None
        return cls(statistics.fmean(known), statistics.stdev(known) if len(known) > 1 else None)

    def percent(self) -> str:
        """``61.00 ± 1.41`` (a fraction shown in percent)."""
        return f"{100 * self.mean:.2f}" + (f" ± {100 * self.std:.2f}" if self.std is not None else "")


@dataclass(frozen=True)
class Group:
    """The runs of one method (same variants switch and options), one per seed."""

    name: str
    method: str
    runs: tuple[Run, ...]

    def stat(self, value: Callable[[Run], float | None]) -> Stat | None:
        return Stat.of(value(r) for r in self.runs)

    def points(self) -> list[tuple[Point, Stat]]:
        """Each operating point (by label, MAC-sorted) with its test accuracy over the seeds."""
        first: dict[str, Point] = {}
        accuracies: dict[str, list[float]] = {}
        for run in self.runs:
            for p in run.points:
                first.setdefault(p.label, p)
                accuracies.setdefault(p.label, []).append(p.accuracy)
        return sorted(((first[k], Stat.of(v)) for k, v in accuracies.items()), key=lambda item: (item[0].macs, item[0].label))


def group_runs(runs: Sequence[Run]) -> list[Group]:
    """Runs grouped by :attr:`Run.group`, in the order feast, centralized, the baselines, then anything else."""
    named: dict[str, list[Run]] = {}
    for run in runs:
        named.setdefault(run.group, []).append(run)
    groups = [Group(name, members[0].method, tuple(sorted(members, key=lambda r: r.seed))) for name, members in named.items()]
    rank = {m: i for i, m in enumerate(METHOD_ORDER)}
    return sorted(groups, key=lambda g: (rank.get(g.method, len(METHOD_ORDER)), g.name))


def reference_group(groups: Sequence[Group]) -> Group | None:
    """The centralized reference (the first centralized group), if a run has method ``centralized``."""
    return next((g for g in groups if g.method == REFERENCE), None)


def variant_gaps(group: Group, reference: Group) -> tuple[str, list[float | None]]:
    """How each point is compared with the reference, and its gap (reference − point, in accuracy points)."""
    mine = group.points()
    ref = [(p, acc.mean) for p, acc in reference.points()]
    by_label = {p.label: acc for p, acc in ref}
    if all(p.label in by_label for p, _ in mine):
        return SAME_LABELS, [100 * (by_label[p.label] - acc.mean) for p, acc in mine]
    gaps: list[float | None] = []
    for p, acc in mine:
        below = [a for q, a in ref if q.macs <= p.macs]
        gaps.append(100 * (below[-1] - acc.mean) if below else None)
    return BY_MACS, gaps


def comparability_warnings(runs: Sequence[Run]) -> list[str]:
    """One line per reason the runs' numbers are not directly comparable (presets, populations, repeated seeds)."""
    warnings = []
    presets = sorted({r.preset for r in runs})
    if len(presets) > 1:
        warnings.append(f"warning: the runs use different presets ({', '.join(presets)}); their accuracies are not directly comparable")
    first = runs[0]
    differ = [str(r.directory) for r in runs if r.budgets != first.budgets]
    if differ:
        warnings.append(
            f"warning: the runs do not share one client population (the budgets of {', '.join(differ)} differ from those of {first.directory}); "
            "population accuracies are not directly comparable"
        )
    for group in group_runs(runs):
        seeds = [r.seed for r in group.runs]
        for seed in sorted({s for s in seeds if seeds.count(s) > 1}):
            warnings.append(f"warning: {group.name} has {seeds.count(seed)} runs with seed {seed}; each counts as a seed of its own")
    return warnings


# ------------------------------------------------------------------ the document
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


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _gap(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.2f}"


def build_document(runs: Sequence[Run], title: str, warnings: Sequence[str], plots: Sequence[Image]) -> list[Block]:
    """The report's blocks: overview, summary, gaps, per-variant tables, plots and the runs read."""
    groups = group_runs(runs)
    reference = reference_group(groups)
    presets = ", ".join(sorted({r.preset for r in runs}))
    clients = f"{len(runs[0].budgets)} clients" if len({r.budgets for r in runs}) == 1 else "differing client populations"
    blocks: list[Block] = [
        Heading(1, title),
        Text(
            f"{_plural(len(runs), 'run')} of preset {presets}, {clients}, "
            f"{_plural(len(groups), 'method')}. Accuracies are test accuracies in percent (best checkpoint); ± is the sample standard deviation "
            "over seeds (n − 1 in the denominator); a value without ± comes from one seed."
        ),
        *(Text(w) for w in warnings),
        Heading(2, "Summary"),
        _summary(groups, reference),
    ]
    if reference is None:
        blocks.append(Text(f"No run has method {REFERENCE}, so the report shows no gaps."))
    else:
        seeds = _plural(len(reference.runs), "seed")
        blocks.append(Text(f"Gaps are in accuracy points: the centralized reference ({reference.name}, mean over {seeds}) minus the method, so a "
                           "positive gap is a shortfall. The population gap compares population accuracies; per-variant gaps are in the tables below."))
    blocks.append(Heading(2, "Per-variant accuracy"))
    for group in groups:
        blocks += _variant_table(group, reference)
    blocks.append(Heading(2, "Plots"))
    blocks += plots
    runs_read = tuple(
        (str(r.directory), g.name, str(r.seed), str(r.rounds), _percent(r.population_accuracy), _percent(r.best_val), f"{r.seconds:.1f}")
        for g in groups
        for r in g.runs
    )
    header = ("directory", "method", "seed", "rounds", "population acc. (%)", "best val. acc. (%)", "seconds")
    return [*blocks, Heading(2, "Runs"), Table(header, runs_read, left=2)]


def _summary(groups: Sequence[Group], reference: Group | None) -> Table:
    peta = max(r.train_macs for g in groups for r in g.runs) >= 1e15
    unit, scale = ("PMAC", 1e15) if peta else ("TMAC", 1e12)
    ref_pop = reference.stat(lambda r: r.population_accuracy) if reference is not None else None
    rows = []
    for g in groups:
        pop = g.stat(lambda r: r.population_accuracy)
        gap = ["ref." if g is reference else _gap(100 * (ref_pop.mean - pop.mean))] if ref_pop is not None else []
        best = g.stat(lambda r: r.best_val)
        rows.append(
            (
                g.name,
                str(len(g.runs)),
                pop.percent(),
                *gap,
                g.stat(lambda r: r.points[-1].accuracy).percent(),
                "—" if best is None else best.percent(),
                count(g.stat(lambda r: r.params_sent).mean),
                count(g.stat(lambda r: r.params_sent / max(r.rounds, 1)).mean),
                f"{g.stat(lambda r: r.train_macs).mean / scale:,.2f}",
                f"{g.stat(lambda r: r.seconds / max(r.rounds, 1)).mean:.1f}",
            )
        )
    gap_col = ("population gap (points)",) if ref_pop is not None else ()
    header = (
        "method", "seeds", "population acc. (%)", *gap_col, "largest point acc. (%)", "best val. acc. (%)",
        "params sent (total)", "params sent / round", f"training compute ({unit})", "wall seconds / round",
    )
    return Table(header, tuple(rows))


def _variant_table(group: Group, reference: Group | None) -> list[Block]:
    points = group.points()
    blocks: list[Block] = [Heading(3, group.name)]
    gaps: list[str] = []
    if reference is group:
        blocks.append(Text("The centralized reference: the gaps of the other methods are measured against these accuracies."))
    elif reference is not None:
        how, values = variant_gaps(group, reference)
        gaps = [_gap(v) for v in values]
        blocks.append(Text(f"gap: {how} minus this accuracy."))
    header = ("#", "label", "MACs (M)", "params (M)", "test acc. (%)") + (("gap (points)",) if gaps else ())
    rows = tuple(
        (str(i), p.label, f"{p.macs / 1e6:,.2f}", f"{p.params / 1e6:,.3f}", acc.percent(), *([gaps[i]] if gaps else []))
        for i, (p, acc) in enumerate(points)
    )
    return [*blocks, Table(header, rows, left=2)]


# ------------------------------------------------------------------ rendering
def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: Sequence[Block]) -> str:
    """Markdown; images are links to the PNGs beside the file."""
    lines: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            lines += ["#" * b.level + " " + b.text, ""]
        elif isinstance(b, Text):
            lines += [("> " if b.text.startswith("warning:") else "") + b.text, ""]
        elif isinstance(b, Table):
            lines.append("| " + " | ".join(_md_cell(h) for h in b.header) + " |")
            lines.append("|" + "|".join(" --- " if i < b.left else " ---: " for i in range(len(b.header))) + "|")
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
            lines.append("")
        else:
            lines += [f"![{_md_cell(b.title)}]({b.file})", ""]
    return "\n".join(lines)


_CSS = (
    "body{font-family:system-ui,sans-serif;max-width:72rem;margin:2rem auto;padding:0 1rem;color:#222}"
    "table{border-collapse:collapse;margin:1rem 0}th,td{border:1px solid #ccc;padding:.25rem .5rem}"
    "th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}"
    "p.warning{color:#8a4b00;font-weight:600}img{max-width:100%;display:block;margin:1rem 0}"
)


def render_html(blocks: Sequence[Block], folder: Path) -> str:
    """One self-contained HTML page: every text HTML-escaped, the PNGs from ``folder`` embedded as base64."""
    esc = html.escape
    title = next((b.text for b in blocks if isinstance(b, Heading)), "feast-edge report")
    parts = ['<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8">', f"<title>{esc(title)}</title><style>{_CSS}</style></head>\n<body>"]
    for b in blocks:
        if isinstance(b, Heading):
            parts.append(f"<h{b.level}>{esc(b.text)}</h{b.level}>")
        elif isinstance(b, Text):
            parts.append(f'<p class="warning">{esc(b.text)}</p>' if b.text.startswith("warning:") else f"<p>{esc(b.text)}</p>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{esc(h)}</th>" for h in b.header)
            body = "".join(
                "<tr>" + "".join(f"<td>{esc(c)}</td>" if i < b.left else f'<td class="num">{esc(c)}</td>' for i, c in enumerate(row)) + "</tr>\n"
                for row in b.rows
            )
            parts.append(f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>")
        else:
            data = base64.b64encode((folder / b.file).read_bytes()).decode("ascii")
            parts.append(f'<figure><img alt="{esc(b.title)}" src="data:image/png;base64,{data}"><figcaption>{esc(b.title)}</figcaption></figure>')
    parts.append("</body>\n</html>\n")
    return "\n".join(parts)


# ------------------------------------------------------------------ entry point
@dataclass(frozen=True)
class Written:
    """What :func:`write_report` wrote, and the comparability warnings it put in the report."""

    report: Path
    plots: tuple[Path, ...]
    warnings: tuple[str, ...]


def write_report(run_dirs: Sequence[Path], out: Path, fmt: str = "markdown", title: str | None = None) -> Written:
    """Read the runs, draw the plots into ``out`` and write ``report.md`` or ``report.html`` there."""
    if fmt not in FORMATS:
        raise FeastError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if not run_dirs:
        raise FeastError("give at least one run directory (written by feast-edge simulate --out DIR)")
    runs = [load_run(Path(d)) for d in run_dirs]
    require_matplotlib()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FeastError(f"--out {out} is a file; pass a directory for the report and its plots")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FeastError(f"cannot create the report directory {out} ({exc.strerror}); choose another --out") from None
    groups = group_runs(runs)
    plots = draw_plots(groups, reference_group(groups), out)
    warnings = comparability_warnings(runs)
    blocks = build_document(runs, title or f"feast-edge report: {', '.join(sorted({r.preset for r in runs}))}", warnings, [Image(f, t) for f, t in plots])
    text = render_markdown(blocks) if fmt == "markdown" else render_html(blocks, out)
    report = atomic_write_bytes(out / FORMATS[fmt], text.encode("utf-8"))
    return Written(report, tuple(out / f for f, _ in plots), tuple(warnings))
