"""Install only if not worse: a device compares a new version with the one it runs, on its own held-out split.

    new, old     per held-out example, whether the new version and the running one classify it right (paired: the
                 same examples, in the same order)
    worse        old accuracy - new accuracy > required_gain(old, new, n, n): the served-round rule's significance
                 test (feast_edge.evaluate.coverage, 2 points and 2 standard errors), one rule, not a second threshold
    install      unless worse; a device that runs no model installs without a comparison

The figures (both counts, and the examples only one of the two gets right) go to the server's registry with the
decision, so a refusal is never a bare "no".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from feast_edge.evaluate.coverage import SERVE_MARGIN, required_gain

INSTALLED, REFUSED, FIRST, ROLLED_BACK, UNGATED = "installed", "refused", "first", "rolled-back", "ungated"
DECISIONS = (INSTALLED, REFUSED, FIRST, ROLLED_BACK, UNGATED)


@dataclass(frozen=True)
class Verdict:
    """A device's decision on one version, with the paired figures behind it (all zero where nothing was compared)."""

    install: bool
    decision: str  # one of DECISIONS
    examples: int = 0  # held-out examples both models classified
    new_correct: int = 0
    old_correct: int = 0
    new_only: int = 0  # examples only the new version gets right
    old_only: int = 0  # ... only the running one
    threshold: float = 0.0  # how far the new accuracy may fall below the old before it is worse

    @property
    def new_accuracy(self) -> float | None:
        return self.new_correct / self.examples if self.examples else None

    @property
    def old_accuracy(self) -> float | None:
        return self.old_correct / self.examples if self.examples else None

    @property
    def difference(self) -> float | None:
        """New minus old accuracy on the same examples (None: not compared)."""
        return (self.new_correct - self.old_correct) / self.examples if self.examples else None

    def figures(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("install", "decision")}

    def words(self) -> str:
        """``installed: 71.2% vs 69.0% running, paired on 500 held-out examples (...)``."""
        if self.decision == FIRST and self.examples:
            return (
                f"installed: the device ran no model ({100 * self.new_correct / self.examples:.1f}% on its "
                f"{self.examples} held-out examples)"
            )
        if not self.examples:
            return {
                FIRST: "installed: the device ran no model",
                UNGATED: "installed without a comparison (the agent cannot refuse a version)",
                ROLLED_BACK: "rolled back",
            }.get(self.decision, f"{self.decision}: not compared (no held-out split)")
        new, old = 100 * self.new_correct / self.examples, 100 * self.old_correct / self.examples
        verb = "installed" if self.install else "refused"
        why = "" if self.install else f" (worse by more than {100 * self.threshold:.1f} points)"
        return (
            f"{verb}: {new:.1f}% vs {old:.1f}% running, paired on {self.examples} held-out examples "
            f"({self.new_only} only the new one gets right, {self.old_only} only the running one){why}"
        )


def judge(new: Sequence[bool] | np.ndarray, old: Sequence[bool] | np.ndarray, margin: float = SERVE_MARGIN) -> Verdict:
    """The install decision from per-example correctness of the new version and the running one (see the module
    docstring); no examples: installed, not compared."""
    new, old = np.asarray(new, dtype=bool), np.asarray(old, dtype=bool)
    if new.shape != old.shape or new.ndim != 1:
        raise ValueError(f"judge: paired outcomes must be two vectors of one length, got {new.shape} and {old.shape}")
    n = int(new.size)
    if n == 0:
        return Verdict(True, INSTALLED)
    return from_counts(n, int(new.sum()), int(old.sum()), int((new & ~old).sum()), int((old & ~new).sum()), margin)


def from_counts(
    examples: int, new_correct: int, old_correct: int, new_only: int, old_only: int, margin: float = SERVE_MARGIN
) -> Verdict:
    """The decision from paired counts (as a device reports them)."""
    if not examples:
        return Verdict(True, INSTALLED)
    new_acc, old_acc = new_correct / examples, old_correct / examples
    threshold = required_gain(old_acc, new_acc, examples, examples, margin)
    worse = old_acc - new_acc > threshold
    return Verdict(
        not worse, REFUSED if worse else INSTALLED, examples, new_correct, old_correct, new_only, old_only, threshold
    )
