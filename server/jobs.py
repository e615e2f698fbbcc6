"""Buffered asynchronous rounds over MQTT: the jobs of feast_edge.run.asynchronous run on the devices.

    start    the slots the scheduler refilled at version t: each drawn device is sent its routed slice of version t
             with a RoundStart of round t (the round runs to its own deadline, --round-timeout from now); the
             exchange keeps the requests of older versions open
    arrive   the replies that settled (waiting up to a second for one): each update decoded against what its device
             was sent, held to the update-norm bound against that slice, and its change Δ = w - θ_v[routed] taken
             against it; a reply past its deadline settles as missing, a device that went offline as dropped
    clock    seconds since the run began on the server (a resumed run goes on from its last release's clock)

The server keeps, per job in flight, the routed slice it was sent (M routed slices at most: a fleet's largest
device's slice of paper-cifar100 is the whole 55.7 M-float supernet, 223 MB in float32), never an old version.
The agents need nothing new: a device trains each round message it gets and answers it with its round, so it
trains continuously while the server keeps it busy. A device never holds back a release: the release waits for K
updates from whichever devices are done.

Resume: the buffer is released whole, so a checkpoint (taken at each release) holds no buffered update; the jobs
in flight when the server stopped are dropped (their devices' answers name a transfer the new server never sent,
and are ignored), and the restarted run refills every slot.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from feast_edge.route.payload import Manifest
from feast_edge.run.collect import Collected, Collector
from feast_edge.run.jobs import DECLINED, INCOMPLETE, LOST, MISSING, REJECTED, Arrival, change
from feast_edge.server.collect import DeviceCollector
from feast_edge.server.exchange import DROPPED, Reply, RoundExchange
from feast_edge.server.exchange import MISSING as NO_REPLY
from feast_edge.util.atomic import atomic_write_bytes

log = logging.getLogger(__name__)

JOBS = "jobs.json"  # an asynchronous run's buffer and jobs in flight, rewritten as they change
WAIT = 1.0  # seconds an arrive() waits for a reply before the scheduler looks for idle devices again
OUTCOMES = {DROPPED: LOST, NO_REPLY: MISSING, REJECTED: REJECTED, DECLINED: DECLINED, INCOMPLETE: INCOMPLETE}


class JobExchange(RoundExchange):
    """A round exchange that also hands over each reply as it settles, for asynchronous rounds, whose requests stay
    open across versions (``open(t, keep=True)``), each until its own deadline."""

    def arrivals(self, wait: float) -> list[Reply]:
        """The replies settled since the last call, waiting up to ``wait`` seconds for the first (KeyboardInterrupt on
        stop). A request past its deadline settles "missing" (or "incomplete" where its upload was announced), one
        whose host went offline "dropped"; each device's request closes with the reply handed over."""
        current = self.current
        assert current is not None, "open() first"
        end = time.monotonic() + wait
        while True:
            self._expire()
            if current.settled or time.monotonic() >= end or self.events.stop.is_set():
                break
            self.events.pump(min(0.1, max(0.0, end - time.monotonic())))
        if self.events.stop.is_set():
            raise KeyboardInterrupt
        replies = []
        while current.settled:
            reply = current.settled.popleft()
            if current.pending.pop(reply.device, None) is not None:  # one reply closes a request
                self.announced.pop(reply.device, None)
                replies.append(reply)
        return replies

    def _expire(self) -> None:
        """Settle the requests past their deadlines, and those of devices that went offline."""
        current = self.current
        assert current is not None
        now = time.monotonic()
        for device, pending in current.pending.items():
            if pending.settled:
                continue
            if device in current.dropped:
                reason, outcome = "its host went offline", DROPPED
            elif now >= pending.deadline:
                size = None if pending.update is None else pending.update.transfer.get("size")
                reason = (
                    "no update before its deadline (--round-timeout)"
                    if size is None
                    else (f"its announced upload ({size} bytes) did not complete before its deadline (--round-timeout)")
                )
                outcome = NO_REPLY if size is None else INCOMPLETE
            else:
                continue
            pending.error = reason
            current.settled.append(Reply(device, error=reason, outcome=outcome))
        current.dropped = [d for d in current.dropped if d in current.pending and not current.pending[d].settled]

    def take_ignored(self) -> list[str]:
        """What was ignored since the last call (asynchronous rounds report it per release)."""
        current = self.current
        if current is None:
            return []
        ignored = current.ignored + ([f"{current.ignored_beyond} more messages"] if current.ignored_beyond else [])
        current.ignored, current.ignored_beyond = [], 0
        return ignored


def write_jobs(out: Path, release: int, held: int, size: int, in_flight: Mapping[str, Any]) -> None:
    """JOBS in ``out``, atomically: where an asynchronous run stands between releases (``feast-server status``)."""
    record = {
        "updated": time.time(),
        "release": release,
        "buffer": {"held": held, "size": size},
        "in_flight": in_flight,
    }
    atomic_write_bytes(out / JOBS, json.dumps(record, sort_keys=True).encode())


def read_jobs(out: Path) -> dict[str, Any] | None:
    """JOBS of the run in ``out``, or None (a synchronous run, or an unreadable file)."""
    try:
        record = json.loads((out / JOBS).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


@dataclass
class _Sent:
    version: int
    plan: Any
    manifest: Manifest
    state: dict[str, torch.Tensor]  # the routed slice it was sent (copies)
    at: float  # monotonic


class DeviceJobs:
    """The jobs of buffered asynchronous rounds on the devices (see the module docstring)."""

    def __init__(
        self, collector: DeviceCollector, steps: set[str], on_change: Callable[[], None] | None = None
    ) -> None:
        """``on_change()`` runs before each refill and each wait for replies: the moments the jobs in flight and the
        buffer are shown (the dashboard, JOBS in the run directory)."""
        assert isinstance(collector.exchange, JobExchange), "asynchronous rounds need a JobExchange"
        self.collector, self.steps, self.on_change = collector, steps, on_change
        self.exchange: JobExchange = collector.exchange
        self.sent: dict[str, _Sent] = {}  # device -> its job in flight
        self.began = time.monotonic()
        self.offset = 0.0  # the clock of the release a resumed run goes on from

    def resume(self, now: float, seq: int) -> None:
        self.offset = now

    def clock(self) -> float:
        return self.offset + time.monotonic() - self.began

    def oldest(self) -> int | None:
        """The oldest version a job in flight was sent (None: none in flight): messages of older rounds are stale."""
        return min((s.version for s in self.sent.values()), default=None)

    def start(
        self,
        t: int,
        collector: Collector,
        clients: Sequence[str],
        plans: Mapping[str, Any],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> None:
        self.collector.devices.coverage.check()
        if self.on_change is not None:
            self.on_change()
        self.exchange.open(t, keep=True)
        live = self.collector.live
        if live is not None:
            live.jobs_started(t, clients, self.exchange.settings.round_timeout)
        routed = self.collector.send(t, clients, plans, global_state, lr)
        for device, sent in routed.items():
            self.sent[device] = _Sent(t, plans[device], sent.manifest, sent.state, sent.at)
        log.debug("version %d sent to %s", t, ", ".join(clients))

    def arrive(self) -> tuple[float, list[Arrival]] | None:
        if not self.sent:  # every online device waits in the buffer: wait for one more to come online
            online = self.collector.devices.online()
            self.exchange.wait_online(len(online) + 1, self.collector.devices)
            return self.clock(), []
        if self.on_change is not None:
            self.on_change()
        replies = self.exchange.arrivals(WAIT)
        return self.clock(), [self._arrival(r) for r in replies if r.device in self.sent]

    def busy(self) -> set[str]:
        return set(self.sent)

    def in_flight(self) -> dict[str, dict[str, float]]:
        """Each job in flight: the version its device trains from and since when (epoch seconds)."""
        now, wall = time.monotonic(), time.time()
        return {d: {"version": s.version, "since": round(wall - (now - s.at), 3)} for d, s in sorted(self.sent.items())}

    def ignored(self) -> list[str]:
        return self.exchange.take_ignored()

    def close(self) -> None:
        """The run is over: the jobs in flight are abandoned, and their late answers are ignored."""
        if self.exchange.current is not None:
            self.exchange.close()
        self.sent.clear()
        if self.on_change is not None:
            self.on_change()

    def _arrival(self, reply: Reply) -> Arrival:
        sent = self.sent.pop(reply.device)
        seconds = time.monotonic() - sent.at
        got = Collected([])  # where the collector's log lines and the dashboard put what did not count
        if reply.error and reply.outcome != REJECTED:
            self.collector.unsettled(got, sent.version, reply)
            return Arrival(
                reply.device, sent.version, sent.plan, None, {}, seconds, OUTCOMES[reply.outcome], reply.error
            )
        checked = reply.error or self.collector.uploads.check(reply, sent.manifest, sent.state)
        if isinstance(checked, str):
            self.collector.reject(got, sent.version, reply.device, checked)
            return Arrival(reply.device, sent.version, sent.plan, None, {}, seconds, REJECTED, checked)
        live = self.collector.live
        if live is not None:
            live.upload_done(reply.device, reply.size, reply.chunks)
        return Arrival(
            reply.device, sent.version, sent.plan, checked, change(checked.state, sent.state, self.steps), seconds
        )
