"""Buffered asynchronous rounds: devices train from whatever version they were sent, and the model is released every
K updates, never waiting for the slowest device (FedBuff, Nguyen et al. 2022, per coordinate of a routed supernet).

    slots    up to M (--concurrency) devices train at once; a slot that frees is refilled at once by a seeded uniform
             draw from the idle devices (neither training nor waiting in the buffer), so fast devices cannot crowd
             out the slow strong ones that alone train the top slices
    start    device i is sent the routed slice of the current version v_i (its plan, the lr of version v_i)
    arrive   its update is kept with its delta Δ_i = w_i - θ_{v_i}[routed]; the server keeps no old model versions,
             only what each job in flight needs to take its delta (feast_edge.run.jobs: in a simulation, which
             trains when it sends, the update as sent and its delta; over MQTT, the routed slice sent), that is
             M routed slices at most, and the buffered updates
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
(tests/core/test_async_rounds.py). Where the jobs run is feast_edge.run.jobs: in process on a virtual clock
(feast_edge.run.clock), or on the devices over MQTT (feast_edge.server.jobs), timed by the server's clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from feast_edge.run.cohort import sample_round_cohort
from feast_edge.run.collect import STALE, ClientUpdate, Collected, Collector
from feast_edge.run.jobs import DECLINED, INCOMPLETE, LOST, MISSING, REJECTED, Arrival, Jobs, leading
from feast_edge.run.release import FLEET_COUNTS, Release, RoundContext, StateDict
from feast_edge.run.schedule import Gathered, step_lr
from feast_edge.settings.buffered import AsyncSettings, discount
from feast_edge.settings.validated import RunError

if TYPE_CHECKING:
    from feast_edge.aggregate.segments import SegmentSums
    from feast_edge.run.round_record import RoundMethod, RoundRecord
    from feast_edge.settings.run_concerns import RunConcerns

RESUMED = 1 << 40  # the draws and jobs of a resumed run count from here (seeds no uninterrupted run uses)


class AsyncSlots:
    """The scheduler of buffered asynchronous rounds (see the module docstring): each ``gather`` fills the free
    slots and takes the jobs' arrivals (feast_edge.run.jobs) until K updates are buffered, and returns them, rebased
    on the current model, as release ``t``'s input."""

    def __init__(
        self, settings: RunConcerns, method: RoundMethod, model: torch.nn.Module, rules: AsyncSettings, jobs: Jobs
    ) -> None:
        self.settings, self.method, self.model, self.rules, self.jobs = settings, method, model, rules, jobs
        self.now = 0.0  # the clock at the last release
        self.buffered: list[Arrival] = []
        self.fills = 0  # slot refills so far (each draws with its own seed)
        self.participation: Counter[str] = Counter()  # device -> updates released
        self.refused: Counter[str] = Counter()  # device -> updates refused as too stale
        self.dropped: Counter[str] = Counter()  # device -> jobs lost (it went away)
        self.steps = parameter_names(model)  # rebased; buffers are taken as sent
        self.counts: dict[str, float] = {}  # device -> its latest example count (what weight caps are measured by)

    def resume(self, history: list[RoundRecord]) -> None:
        """Continue a resumed run from the clock of its last release: the updates in flight or buffered when it
        stopped are dropped (as devices that went away), and the draws continue on seeds of their own."""
        now = (history[-1].clock or 0.0) if history else 0.0
        if self.fills == 0 and now > 0:
            self.now, self.fills = now, RESUMED
            self.jobs.resume(now, RESUMED)

    def busy(self) -> set[str]:
        return self.jobs.busy() | {a.client for a in self.buffered}

    def _fill(self, t: int, clients: list[str], collector: Collector, history: list[RoundRecord]) -> None:
        """Refill the free slots at version ``t``: a seeded uniform draw from the idle clients, trained from now."""
        busy = self.busy()
        free = self.rules.concurrency - len(self.jobs.busy())
        idle = sorted(set(clients) - busy)
        if free <= 0 or not idle:
            return
        drawn = sample_round_cohort(idle, min(free, len(idle)), self.settings.seed, self.fills)
        self.fills += 1
        lr = step_lr(self.settings, t, history)
        plans = self.method.plans(t, drawn, collector.budget)
        self.jobs.start(t, collector, drawn, plans, self.model.state_dict(), lr)

    def gather(
        self,
        t: int,
        collector: Collector,
        needed: int,
        admit: Callable[[RoundContext], None],
        history: list[RoundRecord],
    ) -> Gathered:
        got = Collected([])
        clients: list[str] = []
        while len(self.buffered) < self.rules.buffer:
            # ``needed`` devices start the run; then the slots go on with whoever is online (over MQTT the jobs wait
            # for one more device when every online one is buffered)
            clients = collector.clients(needed if self.fills == 0 else 0)
            self._fill(t, clients, collector, history)
            arrived = self.jobs.arrive()
            if arrived is None:
                raise RunError(
                    f"release {t + 1}: no device can train ({len(clients)} online, {len(self.buffered)} buffered); "
                    f"--buffer {self.rules.buffer} needs at least that many devices"
                )
            now, arrivals = arrived
            self.now = max(self.now, now)
            for arrival in arrivals:
                self._arrived(t, arrival, got)
        got.ignored = self.jobs.ignored()
        released, self.buffered = sorted(self.buffered, key=lambda a: a.client), []
        ctx = RoundContext(t, len(clients), [a.client for a in released], history, sampled=False)
        ctx.notes[FLEET_COUNTS] = [self.counts[c] for c in sorted(self.counts)]
        admit(ctx)
        got.updates = [a.update for a in released if a.update is not None]
        got.clock = self.now
        got.staleness = {a.client: t - a.version for a in released}
        got.durations = {a.client: round(a.seconds, 6) for a in released}
        self.participation.update(a.client for a in released)
        plans = {a.client: a.plan for a in released}
        return Gathered(ctx, plans, step_lr(self.settings, t, history), got)

    def _arrived(self, t: int, arrival: Arrival, got: Collected) -> None:
        """Buffer ``arrival`` (rebased on the current model), or say in ``got`` why it does not count."""
        client, tau = arrival.client, t - arrival.version
        if arrival.update is None:
            if arrival.outcome == LOST:
                got.dropped.append(client)
                self.dropped[client] += 1
            elif arrival.outcome == MISSING:
                got.missing.append(client)
            else:
                outcomes = {REJECTED: got.rejected, DECLINED: got.declined, INCOMPLETE: got.incomplete}
                outcomes.get(arrival.outcome, got.incomplete)[client] = arrival.reason
        elif tau > self.rules.max_staleness:
            self.refused[client] += 1
            got.rejected[client] = (
                f"stale: trained from release {arrival.version} of {t}, {tau} behind (--max-staleness "
                f"{self.rules.max_staleness})"
            )
            got.refusals[client] = STALE
        else:  # rebased on arrival: the buffer is released whole, so the model stays θ_t until then
            self.counts[client] = arrival.update.samples
            arrival.update = self._rebased(arrival, self.model.state_dict(), t)
            arrival.delta = {}
            self.buffered.append(arrival)

    def _rebased(self, arrival: Arrival, global_state: StateDict, t: int) -> ClientUpdate:
        """``arrival``'s update on the current model: as sent where it is fresh, else w' = θ_t[routed] + Δ."""
        assert arrival.update is not None
        if arrival.version == t:
            return arrival.update
        rebased = {k: d.add_(leading(global_state[k], d.shape)) for k, d in arrival.delta.items()}  # Δ becomes w'
        return replace(arrival.update, state={**arrival.update.state, **rebased})


def parameter_names(model: torch.nn.Module) -> set[str]:
    """The state entries that are steps of training (rebased), not statistics of the data (taken as sent)."""
    return {name for name, _ in model.named_parameters()}


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
