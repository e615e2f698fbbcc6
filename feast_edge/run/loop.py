"""The run loop shared by ``feast-edge simulate`` and ``feast-server``: rounds, validation, the served round.

    for t in remaining rounds:
        clients = collector.clients(needed)                  # simulation: every client; server: online devices
        cohort  = sample_round_cohort(clients, m, seed, t)   # method §4
        plans   = {c: plan_client(cache, collector.budget(c))}
        got     = collector.collect(t, cohort, plans, global_state, lr)   # in process, or over MQTT
        >= min_clients valid updates: aggregate_updates (in place, client-id order, settings.aggregation); else unchanged
        every eval_every rounds: validate (BN-recalibrated, method §8); best.safetensors holds the served round's
            weights: on server data the best validation, validated by devices the newest without a regression
        checkpoint.safetensors (atomic; feast_edge.run.store): weights, round, history, best, the caller's extra fields

Only the :class:`Collector` differs between simulation and deployment, so the
two cannot drift apart (tests/federation/test_federation_same_math.py checks
they end bit-identical). Rounds are 0-based inside (``t``, seeds, the wire)
and 1-based wherever a person reads them (:attr:`RoundRecord.round`, logs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from feast_edge.aggregate.server_opt import ServerOptimizer
from feast_edge.aggregate.weights import bounded_weights
from feast_edge.cache.variants import VariantCache
from feast_edge.evaluate.evaluation import Validation
from feast_edge.evaluate.served_round import best_after
from feast_edge.local.recipe import scheduled_lr
from feast_edge.privacy.rounds import BudgetReached, PrivateRounds
from feast_edge.route.payload import bytes_per_param
from feast_edge.run.cohort import sample_round_cohort
from feast_edge.run.collect import ClientUpdate, Collector
from feast_edge.run.settings import (  # noqa: F401 (re-exported: the loop's settings are imported from here)
    RunError,
    RunSettings,
    check_run_options,
    recorded_settings,
    server_opt_of,
)
from feast_edge.run.store import (  # noqa: F401 (re-exported: the run directory's file names)
    BEST,
    CHECKPOINT,
    HISTORY_FORMAT,
    OPTIONS_OF,
    PREVIOUS,
    RunStore,
)
from feast_edge.run.strategy import FeastStrategy
from feast_edge.space.supernet import Supernet


@dataclass
class RoundRecord:
    """What one round did, for simulation and deployment alike; stored in every checkpoint."""

    round: int  # 1-based
    lr: float
    cohort: list[str]
    updated: list[str] = field(default_factory=list)  # clients whose valid update entered the aggregate
    rejected: dict[str, str] = field(default_factory=dict)  # client -> why its update was refused
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
    val_accuracy: float | None = None
    # Federated validation (a server without data): {"source": "devices", "devices": [...], "samples": n,
    # "points": {label: accuracy}, "flagged": {device: why}, "served": {device: [variant, correct, total]},
    # "served_round", "served_reason"} (feast_edge.evaluate.device_validation, .served_round); empty where the validation split is server-held (or there was none).
    validation: dict[str, Any] = field(default_factory=dict)
    dp: dict[str, Any] = field(default_factory=dict)  # DP runs: population, cohort (sizes), epsilon after it, delta

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


class RunLoop:
    """Rounds of one federation over a ``Collector``, checkpointed in ``out`` (see the module docstring)."""

    def __init__(
        self,
        model: Supernet,
        cache: VariantCache,
        settings: RunSettings,
        out: str | Path,
        *,
        kind: str,
        fingerprint: str,
        config: Mapping[str, Any],
        validation: Validation | None = None,
        extra_fields: Callable[[], Mapping[str, Any]] = dict,
        method: RoundMethod | None = None,
        model_record: Mapping[str, Any] | None = None,
        validator: Callable[[int, RoundRecord], float | None] | None = None,
    ) -> None:
        """``method`` defaults to FEAST's steps; a model that is not a full Supernet needs ``model_record`` (its checkpoint header).

        ``validator(t, record)`` validates round ``t``'s aggregated model where no ``validation`` split is held
        (federated validation: the devices test it and report counts); it may fill ``record.validation``.
        """
        self.model = model
        self.preset = model.preset if isinstance(model, Supernet) else None
        self.cache = cache
        self.settings = settings
        self.method: RoundMethod = (
            method
            if method is not None
            else FeastStrategy(model, cache, settings.aggregation, settings.trim, settings.clip_norm)
        )
        self.model_record = None if isinstance(model, Supernet) else dict(model_record or {})
        self.out = Path(out)
        self.store = RunStore(
            self.out,
            model,
            kind=kind,
            fingerprint=fingerprint,
            config=config,
            preset=self.preset,
            model_record=self.model_record,
        )
        self.validation = validation
        self.validator = validator
        self.extra_fields = extra_fields
        self.full_params = self.method.full_params()
        self.server_optimizer = (
            None
            if settings.server_opt.identity
            else ServerOptimizer(settings.server_opt, {n: tuple(p.shape) for n, p in model.named_parameters()})
        )
        self.history: list[RoundRecord] = []
        params, dp = [name for name, _ in model.named_parameters()], settings.dp
        self.privacy = (
            None if dp is None else PrivateRounds(dp, params, settings.rounds, clients_noise=settings.dp_on_devices)
        )
        self.stopped: str | None = None  # why the run ended before its last round (the privacy budget)
        self.recovered: str | None = None  # set when resume fell back to the previous checkpoint, saying why
        self.best: dict[str, Any] = {}
        self.stop = threading.Event()

    # ------------------------------------------------------------------ checkpoints
    def save(self, name: str) -> None:
        """Checkpoint the run as it stands to ``out/name`` (feast_edge.run.store)."""
        self.store.write(
            name,
            dict(
                round=len(self.history),
                history=[asdict(h) for h in self.history],
                history_format=HISTORY_FORMAT,
                best=self.best,
                **self.extra_fields(),
            ),
            self.server_optimizer.state if self.server_optimizer is not None else None,
        )

    def load(self, path: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
        """A checkpoint of this loop's model (validated against it): (a loaded copy or the model itself, the record)."""
        return self.store.load(path)

    def resume(self, hint: str, *, fall_back: bool = False) -> int:
        """Load ``checkpoint.safetensors`` from ``out`` if there is one; returns the completed rounds.

        ``hint`` finishes the error when the checkpoint belongs to another run ("use another --out", ...).
        A damaged checkpoint (hash or finite-value check) stops the resume with a message naming the kept
        previous one; with ``fall_back`` the run resumes from that one instead, keeping the damaged file renamed.
        """
        resumed = self.store.resume(hint, fall_back=fall_back)
        if resumed is None:
            return 0
        self.recovered = resumed.recovered
        self._load_optimizer(resumed.path, resumed.extra)
        zero_based = resumed.fields.get("history_format", 1) < HISTORY_FORMAT
        self.history = [RoundRecord.from_dict(h, zero_based) for h in resumed.fields["history"]]
        self.best = dict(resumed.fields.get("best", {}))
        if zero_based and "round" in self.best:
            self.best["round"] += 1
        return len(self.history)

    def _load_optimizer(self, path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore the server optimizer's state from a checkpoint's extra tensors (the fingerprint already matched)."""
        if self.server_optimizer is None:
            if tensors:
                raise RunError(
                    f"{path} holds a server optimizer's state but this run averages; rerun with its --server-opt"
                )
            return
        try:
            self.server_optimizer.load(tensors)
        except ValueError as exc:
            raise RunError(f"cannot resume from {path}: {exc}; rerun with the checkpoint's --server-opt") from None

    # ------------------------------------------------------------------ rounds
    def validate(self) -> float:
        """Mean validation accuracy of the probe operating points, each BN-recalibrated (method §8)."""
        assert self.validation is not None
        return self.method.validate(self.validation, self.settings.probe_variants, self.settings.device)

    def run_round(self, t: int, collector: Collector, needed: int) -> RoundRecord:
        """Cohort -> plans -> collection -> sparse aggregation (or unchanged) for round ``t``."""
        s = self.settings
        clients = collector.clients(needed)
        start = time.monotonic()
        cohort = sample_round_cohort(clients, min(s.per_round, len(clients)), s.seed, t)
        dp = {}
        if self.privacy is not None:  # before anything is sent: refuse a round past --dp-epsilon
            earlier = [h.dp for h in self.history], [h.cohort for h in self.history]
            dp = self.privacy.check_next(*earlier, t + 1, len(clients), cohort)
        lr = scheduled_lr(s.lr_schedule, s.lr, t, s.rounds)
        plans = self.method.plans(t, cohort, collector.budget)
        global_state = self.model.state_dict()  # aliases the model's tensors: aggregation writes into the model
        got = collector.collect(t, cohort, plans, global_state, lr)
        record = RoundRecord(
            round=t + 1,
            lr=lr,
            cohort=list(cohort),
            rejected=got.rejected,
            declined=got.declined,
            incomplete=got.incomplete,
            missing=got.missing,
            dropped=got.dropped,
            ignored=got.ignored,
            send_seconds=got.send_seconds,
            routed_params=sum(self.method.payload_params(plans[c]) for c in cohort),
            full_params=len(cohort) * self.full_params,
        )
        record.routed_bytes = record.routed_params * bytes_per_param(s.payload_dtype)
        record.full_bytes = record.full_params * bytes_per_param("float32")
        valid = sorted(got.updates, key=lambda u: u.client)
        if self.privacy is not None:  # clipped, BN statistics kept global, uniform weights (feast_edge.privacy)
            states = self.privacy.privatize(global_state, [(u.client, u.state) for u in valid], t, dp)
            valid = [replace(u, state=state, samples=1) for u, state in zip(valid, states)]
        record.dp = dp
        record.updated = [u.client for u in valid]
        weights = bounded_weights([u.samples for u in valid], [u.self_reported for u in valid], s.max_weight_ratio)
        record.capped = {u.client: [u.samples, w] for u, w in zip(valid, weights) if w != u.samples}
        valid = [u if w == u.samples else replace(u, samples=w) for u, w in zip(valid, weights)]
        record.samples = sum(weights)
        seen = sum(u.samples_seen for u in valid if u.loss is not None)
        record.loss = sum(u.loss * u.samples_seen for u in valid if u.loss is not None) / seen if seen else None
        record.train_macs = sum(u.train_macs for u in valid)
        for u in valid:
            if u.compute_seconds is not None:
                record.compute_seconds[u.client] = u.compute_seconds
            for k, v in u.variants_per_batch.items():
                record.variants_per_batch[str(k)] = record.variants_per_batch.get(str(k), 0) + int(v)
        if len(valid) >= s.min_clients:
            began = time.monotonic()
            self.aggregate(t, global_state, valid, plans, dp)
            record.aggregate_seconds = time.monotonic() - began
            record.applied = True
        record.seconds = time.monotonic() - start
        return record

    def aggregate(self, t: int, global_state: dict[str, torch.Tensor], valid: Sequence[ClientUpdate],
                  plans: Mapping[str, Any], dp: Mapping[str, Any]) -> None:  # fmt: skip
        """The method's aggregation in place, then DP's noise (``dp``: the round's privacy record) and the server
        optimizer's step from it (when there is one)."""
        opt = self.server_optimizer
        before = opt.snapshot(global_state) if opt is not None else None
        self.method.aggregate(t, global_state, valid, plans)
        if self.privacy is not None:
            self.privacy.noise(global_state, [u.state for u in valid], t, dp)
        if opt is not None:
            opt.step(global_state, before, self.method.routed(global_state, valid, list(opt.shapes)))

    def run(
        self,
        collector: Collector,
        *,
        start_clients: int | None = None,
        on_round: Callable[[RoundRecord], None] | None = None,
        stop_after: int | None = None,
    ) -> list[RoundRecord]:
        """Run the remaining rounds, checkpointing each; ``stop_after`` completed rounds ends early."""
        self.out.mkdir(parents=True, exist_ok=True)
        s = self.settings
        first = len(self.history)
        for t in range(first, s.rounds):
            needed = (start_clients or s.min_clients) if t == first else s.min_clients
            try:
                record = self.run_round(t, collector, needed)
            except BudgetReached as exc:
                self.stopped = str(exc)
                break
            if (t + 1) % s.eval_every == 0 or t + 1 == s.rounds:
                if self.validation is not None:
                    record.val_accuracy = self.validate()
                elif self.validator is not None:
                    record.val_accuracy = self.validator(t, record)
            self.history.append(record)
            if self.choose_served(record):
                self.save(BEST)
            self.save(CHECKPOINT)
            if on_round is not None:
                on_round(record)
            if stop_after is not None and t + 1 >= stop_after:
                break
        return self.history

    def choose_served(self, record: RoundRecord) -> bool:
        """Update ``best`` (the served round and why) after ``record``; True when its weights became the served ones.

        Validated by the devices (a server without data): the newest round unless its devices' served variants
        regressed (feast_edge.evaluate.served_round); on server-held data: the best validation accuracy.
        """
        if record.validation.get("source") == "devices":
            best = best_after([(h.round, h.validation, h.val_accuracy) for h in self.history if h.validation])
            self.best = best or self.best
            return best.get("round") == record.round
        if record.val_accuracy is None or record.val_accuracy <= self.best.get("val_accuracy", -1.0):
            return False
        self.best = {
            "round": record.round,
            "val_accuracy": record.val_accuracy,
            "reason": f"round {record.round}: the best validation accuracy on the server's data so far",
        }
        return True

    @property
    def finished(self) -> bool:
        """Every round ran, or the privacy budget ended the run (``stopped``)."""
        return len(self.history) >= self.settings.rounds or self.stopped is not None

    def selected_checkpoint(self) -> Path:
        """``best.safetensors`` when validation chose one, else the last checkpoint."""
        return self.store.selected()
