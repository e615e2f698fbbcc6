"""What one round did (:class:`RoundRecord`, stored in every checkpoint) and what the run loop asks of a training
method (:class:`RoundMethod`: FEAST by default, the harness's baselines in feast_edge.sim.methods)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch

from feast_edge.evaluate.evaluation import Validation
from feast_edge.run.collect import REFUSED, STALE, ClientUpdate


@dataclass
class RoundRecord:
    """What one round did, for simulation and deployment alike; stored in every checkpoint."""

    round: int  # 1-based
    lr: float
    cohort: list[str]
    updated: list[str] = field(default_factory=list)  # clients whose valid update entered the aggregate
    rejected: dict[str, str] = field(default_factory=dict)  # client -> why its update was refused
    # client in ``rejected`` -> the kind of refusal where the run knows it (feast_edge.run.collect.STALE); counted
    # by kind, never by its message's words
    refusals: dict[str, str] = field(default_factory=dict)
    declined: dict[str, str] = field(default_factory=dict)  # client -> why it sent no update (its own reason)
    incomplete: dict[str, str] = field(default_factory=dict)  # client -> its payload or upload did not get through
    capped: dict[str, list[int]] = field(default_factory=dict)  # client -> [its self-reported count, the weight it got]
    missing: list[str] = field(default_factory=list)  # no reply by the deadline
    dropped: list[str] = field(default_factory=list)  # went offline during the round
    ignored: list[str] = field(default_factory=list)  # duplicate, stale or foreign messages, with the reason
    applied: bool = False  # the aggregate replaced the global model
    loss: float | None = None  # sample-weighted mean local loss of the valid updates
    samples: int = 0  # Σ n_i of the valid updates (the aggregation weights)
    train_macs: int = 0  # local training compute reported by the cohort
    routed_params: int = 0  # Σ_i P_i over the cohort (one direction)
    full_params: int = 0  # m · P: what broadcasting the full supernet would have sent
    routed_bytes: int = 0  # Σ_i P_i in the round's payload dtype (one direction; tensor data, headers aside)
    full_bytes: int = 0  # m · P as float32: the full-supernet broadcast the bytes are compared with
    variants_per_batch: dict[str, int] = field(default_factory=dict)
    compute_seconds: dict[str, float] = field(default_factory=dict)  # local training time per client
    send_seconds: float = 0.0  # routing, encoding and sending every routed payload
    aggregate_seconds: float = 0.0
    seconds: float = 0.0  # the whole round, from cohort sampling to the aggregated model
    clock: float | None = None  # a virtual clock's seconds since the run began at the end of this step (simulation)
    staleness: dict[str, int] = field(default_factory=dict)  # asynchronous rounds: client -> releases behind
    durations: dict[str, float] = field(default_factory=dict)  # simulation: client -> its job's virtual seconds
    withheld: dict[str, str] = field(default_factory=dict)  # secure sums: segment members -> why it kept its value
    val_accuracy: float | None = None
    # [first, last]: the mean of these rounds' weights was validated, and served if chosen, in this round's stead
    # (feast_edge.run.average); None: the round's own weights
    average_of: list[int] | None = None
    # Federated validation (a server without data): {"source": "devices", "devices": [...], "samples": n,
    # "points": {label: accuracy}, "flagged": {device: why}, "served": {device: [variant, correct, total]},
    # "served_round", "served_reason"} (feast_edge.evaluate.device_validation, .served_round); empty where the validation split is server-held (or there was none).
    validation: dict[str, Any] = field(default_factory=dict)
    # A round with two candidates (its own weights and the mean of the last rounds', feast_edge.evaluate.candidates):
    # {"of": [first, last], "own": {"val_accuracy", "validation"}, "mean": {...}, "choice": "own" | "mean",
    # "reason", "voters"}; val_accuracy and validation above are then the chosen candidate's. {} otherwise.
    candidates: dict[str, Any] = field(default_factory=dict)
    dp: dict[str, Any] = field(default_factory=dict)  # DP runs: population, cohort (sizes), epsilon after it, delta
    # A simulation whose clients join over time or whose shards grow (feast_edge.sim.growth): the clients present at
    # the step and the training examples they hold; None elsewhere
    present: int | None = None
    visible: int | None = None

    def tally(self, updates: Sequence[ClientUpdate]) -> None:
        """What the valid updates (as they enter the aggregate) add up to: who, their weights, their sample-weighted
        loss, their training compute and time, their variants per batch."""
        self.updated = [u.client for u in updates]
        self.samples = sum(u.samples for u in updates)
        seen = sum(u.samples_seen for u in updates if u.loss is not None)
        self.loss = sum(u.loss * u.samples_seen for u in updates if u.loss is not None) / seen if seen else None
        self.train_macs = sum(u.train_macs for u in updates)
        for u in updates:
            if u.compute_seconds is not None:
                self.compute_seconds[u.client] = u.compute_seconds
            for k, v in u.variants_per_batch.items():
                self.variants_per_batch[str(k)] = self.variants_per_batch.get(str(k), 0) + int(v)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], zero_based: bool = False) -> RoundRecord:
        """A stored record; unknown keys (from other versions) are ignored."""
        known = {f.name for f in fields(cls)}
        record = cls(**{k: v for k, v in data.items() if k in known})
        if zero_based:
            record.round += 1
        return record


class RoundMethod(Protocol):
    """What the loop asks of a training method (FEAST by default; the harness's baselines, feast_edge.sim.methods)."""

    def plans(self, t: int, cohort: Sequence[str], budget: Callable[[str], float]) -> dict[str, Any]:
        """What each cohort member trains in round ``t``."""

    def payload_params(self, plan: Any) -> int:
        """Parameters sent to a client with this plan (one direction)."""

    def aggregate(
        self,
        t: int,
        global_state: Mapping[str, torch.Tensor],
        updates: Sequence[ClientUpdate],
        plans: Mapping[str, Any],
    ) -> None:
        """Fold the valid updates (client-id order) into ``global_state`` in place."""

    def validate(self, validation: Validation, k: int, device: str | torch.device = "cpu") -> float:
        """Mean validation accuracy of ``k`` probe operating points."""

    def full_params(self) -> int:
        """Parameters of the whole global model (what broadcasting it to one client sends)."""

    def routed(
        self, global_state: Mapping[str, torch.Tensor], updates: Sequence[ClientUpdate], names: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """Per tensor of ``names``: the positions the valid updates covered (a server optimizer steps only there)."""


def refusal_kinds(stored: Mapping[str, Any]) -> dict[str, str]:
    """A stored record's refused clients by kind (feast_edge.run.collect.STALE, REFUSED). A record written before
    kinds were kept (no ``refusals``) said staleness only in its reason's first word: read there, for old runs."""
    rejected = stored.get("rejected") or {}
    kinds = stored.get("refusals")
    if kinds is None:
        return {c: STALE if str(why).startswith("stale:") else REFUSED for c, why in rejected.items()}
    return {c: kinds.get(c, REFUSED) for c in rejected}
