"""What ``feast-server`` prints for people: one line per round, and the table of the exported models."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from feast_edge.report.model_words import (
    FleetAccuracy,
    chosen_by,
    coverage_words,
    fleet_accuracy,
    model_accuracy,
    served_precision,
    served_words,
)

if TYPE_CHECKING:
    from feast_edge.run.loop import RoundRecord

log = logging.getLogger("feast_edge.server")
OWN_CAPTION = "own acc: on the device's own held-out split, of the served model and of its personal model"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def print_round(record: RoundRecord, rounds: int) -> None:
    """One line per round (1-based): replies, loss, validation accuracy and what was refused."""
    replies = f"{len(record.updated)}/{len(record.cohort)}"
    state = "aggregated" if record.applied else "unchanged"
    loss = "-" if record.loss is None else f"{record.loss:.4f}"
    extra = []
    if record.rejected:
        extra.append(f"rejected {', '.join(sorted(record.rejected))}")
    if record.declined:
        extra.append(f"declined {', '.join(sorted(record.declined))}")
    if record.incomplete:
        extra.append(f"incomplete {', '.join(sorted(record.incomplete))}")
    if record.dropped:
        extra.append(f"offline {', '.join(record.dropped)}")
    if record.missing:
        extra.append(f"no reply {', '.join(record.missing)}")
    if record.withheld:  # secure aggregation: segments of fewer than c + 2 devices kept their global value
        extra.append(f"{len(record.withheld)} segment{'s' * (len(record.withheld) != 1)} withheld")
    val = _pct(record.val_accuracy)
    if record.validation.get("source") == "devices":
        val += f" (on {len(record.validation.get('devices', []))} devices)"
    step = "round"
    if record.staleness:  # an asynchronous release: how stale each buffered update was
        step = "release"
        replies += "  staleness " + ", ".join(f"{d} {tau}" for d, tau in sorted(record.staleness.items()))
    log.info(
        f"{step} {record.round}{f'/{rounds}' if rounds else ''}  replies {replies}  {state}  loss {loss}  val {val}  "
        f"{record.seconds:.1f} s" + (f"  ({'; '.join(extra)})" if extra else "")
    )


def _precision(manifest: dict[str, Any], report: dict[str, Any] | None) -> str:
    """The served file's precision, with the int8 file's held-out accuracy when it is int8."""
    words = served_precision(manifest, report)
    accuracy = (report or manifest).get("int8_accuracy") if words == "int8" else None
    return words if accuracy is None else f"int8 ({_pct(accuracy)})"


def models_table(manifests: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title, caption=served_words(manifests) or None)
    for col in (
        "device",
        "budget",
        "variant MACs",
        "params",
        "precision",
        "val accuracy",
        "chosen by",
        "classes trained",
        "file",
        "sha256",
    ):
        table.add_column(
            col,
            justify="right" if col in ("budget", "variant MACs", "params", "val accuracy") else "left",
            overflow="fold",
        )
    for m in manifests:
        on_device = m.get("calibration") in ("device", "federated")
        table.add_row(
            m["device"],
            f"{m['budget_macs'] / 1e6:.2f}M",
            f"{m['macs'] / 1e6:.2f}M",
            f"{m['params'] / 1e6:.3f}M",
            _precision(m, None),
            _pct(m.get("validation_accuracy")) if not on_device else "on the device",
            chosen_by(m),
            coverage_words(m),
            m["file"],
            m["sha256"][:12],
        )
    return table


def coverage_table(rows: list[dict[str, Any]], title: str) -> Table:
    """One row per served variant (:func:`feast_edge.report.model_words.served_variants`): whom it serves, which rule chose it,
    and the classes it was trained, validated and BN-calibrated on."""
    table = Table(title=title)
    for col in ("variant MACs", "serves", "chosen by", "trained on", "validated on", "BN calibrated on"):
        table.add_column(col, justify="right" if col == "variant MACs" else "left", overflow="fold")
    for row in rows:
        table.add_row(
            f"{row['macs'] / 1e6:.2f}M",
            Text(", ".join(row["devices"])),
            Text("; ".join(row["chosen_by"])),
            Text(row["trained"]),
            Text(row["validated"]),
            Text(row["calibrated"]),
        )
    return table


def coverage_lines(lines: list[str]) -> None:
    """The fleet's class-coverage problems again, under the final table (each was warned about once before)."""
    for line in lines:
        log.warning("class coverage: %s", line)


def served_cell(accuracy: dict[str, Any]) -> str:
    """A device-calibrated model's own held-out accuracy (:func:`feast_edge.report.model_words.model_accuracy`) in a cell."""
    return _pct(accuracy["accuracy"]) if "holdout_accuracy" in accuracy else "no report"


def personal_cell(accuracy: dict[str, Any]) -> Text:
    """``94.40% (prior τ=1)``, ``70.00% (served model kept: …)``, or why there is no accuracy, then the classes a
    personal model tuned to fewer than all was tuned to (``; tuned to 6 of 10 classes: …; serve the global model for
    the others``); as plain text (a device's reason may hold what rich reads as markup)."""
    note = "; ".join(filter(None, (accuracy["personal_note"], accuracy.get("personal_tuned"))))
    return Text(note if accuracy["personal_accuracy"] is None else f"{_pct(accuracy['personal_accuracy'])} ({note})")


def add_fleet_rows(table: Table, fleet: FleetAccuracy, served_column: int) -> None:
    """Below a table's rows, the means over the devices of their own accuracy, served and personal (in the columns
    ``served_column`` and the next), and the worst of each column with its own device (``jetson-nano 8.45%`` under
    served, ``laptop-cpu 88.44%`` under personal: the lowest of one column is not always the lowest of the other)."""
    table.add_row(
        Text(f"mean ({fleet.counted_words})"), *[""] * (served_column - 1), _pct(fleet.served), _pct(fleet.personal)
    )
    if fleet.counted:
        table.add_row(Text("worst (each column)"), *[""] * (served_column - 1), *map(Text, fleet.worst_words()))


def device_models_table(manifests: list[dict[str, Any]], reports: dict[str, dict[str, Any]], title: str) -> Table:
    """The devices' own models: where BN was calibrated, on how many examples, the accuracy each device measured on
    its held-out split, of the served model and of its personal one (what a server without data learns of its
    models); then the means over the devices and the worst of each column."""
    table = Table(title=title, caption="\n".join(filter(None, [served_words(manifests), OWN_CAPTION])))
    for col in (
        "device",
        "variant MACs",
        "precision",
        "calibrated on",
        "own acc, served",
        "own acc, personal",
        "held-out examples",
        "ONNX latency",
    ):
        table.add_column(col, justify="left" if col in ("device", "own acc, personal") else "right", overflow="fold")
    accuracies = []
    for i, m in enumerate(manifests):
        r = reports.get(m["device"], {})
        accuracy = model_accuracy(m, r)
        accuracies.append((m["device"], accuracy))
        latency = r.get("onnx_latency_ms")
        table.add_row(
            m["device"],
            f"{m['macs'] / 1e6:.2f}M",
            _precision(m, r),
            "-"
            if "calibrated_on" not in r
            else f"{r['calibrated_on']} examples on the device"
            if m.get("calibration") == "device"
            else f"own data, {r['calibrated_on']} examples (refused the federated)"
            if r.get("bn_refused")
            else f"federated, {r['calibrated_on']} examples",
            served_cell(accuracy),
            personal_cell(accuracy),
            "-" if accuracy.get("holdout_samples") is None else str(accuracy["holdout_samples"]),
            "-" if latency is None else f"{latency:.3f} ms",
            end_section=i == len(manifests) - 1,
        )
    add_fleet_rows(table, fleet_accuracy(accuracies), 4)
    return table
