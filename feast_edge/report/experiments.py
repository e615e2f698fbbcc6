"""The report's sections for the paper's further experiments: matched training compute, γ-allocation, post-hoc
extraction, personalization.

Each section appears only when the runs hold what it needs: a run whose rounds
were matched to another run's compute (``simulate --match-compute``), runs of
one method at more than one γ, a run with an ``extraction.json``
(``feast-edge extraction-gap``), a run with a personalization block (``simulate --personalize``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from feast_edge.report.blocks import Block, Heading, Table, Text
from feast_edge.report.privacy import draw_privacy
from feast_edge.report.runs import Group, Run

# The paper's figures these sections are read against (method §10; paper Sec. 4 and Fig. 1).
PAPER_GAMMA_GAP = "−4.29 → +6.17 points (CIFAR-100: FEAST's largest minus smallest operating point, γ = 0 → 1)"
PAPER_EXTRACTION_GAP = 1.14  # mean |gap| over 25–52M MACs, CIFAR-100


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values)


def _spread(run: Run) -> float:
    """Largest minus smallest operating point's test accuracy, in points."""
    return 100 * (run.points[-1].accuracy - run.points[0].accuracy)


# ------------------------------------------------------------------ matched training compute
def matched_blocks(groups: Sequence[Group]) -> list[Block]:
    """Equal training compute: the matched groups beside the FEAST groups they were matched to."""
    matched = [g for g in groups if all(r.matched is not None for r in g.runs)]
    if not matched:
        return []
    targets = [Path(r.matched["run"]) for g in matched for r in g.runs]
    feast = [g for g in groups if any(_is_target(r.directory, targets) for r in g.runs)]
    rows = []
    for g in [*feast, *matched]:
        ratio = (
            "1.00 (matched to)"
            if g not in matched
            else f"{_mean([r.train_macs / r.matched['target_train_macs'] for r in g.runs]):.3f}"
        )
        rows.append(
            (
                g.name,
                str(len(g.runs)),
                f"{_mean([r.rounds for r in g.runs]):.0f}",
                f"{_mean([r.train_macs for r in g.runs]) / 1e12:,.2f}",
                ratio,
                g.stat(lambda r: r.population_accuracy).percent(),
                g.stat(lambda r: r.points[-1].accuracy).percent(),
            )
        )
    header = (
        "method",
        "seeds",
        "rounds",
        "training compute (TMAC)",
        "compute / matched run's",
        "population acc. (%)",
        "largest point acc. (%)",
    )
    return [
        Heading(2, "Equal training compute"),
        Text(
            "Each matched run trained the fewest rounds whose training compute (3 × forward MACs per trained sample, "
            "summed) reaches that of the run named by --match-compute, as the paper's matched-compute experiment does; "
            "the summary above compares the runs at their own rounds."
        ),
        Table(header, tuple(rows)),
    ]


def _is_target(directory: Path, targets: Sequence[Path]) -> bool:
    """Whether a matched run named this directory (as it was given then: the same path, or moved with its name)."""
    return any(t.resolve() == directory.resolve() or t.name == directory.name for t in targets)


# ------------------------------------------------------------------ γ-allocation
def gamma_pairs(groups: Sequence[Group]) -> dict[str, dict[float, Group]]:
    """Groups of one kind (method, options) at more than one γ: kind -> γ -> group."""
    kinds: dict[str, dict[float, Group]] = {}
    for g in groups:
        kinds.setdefault(g.runs[0].kind, {})[g.runs[0].gamma] = g
    return {k: v for k, v in kinds.items() if len(v) > 1}


def gamma_blocks(groups: Sequence[Group]) -> list[Block]:
    """Each method at each γ: population, largest and smallest point, and their spread (the paper's Figure 1)."""
    pairs = gamma_pairs(groups)
    if not pairs:
        return []
    rows = []
    for kind, by_gamma in pairs.items():
        for gamma, g in sorted(by_gamma.items()):
            rows.append(
                (
                    kind,
                    f"{gamma:g}",
                    str(len(g.runs)),
                    g.stat(lambda r: r.population_accuracy).percent(),
                    g.stat(lambda r: r.points[-1].accuracy).percent(),
                    g.stat(lambda r: r.points[0].accuracy).percent(),
                    f"{_mean([_spread(r) for r in g.runs]):+.2f}",
                )
            )
    header = (
        "method",
        "γ",
        "seeds",
        "population acc. (%)",
        "largest point acc. (%)",
        "smallest point acc. (%)",
        "largest − smallest (points)",
    )
    return [
        Heading(2, "γ-allocation"),
        Text(
            "The same method on populations that differ only in how data shares follow budgets: γ = 0 draws them "
            "independently of budget, γ = 1 makes the expected share proportional to the capped budget (method §4). "
            f"Paper: {PAPER_GAMMA_GAP}."
        ),
        Table(header, tuple(rows)),
    ]


def plain_log_ticks(plt: Any, axis: Any) -> None:
    """Log-axis ticks at 1, 2, 5 × 10^k written as plain numbers (``20``, not ``2×10¹``)."""
    axis.set_major_locator(plt.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(plt.FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(plt.NullFormatter())


def mac_axes(plt: Any, fig: Any, ax: Any) -> Any:
    """Test accuracy against inference MACs on a log axis, with a grid and a legend."""
    ax.set_xscale("log")
    plain_log_ticks(plt, ax.xaxis)
    ax.set_xlabel("inference MACs per example (millions, log scale)")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def draw_gamma(plt: Any, groups: Sequence[Group]) -> Any:
    """Accuracy vs MACs, one colour per method, dashed at the smallest γ, solid at the largest."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (kind, by_gamma) in enumerate(gamma_pairs(groups).items()):
        gammas = sorted(by_gamma)
        for gamma in gammas:
            points = by_gamma[gamma].points()
            ax.plot(
                [p.macs / 1e6 for p, _ in points],
                [100 * acc.mean for _, acc in points],
                marker="o",
                markersize=3,
                color=f"C{i % 10}",
                linestyle="--" if gamma == gammas[0] else "-",
                label=f"{kind}, γ={gamma:g}".replace("$", r"\$"),
            )
    return mac_axes(plt, fig, ax)


# ------------------------------------------------------------------ post-hoc extraction
def extraction_blocks(runs: Sequence[Run]) -> list[Block]:
    """Per run with an extraction.json: the searched range, how many were uncached, and the mean |gap|."""
    done = [r for r in runs if r.extraction is not None]
    if not done:
        return []
    rows = []
    for r in done:
        e = r.extraction
        low, high = e["range"]
        gap = e.get("mean_abs_gap")
        rows.append(
            (
                str(r.directory),
                f"{low / 1e6:.2f}M–{high / 1e6:.2f}M",
                str(len(e["points"])),
                str(e.get("uncached", "")),
                "—" if gap is None else f"{gap:.2f}",
                f"{min(p['gap'] for p in e['points']):+.2f} / {max(p['gap'] for p in e['points']):+.2f}",
            )
        )
    header = ("run", "MAC range", "targets", "uncached", "mean |gap| (points)", "min / max gap")
    return [
        Heading(2, "Post-hoc extraction"),
        Text(
            "Architectures searched under evenly spaced MAC targets (feast-edge extraction-gap), extracted from the "
            "trained supernet, BN-recalibrated and tested; a gap is the accuracy minus the cached-variant curve "
            f"interpolated at the same MACs. Paper (CIFAR-100, 25–52M MACs): {PAPER_EXTRACTION_GAP} points."
        ),
        Table(header, tuple(rows), left=2),
    ]


# ------------------------------------------------------------------ personalization
def personalization_blocks(runs: Sequence[Run]) -> list[Block]:
    """Per run of ``simulate --personalize``: own held-out accuracy, mean and worst decile, served and personal."""
    done = [r for r in runs if r.personalization is not None]
    if not done:
        return []

    def pct(value: Any) -> str:
        return "—" if value is None else f"{100 * value:.2f}"

    rows = []
    for r in done:
        s = r.personalization
        rows.append(
            (
                str(r.directory),
                str(s["choice"]),
                f"{s.get('personalized', 0)}/{s.get('clients', 0)}",
                pct(s.get("served_mean")),
                pct(s.get("personal_mean")),
                pct(s.get("served_worst_decile")),
                pct(s.get("personal_worst_decile")),
                f"{s.get('device_seconds_total', 0.0):.1f}",
            )
        )
    header = (
        "run",
        "--personalize",
        "personal models",
        "served mean (%)",
        "personal mean (%)",
        "served worst decile (%)",
        "personal worst decile (%)",
        "device seconds",
    )
    return [
        Heading(2, "Personalization"),
        Text(
            "After the last round each client personalized its served variant on its training split (method and "
            "strength chosen on a selection split of it) and counted both models on its own held-out split, which "
            "never trained. Accuracies are means over the clients of that own accuracy; the worst decile is the mean "
            "of the lowest tenth of clients."
        ),
        Table(header, tuple(rows), left=2),
        *_tuned_texts(done),
    ]


def _tuned_texts(runs: Sequence[Run]) -> list[Block]:
    """Under the table: per run, how many personal models were tuned to fewer than all the task's classes (a summary
    from before the count says nothing)."""
    texts = []
    for r in runs:
        fewer = r.personalization.get("tuned_to_fewer_classes")
        if isinstance(fewer, int) and not isinstance(fewer, bool) and fewer > 0:
            texts.append(
                Text(
                    f"{r.directory}: {fewer} of {r.personalization.get('personalized', 0)} personal models were tuned "
                    "to fewer than all the task's classes (results.json names them per client, personal_classes); "
                    "serve the global model for the others."
                )
            )
    return texts


def draw_extraction(plt: Any, runs: Sequence[Run]) -> Any:
    """Each run's cached curve (line) and its extracted architectures (crosses), accuracy vs MACs."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(x for x in runs if x.extraction is not None):
        color = f"C{i % 10}"
        name = str(r.directory.name).replace("$", r"\$")
        ax.plot([p.macs / 1e6 for p in r.points], [100 * p.accuracy for p in r.points], color=color, marker="o",
                markersize=3, label=f"{name}: cached variants")  # fmt: skip
        points = r.extraction["points"]
        ax.scatter([p["macs"] / 1e6 for p in points], [100 * p["accuracy"] for p in points], color=color, marker="x",
                   s=40, label=f"{name}: extracted (uncached)")  # fmt: skip
    return mac_axes(plt, fig, ax)


def draw_experiment_plots(plt: Any, groups: Sequence[Group], runs: Sequence[Run], out: Path) -> list[tuple[str, str]]:
    """The γ and extraction plots the runs call for; (file name, title) pairs."""
    drawn = []
    wanted = (
        ("gamma.png", "Test accuracy vs MACs at each γ (mean over seeds)", bool(gamma_pairs(groups)), draw_gamma, groups),
        ("extraction.png", "Post-hoc extraction against the cached curve", any(r.extraction for r in runs),
         draw_extraction, runs),
        ("privacy.png", "Test accuracy against ε", any(r.privacy for r in runs), draw_privacy, runs),
    )  # fmt: skip
    for name, title, needed, draw, what in wanted:
        if not needed:
            continue
        fig = draw(plt, what)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        drawn.append((name, title))
    return drawn
