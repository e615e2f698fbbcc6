"""One round: the server routes a slice (RoundStart), the device answers with its update (Update) or declines (Declined)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from feast_edge.local.cotrain import LocalResult
from feast_edge.local.recipe import TrainConfig
from feast_edge.privacy.local import LocalDp
from feast_edge.protocol.limits import MAX_REASON
from feast_edge.protocol.plans import check_plan, client_plan, plan_dict
from feast_edge.protocol.secure import SecureBlock
from feast_edge.route.payload import PAYLOAD_DTYPES
from feast_edge.route.plans import ClientPlan
from feast_edge.space.preset import Preset
from feast_edge.transport.errors import ProtocolError
from feast_edge.transport.frames import TransferInfo
from feast_edge.transport.messages import Message, check_ids, check_transfer, message_kind, validate_transfer_id


def shown_round(round_: int, rounds: int) -> str:
    """0-based round ``round_`` of ``rounds`` as people read it: "round 3/20", or "round 3" where ``rounds`` is 0 (a
    federation without an end, feast-server run --continuous)."""
    return f"round {round_ + 1}/{rounds}" if rounds else f"round {round_ + 1}"


@message_kind("round")
@dataclass(frozen=True, kw_only=True)
class RoundStart(Message):
    """Server -> device on ``ctrl/{device}``: train the routed payload of ``transfer`` with exactly these inputs.

    ``instance``: the agent instance whose registration the server holds (as ``registered.instance``); an agent
    drops a round addressed to another, so a signed round replayed from an earlier run trains nothing.
    ``lr`` is this round's cosine learning rate, ``seed`` the client's seed for the round as decimal
    text (it needs 63 bits; JSON numbers are exact only to 2^53), ``plan`` the affordable variants
    and the global minimum (arch objects), ``train`` the local-training hyper-parameters. The server
    stops waiting ``timeout`` seconds after sending (``deadline`` is the same instant in Unix time,
    for logs; agents count from receipt and never compare clocks).
    """

    instance: str
    transfer: dict[str, Any]
    deadline: float
    timeout: float
    rounds: int
    lr: float
    seed: str
    plan: dict[str, Any]
    train: dict[str, Any] = field(default_factory=dict)
    payload_dtype: str = "float32"  # of the routed payload, and of the update the device must send back
    dp: dict[str, Any] = field(default_factory=dict)  # local DP the device must apply ({}: none; LocalDp.wire)
    secure: dict[str, Any] = field(default_factory=dict)  # secure aggregation's terms ({}: a plain round; SecureBlock)

    def check(self) -> None:
        check_ids(self, "instance")
        check_local_dp(self.dp)
        block = self.secure_block()
        if block is not None and self.device not in block.cohort:
            raise ProtocolError("field 'secure' names a cohort without this device")
        check_transfer(self.transfer)
        if self.payload_dtype not in PAYLOAD_DTYPES:
            raise ProtocolError(
                f"field 'payload_dtype' must be one of {', '.join(PAYLOAD_DTYPES)}, got {self.payload_dtype[:24]!r}"
            )
        if not (self.seed.isascii() and self.seed.isdigit() and len(self.seed) <= 20):
            raise ProtocolError(f"field 'seed' must be a decimal integer below 2^64, got {self.seed[:24]!r}")
        if not self.lr > 0:
            raise ProtocolError(f"field 'lr' must be > 0, got {self.lr}")
        if not self.timeout > 0:
            raise ProtocolError(f"field 'timeout' must be > 0, got {self.timeout}")
        if self.rounds < 0 or (self.rounds and self.round >= self.rounds):  # 0: a federation without an end
            raise ProtocolError(f"round {self.round} is outside the horizon of {self.rounds} rounds")
        check_plan(self.plan)

    @classmethod
    def from_plan(
        cls,
        plan: ClientPlan,
        *,
        federation: str,
        round: int,
        device: str,
        instance: str,
        transfer: TransferInfo,
        sent_at: float,
        timeout: float,
        rounds: int,
        lr: float,
        seed: int,
        train: TrainConfig,
        payload_dtype: str = "float32",
        dp: LocalDp | None = None,
        secure: SecureBlock | None = None,
    ) -> RoundStart:
        """Round ``round`` of ``device``: its plan, the routed transfer, the lr, its client seed and the training settings."""
        settings = train.settings()
        settings["randaugment"] = list(settings["randaugment"])
        return cls(
            federation=federation,
            round=round,
            device=device,
            instance=instance,
            transfer=transfer.to_dict(),
            deadline=sent_at + timeout,
            timeout=timeout,
            rounds=rounds,
            lr=lr,
            seed=str(seed),
            train=settings,
            payload_dtype=payload_dtype,
            plan=plan_dict(plan),
            dp={} if dp is None else dp.wire(),
            secure={} if secure is None else secure.wire(),
        )

    @property
    def shown(self) -> str:
        """The round as people read it: "round 3/20", or "round 3" where the federation has no end."""
        return shown_round(self.round, self.rounds)

    def local_dp(self) -> LocalDp | None:
        """The local DP this round asks the device for (None: none)."""
        return LocalDp.of_wire(self.dp)

    def secure_block(self) -> SecureBlock | None:
        """The secure-aggregation terms of this round (None: a plain round; ProtocolError when malformed)."""
        return SecureBlock.of_wire(self.secure) if self.secure else None

    def client_plan(self, preset: Preset) -> ClientPlan:
        """The plan this message carries, every arch validated against ``preset`` (ArchError / ProtocolError when it does not fit)."""
        return client_plan(self.plan, preset)

    def train_config(self) -> TrainConfig:
        """The local-training settings (TrainError / ProtocolError when they are not valid settings)."""
        try:
            return TrainConfig(**self.train)
        except TypeError as exc:
            raise ProtocolError(f"round message has unknown training settings ({exc})") from None

    @property
    def client_seed(self) -> int:
        return int(self.seed)

    def transfer_info(self) -> TransferInfo:
        """The routed transfer, which must be this round's and this device's."""
        info = check_transfer(self.transfer)
        if info.device != self.device or info.round != self.round:
            raise ProtocolError(
                f"the round message's transfer names device {info.device!r} round {info.round}, not {self.device!r} round {self.round}"
            )
        return info


def check_local_dp(value: dict[str, Any]) -> None:
    """A round's ``dp`` field: empty, or ``{"mode": "local", "clip": C > 0, "noise": z > 0[, "seed": "123"]}``."""
    if not value:
        return
    unknown = set(value) - {"mode", "clip", "noise", "seed"}
    if unknown or value.get("mode") != "local":
        raise ProtocolError(f"field 'dp' must be local DP settings (mode, clip, noise, seed), got {sorted(value)[:6]}")
    for name in ("clip", "noise"):
        number = value.get(name)
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not (0 < number < math.inf):
            raise ProtocolError(f"field 'dp.{name}' must be a positive finite number, got {str(number)[:24]!r}")
    seed = value.get("seed")
    if seed is not None and not (isinstance(seed, str) and seed.isascii() and seed.isdigit() and len(seed) <= 20):
        raise ProtocolError(f"field 'dp.seed' must be a decimal integer as text, got {str(seed)[:24]!r}")


def _json_number(value: float) -> float | None:
    """``value``, or None where JSON has no number for it (NaN, infinities): a diverged loss must not stop the message."""
    return float(value) if math.isfinite(value) else None


def _finite(value: Any, default: float) -> float:
    return (
        float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else default
    )


@message_kind("update")
@dataclass(frozen=True, kw_only=True)
class Update(Message):
    """Device -> server on ``events``: the trained slice answering routed transfer ``routed`` is sent as ``transfer``."""

    transfer: dict[str, Any]
    routed: str
    samples: int
    metrics: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        check_transfer(self.transfer)
        validate_transfer_id(self.routed)

    @classmethod
    def from_result(
        cls,
        result: LocalResult,
        *,
        federation: str,
        round: int,
        device_id: str,
        transfer: TransferInfo,
        routed: str,
        compute_seconds: float,
        torch_device: str,
    ) -> Update:
        """The update of ``device_id`` announcing ``transfer`` (the trained slice) with the local result's figures.

        ``torch_device`` is where it trained (``cpu``, ``cuda:0``), sent as ``metrics["device"]``.
        """
        metrics = {
            "loss": _json_number(result.mean_loss),
            "samples_seen": result.samples_seen,
            "num_batches": result.num_batches,
            "train_macs": result.train_macs,
            "compute_seconds": compute_seconds,
            "role_losses": {k: _json_number(v) for k, v in result.role_losses.items()},
            "variants_per_batch": {str(k): v for k, v in result.variants_per_batch.items()},
            "device": torch_device,
        }
        return cls(
            federation=federation,
            round=round,
            device=device_id,
            transfer=transfer.to_dict(),
            routed=routed,
            samples=result.num_samples,
            metrics=metrics,
        )

    def transfer_info(self) -> TransferInfo:
        """The announced transfer, which must be this round's and this device's."""
        info = check_transfer(self.transfer)
        if info.device != self.device or info.round != self.round:
            raise ProtocolError(
                f"its transfer names device {info.device!r} round {info.round}, not {self.device!r} round {self.round}"
            )
        return info

    @property
    def loss(self) -> float | None:
        return _finite(self.metrics["loss"], 0.0) if "loss" in self.metrics else None

    @property
    def samples_seen(self) -> float:
        return _finite(self.metrics.get("samples_seen"), self.samples)

    @property
    def compute_seconds(self) -> float | None:
        return _finite(self.metrics["compute_seconds"], 0.0) if "compute_seconds" in self.metrics else None

    @property
    def train_macs(self) -> int:
        return int(_finite(self.metrics.get("train_macs"), 0.0))


@message_kind("declined")
@dataclass(frozen=True, kw_only=True)
class Declined(Message):
    """Device -> server on ``events/{device}``: no update will come for this round's routed transfer, and why."""

    routed: str  # the transfer id of the routed payload it answers
    reason: str

    def check(self) -> None:
        check_ids(self, "routed")
        if not 1 <= len(self.reason) <= MAX_REASON:
            raise ProtocolError(
                f"a declined message needs a reason of 1-{MAX_REASON} characters, got {len(self.reason)}"
            )
