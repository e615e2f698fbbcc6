"""Requests about the routed model: federated validation (Evaluate, Evaluated) and federated BN statistics (Calibrate)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from typing_extensions import Self

from feast_edge.protocol.limits import MAX_CANDIDATES, MAX_EXAMPLES, MAX_PROBES
from feast_edge.protocol.plans import check_plan, client_plan, plan_dict
from feast_edge.route.payload import PAYLOAD_DTYPES
from feast_edge.route.plans import ClientPlan
from feast_edge.space.arch import Arch
from feast_edge.space.preset import Preset
from feast_edge.transport.errors import ProtocolError
from feast_edge.transport.frames import TransferInfo
from feast_edge.transport.messages import Message, check_ids, check_transfer, message_kind

R = TypeVar("R", bound="RoutedRequest")


@dataclass(frozen=True, kw_only=True)
class RoutedRequest(Message):
    """A server request about the model routed to the device: ``transfer`` carries the routed state of ``plan`` (as a
    round's payload does), to be answered within ``timeout`` seconds; ``calibration``: the training examples to use."""

    instance: str  # the agent instance the server holds the registration of (as RoundStart.instance)
    transfer: dict[str, Any]
    timeout: float
    plan: dict[str, Any]
    calibration: int = 500
    payload_dtype: str = "float32"

    def check(self) -> None:
        check_ids(self, "instance")
        check_transfer(self.transfer)
        if self.payload_dtype not in PAYLOAD_DTYPES:
            raise ProtocolError(
                f"field 'payload_dtype' must be one of {', '.join(PAYLOAD_DTYPES)}, got {self.payload_dtype[:24]!r}"
            )
        if not self.timeout > 0:
            raise ProtocolError(f"field 'timeout' must be > 0, got {self.timeout}")
        check_plan(self.plan)
        if not 1 <= self.calibration <= 1_000_000:
            raise ProtocolError("field 'calibration' must be between 1 and 1,000,000 examples")

    @staticmethod
    def check_indices(name: str, indices: tuple[int, ...], plan: dict[str, Any]) -> None:
        """``indices`` (field ``name``) must be 1 to MAX_PROBES distinct indices into the plan's affordable variants."""
        if not 1 <= len(indices) <= MAX_PROBES:
            raise ProtocolError(f"field {name!r} must name 1 to {MAX_PROBES} variants of the plan")
        if len(set(indices)) != len(indices) or max(indices) >= len(plan.get("affordable") or ()):
            raise ProtocolError(f"field {name!r} must be distinct indices into the plan's affordable variants")

    INDICES: ClassVar[str] = ""  # the field naming the variants the request is about

    @classmethod
    def for_plan(
        cls,
        plan: ClientPlan,
        archs: list[Arch],
        *,
        federation: str,
        round: int,
        device: str,
        instance: str,
        transfer: TransferInfo,
        timeout: float,
        calibration: int,
        payload_dtype: str = "float32",
    ) -> Self:
        """The request about ``archs`` (variants of ``plan``) of the routed ``transfer`` to ``device``."""
        return cls(
            federation=federation,
            round=round,
            device=device,
            instance=instance,
            transfer=transfer.to_dict(),
            timeout=timeout,
            plan=plan_dict(plan),
            calibration=calibration,
            payload_dtype=payload_dtype,
            **{cls.INDICES: tuple(plan.affordable.index(a) for a in archs)},
        )

    def client_plan(self, preset: Preset) -> ClientPlan:
        return client_plan(self.plan, preset)

    def transfer_info(self) -> TransferInfo:
        info = check_transfer(self.transfer)
        if info.device != self.device or info.round != self.round:
            raise ProtocolError(
                f"the {self.kind} request's transfer names device {info.device!r} round {info.round}, not {self.device!r} round {self.round}"
            )
        return info


@message_kind("evaluate")
@dataclass(frozen=True, kw_only=True)
class Evaluate(RoutedRequest):
    """Server -> device on ``ctrl/{device}``: federated validation of round ``round``'s aggregated model (method §8).

    The device recalibrates each of ``probes`` (indices into the plan's affordable set) on up to ``calibration``
    of its training examples, tests it on its held-out split and answers ``evaluated`` within ``timeout`` seconds.

    ``candidates`` (only to a device that registered the ``evaluate-candidates`` feature): transfers of further
    candidate models under the same plan (the tail mean beside the round's own weights), each sent after
    ``transfer``; the device tests the same probes of each on the same held-out examples.
    """

    INDICES: ClassVar[str] = "probes"
    probes: tuple[int, ...]
    candidates: tuple[dict[str, Any], ...] = ()

    def check(self) -> None:
        super().check()
        self.check_indices("probes", self.probes, self.plan)
        if len(self.candidates) > MAX_CANDIDATES - 1:
            raise ProtocolError(f"field 'candidates' must name at most {MAX_CANDIDATES - 1} further models")
        for info in self.candidate_infos():
            if info.device != self.device or info.round != self.round:
                raise ProtocolError("field 'candidates' must name transfers of this device and round")

    def candidate_infos(self) -> list[TransferInfo]:
        """The further candidates' transfers (ChunkError, a ProtocolError, when one is malformed)."""
        return [check_transfer(value) for value in self.candidates]

    def probe_archs(self, plan: ClientPlan) -> list[Arch]:
        """The probes, as architectures of ``plan`` (the plan this message carries)."""
        return [plan.affordable[i] for i in self.probes]


@message_kind("calibrate")
@dataclass(frozen=True, kw_only=True)
class Calibrate(RoutedRequest):
    """Server -> device on ``ctrl/{device}``: federated BN statistics of the served ``variants`` (indices into the
    plan's affordable set) of the routed model, on up to ``calibration`` of the device's training examples.

    The device answers with an ``update`` whose transfer carries the statistics (``evaluate.bn_stats``: per variant,
    per BN layer, the per-channel mean and variance of its input, float64 safetensors) and whose ``samples`` is its
    training examples (the weight of its statistics), or ``declined``.
    """

    INDICES: ClassVar[str] = "variants"
    variants: tuple[int, ...]

    def check(self) -> None:
        super().check()
        self.check_indices("variants", self.variants, self.plan)

    def variant_archs(self, plan: ClientPlan) -> list[Arch]:
        return [plan.affordable[i] for i in self.variants]


@message_kind("evaluated")
@dataclass(frozen=True, kw_only=True)
class Evaluated(Message):
    """Device -> server on ``events/{device}``: per probe of the ``evaluate`` request answering ``routed``, its
    ``(correct, total)`` on the device's held-out split, and how many training examples BN was recalibrated on."""

    routed: str
    results: tuple[int, ...]  # correct_0, total_0, correct_1, total_1, ... in the order of the request's probes
    calibrated_on: int = 0
    # Per further candidate of the request (Evaluate.candidates), in its order: the same pairs as ``results``, on
    # the same held-out examples; () where the request had one candidate
    candidates: tuple[int, ...] = ()

    def check(self) -> None:
        check_ids(self, "routed")
        if len(self.results) % 2 or len(self.results) > 2 * MAX_PROBES:
            raise ProtocolError(f"field 'results' must hold at most {MAX_PROBES} (correct, total) pairs")
        if self.candidates and (
            not self.results
            or len(self.candidates) % len(self.results)
            or len(self.candidates) // len(self.results) > MAX_CANDIDATES - 1
        ):
            raise ProtocolError(
                f"field 'candidates' must hold as many pairs as 'results' for each of at most {MAX_CANDIDATES - 1} "
                "further candidates"
            )
        for name, values in (("results", self.results), ("candidates", self.candidates)):
            if not all(c <= n <= MAX_EXAMPLES for c, n in zip(values[::2], values[1::2])):
                raise ProtocolError(
                    f"field {name!r} must hold (correct, total) pairs with correct <= total <= {MAX_EXAMPLES}"
                )
        if self.calibrated_on > MAX_EXAMPLES:
            raise ProtocolError("field 'calibrated_on' is out of range")

    @classmethod
    def of(
        cls,
        request: Evaluate,
        counts: list[tuple[int, int]],
        calibrated_on: int,
        candidates: list[list[tuple[int, int]]] | None = None,
    ) -> Evaluated:
        """The answer to ``request``: ``counts`` per probe and, per further candidate it carried, its counts."""
        return cls(
            federation=request.federation,
            round=request.round,
            device=request.device,
            routed=request.transfer_info().transfer,
            results=tuple(v for pair in counts for v in pair),
            calibrated_on=calibrated_on,
            candidates=tuple(v for each in candidates or [] for pair in each for v in pair),
        )

    def counts(self) -> list[tuple[int, int]]:
        return list(zip(self.results[::2], self.results[1::2]))

    def candidate_counts(self) -> list[list[tuple[int, int]]]:
        """Per further candidate, its (correct, total) per probe (empty where the request had one candidate)."""
        pairs = list(zip(self.candidates[::2], self.candidates[1::2]))
        size = len(self.results) // 2
        return [pairs[i : i + size] for i in range(0, len(pairs), size)] if size else []
