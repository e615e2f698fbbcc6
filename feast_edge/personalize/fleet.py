"""A fleet's accuracy on its devices' own held-out splits, served model against personal model, device by device.

Every path that personalizes (``feast-edge simulate --personalize``, the Flower ClientApp, the device agent) runs
``feast_edge.personalize.select.personal_step`` per device; what comes back from each is one :class:`OwnRow` (counts,
never an example), and :func:`fleet_summary` turns the rows into the figures reported: the mean over devices and the
worst decile (the mean of the lowest tenth), of the served and of the personal model.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from feast_edge.personalize.select import worst_decile

if TYPE_CHECKING:
    from feast_edge.personalize.select import OwnAccuracy, Personalized

FORMAT = "feast-edge/personalization"


@dataclass(frozen=True)
class OwnRow:
    """One device after the personalization step: its served variant, what it chose and both models' held-out counts."""

    client: str
    served_macs: int
    method: str  # "" when the device keeps the served model alone
    strength: float | None
    examples: int  # its own held-out examples
    served_correct: int
    personal_correct: int  # served_correct when it keeps the served model
    reason: str
    seconds: float  # device time of the step (selection, fitting and both counts)

    @classmethod
    def of(cls, client: str, served_macs: int, outcome: Personalized, own: OwnAccuracy, seconds: float) -> OwnRow:
        """The row of :func:`~feast_edge.personalize.select.personal_step`'s answer for ``client``."""
        return cls(
            client,
            int(served_macs),
            outcome.method,
            outcome.strength,
            own.examples,
            own.served,
            own.personal,
            outcome.reason,
            round(float(seconds), 3),
        )

    @property
    def served_accuracy(self) -> float | None:
        return self.served_correct / self.examples if self.examples else None

    @property
    def personal_accuracy(self) -> float | None:
        return self.personal_correct / self.examples if self.examples else None

    def to_dict(self) -> dict[str, Any]:
        """The row as results.json holds it (JSON values), its two accuracies included."""
        return {
            **asdict(self),
            "served_accuracy": self.served_accuracy,
            "personal_accuracy": self.personal_accuracy,
        }


def fleet_summary(rows: Sequence[OwnRow], choice: str) -> dict[str, Any]:
    """Mean and worst decile of the devices' own held-out accuracy, served and personal, over the devices that hold a
    held-out split; how many chose a personal model, and the device time the step took in all and per device."""
    measured = [r for r in rows if r.examples]
    served = [r.served_accuracy for r in measured]
    personal = [r.personal_accuracy for r in measured]
    seconds = sum(r.seconds for r in rows)
    return {
        "choice": choice,
        "clients": len(rows),
        "measured": len(measured),
        "personalized": sum(1 for r in rows if r.method),
        "served_mean": statistics.fmean(served) if measured else None,
        "personal_mean": statistics.fmean(personal) if measured else None,
        "served_worst_decile": worst_decile(served) if measured else None,
        "personal_worst_decile": worst_decile(personal) if measured else None,
        "device_seconds_total": round(seconds, 3),
        "device_seconds_mean": round(seconds / len(rows), 3) if rows else None,
    }


def personalization_record(rows: Sequence[OwnRow], choice: str, **extra: Any) -> dict[str, Any]:
    """The "personalization" block of a run's results: ``extra`` (how the served models were made), the summary and
    every device's row, in client-id order."""
    ordered = sorted(rows, key=lambda r: r.client)
    return {
        "format": FORMAT,
        **extra,
        "summary": fleet_summary(ordered, choice),
        "clients": [r.to_dict() for r in ordered],
    }
