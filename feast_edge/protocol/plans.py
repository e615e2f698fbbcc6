"""The plan a message carries (affordable variants and the global minimum) as JSON, and back, validated."""

from __future__ import annotations

from typing import Any

from feast_edge.route.envelope import Envelope
from feast_edge.route.plans import ClientPlan
from feast_edge.space.arch import Arch
from feast_edge.space.preset import Preset
from feast_edge.transport.errors import ProtocolError

_PLAN_KEYS = ("affordable", "global_min")


def plan_dict(plan: ClientPlan) -> dict[str, Any]:
    return {"affordable": [a.to_dict() for a in plan.affordable], "global_min": plan.global_min.to_dict()}


def check_plan(plan: Any) -> None:
    missing = [key for key in _PLAN_KEYS if key not in plan]
    if missing:
        raise ProtocolError(f"field 'plan' lacks {', '.join(missing)}")
    if not isinstance(plan["affordable"], list) or not plan["affordable"]:
        raise ProtocolError("field 'plan.affordable' must be a non-empty list of architectures")


def client_plan(plan: dict[str, Any], preset: Preset) -> ClientPlan:
    try:
        affordable = tuple(Arch.from_dict(a).validated(preset) for a in plan["affordable"])
        global_min = Arch.from_dict(plan["global_min"]).validated(preset)
    except (TypeError, ValueError, KeyError) as exc:
        raise ProtocolError(f"the message has a malformed plan ({exc})") from None
    return ClientPlan(affordable, global_min, Envelope.of(affordable))
