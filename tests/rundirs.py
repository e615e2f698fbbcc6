"""Run directories written by tests: a ``feast-server run --out`` directory (its checkpoint, registry and exported
models) and synthetic ``feast-edge simulate`` results.json files.

``federated=True``: a server without ``--data`` (validation on the devices' held-out splits, the model of pi-5
calibrated on pi-5, which reported its held-out accuracy and that of its personal model); ``federated=False``: the
server's ``--data``. :func:`add_personal_fleet` adds device-calibrated models to a federated run: one device that kept
its served model and three that lie in their reports (or, with :data:`TUNED`, a personal model tuned to 3 classes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from feast_edge.run.checkpoint import save_supernet
from feast_edge.run.loop import CHECKPOINT, HISTORY_FORMAT
from feast_edge.server.registry import Registry
from feast_edge.space.preset import Preset
from feast_edge.space.supernet import Supernet

ARCH = {"d": [0, 0, 0], "e": [0.5, 0.5, 0.5], "w": [0, 0, 0, 0]}
DEVICES = ("cam-1", "pi-5")
HELD_OUT = 60  # examples the cohort held out, in all (the federated run's validation)
HOLDOUT_ACCURACY = 0.875  # what pi-5 reported of the model it calibrated
PERSONAL_ACCURACY = 0.9375  # ... and of its personal model (prior correction, τ = 1)
PERSONAL = {
    "personal_method": "prior",
    "personal_strength": 1.0,
    "personal_reason": "chose prior (tau 1): 45/50 right on its selection split against 40/50 for the served model",
    "personal_accuracy": PERSONAL_ACCURACY,
    "personal_seconds": 0.4,
    "personal_sha256": "ab" * 32,
    "personal_precision": "fp32",
}
# add_personal_fleet: device -> what it reported of its models (its held-out accuracy, served and personal).
KEPT_ACCURACY = 0.7  # cam-1 kept its served model: its personal accuracy is its served one
FLEET = {
    "cam-1": {
        "holdout_accuracy": KEPT_ACCURACY,
        "personal_method": "",
        "personal_strength": None,
        # what rich reads as markup, and a terminal escape: shown as text, never obeyed
        "personal_reason": "[/bold]\x1b[31m no method beat the served model on the selection split",
        "personal_accuracy": KEPT_ACCURACY,
    },
    # Three liars, each with a plausible served accuracy that must not enter the means either.
    "liar-range": {"holdout_accuracy": 0.95, **PERSONAL, "personal_accuracy": 7.5},
    "liar-method": {"holdout_accuracy": 0.95, **PERSONAL, "personal_method": "m" * 5000},
    "liar-type": {"holdout_accuracy": 0.95, **PERSONAL, "personal_accuracy": "0.99"},
}
# add_personal_fleet(..., TUNED): a device whose personal model was tuned to 3 of the 10 classes (its own images hold no
# others), and one whose classes do not add up (a class named twice): its whole personal report is void.
TUNED_CLASSES = ["T-shirt_top", "Pullover", "Shirt"]
TUNED_WORDS = "tuned to 3 of 10 classes: T-shirt_top, Pullover, Shirt; serve the global model for the others"
TUNED = {
    "jetson-shirts": {
        "holdout_accuracy": 0.5,
        **PERSONAL,
        "personal_accuracy": 1.0,
        "personal_classes": TUNED_CLASSES,
        "personal_task_classes": 10,
    },
    "liar-classes": {
        "holdout_accuracy": 0.95,
        **PERSONAL,
        "personal_classes": ["Shirt", "Shirt"],
        "personal_task_classes": 10,
    },
}
# What every summary of a federated run with add_personal_fleet shows (feast_edge.report.model_words.FleetAccuracy): the means
# over pi-5 and cam-1 alone (a liar counts for nothing, not even its served accuracy), cam-1 the worst of both columns.
FLEET_OWN_ACCURACY = {
    "devices": 5,
    "counted": 2,
    "served": (HOLDOUT_ACCURACY + KEPT_ACCURACY) / 2,
    "personal": (PERSONAL_ACCURACY + KEPT_ACCURACY) / 2,
    "worst_served_device": "cam-1",
    "worst_served": KEPT_ACCURACY,
    "worst_personal_device": "cam-1",
    "worst_personal": KEPT_ACCURACY,
    # the mean of the lowest tenth (at least one device) of each: of two devices, the lower
    "served_worst_decile": min(HOLDOUT_ACCURACY, KEPT_ACCURACY),
    "personal_worst_decile": min(PERSONAL_ACCURACY, KEPT_ACCURACY),
}


def register_device(
    registry: Registry,
    name: str,
    preset: Preset,
    budget: int,
    profile: dict[str, Any] | None = None,
    *,
    status: str = "online",
    precision: str = "fp32",
) -> None:
    """Register ``name`` (100 samples, on host agent-1) as the runs here do; a Raspberry Pi 5 unless ``profile``."""
    registry.register(
        name,
        host="agent-1",
        instance="i",
        budget_macs=budget,
        samples=100,
        preset=preset.name,
        profile=profile or {"name": "raspberry-pi-5", "hardware": {"cpu": "4x Cortex-A76"}},
        status=status,
        precision=precision,
    )


# pi-5's federated manifest: a smaller variant than its largest affordable, trained by pi-5 alone on 3 of 4 classes.
PI_SERVING_AND_COVERAGE = {
    "serving_rule": "better on validation: 90.0% vs 60.0% for the 5.50M variant",
    "largest_affordable_macs": 5_500_000,
    "coverage": {
        "trained": {"classes": ["a", "b", "c"], "missing": ["d"], "devices": ["pi-5"]},
        "validated": {"classes": ["a", "b", "c", "d"], "missing": [], "devices": ["cam-1", "pi-5"]},
        "calibrated": None,
    },
}


def federation_run(
    out: Path,
    preset: Preset,
    *,
    federated: bool,
    preset_name: str | None = None,
    classes: bool = False,
    rounds: int = 3,
) -> Path:
    """A checkpoint with 2 of ``rounds`` rounds (both validated; ``rounds=2``: a finished run), the registry of cam-1
    and pi-5, pi-5's exported model. ``preset_name``: the preset the run's settings name (default: ``preset``'s);
    ``classes``: the checkpoint records the task's class names, as feast-server run does."""
    out.mkdir()
    history = [
        {
            "round": r,
            "lr": 0.1,
            "cohort": list(DEVICES),
            "updated": list(DEVICES) if r == 1 else ["pi-5"],
            "rejected": {} if r == 1 else {"cam-1": "bad digest"},
            "loss": 1.5,
            "routed_params": 1000,
            "full_params": 5000,
            "train_macs": 10**9,
            "seconds": 3.0,
            "val_accuracy": 0.2 * r,
            "validation": {
                "source": "devices",
                "devices": list(DEVICES),
                "missing": [],
                "samples": HELD_OUT,
                "points": {"variant 0": 0.2 * r},
                "seconds": 1.0,
            }
            if federated
            else {},
        }
        for r in (1, 2)
    ]
    config = {"federation": "lab", "preset": preset_name or preset.name, "rounds": rounds, "method": "feast", "seed": 7}
    save_supernet(
        out / CHECKPOINT,
        Supernet(preset, seed=0),
        kind="federation",
        fingerprint="x",
        config=config,
        round=2,
        history=history,
        history_format=HISTORY_FORMAT,
        best={"round": 2, "val_accuracy": 0.4, "reason": "round 2: the newest validated round (a test's words)"},
        data=None if federated else "/data/fashion-mnist",
        registry=[],
        **({"classes": list(preset.task.classes)} if classes else {}),
    )
    registry = Registry(out / "devices.sqlite")
    for name, budget in (("cam-1", 2_000_000), ("pi-5", 6_000_000)):
        register_device(registry, name, preset, budget)
    models = out / "models"
    models.mkdir()
    manifest = {
        "device": "pi-5",
        "arch": ARCH,
        "macs": 1_230_000,
        "params": 45,
        "rounds": 2,
        "sha256": "cd" * 32,
        "size": 4,
    }
    if federated:
        (models / "pi-5.variant.safetensors").write_bytes(b"wts!")
        manifest.update(
            file="pi-5.variant.safetensors", calibration="device", bn_recalibrated=False, **PI_SERVING_AND_COVERAGE
        )
        registry.touch(
            "pi-5",
            metrics={
                "holdout_accuracy": HOLDOUT_ACCURACY,
                "holdout_samples": 40,
                "calibrated_on": 200,
                "model_sha256": "ef" * 32,
                "model_macs": 1_230_000,
                "model_round": 2,
                **PERSONAL,
            },
        )
    else:
        (models / "pi-5.onnx").write_bytes(b"onnx")
        manifest.update(file="pi-5.onnx", validation_accuracy=0.4, bn_recalibrated=True)
    registry.close()
    (models / "index.json").write_text(json.dumps({"models": [manifest]}))
    return out


def add_personal_fleet(out: Path, preset: Preset, fleet: dict[str, dict[str, Any]] = FLEET) -> Path:
    """Give each device of ``fleet`` (:data:`FLEET`, :data:`TUNED`) a model it calibrated and its report of it, in the
    federated run ``out``."""
    registry = Registry(out / "devices.sqlite")
    index = json.loads((out / "models" / "index.json").read_text())
    for name, metrics in fleet.items():
        if registry.get(name) is None:
            register_device(registry, name, preset, 4_000_000, {"name": "jetson-nano"}, status="offline")
        registry.touch(name, metrics={"holdout_samples": 40, "calibrated_on": 200, "model_round": 2, **metrics})
        index["models"].append(
            {
                "device": name,
                "arch": ARCH,
                "macs": 1_000_000,
                "params": 40,
                "rounds": 2,
                "sha256": "cd" * 32,
                "size": 4,
                "file": f"{name}.variant.safetensors",
                "calibration": "device",
                "bn_recalibrated": False,
            }
        )
    registry.close()
    (out / "models" / "index.json").write_text(json.dumps(index))
    return out


# ------------------------------------------------------------------ synthetic simulate runs
BUDGETS = [12e6, 25e6, 50e6, 50e6]
# label -> (MACs, params) of the cached variants FEAST and the centralized reference share
CACHED = {"v0": (10_000_000, 100_000), "v1": (20_000_000, 200_000), "v2": (40_000_000, 400_000)}
HETEROFL = {
    "x0.125": (5_000_000, 50_000),
    "x0.25": (15_000_000, 150_000),
    "x0.5": (30_000_000, 300_000),
    "x1": (45_000_000, 450_000),
}


def simulate_results(
    method: str,
    seed: int,
    accuracies: dict[str, float],
    points: dict[str, tuple[int, int]],
    *,
    population: float,
    **extra: Any,
) -> dict[str, Any]:
    """A results.json of ``simulate``: 4 rounds, validated on rounds 2 and 4."""
    config = {
        "seed": seed,
        "rounds": 4,
        "clients": len(BUDGETS),
        "per_round": 2,
        "variants": "full",
        "method_options": [],
        **extra.pop("config", {}),
    }
    variants = [
        {
            "index": i,
            "label": label,
            "macs": points[label][0],
            "params": points[label][1],
            "dense_macs": None,
            "detail": {},
            "test_accuracy": accuracies[label],
        }
        for i, label in enumerate(accuracies)
    ]
    rounds = [
        {
            "round": t,
            "lr": 0.02,
            "loss": 2.0 / t,
            "samples": 100,
            "train_macs": 10**12,
            "routed_params": 1_000_000,
            "val_accuracy": None if t % 2 else 0.1 * t + 0.01 * seed,
            "seconds": 2.5,
        }
        for t in range(1, 5)
    ]
    return {
        "method": method,
        "method_summary": f"{method} (synthetic)",
        "preset": "fmnist-small",
        "config": config,
        "best": {"round": 4, "val_accuracy": 0.4 + 0.01 * seed},
        "population": {"budgets": extra.pop("budgets", BUDGETS), "clients": len(BUDGETS)},
        "population_accuracy": population,
        "variants": variants,
        "served": [0, 1, 2, 2],
        "communication": {"routed_params_total": 8_000_000, "full_params_total": 16_000_000, "reduction": 2.0},
        "compute": {"train_macs_total": 4 * 10**12},
        "rounds": rounds,
        "seconds_total": 10.0,
        **extra,
    }


def write_run(folder: Path, record: dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(record))
    return folder
