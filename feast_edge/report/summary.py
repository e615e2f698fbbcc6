"""Compare finished ``feast-edge simulate`` runs: summary and per-variant tables, gaps to the centralized reference, plots;
and ``feast-server run`` directories: rounds, best validation, where validation and BN calibration ran.

Each run directory holds the ``results.json`` that ``simulate`` writes. Runs of
one method (same FEAST ``variants`` switch and method options) with different
seeds form a group, reported as mean ± sample standard deviation. A run with
method ``centralized`` is the reference: a gap is its accuracy minus the
method's, in points (method §8). The document is a list of blocks rendered as
Markdown (PNG links) or HTML (PNGs embedded); :mod:`feast_edge.report.plots` draws.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from feast_edge.errors import FeastError
from feast_edge.report.blocks import Block, Heading, Image, Table, Text, count
from feast_edge.report.experiments import extraction_blocks, gamma_blocks, matched_blocks, personalization_blocks
from feast_edge.report.federation import FederationRun, is_federation_run, load_federation_run
from feast_edge.report.model_words import FleetAccuracy
from feast_edge.report.plots import draw_plots, require_matplotlib
from feast_edge.report.privacy import privacy_blocks
from feast_edge.report.runs import (
    REFERENCE,
    Group,
    Run,
    comparability_warnings,
    group_runs,
    load_run,
    reference_group,
    variant_gaps,
)
from feast_edge.util.atomic import atomic_write_bytes

FORMATS = {"markdown": "report.md", "html": "report.html"}


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
    clients = (
        f"{len(runs[0].budgets)} clients" if len({r.budgets for r in runs}) == 1 else "differing client populations"
    )
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
        blocks.append(
            Text(
                f"Gaps are in accuracy points: the centralized reference ({reference.name}, mean over {seeds}) minus the method, so a "
                "positive gap is a shortfall. The population gap compares population accuracies; per-variant gaps are in the tables below."
            )
        )
    blocks += [*matched_blocks(groups), *gamma_blocks(groups), *extraction_blocks(runs), *personalization_blocks(runs),
               *privacy_blocks(runs)]  # fmt: skip
    blocks.append(Heading(2, "Per-variant accuracy"))
    for group in groups:
        blocks += _variant_table(group, reference)
    blocks.append(Heading(2, "Plots"))
    blocks += plots
    runs_read = tuple(
        (
            str(r.directory),
            g.name,
            str(r.seed),
            str(r.rounds),
            _percent(r.population_accuracy),
            _percent(r.best_val),
            f"{r.seconds:.1f}",
            "—" if r.virtual_seconds is None else f"{r.virtual_seconds:,.0f}",
        )
        for g in groups
        for r in g.runs
    )
    header = (
        "directory",
        "method",
        "seed",
        "rounds",
        "population acc. (%)",
        "best val. acc. (%)",
        "seconds",
        "virtual seconds",
    )
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
        "method",
        "seeds",
        "population acc. (%)",
        *gap_col,
        "largest point acc. (%)",
        "best val. acc. (%)",
        "params sent (total)",
        "params sent / round",
        f"training compute ({unit})",
        "wall seconds / round",
    )
    return Table(header, tuple(rows))


def _variant_table(group: Group, reference: Group | None) -> list[Block]:
    points = group.points()
    blocks: list[Block] = [Heading(3, group.name)]
    gaps: list[str] = []
    if reference is group:
        blocks.append(
            Text("The centralized reference: the gaps of the other methods are measured against these accuracies.")
        )
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


def federation_blocks(runs: Sequence[FederationRun]) -> list[Block]:
    """The feast-server runs: rounds, best validation and where it ran; each run's models and how they were measured."""
    if not runs:
        return []
    rows = tuple(
        (
            str(r.directory),
            r.federation or "—",
            (r.validation or "—").removeprefix("validation: "),
            f"{r.rounds}/{r.rounds_total or '?'}",
            "last" if r.best_round is None else str(r.best_round),
            _percent(r.best_val),
        )
        for r in runs
    )
    header = ("directory", "federation", "validation", "rounds", "served round", "its val. acc. (%)")
    blocks: list[Block] = [
        Heading(2, "Federations"),
        Text(
            "Runs of feast-server: no test split is held anywhere, so the accuracies are validation accuracies, on the "
            "server's data or federated (each device tests the model on its held-out split and reports counts)."
        ),
        Table(header, rows, left=3),
    ]
    for r in runs:
        served = f"served: {r.served_reason}" if r.served_reason else None
        blocks += [
            Heading(3, str(r.directory)),
            Text("; ".join(filter(None, (r.validation, r.calibration, served))) or "—"),
        ]
        if r.models:
            models = tuple(
                (
                    m.device,
                    m.measured,
                    "—" if m.macs is None else f"{m.macs / 1e6:,.2f}",
                    _percent(m.accuracy),
                    _percent(m.personal_accuracy),
                    m.personal or "—",
                )
                for m in r.models
            )
            header = ("device", "measured", "MACs (M)", "accuracy (%)", "personal (%)", "personal model")
            blocks.append(Table(header, models + _own_rows(r.own), left=2))
        if r.own is not None:
            blocks.append(Text(r.own.words()))
        if r.coverage:
            header = ("variant MACs (M)", "serves", "chosen by", "trained on", "validated on", "BN calibrated on")
            variants = tuple(
                (
                    f"{v['macs'] / 1e6:,.2f}",
                    ", ".join(v["devices"]),
                    "; ".join(v["chosen_by"]),
                    v["trained"],
                    v["validated"],
                    v["calibrated"],
                )
                for v in r.coverage
            )
            blocks.append(Table(header, variants, left=6))
    return blocks


def _own_rows(own: FleetAccuracy | None) -> tuple[tuple[str, ...], ...]:
    """The mean over the devices of their own accuracy, served and personal, and the worst of each column with its own
    device (often two devices), as table rows."""
    if own is None:
        return ()
    rows = [("mean", f"own held-out, {own.counted_words}", "", _percent(own.served), _percent(own.personal), "")]
    if own.counted:
        served = f"{own.worst_served_device} {_percent(own.worst_served)}"
        personal = f"{own.worst_personal_device} {_percent(own.worst_personal)}"
        rows.append(("worst (each column)", "own held-out, lowest of each column", "", served, personal, ""))
    return tuple(rows)


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
    parts = [
        '<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{_CSS}</style></head>\n<body>",
    ]
    for b in blocks:
        if isinstance(b, Heading):
            parts.append(f"<h{b.level}>{esc(b.text)}</h{b.level}>")
        elif isinstance(b, Text):
            parts.append(
                f'<p class="warning">{esc(b.text)}</p>' if b.text.startswith("warning:") else f"<p>{esc(b.text)}</p>"
            )
        elif isinstance(b, Table):
            head = "".join(f"<th>{esc(h)}</th>" for h in b.header)
            body = "".join(
                "<tr>"
                + "".join(
                    f"<td>{esc(c)}</td>" if i < b.left else f'<td class="num">{esc(c)}</td>' for i, c in enumerate(row)
                )
                + "</tr>\n"
                for row in b.rows
            )
            parts.append(f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>")
        else:
            data = base64.b64encode((folder / b.file).read_bytes()).decode("ascii")
            parts.append(
                f'<figure><img alt="{esc(b.title)}" src="data:image/png;base64,{data}"><figcaption>{esc(b.title)}</figcaption></figure>'
            )
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
        raise FeastError(
            "give at least one run directory (written by feast-edge simulate --out DIR or feast-server run --out DIR)"
        )
    federated = [is_federation_run(Path(d)) for d in run_dirs]
    federations = [load_federation_run(Path(d)) for d, f in zip(run_dirs, federated) if f]
    runs = [load_run(Path(d)) for d, f in zip(run_dirs, federated) if not f]
    if runs:
        require_matplotlib()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FeastError(f"--out {out} is a file; pass a directory for the report and its plots")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FeastError(f"cannot create the report directory {out} ({exc.strerror}); choose another --out") from None
    title = title or f"feast-edge report: {', '.join(sorted({r.preset for r in [*runs, *federations]}))}"
    plots: list[tuple[str, str]] = []
    warnings: list[str] = []
    if runs:
        groups = group_runs(runs)
        plots = draw_plots(groups, reference_group(groups), out)
        warnings = comparability_warnings(runs)
        blocks = build_document(runs, title, warnings, [Image(f, t) for f, t in plots])
    else:
        blocks = [Heading(1, title)]
    blocks += federation_blocks(federations)
    text = render_markdown(blocks) if fmt == "markdown" else render_html(blocks, out)
    report = atomic_write_bytes(out / FORMATS[fmt], text.encode("utf-8"))
    return Written(report, tuple(out / f for f, _ in plots), tuple(warnings))
