"""Where the jobs of buffered asynchronous rounds run (feast_edge.run.asynchronous): each device is sent the routed
slice of the version current when its slot was filled, and its update arrives later, on a clock.

    start(t, collector, clients, plans, global_state, lr)   send each client its slice of version t
    arrive()   -> the next arrivals (the clock then, and every job settling at that instant), [] while none has
                  settled yet, None when nothing is in flight and nothing will ever arrive
    busy()     -> the clients with a job in flight
    ignored()  -> what was ignored since the last call (messages of nobody's job, over MQTT)
    resume(now, seq)   a resumed run's clock and job count go on from its last release

``ClockJobs`` runs them in process: the collector trains each client at once and the clock (the simulation's
virtual one, feast_edge.run.clock) says when its update arrives, or that it is lost. Over MQTT the devices train
and the clock is the server's (feast_edge.server.jobs). Either way an arrival carries its update as sent and its
change of the parameters, Δ = w - θ_v[routed], against the version v it was sent; the scheduler rebases it.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from feast_edge.run.collect import ClientUpdate, Collector

# What became of a job that brought no update (Arrival.outcome), as a synchronous round's record names them.
LOST, REJECTED, DECLINED, INCOMPLETE, MISSING = "dropped", "rejected", "declined", "incomplete", "missing"


@dataclass
class Arrival:
    """A settled job: its client's update as sent and the change Δ of its parameters, or why it brought none."""

    client: str
    version: int  # the version it was sent
    plan: Any
    update: ClientUpdate | None  # as sent (None: ``outcome`` says why)
    delta: dict[str, torch.Tensor]  # Δ = w - θ_version[routed], parameters only
    seconds: float  # from being sent its slice to its update arriving
    outcome: str = ""  # with no update: LOST, REJECTED, DECLINED, INCOMPLETE or MISSING
    reason: str = ""


class Clock(Protocol):
    """How long a device's job takes, from being sent its slice to its update arriving, and whether it is lost."""

    def duration(self, client: str, update: ClientUpdate, plan: Any, job: int) -> float: ...

    def drops(self, client: str, job: int) -> bool: ...


class Jobs(Protocol):
    """Where the jobs of asynchronous rounds run (see the module docstring)."""

    def start(
        self,
        t: int,
        collector: Collector,
        clients: Sequence[str],
        plans: Mapping[str, Any],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> None: ...

    def arrive(self) -> tuple[float, list[Arrival]] | None: ...

    def busy(self) -> set[str]: ...

    def ignored(self) -> list[str]: ...

    def resume(self, now: float, seq: int) -> None:
        """A resumed run goes on from the clock ``now`` of its last release, its jobs counted from ``seq``."""


def leading(tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The leading slice of ``tensor`` of ``shape`` (a routed slice, method §5)."""
    return tensor[tuple(slice(0, d) for d in shape)]


def change(
    state: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], steps: set[str]
) -> dict[str, torch.Tensor]:
    """Δ = w - θ_v[routed] of the parameters (``steps``) of ``state``, against ``base`` (θ_v or its routed slice)."""
    return {k: v - leading(base[k], v.shape) for k, v in state.items() if k in steps}


@dataclass(order=True)
class _Job:
    finish: float
    seq: int
    arrival: Arrival = field(compare=False)


class ClockJobs:
    """Jobs in process on a clock: every client trains when sent its slice (the collector), and its update arrives
    when the clock says, or never (lost). Δ is taken when it is sent, so no old version is kept: each job in flight
    holds its update twice (as sent, and Δ), one routed slice each."""

    def __init__(self, clock: Clock, steps: set[str]) -> None:
        self.clock, self.steps = clock, steps
        self.jobs: list[_Job] = []  # by finish time
        self.now = 0.0  # the clock at the last arrival
        self.seq = 0  # jobs started so far: each is timed with its own seed

    def resume(self, now: float, seq: int) -> None:
        self.now, self.seq = now, seq

    def start(
        self,
        t: int,
        collector: Collector,
        clients: Sequence[str],
        plans: Mapping[str, Any],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> None:
        got = collector.collect(t, clients, plans, global_state, lr)
        by_client = {u.client: u for u in got.updates}
        why = {REJECTED: got.rejected, DECLINED: got.declined, INCOMPLETE: got.incomplete}
        for client in clients:
            update = by_client.get(client)  # None: the collector refused it (its reason kept) or got nothing
            refused = next(((kind, reasons[client]) for kind, reasons in why.items() if client in reasons), None)
            lost = update is None or self.clock.drops(client, self.seq)
            seconds = 0.0 if update is None else self.clock.duration(client, update, plans[client], self.seq)
            outcome, reason = refused if refused is not None else (LOST if lost else "", "")
            arrival = Arrival(
                client,
                t,
                plans[client],
                None if lost else update,
                {} if lost else change(update.state, global_state, self.steps),
                seconds,
                outcome=outcome,
                reason=reason,
            )
            heapq.heappush(self.jobs, _Job(self.now + seconds, self.seq, arrival))
            self.seq += 1

    def arrive(self) -> tuple[float, list[Arrival]] | None:
        if not self.jobs:
            return None
        first = heapq.heappop(self.jobs)
        arrived = [first.arrival]
        while self.jobs and self.jobs[0].finish == first.finish:  # ties arrive together
            arrived.append(heapq.heappop(self.jobs).arrival)
        self.now = first.finish
        return self.now, arrived

    def busy(self) -> set[str]:
        return {j.arrival.client for j in self.jobs}

    def ignored(self) -> list[str]:
        return []
