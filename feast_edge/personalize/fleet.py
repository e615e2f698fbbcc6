"""A fleet's accuracy on its devices' own held-out splits, served model against personal model, device by device.

Every path that personalizes (``feast-edge simulate --personalize``, the Flower ClientApp, the device agent) runs
``feast_edge.personalize.select.personal_step`` per device; what comes back from each is one :class:`OwnRow` (counts,
never an example), and :func:`fleet_summary` turns the rows into the figures reported: the mean over devices and the
worst decile (the mean of the lowest tenth), of the served and of the personal model. A row also holds the classes its
personal model was tuned to (:mod:`feast_edge.personalize.tuned`): :func:`tuned_lines` says which fell short of all.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from feast_edge.personalize.select import worst_decile
from feast_edge.personalize.tuned import Tuned, TunedError
from feast_edge.util.text import printable

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
    tuned: Tuned | None = None  # the classes its personal model was tuned to (None: no personal model, or not said)

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
            outcome.tuned if outcome.model is not None else None,
        )

    @property
    def served_accuracy(self) -> float | None:
        return self.served_correct / self.examples if self.examples else None

    @property
    def personal_accuracy(self) -> float | None:
        return self.personal_correct / self.examples if self.examples else None

    def to_dict(self) -> dict[str, Any]:
        """The row as results.json holds it (JSON values), its two accuracies and its personal model's classes
        included (``personal_classes``, ``personal_task_classes``, and ``tuned``: the words, "" for all classes)."""
        row = {k: v for k, v in asdict(self).items() if k != "tuned"}
        return {
            **row,
            "served_accuracy": self.served_accuracy,
            "personal_accuracy": self.personal_accuracy,
            **({} if self.tuned is None else {**self.tuned.to_dict(), "tuned": self.tuned.words()}),
        }


@dataclass(frozen=True)
class FleetAccuracy:
    """Own held-out accuracy over the devices, served model -> personal model: the means over the devices with both
    (``counted`` of ``devices``), the worst decile of each (the mean of the lowest tenth), and the worst of each, with
    its device: the lowest served accuracy and the lowest personal one, often of two devices. The one fleet summary: of
    a simulation's or a Flower run's rows (:func:`fleet_summary`) and of what a federation's devices reported
    (feast_edge.report.model_words)."""

    devices: int
    counted: int
    served: float | None
    personal: float | None
    worst_served_device: str | None
    worst_served: float | None
    worst_personal_device: str | None
    worst_personal: float | None
    served_worst_decile: float | None = None
    personal_worst_decile: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def counted_words(self) -> str:
        """``2 of 5 devices``: how many devices the means are over."""
        return f"{self.counted} of {self.devices} device" + ("" if self.devices == 1 else "s")

    def worst_words(self, separator: str = " ") -> tuple[str, str]:
        """``("jetson-nano 8.45%", "laptop-cpu 88.44%")``: the worst served and the worst personal accuracy, each
        with its own device (``separator`` between them), for a table's two columns."""
        return (
            f"{self.worst_served_device}{separator}{_percent(self.worst_served)}",
            f"{self.worst_personal_device}{separator}{_percent(self.worst_personal)}",
        )

    def words(self) -> str:
        """``own held-out accuracy, served -> personal: mean 78.75% -> 82.20% over 2 of 3 devices; worst served
        jetson-nano 8.45%, worst personal laptop-cpu 88.44%`` (or that no device reported both)."""
        said = "own held-out accuracy, served -> personal: "
        if not self.counted:
            return said + f"no device reported both (of {self.devices})"
        served, personal = self.worst_words()
        return (
            said + f"mean {_percent(self.served)} -> {_percent(self.personal)} over {self.counted_words}; "
            f"worst served {served}, worst personal {personal}"
        )


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def fleet_accuracy_of(pairs: Iterable[tuple[str, float | None, float | None]]) -> FleetAccuracy:
    """Summarize ``(device, served accuracy, personal accuracy)`` triples (None: not measured or not believed)."""
    pairs = list(pairs)
    both = [
        (device, served, personal) for device, served, personal in pairs if served is not None and personal is not None
    ]
    if not both:
        return FleetAccuracy(len(pairs), 0, None, None, None, None, None, None)
    # The lowest of each column; among equals the lower other column, then the first name.
    served = min(both, key=lambda b: (b[1], b[2], b[0]))
    personal = min(both, key=lambda b: (b[2], b[1], b[0]))
    return FleetAccuracy(
        devices=len(pairs),
        counted=len(both),
        served=statistics.fmean(b[1] for b in both),
        personal=statistics.fmean(b[2] for b in both),
        worst_served_device=served[0],
        worst_served=served[1],
        worst_personal_device=personal[0],
        worst_personal=personal[2],
        served_worst_decile=worst_decile([b[1] for b in both]),
        personal_worst_decile=worst_decile([b[2] for b in both]),
    )


def fleet_summary(rows: Sequence[OwnRow], choice: str) -> dict[str, Any]:
    """Mean and worst decile of the devices' own held-out accuracy, served and personal, over the devices that hold a
    held-out split; how many chose a personal model, and the device time the step took in all and per device."""
    fleet = fleet_accuracy_of((r.client, r.served_accuracy, r.personal_accuracy) for r in rows)
    seconds = sum(r.seconds for r in rows)
    return {
        "choice": choice,
        "clients": len(rows),
        "measured": fleet.counted,
        "personalized": sum(1 for r in rows if r.method),
        "tuned_to_fewer_classes": sum(1 for r in rows if r.method and r.tuned is not None and r.tuned.partial),
        "served_mean": fleet.served,
        "personal_mean": fleet.personal,
        "served_worst_decile": fleet.served_worst_decile,
        "personal_worst_decile": fleet.personal_worst_decile,
        "worst_served_device": fleet.worst_served_device,
        "worst_personal_device": fleet.worst_personal_device,
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


def tuned_lines(clients: Sequence[Mapping[str, Any]], limit: int = 10) -> list[str]:
    """``client-003: personal model tuned to 6 of 10 classes: …; serve the global model for the others``, one per row of
    ``clients`` (a personalization record's, :meth:`OwnRow.to_dict`) whose personal model was tuned to fewer than all
    the task's classes; after ``limit`` of them, how many more. Rows from before the fields say nothing."""
    lines = []
    for row in clients:
        try:
            tuned = Tuned.read(row) if row.get("method") else None
        except TunedError:
            tuned = None  # a row that does not add up says nothing of classes
        words = "" if tuned is None else tuned.words()
        if words:
            lines.append(f"{printable(str(row.get('client')), 64)}: personal model {words}")
    if len(lines) > limit:
        lines = [*lines[:limit], f"and {len(lines) - limit} more clients' personal models tuned to fewer classes"]
    return lines


def summary_lines(block: Mapping[str, Any]) -> list[str]:
    """What ``simulate --personalize`` prints under its table of a personalization record ``block``: who chose a
    personal model (and how many of those were tuned to fewer classes), the step's device time, then
    :func:`tuned_lines`."""
    s = block["summary"]
    fewer = s.get("tuned_to_fewer_classes")  # absent from results written before it
    return [
        f"personalization: {s['personalized']} of {s['clients']} clients chose a personal model"
        + (f" ({fewer} tuned to fewer than all the task's classes)" if fewer else "")
        + f", {s['measured']} measured on their own held-out split; device time {s['device_seconds_total']:.1f} s",
        *tuned_lines(block.get("clients", [])),
    ]
