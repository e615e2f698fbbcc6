"""The PNG plots of ``feast-edge report``: accuracy vs MACs, validation curves, population accuracy, traffic and compute.

matplotlib is an optional dependency (``pip install 'feast-edge[report]'``): it is
imported only when a plot is drawn, with the non-interactive Agg backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from feast_edge.errors import FeastError
from feast_edge.report.experiments import draw_experiment_plots, mac_axes
from feast_edge.report.runs import Group

WIDE = 100.0  # a bar chart whose largest bar is this many times its smallest uses a log axis


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a one-line FeastError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise FeastError("feast-edge report needs matplotlib: pip install 'feast-edge[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain(text: str) -> str:
    """``text`` as matplotlib shows it literally (a ``$`` would start mathtext)."""
    return text.replace("$", r"\$")


def draw_plots(groups: Sequence[Group], reference: Group | None, out: Path) -> list[tuple[str, str]]:
    """Draw every plot into ``out``; returns (file name, title) pairs in report order."""
    plt = require_matplotlib()
    colors = {g.name: f"C{i % 10}" for i, g in enumerate(groups)}
    drawn = []
    for name, title, draw in (
        ("accuracy_vs_macs.png", "Test accuracy vs inference MACs (mean over seeds)", _accuracy_vs_macs),
        ("validation.png", "Validation accuracy per round (each run)", _validation),
        ("population_accuracy.png", "Population accuracy per method (mean ± std over seeds)", _population),
        ("cost.png", "Communication and training compute per method (mean over seeds)", _cost),
    ):
        fig = draw(plt, groups, reference, colors)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        drawn.append((name, title))
    if any(r.validation_in_time for g in groups for r in g.runs if r.schedule):  # an asynchronous run among them
        name, title = "accuracy_vs_time.png", "Validation accuracy vs virtual time (each run)"
        fig = _validation_in_time(plt, groups, colors)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        drawn.append((name, title))
    return drawn + draw_experiment_plots(plt, groups, [r for g in groups for r in g.runs], out)


def _validation_in_time(plt: Any, groups: Sequence[Group], colors: dict[str, str]) -> Any:
    """Synchronous and asynchronous runs on one virtual clock (feast_edge.run.clock)."""
    fig, ax = _run_curves(plt, groups, colors, lambda run: run.validation_in_time)
    ax.set_xlabel("virtual seconds")
    return fig


def _accuracy_vs_macs(plt: Any, groups: Sequence[Group], reference: Group | None, colors: dict[str, str]) -> Any:
    fig, ax = plt.subplots(figsize=(8, 5))
    for g in groups:
        points = g.points()
        ax.plot(
            [p.macs / 1e6 for p, _ in points],
            [100 * acc.mean for _, acc in points],
            marker="o",
            markersize=4,
            color=colors[g.name],
            label=_plain(g.name),
            linestyle="--" if g is reference else "-",
        )
    return mac_axes(plt, fig, ax)


def _validation(plt: Any, groups: Sequence[Group], reference: Group | None, colors: dict[str, str]) -> Any:
    fig, ax = _run_curves(plt, groups, colors, lambda run: run.validation)
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set_xlabel("round")
    return fig


def _run_curves(plt: Any, groups: Sequence[Group], colors: dict[str, str], points: Any) -> tuple[Any, Any]:
    """One validation curve per run, ``points(run)`` its (x, accuracy) pairs: the figure and its axes."""
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = ("-", "--", ":", "-.")
    curves = 0
    for g in groups:
        for k, run in enumerate(g.runs):
            if points(run):
                xs, accuracy = zip(*points(run))
                ax.plot(
                    xs,
                    [100 * a for a in accuracy],
                    marker=".",
                    color=colors[g.name],
                    linestyle=styles[k % len(styles)],
                    label=_plain(f"{g.name}, seed {run.seed}"),
                )
                curves += 1
    if curves:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no run validated", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("validation accuracy (%)")
    ax.grid(True, alpha=0.3)
    return fig, ax


def _population(plt: Any, groups: Sequence[Group], reference: Group | None, colors: dict[str, str]) -> Any:
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) + 2), 5))
    stats = [g.stat(lambda r: r.population_accuracy) for g in groups]
    means, errors = [100 * s.mean for s in stats], [100 * (s.std or 0.0) for s in stats]
    bars = ax.bar(range(len(groups)), means, yerr=errors, capsize=4, color=[colors[g.name] for g in groups])
    ax.bar_label(bars, labels=[f"{m:.1f}" for m in means], label_type="center", color="white", fontweight="bold")
    top = max(m + e for m, e in zip(means, errors))
    if reference is not None:
        level = 100 * reference.stat(lambda r: r.population_accuracy).mean
        ax.axhline(level, color="black", linestyle="--", linewidth=1, label=f"centralized reference ({level:.2f}%)")
        ax.legend(fontsize="small", loc="upper left")
        top = max(top, level)
    ax.set_ylim(0, 1.2 * top if top > 0 else 1)  # headroom: the legend sits above the bars
    _method_ticks(ax, groups)
    ax.set_ylabel("population accuracy (%)")
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def _cost(plt: Any, groups: Sequence[Group], reference: Group | None, colors: dict[str, str]) -> Any:
    fig, (sent, compute) = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(groups) + 4), 5))
    _bars(
        sent,
        groups,
        [g.stat(lambda r: r.params_sent).mean / 1e6 for g in groups],
        colors,
        "parameters sent, both directions (millions)",
    )
    sent.set_title("communication")
    _bars(
        compute, groups, [g.stat(lambda r: r.train_macs).mean / 1e12 for g in groups], colors, "training compute (TMAC)"
    )
    compute.set_title("training compute")
    return fig


def _bars(ax: Any, groups: Sequence[Group], values: list[float], colors: dict[str, str], label: str) -> None:
    ax.bar(range(len(groups)), values, color=[colors[g.name] for g in groups])
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) >= WIDE:
        ax.set_yscale("log")
        label += ", log scale"
    ax.set_ylabel(label)
    _method_ticks(ax, groups)
    ax.grid(True, axis="y", which="both", alpha=0.3)


def _method_ticks(ax: Any, groups: Sequence[Group]) -> None:
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([_plain(g.name) for g in groups], rotation=20, ha="right")
    ax.set_xlabel("method")
