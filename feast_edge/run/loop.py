"""The run loop shared by ``feast-edge simulate`` and ``feast-server``: rounds, validation, the served round.

    for t in remaining rounds:
        the scheduler (feast_edge.run.schedule; synchronous rounds by default):
            clients = collector.clients(needed)                  # simulation: every client; server: online devices
            cohort  = sample_round_cohort(clients, m, seed, t)   # method §4
            plans   = {c: plan_client(cache, collector.budget(c))}
            got     = collector.collect(t, cohort, plans, global_state, lr)   # in process, or over MQTT
        the release's stages prepare the valid updates (client-id order)
        the release policy (feast_edge.run.policy; by default >= min_clients contributors): the release
            (feast_edge.run.release), its stages around the method's aggregation, in place; else unchanged
        every eval_every rounds: validate (BN-recalibrated, method §8); at the last round its own weights and the
            mean of the last --serve-average rounds' weights (feast_edge.run.average) both, on the same examples, the
            better offered (feast_edge.evaluate.candidates); best.safetensors holds the served round's weights: on
            server data the best validation, validated by devices the newest without a regression
        checkpoint.safetensors (atomic; feast_edge.run.store): weights, round, history, best, the caller's extra fields

Without a horizon (``--continuous``) the rounds go on until ``stop`` is set (feast-server stop) or ``stop_after``;
nothing depends on where they end: the lr restarts its cosine every --lr-period rounds, every validation has its
tail mean (feast_edge.run.average), and the history keeps its last rounds in full (feast_edge.run.retention). A
resumed run may change only its horizon (feast_edge.run.store.EXTENDABLE): it goes on from its last round.

Only the :class:`Collector` differs between simulation and deployment, so the
two cannot drift apart (tests/federation/test_federation_same_math.py checks
they end bit-identical). Rounds are 0-based inside (``t``, seeds, the wire)
and 1-based wherever a person reads them (:attr:`RoundRecord.round`, logs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from feast_edge.cache.variants import VariantCache
from feast_edge.evaluate.candidates import choose_candidate
from feast_edge.evaluate.evaluation import Validation
from feast_edge.evaluate.served_round import serve_after
from feast_edge.route.payload import bytes_per_param
from feast_edge.run.average import TailAverage, loaded, serve_average_of, split_extra
from feast_edge.run.collect import Collector
from feast_edge.run.policy import EveryRound, ReleasePolicy
from feast_edge.run.release import EndRequested, Release, RunStops
from feast_edge.run.retention import retain, retained, written
from feast_edge.run.round_record import RoundMethod, RoundRecord
from feast_edge.run.schedule import Scheduler, SyncRounds
from feast_edge.run.stages import release_of
from feast_edge.run.store import (  # noqa: F401 (re-exported: the run directory's file names)
    BEST,
    CHECKPOINT,
    HISTORY_FORMAT,
    OPTIONS_OF,
    PREVIOUS,
    RunStore,
)
from feast_edge.run.strategy import FeastStrategy
from feast_edge.settings.run_concerns import RunConcerns
from feast_edge.settings.validated import RunError  # noqa: F401 (re-exported)
from feast_edge.space.supernet import Supernet


class Validator(Protocol):
    """Validation where the server holds no split: round ``t``'s model by the devices (or clients) that hold data."""

    def __call__(
        self, t: int, record: RoundRecord, alternative: Mapping[str, torch.Tensor] | None = None
    ) -> float | None: ...


@dataclass(frozen=True)
class Hooks:
    """What an environment does around the loop's steps (feast_edge.run.environment): ``before_release`` before every
    release, synchronous or asynchronous (e.g. choose the server's threads); ``resumed(history)`` after a resume;
    ``served(record)`` when the served round changed to ``record``'s, the model holding the served weights (a new
    version, feast_edge.sim.versions)."""

    before_release: Callable[[], None] = lambda: None
    resumed: Callable[[list[RoundRecord]], None] = lambda history: None
    served: Callable[[RoundRecord], None] = lambda record: None


class RunLoop:
    """Rounds of one federation over a ``Collector``, checkpointed in ``out`` (see the module docstring); built by
    feast_edge.run.compose.compose."""

    def __init__(
        self,
        model: Supernet,
        cache: VariantCache,
        settings: RunConcerns,
        out: str | Path,
        *,
        kind: str,
        fingerprint: str,
        config: Mapping[str, Any],
        validation: Validation | None = None,
        extra_fields: Callable[[], Mapping[str, Any]] = dict,
        method: RoundMethod | None = None,
        model_record: Mapping[str, Any] | None = None,
        validator: Validator | None = None,
        release: Release | None = None,
        scheduler: Scheduler | None = None,
        policy: ReleasePolicy | None = None,
        collector: Collector | None = None,
        hooks: Hooks | None = None,
        fingerprint_of: Callable[[Mapping[str, Any]], str] | None = None,
    ) -> None:
        """``method`` defaults to FEAST's steps; a model that is not a full Supernet needs ``model_record`` (its checkpoint header).
        ``release`` (the aggregation and its stages) defaults to the stages ``settings`` ask for; ``scheduler`` (who
        trains next) and ``policy`` (when collected input becomes a model) default to synchronous rounds
        (feast_edge.run.schedule.SyncRounds, feast_edge.run.policy.EveryRound); ``collector`` is how a cohort's
        updates come back (:meth:`run` may be given another); ``hooks`` what the environment does around the steps;
        ``fingerprint_of(config)`` the run's fingerprint of a stored config (a resume may then extend the run's horizon,
        feast_edge.run.store.EXTENDABLE).

        ``validator(t, record, alternative)`` validates round ``t``'s aggregated model where no ``validation`` split is
        held (federated validation: the devices test it and report counts); it may fill ``record.validation``, and
        where ``alternative`` (the tail mean's tensors) is given it tests that too on the same held-out examples and
        fills ``record.candidates["mean"]`` (``{"val_accuracy", "validation"}``).
        """
        self.model = model
        self.preset = model.preset if isinstance(model, Supernet) else None
        self.cache = cache
        self.settings = settings
        self.method: RoundMethod = method if method is not None else FeastStrategy.of_settings(model, cache, settings)
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
            fingerprint_of=fingerprint_of,
        )
        self.validation = validation
        self.validator = validator
        self.extra_fields = extra_fields
        self.full_params = self.method.full_params()
        # aggregation and its stages (feast_edge.run.release)
        self.release = release if release is not None else release_of(settings, model, self.method)
        self.scheduler = scheduler if scheduler is not None else SyncRounds(settings, self.method, model)
        self.policy = policy if policy is not None else EveryRound(self.release, settings.min_clients)
        self.collector = collector
        self.hooks = hooks if hooks is not None else Hooks()
        self.history: list[RoundRecord] = []
        self.stopped: str | None = None  # why the run ended before its last round (a stage refused it)
        self.recovered: str | None = None  # set when resume fell back to the previous checkpoint, saying why
        self.notes: list[str] = []  # what a resume changed that the run should say (a dropped tail mean)
        self.best: dict[str, Any] = {}
        by_devices = validation is None and validator is not None
        self.horizon = settings.training.horizon  # None: rounds without an end (--continuous)
        every = settings.validation.eval_every
        self.average = TailAverage(
            self.horizon,
            serve_average_of(settings.validation.serve_average, by_devices, self.horizon, every),
            every,
        )
        self.stop = threading.Event()  # set: the run ends after the round in progress, checkpointed (feast-server stop)
        self.ended: str | None = None  # why the run ended early on request (it can be resumed)

    # ------------------------------------------------------------------ checkpoints
    def save(self, name: str) -> None:
        """Checkpoint the run as it stands to ``out/name`` (feast_edge.run.store)."""
        self.store.write(
            name,
            dict(
                round=len(self.history),
                history=written(self.history, endless=self.horizon is None),
                history_format=HISTORY_FORMAT,
                best=self.best,
                average=self.average.fields,
                **self.extra_fields(),
            ),
            {**self.release.state, **self.average.state} or None,
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
            self.hooks.resumed(self.history)
            return 0
        done = int(resumed.fields.get("round", len(resumed.fields.get("history", []))))
        if self.horizon is not None and done > self.horizon:
            raise RunError(
                f"{resumed.path} has completed {done} rounds, more than --rounds {self.horizon}: give --rounds "
                f"{done} or more to go on, or --continuous; {hint}"
            )
        self.recovered = resumed.recovered
        released, averaged = split_extra(resumed.extra)
        self.release.load(released, resumed.path)
        dropped = self.average.load(averaged, resumed.fields.get("average") or {}, resumed.path)
        self.notes = [dropped] if dropped else []
        if self.store.extended:  # the horizon changed: the run goes on from its last round under the new one
            changed = ", ".join(f"{k} {was} -> {now}" for k, (was, now) in sorted(self.store.extended.items()))
            self.notes.append(f"{resumed.path}: the run is extended ({changed}); it goes on from round {done}")
        zero_based = resumed.fields.get("history_format", 1) < HISTORY_FORMAT
        self.history = [RoundRecord.from_dict(h, zero_based) for h in resumed.fields["history"]]
        if self.horizon is None:  # a run without an end keeps its last rounds in full (feast_edge.run.retention)
            self.history = retained(self.history)
        self.best = dict(resumed.fields.get("best", {}))
        if zero_based and "round" in self.best:
            self.best["round"] += 1
        self.scheduler.resume(self.history)
        self.hooks.resumed(self.history)
        return len(self.history)

    # ------------------------------------------------------------------ rounds
    def validate(self) -> float:
        """Mean validation accuracy of the probe operating points, each BN-recalibrated (method §8)."""
        assert self.validation is not None
        return self.method.validate(self.validation, self.settings.validation.probe_variants, self.settings.device)

    def run_round(self, t: int, collector: Collector | None, needed: int) -> RoundRecord:
        """The scheduler's step ``t`` (cohort -> plans -> collection), then the release policy (sparse aggregation, or
        the model unchanged)."""
        s = self.settings
        collector = collector if collector is not None else self.collector
        assert collector is not None, "a collector: compose the loop with an environment, or give one"
        start = time.monotonic()
        # admit: before anything is sent, a stage may refuse the round (RunStops)
        step = self.scheduler.gather(t, collector, needed, self.release.admit, self.history)
        ctx, plans, got, cohort = step.ctx, step.plans, step.got, step.ctx.cohort
        record = RoundRecord(
            round=t + 1,
            lr=step.lr,
            cohort=list(cohort),
            rejected=got.rejected,
            refusals=dict(got.refusals),
            declined=got.declined,
            incomplete=got.incomplete,
            missing=got.missing,
            dropped=got.dropped,
            ignored=got.ignored,
            send_seconds=got.send_seconds,
            clock=got.clock,
            staleness=dict(got.staleness),
            durations=dict(got.durations),
            withheld=dict(got.withheld),
            routed_params=sum(self.method.payload_params(plans[c]) for c in cohort),
            full_params=len(cohort) * self.full_params,
        )
        record.routed_bytes = record.routed_params * bytes_per_param(s.aggregation.payload_dtype)
        record.full_bytes = record.full_params * bytes_per_param("float32")
        ctx.record = record
        global_state = self.model.state_dict()  # aliases the model's tensors: the release writes into the model
        valid = sorted(got.updates, key=lambda u: u.client)
        valid = valid if got.sums is not None else self.release.prepare(ctx, global_state, valid)
        record.tally(valid)
        self.hooks.before_release()
        began = time.monotonic()
        if self.policy.release(ctx, global_state, valid, plans, got.sums):
            record.aggregate_seconds = time.monotonic() - began
            record.applied = True
        record.seconds = time.monotonic() - start
        return record

    def run(
        self,
        collector: Collector | None = None,
        *,
        start_clients: int | None = None,
        on_round: Callable[[RoundRecord], None] | None = None,
        stop_after: int | None = None,
    ) -> list[RoundRecord]:
        """Run the remaining rounds through ``collector`` (default: the composed one), checkpointing each;
        ``stop_after`` completed rounds ends early."""
        collector = collector if collector is not None else self.collector
        assert collector is not None, "a collector: compose the loop with an environment, or give one"
        self.out.mkdir(parents=True, exist_ok=True)
        s = self.settings
        first = len(self.history)
        t = first
        while (self.horizon is None or t < self.horizon) and not self._end_requested(t):
            needed = (start_clients or s.min_clients) if t == first else s.min_clients
            try:
                record = self.run_round(t, collector, needed)
            except RunStops as exc:
                self.stopped = str(exc)
                break
            except EndRequested as exc:
                self.ended = f"{exc} before round {t + 1}"
                break
            validated = (t + 1) % s.validation.eval_every == 0 or t + 1 == self.horizon
            self.average.add(record.round, self.model.state_dict())
            if validated:
                self.validate_round(t, record)
            self.history.append(record)
            if self.choose_served(record):
                with loaded(self.model, self.average.mean if record.average_of else None):
                    self.save(BEST)  # the chosen candidate's weights: the mean, where it was chosen
                    self.hooks.served(record)
            if self.horizon is None:  # without an end, older rounds keep their figures only (feast_edge.run.retention)
                retain(self.history)
            self.save(CHECKPOINT)
            if on_round is not None:
                on_round(record)
            if stop_after is not None and t + 1 >= stop_after:
                break
            t += 1
        return self.history

    def _end_requested(self, t: int) -> bool:
        """Whether a stop was requested (``stop``) before round ``t``: then ``ended`` says so and the run ends, its
        last round checkpointed."""
        if self.stop.is_set() and self.ended is None:
            self.ended = f"stopped on request after round {t}" if t else "stopped on request before round 1"
        return self.stop.is_set()

    def validate_round(self, t: int, record: RoundRecord) -> None:
        """Validate round ``t``'s weights into ``record`` and, where the tail mean is a candidate of the round, the mean
        too, on the same examples (the server's split, or each device's held-out split)."""
        candidate = self.average.candidate(record.round)
        span, mean = (None, None) if candidate is None else candidate
        if self.validation is not None:
            record.val_accuracy = self.validate()
            if mean is not None:
                with loaded(self.model, mean):
                    record.candidates = {"mean": {"val_accuracy": self.validate()}}
        elif self.validator is not None:
            record.val_accuracy = self.validator(t, record, mean)
        if span is not None and record.candidates:
            record.candidates["of"] = list(span)

    def choose_served(self, record: RoundRecord) -> bool:
        """Update ``best`` (the served round and why) after ``record``: first the candidate the round offers (its own
        weights or the tail mean, feast_edge.evaluate.candidates), then the served-round rule against the incumbent
        (feast_edge.evaluate.served_round.serve_after); True when the round's weights became the served ones."""
        choose_candidate(self.history, record)
        self.best, chosen = serve_after(self.best, self.history, record)
        return chosen

    @property
    def finished(self) -> bool:
        """Every round ran, or a stage refused the next one (``stopped`` says why)."""
        if self.stopped is not None:
            return True
        return self.horizon is not None and len(self.history) >= self.horizon

    def selected_checkpoint(self) -> Path:
        """``best.safetensors`` when validation chose one, else the last checkpoint."""
        return self.store.selected()
