"""One client's step of a round, as a function: ``train(job) -> Trained | Declined``.

The round message is parsed once (:meth:`Assignment.parse`, before the agent
waits for the payload), the routed payload decoded once (:meth:`Job.of`), and
:func:`train` runs exactly what the simulator runs for that client
(``feast_edge.local.update.client_update``) with exactly the inputs the server
sent. Nothing here touches MQTT: the round runner (``client_round.py``) moves the
bytes and messages around it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from feast_edge.agent.local_data import LocalClient
from feast_edge.errors import FeastError
from feast_edge.local.cotrain import LocalResult, stayed_finite
from feast_edge.local.recipe import TrainConfig
from feast_edge.local.update import client_update
from feast_edge.privacy.local import LocalDp, parameter_names, privatize
from feast_edge.protocol import RoundStart
from feast_edge.protocol.round_messages import shown_round
from feast_edge.route.payload import decode, encode
from feast_edge.route.plans import ClientPlan
from feast_edge.space.preset import Preset
from feast_edge.space.supernet import Supernet
from feast_edge.transport.frames import MiB, TransferInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Assignment:
    """A round message as this agent takes it, parsed once: the routed transfer to wait for, the plan, the settings."""

    start: RoundStart
    transfer: TransferInfo
    plan: ClientPlan
    settings: TrainConfig

    @classmethod
    def parse(cls, start: RoundStart, preset: Preset) -> Assignment:
        """FeastError when this agent cannot train it (its transfer, plan or training settings), before any wait."""
        return cls(start, start.transfer_info(), start.client_plan(preset), start.train_config())


@dataclass(frozen=True)
class Job:
    """Everything one client's step of a round trains with: the round's inputs and the routed state, decoded."""

    preset: Preset
    round: int
    rounds: int
    device_id: str
    plan: ClientPlan
    routed: dict[str, torch.Tensor]  # the routed sub-supernet's state, float32
    dtype: str  # of the routed payload, and so of the update sent back
    lr: float
    seed: int
    settings: TrainConfig
    data: LocalClient
    torch_device: str
    amp: str = "off"  # mixed precision of local training (feast_edge.local.precision)
    dp: LocalDp | None = None  # local DP applied to the trained slice before it is encoded (feast_edge.privacy.local)

    @classmethod
    def of(
        cls,
        assignment: Assignment,
        payload: bytes,
        data: LocalClient,
        preset: Preset,
        torch_device: str,
        amp: str,
        dp: LocalDp | None = None,
    ) -> Job:
        """The job of ``assignment`` with its routed ``payload``; FeastError when the payload is not what it routes."""
        start, plan = assignment.start, assignment.plan
        expected = plan.manifest(preset, preset.classes, start.round, "routed", dtype=start.payload_dtype)
        manifest, routed = decode(payload, preset, expected=expected)
        if manifest.kind != "routed":
            raise FeastError(f"payload kind {manifest.kind!r} is not 'routed'")
        return replace(cls.of_state(assignment, routed, data, preset, torch_device, amp), dp=dp)

    @classmethod
    def of_state(
        cls,
        assignment: Assignment,
        routed: dict[str, torch.Tensor],
        data: LocalClient,
        preset: Preset,
        torch_device: str,
        amp: str,
    ) -> Job:
        """The job of ``assignment`` with its routed state, already checked against the plan's envelope (float32)."""
        start = assignment.start
        return cls(
            preset=preset,
            round=start.round,
            rounds=start.rounds,
            device_id=data.device_id,
            plan=assignment.plan,
            routed=routed,
            dtype=start.payload_dtype,
            lr=start.lr,
            seed=start.client_seed,
            settings=assignment.settings,
            data=data,
            torch_device=torch_device,
            amp=amp,
        )

    @property
    def shown(self) -> str:
        """The round as people read it (1-based)."""
        return shown_round(self.round, self.rounds)


@dataclass(frozen=True)
class Trained:
    """The encoded update (the trained slice), its training result and the seconds training took."""

    payload: bytes
    result: LocalResult
    compute_seconds: float


@dataclass(frozen=True)
class Declined:
    """No update for this round, and why (for the server)."""

    reason: str


@dataclass(frozen=True)
class TrainedState:
    """The trained slice as tensors (before any encoding), its training result and the seconds training took."""

    state: dict[str, torch.Tensor]
    result: LocalResult
    compute_seconds: float


def train_state(job: Job, between_steps: Callable[[], None] | None = None) -> TrainedState | Declined:
    """Co-train the routed sub-supernet on the client's data (method §5, §7): the trained slice, or why there is none.
    ``between_steps``: called after every training step (the agent re-chooses its threads there)."""
    began = time.perf_counter()
    try:
        state, result = client_update(
            job.preset,
            job.preset.classes,
            job.plan,
            job.routed,
            job.data.images,
            job.data.labels,
            job.settings,
            lr=job.lr,
            seed=job.seed,
            device=job.torch_device,
            amp=job.amp,
            between_steps=between_steps,
        )
    except (FeastError, RuntimeError) as exc:  # e.g. settings this device cannot train with, or out of memory
        log.error("%s: local training of %s failed: %s; skipped", job.shown, job.device_id, exc)
        return Declined(f"local training failed: {exc}")
    compute = time.perf_counter() - began
    if not stayed_finite(state, result.mean_loss):
        log.warning(
            "%s: the training of %s diverged (loss %s, or non-finite weights); no update sent for this round",
            job.shown,
            job.device_id,
            result.mean_loss,
        )
        return Declined(f"training diverged (loss {result.mean_loss}, or non-finite weights)")
    return TrainedState(state, result, compute)


def train(job: Job, between_steps: Callable[[], None] | None = None) -> Trained | Declined:
    """:func:`train_state`, the slice (clipped and noised under local DP) encoded as the update payload in the routed
    payload's dtype."""
    trained = train_state(job, between_steps)
    if isinstance(trained, Declined):
        return trained
    manifest = job.plan.manifest(job.preset, job.preset.classes, job.round, "update", job.device_id, job.dtype)
    state = trained.state
    if job.dp is not None:  # nothing of the raw update leaves the device (docs/privacy.md, the trust model)
        state = privatize(job.routed, state, parameter_names(job.preset), job.dp, job.device_id, job.round)
    try:
        payload = encode(state, manifest)
    except FeastError as exc:  # e.g. weights beyond float16's range
        log.warning("%s: the update of %s cannot be sent as %s: %s", job.shown, job.device_id, job.dtype, exc)
        return Declined(f"the update cannot be encoded: {exc}")
    return Trained(payload, trained.result, trained.compute_seconds)


def largest_payload(preset: Preset) -> int:
    """A bound on any payload the server sends: the whole supernet (the largest routed envelope), or an ONNX file."""
    weights = sum(t.numel() * t.element_size() for t in Supernet(preset).state_dict().values())
    return 2 * weights + 16 * MiB
