"""Buffered asynchronous rounds: devices train from whatever version they were sent, and the model is released every
K updates, never waiting for the slowest device (FedBuff, Nguyen et al. 2022, per coordinate of a routed supernet).

    slots    up to M (--concurrency) devices train at once; a slot that frees is refilled at once by a seeded uniform
             draw from the idle devices (neither training nor waiting in the buffer), so fast devices cannot crowd
             out the slow strong ones that alone train the top slices
    start    device i is sent the routed slice of the current version v_i (its plan, the lr of version v_i)
    arrive   its update is kept with its delta Δ_i = w_i - θ_{v_i}[routed]; the server keeps no old model versions,
             only the in-flight and buffered updates (M routed slices at most, each twice in a simulation, which
             computes them when sent: as sent, and as a delta)
    stale    τ_i = t - v_i (releases since its start); τ_i > S (--max-staleness) is refused with the reason, counted
    buffer   an update that arrives between releases t-1 and t is rebased on the current model at once,
                 w'_i = θ_t[routed] + Δ_i (τ_i = 0: w_i as sent), in place of its delta; the buffer is released
                 whole, so the model stays θ_t until then and the rebasing is off the release's path. Only the
                 parameters are steps: buffers (BatchNorm running statistics, counters) describe the device's data
                 and enter as sent (rebased, a running variance could turn negative)
    release  once K (--buffer) updates are buffered, at release t (ties: every update arriving at the same instant):
                 its weight n_i · s(τ_i),  s(τ) = 1/sqrt(1 + τ)  (--staleness sqrt; constant: 1; hinge: 1 up to
                 τ = 2, then 1/(1 + τ - 2))
                 then the release pipeline as in a synchronous round (stages, method §6 per coordinate), so
                 θ[u] <- Σ n_i s(τ_i) w'_i[u] / Σ n_i s(τ_i) over the updates that trained coordinate u,
                 that is θ[u] + Σ n_i s(τ_i) Δ_i[u] / Σ n_i s(τ_i)

``--rounds`` counts releases, and the learning-rate schedule runs over them (under ``--compute-budget``, over the
share of the budget spent: feast_edge.run.schedule.step_lr): a device trains with the lr of the version it was sent.
With K = M = the cohort size, every device taking the same time and the synchronous cohort
draw (a fill of M slots at version t draws as round t does), each release is exactly the synchronous round t
(tests/core/test_async_rounds.py). How long a device takes comes from a clock: virtual in a simulation
(feast_edge.sim.clock), measured over MQTT.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from feast_edge.run.cohort import sample_round_cohort
from feast_edge.run.collect import ClientUpdate, Collected, Collector
from feast_edge.run.release import FLEET_COUNTS, Release, RoundContext, StateDict
from feast_edge.run.schedule import Gathered, step_lr
from feast_edge.run.settings import RunError

if TYPE_CHECKING:
    from feast_edge.aggregate.segments import SegmentSums
    from feast_edge.run.round_record import RoundMethod, RoundRecord
    from feast_edge.run.settings import RunSettings

DISCOUNTS = ("sqrt", "constant", "hinge")
HINGE = 2  # hinge: no discount up to this staleness
# η of a release by plain averaging unless --server-lr says otherwise: θ[u] += η · (the buffer's weighted mean - θ[u]).
# η = 1 left the straggler fleet near chance; 0.25 trained it (docs/benchmarks.md, "Asynchronous rounds").
SERVER_LR = 0.25
RESUMED = 1 << 40  # the draws and jobs of a resumed run count from here (seeds no uninterrupted run uses)


def discount(kind: str, tau: int) -> float:
    """s(τ): the weight of an update ``tau`` releases stale, relative to a fresh one (see the module docstring)."""
    if kind == "sqrt":
        return 1.0 / math.sqrt(1.0 + tau)
    if kind == "constant":
        return 1.0
    if kind == "hinge":
        return 1.0 if tau <= HINGE else 1.0 / (1.0 + tau - HINGE)
    raise RunError(f"--staleness {kind!r} is not a staleness discount; choose one of {', '.join(DISCOUNTS)}")


@dataclass(frozen=True)
class AsyncSettings:
    """K, M, S and s(τ) of buffered asynchronous rounds."""

    buffer: int  # K: updates per release
    concurrency: int  # M: devices training at once
    max_staleness: int  # S: releases an update may lag behind
    staleness: str = "sqrt"

    def __post_init__(self) -> None:
        problems = [
            f"--buffer {self.buffer} must be at least 1" if self.buffer < 1 else "",
            f"--concurrency {self.concurrency} must be at least --buffer {self.buffer} (a release needs K updates "
            "in flight)"
            if self.concurrency < self.buffer
            else "",
            f"--max-staleness {self.max_staleness} must be at least 0" if self.max_staleness < 0 else "",
        ]
        problem = next((p for p in problems if p), "")
        if problem:
            raise RunError(problem)
        discount(self.staleness, 0)


class Clock(Protocol):
    """How long a device's job takes, from being sent its slice to its update arriving, and whether it is lost."""

    def duration(self, client: str, update: ClientUpdate, plan: Any, job: int) -> float: ...

    def drops(self, client: str, job: int) -> bool: ...


@dataclass(order=True)
class _Job:
    finish: float
    seq: int
    client: str = field(compare=False)
    version: int = field(compare=False)
    plan: Any = field(compare=False)
    update: ClientUpdate | None = field(compare=False)  # as sent (None: lost)
    seconds: float = field(compare=False, default=0.0)  # its duration on the clock
    delta: dict[str, torch.Tensor] = field(compare=False, default_factory=dict)  # Δ_i = w_i - θ_{v_i}[routed]


def leading(tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The leading slice of ``tensor`` of ``shape`` (a routed slice, method §5)."""
    return tensor[tuple(slice(0, d) for d in shape)]


class AsyncSlots:
    """The scheduler of buffered asynchronous rounds (see the module docstring): each ``gather`` runs the clock until
    K updates are buffered and returns them, rebased on the current model, as release ``t``'s input."""

    def __init__(
        self, settings: RunSettings, method: RoundMethod, model: torch.nn.Module, rules: AsyncSettings, clock: Clock
    ) -> None:
        self.settings, self.method, self.model, self.rules, self.clock = settings, method, model, rules, clock
        self.now = 0.0  # the clock at the last release
        self.jobs: list[_Job] = []  # in flight, by finish time
        self.buffered: list[_Job] = []
        self.fills = 0  # slot refills so far (each draws with its own seed)
        self.seq = 0
        self.participation: Counter[str] = Counter()  # device -> updates released
        self.refused: Counter[str] = Counter()  # device -> updates refused as too stale
        self.dropped: Counter[str] = Counter()  # device -> jobs lost (it went away)
        self.steps = {name for name, _ in model.named_parameters()}  # rebased; buffers are taken as sent
        self.counts: dict[str, float] = {}  # device -> its latest example count (what weight caps are measured by)

    def resume(self, now: float) -> None:
        """Continue a resumed run from the clock of its last release: the updates in flight or buffered when it
        stopped are dropped (as devices that went away), and the draws continue on seeds of their own."""
        if self.seq == 0 and now > 0:
            self.now, self.fills, self.seq = now, RESUMED, RESUMED

    def busy(self) -> set[str]:
        return {j.client for j in self.jobs} | {j.client for j in self.buffered}

    def _fill(self, t: int, clients: list[str], collector: Collector, history: list[RoundRecord]) -> None:
        """Refill the free slots at version ``t``: a seeded uniform draw from the idle clients, trained from now."""
        free = self.rules.concurrency - len(self.jobs)
        idle = sorted(set(clients) - self.busy())
        if free <= 0 or not idle:
            return
        drawn = sample_round_cohort(idle, min(free, len(idle)), self.settings.seed, self.fills)
        self.fills += 1
        lr = step_lr(self.settings, t, history)
        plans = self.method.plans(t, drawn, collector.budget)
        global_state = self.model.state_dict()
        got = collector.collect(t, drawn, plans, global_state, lr)
        by_client = {u.client: u for u in got.updates}
        for client in drawn:
            update = by_client.get(client)  # None: the collector refused or got nothing
            lost = update is None or self.clock.drops(client, self.seq)
            duration = 0.0 if update is None else self.clock.duration(client, update, plans[client], self.seq)
            delta = (
                {}
                if lost
                else {k: v - leading(global_state[k], v.shape) for k, v in update.state.items() if k in self.steps}
            )
            job = _Job(
                self.now + duration, self.seq, client, t, plans[client], None if lost else update, duration, delta
            )
            heapq.heappush(self.jobs, job)
            self.seq += 1

    def gather(
        self,
        t: int,
        collector: Collector,
        needed: int,
        admit: Callable[[RoundContext], None],
        history: list[RoundRecord],
    ) -> Gathered:
        clients = collector.clients(needed)
        refused: dict[str, str] = {}
        lost: list[str] = []
        while len(self.buffered) < self.rules.buffer:
            self._fill(t, clients, collector, history)
            if not self.jobs:
                raise RunError(
                    f"release {t + 1}: no device can train ({len(clients)} online, {len(self.buffered)} buffered); "
                    f"--buffer {self.rules.buffer} needs at least that many devices"
                )
            first = heapq.heappop(self.jobs)
            arrived = [first]
            while self.jobs and self.jobs[0].finish == first.finish:  # ties arrive together
                arrived.append(heapq.heappop(self.jobs))
            self.now = first.finish
            for job in arrived:
                tau = t - job.version
                if job.update is None:
                    lost.append(job.client)
                    self.dropped[job.client] += 1
                elif tau > self.rules.max_staleness:
                    self.refused[job.client] += 1
                    refused[job.client] = (
                        f"stale: trained from release {job.version} of {t}, {tau} behind (--max-staleness "
                        f"{self.rules.max_staleness})"
                    )
                else:  # rebased on arrival: the buffer is released whole, so the model stays θ_t until then
                    self.counts[job.client] = job.update.samples
                    job.update = self._rebased(job, self.model.state_dict(), t)
                    job.delta = {}
                    self.buffered.append(job)
        released, self.buffered = sorted(self.buffered, key=lambda j: j.client), []
        ctx = RoundContext(t, len(clients), [j.client for j in released], history, sampled=False)
        ctx.notes[FLEET_COUNTS] = [self.counts[c] for c in sorted(self.counts)]
        admit(ctx)
        staleness = {j.client: t - j.version for j in released}
        updates = [j.update for j in released if j.update is not None]
        self.participation.update(j.client for j in released)
        plans = {j.client: j.plan for j in released}
        lr = step_lr(self.settings, t, history)
        durations = {j.client: round(j.seconds, 6) for j in released}
        got = Collected(
            updates, rejected=refused, dropped=lost, clock=self.now, staleness=staleness, durations=durations
        )
        return Gathered(ctx, plans, lr, got)

    def _rebased(self, job: _Job, global_state: StateDict, t: int) -> ClientUpdate:
        """``job``'s update on the current model: as sent where it is fresh, else w' = θ_t[routed] + Δ."""
        assert job.update is not None
        if job.version == t:
            return job.update
        rebased = {k: d.add_(leading(global_state[k], d.shape)) for k, d in job.delta.items()}  # Δ becomes w', in place
        return replace(job.update, state={**job.update.state, **rebased})


class Buffered:
    """The release policy of buffered asynchronous rounds: each buffered update weighs n_i · s(τ_i), then the release
    as in a synchronous round (see the module docstring)."""

    def __init__(self, pipeline: Release, staleness: str) -> None:
        self.pipeline = pipeline
        self.staleness = staleness

    def release(
        self,
        ctx: RoundContext,
        global_state: StateDict,
        valid: list[ClientUpdate],
        plans: Mapping[str, Any],
        sums: SegmentSums | None,
    ) -> bool:
        if sums is not None:
            raise RunError("buffered asynchronous rounds aggregate single updates; this collector delivers sums")
        if not valid:
            return False
        taus: Mapping[str, int] = ctx.record.staleness if ctx.record is not None else {}
        weighted = [
            u if not taus.get(u.client) else replace(u, samples=u.samples * discount(self.staleness, taus[u.client]))
            for u in valid
        ]
        self.pipeline.apply(ctx, global_state, weighted, plans)
        return True
