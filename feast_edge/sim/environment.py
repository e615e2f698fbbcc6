"""The simulation's environment (feast_edge.run.environment): every client trains in process, its jobs take the time
the virtual clock says (feast_edge.run.clock), secure sums are masked and unmasked in process, the clients'
held-out splits validate where ``--validate-on devices``, a cohort is drawn from the clients that have joined
where they join over time (feast_edge.sim.growth), and with ``--versions`` every change of the served round is a
version the present devices install or refuse (feast_edge.sim.versions)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from feast_edge.run.clock import TimedRounds, VirtualClock
from feast_edge.run.collect import Collector
from feast_edge.run.environment import EVERYTHING, Plain
from feast_edge.run.jobs import ClockJobs, Jobs
from feast_edge.secagg.collector import in_process_secure_sums
from feast_edge.sim.collect import InProcessCollector
from feast_edge.sim.device_validation import lying_clients
from feast_edge.sim.growth import Present
from feast_edge.sim.versions import SimulatedVersions

if TYPE_CHECKING:
    from feast_edge.run.loop import Validator
    from feast_edge.run.round_record import RoundRecord
    from feast_edge.sim.config import SimulationConfig
    from feast_edge.sim.setup import Setup


class Clients(Protocol):
    """How a simulation's clients are reached: a collector that trains each cohort member on its shard."""

    def __call__(self, setup: Setup, method: Any, *, self_reported: bool = False) -> InProcessCollector: ...


class SimulationEnvironment(Plain):
    """Clients in process on a virtual clock (see the module docstring)."""

    capabilities = EVERYTHING

    def __init__(
        self,
        setup: Setup,
        method: Any,
        config: SimulationConfig,
        clock: VirtualClock,
        steps: set[str],
        validator: Validator | None = None,
        clients: Clients | None = None,
        out: str | Path | None = None,
    ) -> None:
        """``steps``: the model's parameters (what a device clips under central DP before masking); ``clients``: how
        the clients are reached (default: each trains in this process; ``--nproc``: spread over processes,
        feast_edge.sim.distributed); ``out``: the run directory (--versions keeps versions.sqlite there; None: in
        memory)."""
        self.setup, self.method, self.config, self.clock, self.steps = setup, method, config, clock, steps
        self._validator = validator
        self.clients = clients if clients is not None else InProcessCollector
        self.untimed: Collector | None = None  # the collector before the clock (one round alone: Simulation.run_round)
        self.in_process: InProcessCollector | None = None  # the innermost: where each member trains (its on_start)
        self.rounds: TimedRounds | None = None
        self.step = 0  # the step the next cohort is drawn for: the releases so far (clients that join over time)
        self.versions: SimulatedVersions | None = None
        if config.versions.versions:
            self.versions = SimulatedVersions(
                setup,
                method.model,
                {cid: float(b) for cid, b in zip(setup.client_ids, setup.population.budgets)},
                canary=config.versions.canary,
                gated=config.versions.gated,
                seed=config.seed,
                calibration=config.validation.calib_samples,
                out=out,
                liars=lying_clients(setup.client_ids, config.validation.lying_validators, config.seed),
            )

    def collector(self) -> Collector:
        self_reported = self.config.aggregation.max_weight_ratio > 0
        self.untimed = self.in_process = self.clients(self.setup, self.method, self_reported=self_reported)
        growth = self.setup.growth
        if growth is not None and self.config.population.joined_at_start < 1:  # a cohort only of who has joined
            self.untimed = Present(self.in_process, growth, lambda: self.step)
        return self.untimed

    def secure_sums(self, inner: Collector) -> Collector:
        self.untimed = in_process_secure_sums(inner, self.config.secure, self.config.dp_settings(), self.steps)
        return self.untimed

    def jobs(self, collector: Collector, steps: set[str]) -> Jobs:
        return ClockJobs(self.clock, steps)

    def timed(self, collector: Collector) -> Collector:
        self.rounds = TimedRounds(collector, self.clock, self.config.timing.round_timeout)
        return self.rounds

    def validator(self) -> Validator | None:
        return self._validator

    def before_release(self) -> None:
        self.step += 1  # the step's cohort is drawn: the next one is drawn for the step after

    def resumed(self, history: Sequence[RoundRecord]) -> None:
        if self.rounds is not None:  # synchronous rounds go on from the clock of the last one
            self.rounds.now = (history[-1].clock or 0.0) if history else 0.0
        self.step = history[-1].round if history else 0  # 1-based: the step after the last one
        if self.versions is not None:
            self.versions.resumed()

    def served(self, record: RoundRecord) -> None:
        if self.versions is not None:
            self.versions.served(record)
