"""A dashboard state with something in every panel, for the dashboard's tests (the ``filled`` fixture)."""

from __future__ import annotations

import time
from pathlib import Path

from feast_edge.dashboard import DashboardState

MODEL_BYTES = b"not really onnx, but bytes a browser downloads"


def fill(state: DashboardState, model_dir: Path) -> DashboardState:
    """Two devices, a round in flight, two finished rounds, variants, population accuracy, one exported model."""
    now = time.time()
    state.set_run(
        federation="lab",
        preset="fmnist-small",
        method="feast",
        rounds_total=5,
        rounds_done=2,
        status="running",
        started=now - 60,
    )
    state.set_device(
        "pi-5",
        profile="raspberry-pi-5",
        hardware="4x Cortex-A76",
        budget_macs=6_600_000,
        precision="int8",
        variant={"label": "small", "macs": 6_400_000, "params": 90_000},
        envelope={"params": 120_000, "bytes": 480_000},
        online=True,
        last_seen=now - 3,
        rounds=2,
        last_upload={"round": 2, "status": "accepted", "reason": None},
        version={"version": 3, "since": now - 120, "accuracy": 0.8125, "examples": 64},
    )
    state.set_device(
        "jetson",
        profile="jetson-nano",
        budget_macs=2_791_024,
        precision="fp32",
        variant={"label": "tiny", "macs": 2_700_000, "params": 30_000},
        online=False,
        last_seen=now - 400,
        rounds=1,
        last_upload={"round": 2, "status": "late", "reason": "after the deadline"},
    )
    for r in (1, 2):
        state.end_round(
            {
                "round": r,
                "loss": 2.0 / r,
                "val_accuracy": 0.3 + 0.1 * r,
                "bytes_down": 600_000,
                "bytes_up": 590_000,
                "broadcast_bytes": 4_000_000,
                "train_macs": 8e8,
                "seconds": 5.0,
                "devices": {"pi-5": {"down": 480_000, "up": 470_000}, "jetson": {"down": 120_000, "up": 120_000}},
            }
        )
    state.start_round(3, ["pi-5", "jetson"], now + 120)
    state.member("pi-5", "downloading", done=3, total=8)
    state.set_variants(
        [
            {"label": "tiny", "macs": 2_700_000, "params": 30_000, "val_accuracy": 0.41, "test_accuracy": 0.40},
            {"label": "small", "macs": 6_400_000, "params": 90_000, "val_accuracy": 0.52, "test_accuracy": 0.50},
        ]
    )
    state.set_population(0.45)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "pi-5.onnx").write_bytes(MODEL_BYTES)
    state.set_models(
        [
            {
                "device": "pi-5",
                "label": "small",
                "macs": 6_400_000,
                "params": 90_000,
                "validation_accuracy": 0.52,
                "sha256": "ab" * 32,
                "file": "pi-5.onnx",
                "served_round": {"round": 2, "of": 3, "reason": "round 2: round 3 regressed on 2 of 2 devices"},
            }
        ],
        model_dir,
    )
    return state
