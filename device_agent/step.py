"""One client's step of a round, as a function: the routed payload in, the encoded update (or why there is none) out.

It runs exactly what the simulator runs for that client
(``feast_edge.local.update.client_update``) with exactly the inputs the server
sent; the agent (``agent.py``) only moves bytes and messages around it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from feast_edge.agent.local_data import LocalClient
from feast_edge.errors import FeastError
from feast_edge.local.cotrain import LocalResult, stayed_finite
from feast_edge.local.update import client_update
from feast_edge.protocol import RoundStart
from feast_edge.route.payload import decode, encode
from feast_edge.space.preset import Preset
from feast_edge.space.supernet import Supernet
from feast_edge.transport.frames import MiB

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    """The encoded update and its training result, or ``reason`` (for the server) why there is none."""

    payload: bytes | None = None
    result: LocalResult | None = None
    compute_seconds: float = 0.0
    reason: str = ""


def largest_payload(preset: Preset) -> int:
    """A bound on any payload the server sends: the whole supernet (the largest routed envelope), or an ONNX file of a variant."""
    weights = sum(t.numel() * t.element_size() for t in Supernet(preset).state_dict().values())
    return 2 * weights + 16 * MiB


def local_step(
    preset: Preset, start: RoundStart, blob: bytes, client: LocalClient, device: str, busy: Callable[[bool], None], amp: str = "off"
) -> StepResult:
    """Decode the routed payload of ``start``, co-train on ``client``'s data (``amp``: feast_edge.local.precision), encode the returned slice (SPEC §5).

    ``busy(True/False)`` brackets the training itself (a stop signal then interrupts it at once).
    """
    t, classes, device_id = start.round, preset.classes, client.device_id
    shown = f"round {t + 1}/{start.rounds}"
    plan, train = start.client_plan(preset), start.train_config()
    try:
        manifest, state = decode(blob, preset, expected=plan.manifest(preset, classes, t, "routed", dtype=start.payload_dtype))
        if manifest.kind != "routed":
            raise FeastError(f"payload kind {manifest.kind!r} is not 'routed'")
    except FeastError as exc:
        log.error("%s: refused the routed payload for %s: %s", shown, device_id, exc)
        return StepResult(reason=f"refused the routed payload: {exc}")
    log.info("%s: %s trains %d variants on %d examples (routed payload %.2f MB)", shown, device_id, len(plan.affordable), client.samples, len(blob) / 1e6)
    began = time.perf_counter()
    busy(True)
    try:
        new_state, result = client_update(preset, classes, plan, state, client.images, client.labels, train, start.lr, start.client_seed, device, amp)
    except (FeastError, RuntimeError) as exc:  # e.g. settings this device cannot train with, or out of memory
        log.error("%s: local training of %s failed: %s; skipped", shown, device_id, exc)
        return StepResult(reason=f"local training failed: {exc}")
    finally:
        busy(False)
    compute = time.perf_counter() - began
    if not stayed_finite(new_state, result.mean_loss):
        log.warning("%s: the training of %s diverged (loss %s, or non-finite weights); no update sent for this round", shown, device_id, result.mean_loss)
        return StepResult(reason=f"training diverged (loss {result.mean_loss}, or non-finite weights)")
    try:
        payload = encode(new_state, plan.manifest(preset, classes, t, "update", device_id, manifest.dtype))
    except FeastError as exc:  # e.g. weights beyond float16's range
        log.warning("%s: the update of %s cannot be sent as %s: %s", shown, device_id, manifest.dtype, exc)
        return StepResult(reason=f"the update cannot be encoded: {exc}")
    return StepResult(payload, result, compute)
