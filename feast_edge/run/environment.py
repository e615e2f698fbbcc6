"""What an app supplies to a run: its environment (how clients are reached, how a job starts, the secure-sums
transport, the validator, the threads policy, the clock) and what it can run at all (its capabilities).

    simulation   feast_edge.sim.environment      clients in process, jobs on the virtual clock
    feast-server feast_edge.server.environment   devices over MQTT, jobs on the devices, the server's wall clock
    Flower       feast_edge.flower.serverapp.environment   SuperNodes through Flower's Grid, synchronous rounds only

:func:`feast_edge.run.compose.compose` builds every run's loop from its settings and one environment; an environment
never builds or patches a loop. A feature an environment cannot run is refused by its :class:`Capabilities`, with the
reason, before anything starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from feast_edge.run.collect import Collector
from feast_edge.run.jobs import Jobs

if TYPE_CHECKING:
    from feast_edge.run.loop import Validator
    from feast_edge.run.round_record import RoundRecord


@dataclass(frozen=True)
class Capabilities:
    """What an environment runs: each feature it cannot run names why (None: it runs it)."""

    asynchronous: str | None = None  # buffered asynchronous rounds (--mode async)
    secure: str | None = None  # secure aggregation per routed segment (--secure-agg)
    privacy: str | None = None  # client-level differential privacy (--dp-*)

    def refusals(self, config: Any) -> list[tuple[bool, str]]:
        """(allowed, why) of ``config``'s features in this environment (``config``: a SimulationConfig, a
        ServerConfig or a run's RunConcerns, by its concerns)."""
        secure = getattr(config, "secure", None)
        return [
            (self.asynchronous is None or config.schedule.mode == "sync", self.asynchronous or ""),
            (self.secure is None or secure is None or not secure.secure_agg, self.secure or ""),
            (self.privacy is None or config.privacy.settings() is None, self.privacy or ""),
        ]

    def refused(self, config: Any) -> str | None:
        """Why this environment cannot run ``config`` (the first reason), or None."""
        return next((why for ok, why in self.refusals(config) if not ok), None)


EVERYTHING = Capabilities()


class Environment(Protocol):
    """What an app supplies to :func:`feast_edge.run.compose.compose` (see the module docstring)."""

    capabilities: Capabilities

    def collector(self) -> Collector:
        """How a cohort's clients are reached and their updates collected."""

    def secure_sums(self, inner: Collector) -> Collector:
        """``inner``'s rounds as securely aggregated per-segment sums, over this environment's transport."""

    def jobs(self, collector: Collector, steps: set[str]) -> Jobs:
        """Where the jobs of asynchronous rounds run (``steps``: the parameters an arrival's delta is taken of)."""

    def timed(self, collector: Collector) -> Collector:
        """Synchronous rounds on this environment's clock (a simulation's virtual one; a server's is the wall)."""

    def validator(self) -> Validator | None:
        """Who validates where the server holds no split (the devices' held-out data), or None."""

    def before_release(self) -> None:
        """Called before every release (synchronous or asynchronous): e.g. choose the server's threads."""

    def resumed(self, history: Sequence[RoundRecord]) -> None:
        """The run resumed with ``history`` (its clock, the messages it may ignore, its live view)."""

    def served(self, record: RoundRecord) -> None:
        """The served round changed to ``record``'s (the model holds the served weights while this runs)."""


class Plain:
    """An environment's defaults: the collector as it is, no secure transport, no asynchronous jobs, no hooks (a
    concrete environment overrides what it has)."""

    capabilities = EVERYTHING

    def secure_sums(self, inner: Collector) -> Collector:
        raise NotImplementedError("this environment has no secure-sums transport")

    def jobs(self, collector: Collector, steps: set[str]) -> Jobs:
        raise NotImplementedError("this environment runs no asynchronous jobs")

    def timed(self, collector: Collector) -> Collector:
        return collector

    def validator(self) -> Validator | None:
        return None

    def before_release(self) -> None:
        return None

    def resumed(self, history: Sequence[RoundRecord]) -> None:
        return None

    def served(self, record: RoundRecord) -> None:
        return None
