"""``feast-server run``'s environment (feast_edge.run.environment): devices reached over MQTT, asynchronous jobs run on
the devices and timed by the server's clock, secure sums through the key stages over MQTT, federated validation on
the devices' held-out data, and the server's threads chosen before every release."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from feast_edge.run.collect import Collector
from feast_edge.run.environment import EVERYTHING, Plain
from feast_edge.run.jobs import Jobs
from feast_edge.server.collect import DeviceCollector, RoundTerms
from feast_edge.server.jobs import DeviceJobs, write_jobs
from feast_edge.server.secure import mqtt_secure_sums

if TYPE_CHECKING:
    from feast_edge.run.loop import RunLoop, Validator
    from feast_edge.run.round_record import RoundRecord
    from feast_edge.server.config import ServerConfig
    from feast_edge.server.devices import DeviceBook
    from feast_edge.server.events import Events
    from feast_edge.server.live import LiveView
    from feast_edge.transport.link import Link
    from feast_edge.util.cores import Threads


class Hosting(Protocol):
    """What the environment reaches of the server that hosts it (server.app.FederationServer)."""

    config: ServerConfig
    out: Path
    events: Events
    devices: DeviceBook
    live: LiveView | None
    link: Link
    threads: Threads | None
    loop: RunLoop
    history: list[RoundRecord]
    validate_on_devices: Validator


log = logging.getLogger(__name__)


class ServerEnvironment(Plain):
    """The devices of one ``feast-server run`` (see the module docstring)."""

    capabilities = EVERYTHING

    def __init__(self, server: Hosting, terms: RoundTerms) -> None:
        self.server, self.terms = server, terms
        self.async_jobs: DeviceJobs | None = None  # --mode async: the jobs on the devices

    def collector(self) -> Collector:
        s = self.server
        return DeviceCollector(s.events.exchange, s.devices, self.terms, s.live)

    def secure_sums(self, inner: Collector) -> Collector:
        s, cfg = self.server, self.server.config
        log.info(
            "--secure-agg: the server sees per-segment sums of at least %d devices, never one update; "
            "--max-update-norm is not applied (each device clips its weighted change to ±%g per value)",
            cfg.secure.colluders + 2,
            cfg.secure.secagg_bound,
        )
        assert isinstance(inner, DeviceCollector)
        return mqtt_secure_sums(
            inner,
            cfg.secure,
            cfg.dp_settings(),
            publish=s.link.publish,
            events=s.events,
            out=s.out,
            weight_ratio=cfg.aggregation.max_weight_ratio,
        )

    def jobs(self, collector: Collector, steps: set[str]) -> Jobs:
        s = self.server
        rules = s.config.schedule.rules()
        assert rules is not None and isinstance(collector, DeviceCollector)

        def changed() -> None:  # the buffer and the jobs in flight, for the dashboard and feast-server status
            held, in_flight = len(s.loop.scheduler.buffered), jobs.in_flight()  # type: ignore[attr-defined]
            if s.live is not None:
                s.live.buffer(held, rules.buffer, {d: int(j["version"]) for d, j in in_flight.items()})
            write_jobs(s.out, len(s.history) + 1, held, rules.buffer, in_flight)

        jobs = self.async_jobs = DeviceJobs(collector, steps, changed)
        return jobs

    def validator(self) -> Validator | None:
        # Under DP the devices' held-out counts stay on the devices: no federated validation
        # (ServerConfig.federated_statistics).
        return self.server.validate_on_devices if self.server.config.federated_statistics else None

    def before_release(self) -> None:
        if self.server.threads is not None:  # the server's threads for what it computes next (aggregation, validation)
            self.server.threads.use("aggregating")

    def resumed(self, history: Sequence[RoundRecord]) -> None:
        s = self.server
        s.events.filter.advance(len(history))
        if s.live is not None:
            s.live.resumed(history)
