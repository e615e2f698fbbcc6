"""The agent's standing with the server: its clients' registrations, the server's presence, the federation's end."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping

import torch

from feast_edge.agent.config import AgentConfig
from feast_edge.agent.hosted import Hosted
from feast_edge.agent.local_data import LocalClient
from feast_edge.data.task import Task, TaskError
from feast_edge.errors import FeastError
from feast_edge.protocol import Finished, Register, Registered
from feast_edge.space.preset import Preset
from feast_edge.transport.link import Link
from feast_edge.transport.messages import Presence, new_msg_id
from feast_edge.transport.topics import Topics

log = logging.getLogger(__name__)

REGISTER_RETRY = 3.0  # seconds between registration attempts while the server is silent
HEARTBEAT = 10.0  # seconds between "still waiting" lines


class AgentError(FeastError):
    """The agent cannot start or continue (refused registration, no server, unusable data or budget)."""


def class_counts(labels: torch.Tensor, classes: int) -> tuple[int, ...]:
    """Examples per class of ``labels`` (int64), for every class of the task."""
    return tuple(int(n) for n in torch.bincount(labels.long(), minlength=classes)[:classes].tolist())


class Registration:
    """Registers every hosted client and follows what the server says of them: accepted, refused, finished."""

    def __init__(
        self,
        config: AgentConfig,
        preset: Preset,
        instance: str,
        link: Link,
        topics: Topics,
        clients: Mapping[str, Hosted],
        evaluate_macs: Mapping[str, int] | None = None,
    ) -> None:
        """``evaluate_macs``: per client, the largest variant it evaluates for the federation (default its budget)."""
        self.config, self.preset, self.instance = config, preset, instance
        self.evaluate_macs = dict(evaluate_macs or {})
        self.link, self.topics, self.clients = link, topics, clients
        self.server_online: bool | None = None  # None: the server never reported
        self.accepted: set[str] = set()
        self.ended: dict[str, Finished] = {}  # device -> the server's word that the federation is over
        self.validation = ""  # where the server validates: "server" (its data) or "devices" (ours), once it said so
        self._ever_accepted = False
        self._refused = False
        self._closing = False
        self._last_sent = float("-inf")  # monotonic time of the last registration sent
        self._updating: set[str] = set()  # accepted devices registering new counts (their folder changed)
        self._sent: dict[str, LocalClient] = {}  # device -> the data its last registration counted

    @property
    def finished(self) -> bool:
        """The server said the federation is over, for every hosted client."""
        return len(self.ended) == len(self.clients)

    def server_state(self) -> str:
        return {None: "has never reported", True: "is online but did not answer", False: "is offline"}[
            self.server_online
        ]

    def send(self) -> None:
        """Register every client the server has not accepted yet."""
        self._last_sent = time.monotonic()
        for device_id, client in self.clients.items():
            if device_id in self.accepted:
                continue
            data = self._sent[device_id] = client.current  # its newest data: trained on once this is accepted
            message = Register.for_client(
                federation=self.config.federation,
                device_id=device_id,
                host=self.config.host,
                instance=self.instance,
                preset=self.preset,
                budget_macs=client.budget_macs,
                samples=data.samples,
                profile=self.config.profile,
                holdout=data.holdout,
                precision=self.config.precision,
                # Counts only: how many examples of each class it trains on and holds out (the server's coverage).
                class_counts=class_counts(data.labels, self.preset.classes),
                holdout_counts=class_counts(data.holdout_labels, self.preset.classes),
                evaluate_macs=self.evaluate_macs.get(device_id, client.budget_macs),
            )
            self.link.publish(self.topics.register(device_id), message.encode())

    def update(self, device_id: str) -> None:
        """Register accepted ``device_id`` again, with the counts of its newest data (its folder changed); sent again
        every REGISTER_RETRY s until the server answers (:meth:`retry`)."""
        self.accepted.discard(device_id)
        self._updating.add(device_id)
        self.send()

    def retry(self, now: float) -> None:
        """While serving rounds: register again, every REGISTER_RETRY s, the clients a restarted server has not
        accepted yet (a registration sent before it subscribed is lost; until it accepts, it sends them no round)."""
        if self.server_online and not self.finished and not self.accepted >= set(self.clients):
            if now - self._last_sent >= REGISTER_RETRY:
                self.send()

    def wait(self, process: Callable[[float], None], stop: threading.Event, timeout: float) -> bool:
        """Register until every client is accepted, handling messages with ``process(seconds)``; False if ``stop`` was
        set first; AgentError when refused or when no server answers within ``timeout``."""
        began = time.monotonic()
        deadline = began + timeout
        last, last_note = float("-inf"), began
        while not self.accepted >= set(self.clients):
            if stop.is_set():
                return False
            now = time.monotonic()
            if now - last_note >= HEARTBEAT:
                log.info(
                    "waiting for the server of federation %r to answer the registration (the server %s); %.0f s",
                    self.config.federation,
                    self.server_state(),
                    now - began,
                )
                last_note = now
            if now >= deadline:
                waiting = ", ".join(d for d in self.clients if d not in self.accepted)
                raise AgentError(
                    f"no feast-server answered the registration of {waiting} within {timeout:g} s: the server of "
                    f"federation {self.config.federation!r} at {self.link.address} {self.server_state()}; start "
                    f"'feast-server run --federation {self.config.federation}' on that broker, "
                    "or check --federation/--broker"
                )
            if now - last >= REGISTER_RETRY:
                self.send()
                last = now
            process(min(0.2, deadline - now))
        return True

    def on_server(self, presence: Presence) -> bool:
        """The server's presence changed; True when a (re)started server came online (its round ids may restart)."""
        was, self.server_online = self.server_online, presence.state == "online"
        if self.server_online and was is False:
            log.info("the server is back online; registering again")
            self.accepted.clear()
            self.ended.clear()
            self.send()
            return True
        if self.server_online and was is None:
            self.send()  # the server may have missed registrations sent before it subscribed
        elif not self.server_online and was and not self.finished:
            log.warning("the server went offline; waiting for it to come back")
        return False

    def on_registered(self, message: Registered, number: int = 0) -> None:
        """The server's answer to a registration (inbox message ``number``): AgentError when it refused this agent's
        client."""
        if message.instance != self.instance:
            return  # the answer to another agent claiming the same id
        if not message.accepted and message.device in self._updating:
            self._update_refused(message)
            return
        if not message.accepted:
            self._refused = True
            raise AgentError(f"the server refused device {message.device}: {message.reason}")
        self._check_task(message)
        self._updated(message.device, number)
        if message.finished:
            log.info(
                "federation %r has already finished (%d rounds); nothing to train for %s",
                self.config.federation,
                message.rounds,
                message.device,
            )
            self.ended[message.device] = Finished(
                federation=message.federation,
                round=0,
                device=message.device,
                rounds=message.rounds,
                completed=message.rounds,
                instance=self.instance,
            )
        elif message.device not in self.accepted:
            log.debug("server accepted %s (preset %s, %d rounds)", message.device, message.preset, message.rounds)
        self.accepted.add(message.device)
        self._ever_accepted = True

    def _updated(self, device: str, number: int) -> None:
        """An accepted registration: a device that registered its staged data's counts trains on that data from the
        rounds that arrive after this answer (:meth:`Hosted.settle`)."""
        self._updating.discard(device)
        client = self.clients.get(device)
        if client is not None and client.staged is not None and self._sent.get(device) is client.staged:
            client.accepted_at = number

    def _update_refused(self, message: Registered) -> None:
        """The server refused the new counts of an accepted device (e.g. more than its --max-samples): it keeps its
        registration and the images it trains on, and reads its folder again only once the folder changes again."""
        device = message.device
        self._updating.discard(device)
        self.accepted.add(device)
        client = self.clients[device]
        if client.staged is not None:
            growing = client.staged.growing
            client.data = dataclasses.replace(client.data, growing=growing)  # that listing is read: not again
            client.staged = client.accepted_at = None
        log.warning(
            "the server refused the new counts of %s (%s); it keeps training on its %d registered images",
            device,
            message.reason,
            client.data.samples,
        )

    def _check_task(self, message: Registered) -> None:
        """The federation's task, as the server announced it, must be the one this agent checked its data against."""
        if not message.task:
            return  # a server from before the task contract
        try:
            theirs = Task.from_dict(message.task)
        except TaskError as exc:
            self._refused = True
            raise AgentError(f"the server announced a malformed task: {exc}") from None
        ours = self.preset.task
        if theirs.digest != ours.digest:
            self._refused = True
            raise AgentError(
                f"the federation trains task {theirs.describe()}, but this agent's data was checked against "
                f"{ours.describe()} (preset {self.preset.name}); start feast-agent with the server's preset file (--preset)"
            )
        if message.validation and message.validation != self.validation:
            self.validation = message.validation
            if message.validation == "devices" and not any(c.data.holdout for c in self.clients.values()):
                log.warning(
                    "the server holds no data: it validates on the devices' held-out data, but %s holds none out "
                    "(--holdout 0); it trains, and calibrates its model, without testing it",
                    self.config.host,
                )

    def on_finished(self, message: Finished) -> None:
        if message.instance != self.instance:  # a replay from an earlier run, or another agent's: not this agent's end
            log.info(
                "ignored finished for %s: it names agent instance %s, this agent is %s (replayed from an earlier run?)",
                message.device,
                message.instance[:16],
                self.instance,
            )
            return
        self.ended[message.device] = message
        log.info(
            "federation %r finished after %d%s rounds%s",
            self.config.federation,
            message.completed,
            f" of {message.rounds}" if message.rounds else "",
            "" if self.config.stay else "; leaving",
        )

    def say_online(self) -> None:
        """Paho's thread: an offline status for this agent appeared while it is online; publish online again."""
        if self._closing or not self.link.connected or self.link.presence is None:
            return
        log.warning(
            "an offline status for %s appeared while this agent is online; publishing online again", self.config.host
        )
        online = dataclasses.replace(self.link.presence, state="online", msg_id=new_msg_id())
        self.link.publish(self.link.status_topic or self.topics.status(self.config.host), online.encode(), retain=True)

    def leave(self) -> None:
        """Before disconnecting: no offline status if the server refused us (the agent owning the id stays online)."""
        self._closing = True
        if not self._ever_accepted and self._refused:
            self.link.presence = None
