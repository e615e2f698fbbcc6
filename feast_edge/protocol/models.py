"""After training: metrics, the devices' models (ModelRequest, ModelReady) and the federation's end (Finished)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from feast_edge.protocol.limits import MAX_EXAMPLES, MAX_REASON
from feast_edge.transport.errors import ProtocolError
from feast_edge.transport.messages import Message, check_choice, check_ids, check_transfer, message_kind
from feast_edge.versions.gate import DECISIONS


@message_kind("metrics")
@dataclass(frozen=True, kw_only=True)
class Metrics(Message):
    """Device -> server on ``events``: free-form numbers (e.g. the measured latency of the served ONNX model)."""

    round_scoped: ClassVar[bool] = False  # e.g. sent after the last round, when the model arrives

    values: dict[str, Any]


@message_kind("model_request")
@dataclass(frozen=True, kw_only=True)
class ModelRequest(Message):
    """Device -> server on ``events``: send me my exported ONNX model (answered by ``model`` with ``request`` = this msg_id)."""

    round_scoped: ClassVar[bool] = False


@message_kind("model")
@dataclass(frozen=True, kw_only=True)
class ModelReady(Message):
    """Server -> device on ``ctrl/{device}``: this device's ONNX model is sent as ``transfer``, or is not ``available``.

    ``manifest`` describes the file (arch, MACs, params, validation accuracy, SHA-256); ``request`` is
    the msg_id of the ``model_request`` it answers, empty when the server pushes it after the last round.
    """

    round_scoped: ClassVar[bool] = False

    available: bool = True
    transfer: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    request: str = ""
    reason: str = ""

    def check(self) -> None:
        if self.available:
            check_transfer(self.transfer)
        if self.request:
            check_ids(self, "request")


@message_kind("finished")
@dataclass(frozen=True, kw_only=True)
class Finished(Message):
    """Server -> device on ``ctrl/{device}``: the federation ran ``completed`` of ``rounds`` rounds and is over.

    ``model``: whether a model was exported for the device (it follows as ``model`` or can be fetched).
    ``instance``: the agent instance whose registration the server holds (as ``registered.instance``): a signed
    ``finished`` recorded in an earlier run, or sent to another agent of the same device id, names another instance
    and is dropped.
    """

    round_scoped: ClassVar[bool] = False

    rounds: int
    completed: int
    instance: str
    model: bool = False

    def check(self) -> None:
        check_ids(self, "instance")


@message_kind("version_report")
@dataclass(frozen=True, kw_only=True)
class VersionReport(Message):
    """Device -> server on ``events``: what the device did with served model ``version`` (feast_edge.versions).

    ``decision``: installed, refused, first (it ran no model), ungated, or rolled-back (by hand: it now runs
    ``running``). The paired figures on its held-out split: ``examples`` compared, each model's correct count, and
    the examples only one of the two gets right (all zero where nothing was compared). ``running``: the version it
    runs after this (0: none of this run). The server recomputes the decision's threshold from the counts; it never
    takes a device's word for it.
    """

    round_scoped: ClassVar[bool] = False

    version: int
    decision: str
    running: int = 0
    examples: int = 0
    new_correct: int = 0
    old_correct: int = 0
    new_only: int = 0
    old_only: int = 0
    reason: str = ""

    def check(self) -> None:
        check_choice("decision", self.decision, DECISIONS)
        if self.version < 1:
            raise ProtocolError("field 'version' must be a served version (1 or more)")
        if self.examples > MAX_EXAMPLES:
            raise ProtocolError(f"field 'examples' must be at most {MAX_EXAMPLES}")
        if not (
            self.new_only <= self.new_correct <= self.examples and self.old_only <= self.old_correct <= self.examples
        ):
            raise ProtocolError(
                "the paired counts are inconsistent (each correct count within examples, 'only' counts within them)"
            )
        if self.new_correct - self.new_only != self.old_correct - self.old_only:
            raise ProtocolError(
                "the paired counts are inconsistent (both models must get the same examples right beyond their 'only' counts)"
            )
        if self.new_only + self.old_only + (self.new_correct - self.new_only) > self.examples:
            raise ProtocolError("the paired counts are inconsistent (more examples right than compared)")
        if len(self.reason) > MAX_REASON:
            raise ProtocolError(f"field 'reason' must be at most {MAX_REASON} characters")
