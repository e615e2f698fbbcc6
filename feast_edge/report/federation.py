"""``feast-server run`` directories as report records: rounds, best validation, where validation and BN calibration ran.

A federation leaves no ``results.json`` (no test split is held anywhere): the report reads the record of its
``checkpoint.safetensors``, its device registry and its exported models' manifests
(:mod:`feast_edge.report.model_words`), and says in the dashboard's words where it validated and calibrated, and for the models
the devices calibrated, their own held-out accuracy, served model -> personal model, the means and the worst of each column,
and per served variant the rule that chose it and the classes it was trained, validated and calibrated on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from feast_edge.errors import FeastError
from feast_edge.report.model_words import (
    FleetAccuracy,
    device_calibrated,
    fleet_accuracy,
    model_accuracy,
    run_validated_on,
    served_variants,
    validation_words,
)
from feast_edge.report.run_files import FEDERATION, read_manifests, read_registry
from feast_edge.run.checkpoint import read_record
from feast_edge.run.loop import CHECKPOINT, HISTORY_FORMAT


@dataclass(frozen=True)
class ServedModel:
    """One device's exported model: its MACs, its accuracy and how that was measured (in words)."""

    device: str
    macs: int | None
    accuracy: float | None
    measured: str
    on_device: bool  # BN-calibrated (and exported as ONNX) on the device
    personal_accuracy: float | None = None  # the device's own held-out accuracy of its personal model (checked)
    # How that model was made, in words (``prior τ=1``, ``served model kept: …``), and the classes it was tuned to
    # where those are fewer than all (``prior τ=1; tuned to 6 of 10 classes: …; serve the global model for the others``).
    personal: str = ""


@dataclass(frozen=True)
class FederationRun:
    """What the report reads from one ``feast-server run --out`` directory."""

    directory: Path
    federation: str | None
    preset: str
    rounds: int
    rounds_total: int | None
    best_val: float | None
    best_round: int | None
    served_reason: str | None  # why those weights are served (feast_edge.evaluate.served_round); None in older runs
    validation: str | None  # where it validated, in words (:func:`feast_edge.report.model_words.validation_words`)
    models: tuple[ServedModel, ...]
    own: FleetAccuracy | None = None  # over the models the devices calibrated: the means and each column's worst
    # Per served variant: whom it serves, the rules that chose it, the classes it was trained, validated and
    # BN-calibrated on (:func:`feast_edge.report.model_words.served_variants`).
    coverage: tuple[dict, ...] = ()

    @property
    def calibration(self) -> str | None:
        """Where the exported models were BN-calibrated, in words; None before an export."""
        places = {m.on_device for m in self.models}
        if not places:
            return None
        if places == {True}:
            return "BN calibration: on each device, on its own data"
        return (
            "BN calibration: on the server's data" if places == {False} else "BN calibration: on the server and devices"
        )


def is_federation_run(directory: Path) -> bool:
    """Whether ``directory`` holds a feast-server run (a federation's checkpoint and no simulation results)."""
    directory = Path(directory)
    if (directory / "results.json").is_file() or not (directory / CHECKPOINT).is_file():
        return False
    try:
        return read_record(directory / CHECKPOINT, format=None).get("fields", {}).get("kind") == FEDERATION
    except FeastError:
        return False


def load_federation_run(directory: Path) -> FederationRun:
    """Read a feast-server run directory; an unreadable registry or model index is a one-line :class:`FeastError`."""
    directory = Path(directory)
    fields = read_record(directory / CHECKPOINT, format=None).get("fields", {})
    config = fields.get("config", {})
    shift = 1 if fields.get("history_format", 1) < HISTORY_FORMAT else 0  # older checkpoints counted rounds from 0
    best = fields.get("best") or {}
    metrics = {str(d.get("device_id")): d.get("metrics") or {} for d in read_registry(directory, fields)}
    models, own = [], []
    manifests = read_manifests(directory)
    for manifest in manifests:
        device = str(manifest.get("device", ""))
        measured = model_accuracy(manifest, metrics.get(device))
        macs = manifest.get("macs")
        on_device = device_calibrated(manifest)
        models.append(
            ServedModel(
                device,
                macs if isinstance(macs, int) else None,
                measured["accuracy"],
                measured["accuracy_note"],
                on_device,
                measured["personal_accuracy"],
                "; ".join(filter(None, (measured["personal_note"], measured["personal_tuned"]))),
            )
        )
        if on_device:
            own.append((device, measured))
    return FederationRun(
        directory=directory,
        federation=config.get("federation"),
        preset=str(config.get("preset", "?")),
        rounds=int(fields.get("round", 0)),
        rounds_total=config.get("rounds"),
        best_val=best.get("val_accuracy"),
        best_round=None if "round" not in best else int(best["round"]) + shift,
        served_reason=best.get("reason"),
        validation=validation_words(run_validated_on(fields)),
        models=tuple(sorted(models, key=lambda m: m.device)),
        own=fleet_accuracy(own) if own else None,
        coverage=tuple(served_variants(manifests)),
    )
