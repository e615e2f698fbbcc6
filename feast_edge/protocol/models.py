"""After training: metrics, the devices' models (ModelRequest, ModelReady) and the federation's end (Finished)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from feast_edge.transport.messages import Message, check_ids, check_transfer, message_kind


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
