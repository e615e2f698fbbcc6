"""Registration: a device asks to join (Register), the server answers (Registered) with the federation's task."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from feast_edge.evaluate.precisions import PRECISIONS
from feast_edge.protocol.features import AGENT_FEATURES, check_features
from feast_edge.protocol.limits import MAX_CLASSES, MAX_EXAMPLES
from feast_edge.space.preset import Preset
from feast_edge.transport.errors import ProtocolError
from feast_edge.transport.messages import Message, check_choice, check_ids, message_kind


@message_kind("register")
@dataclass(frozen=True, kw_only=True)
class Register(Message):
    """Device -> server on ``register``: one (virtual) client's budget, sample count, preset and profile.

    ``precision`` is the precision the device is served in, the one its budget was measured at (a profile's).

    ``host`` is the agent process that hosts the device (its presence is ``status/{host}``);
    ``instance`` is random per agent process, so the server can tell a reconnecting agent from a
    second agent that claims the same device id.
    """

    round_scoped: ClassVar[bool] = False

    host: str
    instance: str
    preset: str
    preset_digest: str
    budget_macs: int
    samples: int
    profile: dict[str, Any] = field(default_factory=dict)
    task_digest: str = ""  # the task (feast_edge.data.task) the device checked its data against; "" from older agents
    holdout: int = 0  # examples the device holds out for federated validation (0: it cannot validate)
    precision: str = "fp32"  # the serving precision its budget is for (PRECISIONS); "fp32" from older agents
    # Per class of the task, in its order: training and held-out examples (counts only; () from older agents). The
    # server checks them against the task's classes and the registered totals (feast_edge.evaluate.coverage).
    class_counts: tuple[int, ...] = ()
    holdout_counts: tuple[int, ...] = ()
    evaluate_macs: int = 0  # the largest variant it may evaluate and calibrate (memory allowing); 0: its budget
    features: tuple[
        str, ...
    ] = ()  # protocol features it implements (feast_edge.protocol.features); () from older agents

    def check(self) -> None:
        check_ids(self, "host", "instance")
        check_features(self.features)
        if self.task_digest and not (
            len(self.task_digest) == 64 and all(c in "0123456789abcdef" for c in self.task_digest)
        ):
            raise ProtocolError("field 'task_digest' must be a SHA-256 in hex")
        if not 0 <= self.holdout <= MAX_EXAMPLES:
            raise ProtocolError(f"field 'holdout' must be between 0 and {MAX_EXAMPLES}")
        check_choice("precision", self.precision, PRECISIONS)
        for name in ("class_counts", "holdout_counts"):
            counts = getattr(self, name)
            if len(counts) > MAX_CLASSES:
                raise ProtocolError(f"field {name!r} must list at most {MAX_CLASSES} counts")
            if not all(0 <= n <= MAX_EXAMPLES for n in counts):
                raise ProtocolError(f"field {name!r} must hold counts between 0 and {MAX_EXAMPLES}")
        if not 0 <= self.evaluate_macs <= MAX_EXAMPLES:
            raise ProtocolError(f"field 'evaluate_macs' must be an integer between 0 and {MAX_EXAMPLES}")

    @classmethod
    def for_client(
        cls,
        *,
        federation: str,
        device_id: str,
        host: str,
        instance: str,
        preset: Preset,
        budget_macs: int,
        samples: int,
        profile: dict[str, Any],
        holdout: int = 0,
        precision: str = "fp32",
        class_counts: tuple[int, ...] = (),
        holdout_counts: tuple[int, ...] = (),
        evaluate_macs: int = 0,
        features: tuple[str, ...] = AGENT_FEATURES,
    ) -> Register:
        """The registration of hosted client ``device_id`` training ``preset`` (its data checked against ``preset.task``)."""
        return cls(
            federation=federation,
            round=0,
            device=device_id,
            host=host,
            instance=instance,
            preset=preset.name,
            preset_digest=preset.digest,
            budget_macs=int(budget_macs),
            samples=samples,
            profile=profile,
            task_digest=preset.task.digest,
            holdout=int(holdout),
            precision=precision,
            class_counts=tuple(int(n) for n in class_counts),
            holdout_counts=tuple(int(n) for n in holdout_counts),
            evaluate_macs=int(evaluate_macs),
            features=tuple(features),
        )


@message_kind("registered")
@dataclass(frozen=True, kw_only=True)
class Registered(Message):
    """Server -> device on ``ctrl/{device}``: the registration of ``instance`` is accepted, or refused with a reason.

    ``finished``: the federation has already run all its rounds (the server only serves models now).
    """

    round_scoped: ClassVar[bool] = False

    instance: str
    accepted: bool
    reason: str = ""
    preset: str = ""  # the server's preset
    rounds: int = 0  # the federation's horizon
    finished: bool = False
    task: dict[str, Any] = field(
        default_factory=dict
    )  # the federation's task contract (Task.to_dict()); {} from older servers
    validation: str = ""  # where models are validated and BN-calibrated: "server" (server-held data) or "devices"

    def check(self) -> None:
        check_ids(self, "instance")
        if self.validation not in ("", "server", "devices"):
            raise ProtocolError(f"field 'validation' must be 'server' or 'devices', got {self.validation[:24]!r}")
