"""``feast-edge simulate --personalize``: after the last round, every client runs the device's personalization step.

    served model   the largest cached variant its budget affords, of the supernet the results test (the best
                   checkpoint, else the last), BN recalibrated on the server-held calibration split exactly as the
                   final test does (``Method.point_network``)
    step           ``feast_edge.personalize.select.personal_step`` on the client's training split (its shard less
                   its held-out split), counted on its own held-out split (``Setup.client_holdout``)
    record         one ``OwnRow`` per client and the fleet's mean and worst decile (feast_edge.personalize.fleet)

The device agent and the Flower ClientApp run the same step on their own data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from feast_edge.personalize.fleet import OwnRow, personalization_record
from feast_edge.personalize.select import Choice, personal_step
from feast_edge.sim.methods.base import Method
from feast_edge.sim.setup import HOLDOUT_SEED, Setup
from feast_edge.space.static import StaticResNet


def personalize_clients(
    setup: Setup,
    method: Method,
    served: Sequence[int],
    choice: Choice,
    *,
    seed: int,
    device: str | torch.device = "cpu",
    progress: Callable[[int, int], None] | None = None,
    t: int | None = None,
) -> dict[str, Any]:
    """Every client's personalization step on its served variant (``served[i]``: client ``i``'s index into
    ``method.points()``), on the training examples it holds at step ``t`` (shards that grow; None: all); the
    "personalization" block of results.json."""
    points = method.points()
    calibration = setup.calibration_images()
    networks: dict[int, StaticResNet] = {}  # one calibrated network per served variant; personal_step only reads it
    rows = []
    for i, (client, index) in enumerate(zip(setup.client_ids, served)):
        if index not in networks:
            networks[index] = method.point_network(points[index], calibration, device)
        images, labels = setup.client_data(client, t)
        held_images, held_labels = setup.client_holdout(client)
        began = time.perf_counter()
        outcome, own = personal_step(
            networks[index], images, labels, held_images, held_labels, setup.preset, choice, seed=seed, device=device
        )
        rows.append(OwnRow.of(client, points[index].macs, outcome, own, time.perf_counter() - began))
        if progress is not None:
            progress(i + 1, len(setup.client_ids))
    return personalization_record(
        rows,
        str(choice),
        holdout=setup.holdout,
        holdout_seed=HOLDOUT_SEED,
        seed=seed,
        calibration="server",
        calibration_samples=int(calibration.shape[0]),
    )
