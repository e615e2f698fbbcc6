"""Per-round metrics where people already look: ``rounds.csv`` after every round, TensorBoard event files on request.

``feast-edge simulate`` and ``feast-server run`` both keep ``rounds.csv`` in
their run directory, rewritten atomically after each round (a reader never sees
half a file). With ``--tensorboard`` the same numbers go to
``RUN_DIR/tensorboard/`` as TensorBoard scalars (``tensorboard --logdir
RUN_DIR``); that needs the optional ``tensorboard`` package.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from feast_edge.errors import FeastError
from feast_edge.run.loop import RoundRecord
from feast_edge.util.atomic import atomic_write_bytes

ROUNDS_CSV = "rounds.csv"
TENSORBOARD_DIR = "tensorboard"
COLUMNS = [
    "round",
    "lr",
    "loss",
    "samples",
    "train_macs",
    "routed_params",
    "full_params",
    "routed_bytes",
    "full_bytes",
    "val_accuracy",
    "seconds",
    "updated",
    "rejected",
    "missing",
    "dropped",
    "declined",
    "incomplete",
    "epsilon",  # DP runs: ε after the round at the run's δ (feast_edge.privacy); empty otherwise
    "clip",  # adaptive clipping: the round's L2 bound on each update; empty otherwise
    "clock",  # simulation: the virtual clock's seconds at the end of the step (feast_edge.run.clock)
    "staleness_mean",  # asynchronous rounds: the released updates' mean staleness (releases); empty otherwise
    "staleness_max",
    "present",  # simulation with clients that join over time: the clients the cohort was drawn from; else empty
    "visible",  # ... and the training examples those clients hold at the step (shards that grow)
]


class TensorBoardError(FeastError):
    """``--tensorboard`` was asked for without the tensorboard package."""


def round_row(h: RoundRecord) -> list[Any]:
    """One ``rounds.csv`` row (empty cells for what the round did not measure)."""
    return [
        h.round,
        f"{h.lr:.6f}",
        "" if h.loss is None else f"{h.loss:.4f}",
        h.samples,
        h.train_macs,
        h.routed_params,
        h.full_params,
        h.routed_bytes,
        h.full_bytes,
        "" if h.val_accuracy is None else f"{h.val_accuracy:.4f}",
        f"{h.seconds:.2f}",
        len(h.updated),
        len(h.rejected),
        len(h.missing),
        len(h.dropped),
        len(h.declined),
        len(h.incomplete),
        f"{h.dp['epsilon']:.4f}" if h.dp else "",
        f"{h.dp['clip']:.6g}" if "clip" in h.dp else "",
        "" if h.clock is None else f"{h.clock:.2f}",
        f"{sum(h.staleness.values()) / len(h.staleness):.3f}" if h.staleness else "",
        max(h.staleness.values()) if h.staleness else "",
        "" if h.present is None else h.present,
        "" if h.visible is None else h.visible,
    ]


def write_rounds_csv(path: str | Path, history: Sequence[RoundRecord]) -> Path:
    """The whole history as CSV, replaced atomically."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(COLUMNS)
    writer.writerows(round_row(h) for h in history)
    return atomic_write_bytes(path, buffer.getvalue().encode())


class TensorBoardLog:
    """Scalars per round in ``directory`` (one run of TensorBoard's file format, written by TensorBoard's own writer)."""

    def __init__(self, directory: str | Path, first_round: int = 1) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch ships the writer, the tensorboard package the protobufs it writes
            raise TensorBoardError(
                "--tensorboard needs the tensorboard package: pip install 'feast-edge[tensorboard]' (or pip install tensorboard)"
            ) from None
        # A resumed run starts again after its last checkpoint: events of rounds past it (written before a crash) are dropped.
        self.writer = SummaryWriter(log_dir=str(directory), purge_step=first_round)

    def write(self, h: RoundRecord) -> None:
        scalars = {
            "train/loss": h.loss,
            "train/lr": h.lr,
            "train/samples": h.samples,
            "compute/train_macs": h.train_macs,
            "traffic/routed_params": h.routed_params,
            "traffic/full_broadcast_params": h.full_params,
            "traffic/routed_bytes": h.routed_bytes,
            "traffic/full_broadcast_bytes": h.full_bytes,
            "round/seconds": h.seconds,
            "round/updated": len(h.updated),
            "round/rejected": len(h.rejected),
            "validation/accuracy": h.val_accuracy,
            "privacy/epsilon": h.dp.get("epsilon"),
            "privacy/clip": h.dp.get("clip"),
            "population/present": h.present,
            "population/visible": h.visible,
        }
        for tag, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(tag, value, global_step=h.round)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class RoundLog:
    """After every round: ``rounds.csv`` in ``out`` and, when ``tensorboard``, TensorBoard scalars in ``out/tensorboard``."""

    def __init__(self, out: str | Path, *, tensorboard: bool = False, first_round: int = 1) -> None:
        self.out = Path(out)
        self.tensorboard = TensorBoardLog(self.out / TENSORBOARD_DIR, first_round) if tensorboard else None

    def write(self, history: Sequence[RoundRecord]) -> None:
        write_rounds_csv(self.out / ROUNDS_CSV, history)
        if self.tensorboard is not None and history:
            self.tensorboard.write(history[-1])

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
