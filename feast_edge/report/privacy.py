"""The report's privacy section: accuracy against ε for runs of ``feast-edge simulate --dp-*`` (feast_edge.privacy)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from feast_edge.report.blocks import Block, Heading, Table, Text
from feast_edge.report.runs import Run, dp_words


def _pct(value: float) -> str:
    return f"{100 * value:.2f}"


def privacy_blocks(runs: Sequence[Run]) -> list[Block]:
    """One row per run when any run has DP: ε at δ, and the accuracy of the population, the smallest and the largest
    served variant (runs without DP as ε = ∞, the price's reference)."""
    if not any(r.privacy for r in runs):
        return []
    rows = []
    for r in sorted(runs, key=lambda r: (r.privacy or {}).get("epsilon", math.inf)):
        p = r.privacy
        rows.append(
            (
                str(r.directory),
                dp_words(p) if p else "no DP",
                str(r.rounds),
                "∞" if not p else f"{p['epsilon']:.3g}",
                "—" if not p else f"{p['delta']:.2g}",
                _pct(r.population_accuracy),
                _pct(r.points[0].accuracy),
                _pct(r.points[-1].accuracy),
                "" if not p or not p.get("stopped") else "stopped at the budget",
            )
        )
    header = ("run", "privacy", "rounds", "ε", "δ", "population acc. (%)", "smallest variant (%)",
              "largest variant (%)", "note")  # fmt: skip
    return [
        Heading(2, "Privacy"),
        Text(
            "Client-level differential privacy: ε at δ for the whole run, from the run's own accounting (dp-accounting "
            "RDP, cohorts of fixed size drawn without replacement, replace-one). A smaller ε is a stronger guarantee; "
            "runs without DP are the reference (ε = ∞). Accuracies are test accuracies of the best checkpoint."
        ),
        Table(header, tuple(rows), left=2),
    ]


def draw_privacy(plt: Any, runs: Sequence[Run]) -> Any:
    """Population, smallest- and largest-variant accuracy against ε (log scale): central DP as lines, local DP as
    crosses, runs without DP as dashed lines."""
    fig, ax = plt.subplots(figsize=(8, 5))
    private = sorted((r for r in runs if r.privacy), key=lambda r: r.privacy["epsilon"])
    series = (
        ("population", lambda r: r.population_accuracy, "C0"),
        ("smallest variant", lambda r: r.points[0].accuracy, "C1"),
        ("largest variant", lambda r: r.points[-1].accuracy, "C2"),
    )
    for name, value, color in series:
        for local in (False, True):
            chosen = [r for r in private if (r.privacy.get("mode") == "local") == local]
            if not chosen:
                continue
            eps, acc = [r.privacy["epsilon"] for r in chosen], [100 * value(r) for r in chosen]
            if local:
                ax.scatter(eps, acc, marker="x", s=60, color=color, label=f"{name}, local DP")
            else:
                ax.plot(eps, acc, marker="o", color=color, label=f"{name}, central DP")
        for r in (x for x in runs if not x.privacy):
            ax.axhline(100 * value(r), color=color, linestyle="--", linewidth=1, label=f"{name}, no DP")
    ax.set_xscale("log")
    ax.set_xlabel("ε (at the run's δ)")
    ax.set_ylabel("test accuracy (%)")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.grid(True, alpha=0.3)
    return fig
