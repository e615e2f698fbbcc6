"""The device agent: registers its (virtual) clients, trains each routed sub-supernet it is sent, returns the slice.

One agent process holds one MQTT connection (presence ``status/{host}``) and
hosts one or more clients, each with its own device id, data and budget. For
every ``round`` message it receives it runs exactly what the simulator runs for
that client (``step.local_step``, which calls ``feast_edge.local.update.client_update``) with exactly the inputs
the server sent: the routed tensors, the learning rate, the client seed, the
affordable variants and the training settings (docs/protocol.md §7).

paho's network thread only parses and queues; the agent's own thread (the
caller of :meth:`Agent.run`) trains and uploads, so a long local epoch never
stalls acknowledgements, nacks or presence.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feast_edge.agent.config import AgentConfig
from feast_edge.agent.local_data import LocalClient, client_budgets
from feast_edge.agent.step import largest_payload, local_step
from feast_edge.cache.variants import load_cache
from feast_edge.errors import FeastError
from feast_edge.protocol import MAX_REASON, Declined, Finished, Metrics, ModelReady, Register, Registered, RoundStart, Update
from feast_edge.space.preset import load_preset
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.chunks import Reassembler, Status
from feast_edge.transport.errors import LinkError, ProtocolError, TopicError
from feast_edge.transport.frames import MIN_CHUNK_SIZE, TransferInfo
from feast_edge.transport.link import Link, Received
from feast_edge.transport.messages import Message, MessageFilter, Presence, new_msg_id, parse
from feast_edge.transport.throttle import Throttle, channel_of
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import ChunkReceiver, ChunkSender, Confirmations

log = logging.getLogger(__name__)

__all__ = ["Agent", "AgentConfig", "AgentError"]

REGISTER_RETRY = 3.0  # seconds between registration attempts while the server is silent
HEARTBEAT = 10.0  # seconds between "still waiting" lines


class AgentError(FeastError):
    """The agent cannot start or continue (refused registration, no server, unusable data or budget)."""


@dataclass
class _Client:
    data: LocalClient
    budget_macs: int
    receiver: ChunkReceiver | None = None
    sender: ChunkSender | None = None
    accepted: bool = False
    finished: Finished | None = None  # the server's word that the federation is over
    rounds_trained: int = 0
    model_path: Path | None = None


class Agent:
    """One agent process: a link, its clients, a loop that trains what the server routes."""

    def __init__(self, config: AgentConfig, link_config: LinkConfig, clients: list[LocalClient]) -> None:
        self.config = config
        self.preset = load_preset(config.preset)
        self.max_payload = largest_payload(self.preset)
        self.cache = load_cache(self.preset)
        self.classes = self.preset.classes
        budgets = client_budgets(clients, self.preset, self.cache, config.budget_macs)
        self.clients = {c.device_id: _Client(c, budgets[c.device_id]) for c in clients}
        self.instance = uuid.uuid4().hex[:16]
        self.topics = Topics(config.federation)
        self.presence = Presence(federation=config.federation, round=0, device=config.host, state="online", role="device")
        self.link = Link(link_config, presence=self.presence)
        self.stop = threading.Event()
        self.current_round = 0
        self._events: queue.Queue[tuple[str, Message, float]] = queue.Queue(maxsize=10_000)
        self._dropped = Throttle(log)  # bad input is logged, at most a few lines a minute per kind
        self._filter = MessageFilter(config.federation)
        self._pending: dict[str, tuple[RoundStart, float]] = {}  # device -> latest round message and when it arrived
        self._models: list[ModelReady] = []
        self._stash: OrderedDict[str, Any] = OrderedDict()  # finished transfers that arrived before anyone waited for them
        self._receipts = Confirmations()  # uploads awaiting the server's receipt
        self._server_online: bool | None = None
        self._closing = False
        self._ever_accepted = False
        self._refused = False
        self._horizon: int | None = None  # the federation's rounds, from its round messages
        self.training = False  # True while client_update runs (a stop signal then interrupts it)
        self.rounds_trained = 0

    # ------------------------------------------------------------------ connection
    def start(self, timeout: float = 10.0) -> None:
        """Subscribe every client's topics (all in the one SUBSCRIBE sent on connect, not a round trip each), then connect (LinkError with a fix)."""
        t = self.topics
        for device_id, client in self.clients.items():
            self.link.subscribe(t.ctrl(device_id), self._on_ctrl(device_id))
        self.link.subscribe(t.server_status, self._on_server_status)
        self.link.subscribe(t.status(self.config.host), self._on_own_status)
        if self.config.model_dir is not None:
            Path(self.config.model_dir).mkdir(parents=True, exist_ok=True)
        for device_id, client in self.clients.items():
            # Only transfers the server announced to this device, each at most the largest payload it can be sent.
            reassembler = Reassembler(
                federation=self.config.federation, max_chunk_size=self.config.chunk_size, min_chunk_size=MIN_CHUNK_SIZE,
                max_payload_bytes=self.max_payload, max_buffered_bytes=2 * self.max_payload, expected_only=True,
            )
            client.receiver = ChunkReceiver(self.link, t, "down", device=device_id, reassembler=reassembler)
            client.sender = ChunkSender(self.link, t, "up", device=device_id, chunk_size=self.config.chunk_size)
        self.link.connect(timeout=timeout)
        log.info(
            "agent %s (instance %s) connected to %s; hosting %s", self.config.host, self.instance, self.link.address,
            ", ".join(f"{d} ({c.data.samples} samples, {c.budget_macs / 1e6:.2f}M MACs)" for d, c in self.clients.items()),
        )

    def close(self) -> None:
        """Leave: offline presence and DISCONNECT (no offline status if the server refused us, so the agent owning the id stays online)."""
        self._closing = True
        if not self._ever_accepted and self._refused:
            self.link.presence = None
        self.link.close()

    # ------------------------------------------------------------------ incoming (paho's thread)
    def _on_ctrl(self, device_id: str):
        def handle(received: Received) -> None:
            message = self._parse(received)
            if message is None:
                return
            if message.device != device_id:
                self._dropped.warning(f"name {device_id}", "dropped %s on %s: it names device %r", message.kind, received.topic, message.device)
                return
            if isinstance(message, (RoundStart, ModelReady)):
                self._pre_expect(device_id, message)
            self._queue("ctrl", message)

        return handle

    def _pre_expect(self, device_id: str, message: RoundStart | ModelReady) -> None:
        """Paho's thread: take the chunks of an announced transfer from the first one on (they follow the announcement at once)."""
        try:  # a bad description is refused, with its reason, by the agent's thread
            info, receiver = TransferInfo.from_dict(message.transfer), self.clients[device_id].receiver
            if receiver is not None and info.device == device_id and info.round == message.round:
                receiver.expect(info)
        except ProtocolError:
            pass

    def _on_server_status(self, received: Received) -> None:
        if not received.payload:
            return
        message = self._parse(received)
        if isinstance(message, Presence) and message.role == "server":
            self._queue("server", message)

    def _on_own_status(self, received: Received) -> None:
        # Someone else's last will or clean exit on our presence topic (e.g. a refused duplicate agent that
        # crashed): say again that we are here. Retained copies are history, not news.
        if received.retain or not received.payload or self._closing or not self.link.connected:
            return
        message = self._parse(received)
        if isinstance(message, Presence) and message.state == "offline":
            log.warning("an offline status for %s appeared while this agent is online; publishing online again", self.config.host)
            online = dataclasses.replace(self.presence, msg_id=new_msg_id())
            self.link.publish(self.link.status_topic or self.topics.status(self.config.host), online.encode(), retain=True)

    def _parse(self, received: Received) -> Message | None:
        try:
            self.topics.parse(received.topic)
            return parse(received.payload)
        except (ProtocolError, TopicError) as exc:
            self._dropped.warning(f"malformed {channel_of(received.topic)}", "dropped malformed message on %s: %s", received.topic, exc)
            return None

    def _queue(self, channel: str, message: Message) -> None:
        try:
            self._events.put_nowait((channel, message, time.monotonic()))
        except queue.Full:
            self._dropped.warning("inbox", "agent inbox full; dropped a %s message", message.kind)

    # ------------------------------------------------------------------ event handling (the agent's thread)
    def _process(self, timeout: float) -> None:
        """Handle queued messages; wait up to ``timeout`` for the first one."""
        try:
            channel, message, at = self._events.get(timeout=timeout) if timeout > 0 else self._events.get_nowait()
        except queue.Empty:
            return
        while True:
            self._guarded(f"{message.kind} for {message.device}", self._handle, channel, message, at)
            try:
                channel, message, at = self._events.get_nowait()
            except queue.Empty:
                return

    def _guarded(self, what: str, step: Callable[..., None], *args: Any) -> None:
        """Run one step on network input; whatever it holds, a bug or bad input ends that step, never the agent (refusals do)."""
        try:
            step(*args)
        except AgentError:
            raise
        except Exception as exc:  # noqa: BLE001
            log.warning("could not handle %s: %s", what, exc, exc_info=not isinstance(exc, FeastError))

    def _handle(self, channel: str, message: Message, at: float) -> None:
        if channel == "server" and isinstance(message, Presence):
            was = self._server_online
            self._server_online = message.state == "online"
            if self._server_online and was is False:
                # A (re)started server: its rounds may restart from an older round id; re-register everyone.
                log.info("the server is back online; registering again")
                self._filter = MessageFilter(self.config.federation)
                for client in self.clients.values():
                    client.accepted = False
                    client.finished = None
                self._send_registrations()
            elif self._server_online and was is None:
                self._send_registrations()  # the server may have missed registrations sent before it subscribed
            elif not self._server_online and was and not self.finished:
                log.warning("the server went offline; waiting for it to come back")
            return
        verdict = self._filter.verdict(message)
        if verdict is not None:
            log.info("ignored %s for %s: %s", message.kind, message.device, verdict)
            return
        if isinstance(message, Registered):
            if message.instance != self.instance:
                return  # the answer to another agent claiming the same id
            client = self.clients[message.device]
            if not message.accepted:
                self._refused = True
                raise AgentError(f"the server refused device {message.device}: {message.reason}")
            if message.finished:
                log.info("federation %r has already finished (%d rounds); nothing to train for %s", self.config.federation, message.rounds, message.device)
                client.finished = Finished(federation=message.federation, round=0, device=message.device, rounds=message.rounds, completed=message.rounds)
            elif not client.accepted:
                log.debug("server accepted %s (preset %s, %d rounds)", message.device, message.preset, message.rounds)
            client.accepted = True
            self._ever_accepted = True
        elif isinstance(message, Finished):
            self.clients[message.device].finished = message
            log.info(
                "federation %r finished after %d of %d rounds%s", self.config.federation, message.completed, message.rounds,
                "" if self.config.stay else "; leaving",
            )
        elif isinstance(message, RoundStart):
            self._horizon = message.rounds
            self._filter.advance(message.round)
            self.current_round = max(self.current_round, message.round)
            previous = self._pending.get(message.device)
            if previous is not None:
                log.info("round %d for %s supersedes its unstarted round %d", message.round, message.device, previous[0].round)
            self._pending[message.device] = (message, at)
        elif isinstance(message, ModelReady):
            if message.request:
                return  # answers a fetch-model request, not ours
            if not message.available:
                log.info("server: no model for %s: %s", message.device, message.reason)
            elif self.config.model_dir is None:
                log.info("server announced the model of %s (%s); fetch it with feast-agent fetch-model", message.device, message.manifest.get("file"))
            else:
                self._models.append(message)
        else:
            log.info("ignored unexpected %s message for %s", message.kind, message.device)

    # ------------------------------------------------------------------ registration
    def _send_registrations(self) -> None:
        summary = self.config.profile
        for device_id, client in self.clients.items():
            if client.accepted:
                continue
            message = Register.for_client(
                federation=self.config.federation, device=device_id, host=self.config.host, instance=self.instance, preset=self.preset,
                budget_macs=client.budget_macs, samples=client.data.samples, profile=summary,
            )
            self.link.publish(self.topics.register(device_id), message.encode())

    def register(self, timeout: float | None = None) -> bool:
        """Register every client (False if ``stop`` was set first); AgentError when refused or when no server answers within ``timeout``."""
        timeout = self.config.register_timeout if timeout is None else timeout
        began = time.monotonic()
        deadline = began + timeout
        last, last_note = float("-inf"), began
        while not all(c.accepted for c in self.clients.values()):
            if self.stop.is_set():
                return False
            now = time.monotonic()
            state = {None: "has never reported", True: "is online but did not answer", False: "is offline"}[self._server_online]
            if now - last_note >= HEARTBEAT:
                log.info("waiting for the server of federation %r to answer the registration (the server %s); %.0f s", self.config.federation, state, now - began)
                last_note = now
            if now >= deadline:
                raise AgentError(
                    f"no feast-server answered the registration of {', '.join(d for d, c in self.clients.items() if not c.accepted)} within "
                    f"{timeout:g} s: the server of federation {self.config.federation!r} at {self.link.address} {state}; start "
                    f"'feast-server run --federation {self.config.federation}' on that broker, or check --federation/--broker"
                )
            if now - last >= REGISTER_RETRY:
                self._send_registrations()
                last = now
            self._process(min(0.2, deadline - now))
        return True

    # ------------------------------------------------------------------ main loop
    @property
    def finished(self) -> bool:
        """The server said the federation is over, for every hosted client."""
        return all(c.finished is not None for c in self.clients.values())

    def run(self, max_rounds: int | None = None) -> None:
        """Serve rounds (and model announcements) until the federation finishes (unless ``stay``) or ``stop`` is set."""
        idle_since = last_note = time.monotonic()
        while not self.stop.is_set():
            self._process(0 if self._pending or self._models else 0.2)  # work waiting: no idle wait before it (one per hosted client)
            self._receipts.check(cancelled=lambda device_id: device_id in self._pending or self.stop.is_set())
            now = time.monotonic()
            if self._pending or self._models:
                idle_since = last_note = now
            elif now - last_note >= HEARTBEAT:
                server = {None: "not seen yet", True: "online", False: "offline"}[self._server_online]
                last = self._horizon is not None and self.current_round + 1 >= self._horizon
                what = "the server's next run" if self.finished else "the end of the federation (export, models)" if last else "the next round"
                log.info("waiting for %s (server %s; %d round(s) trained so far); %.0f s", what, server, self.rounds_trained, now - idle_since)
                last_note = now
            if self._pending:
                device_id = min(self._pending, key=lambda d: (self._pending[d][0].round, self._pending[d][1]))
                start, at = self._pending.pop(device_id)
                self._guarded(f"round {start.round + 1} of {device_id}", self._train_round, device_id, start, at)
                if max_rounds is not None and self.rounds_trained >= max_rounds:
                    return
            while self._models and not self.stop.is_set():
                model = self._models.pop(0)
                self._guarded(f"the model of {model.device}", self._receive_model, model)
            if self.finished and not self._pending and not self._models and not self.config.stay:
                return

    def summary(self) -> str:
        """One line for people: what each hosted client did in this federation."""
        ends = {(c.finished.completed, c.finished.rounds) for c in self.clients.values() if c.finished is not None}
        state = "finished after " + ", ".join(f"{done} of {total} rounds" for done, total in sorted(ends)) if ends else "did not finish"
        parts = [
            f"{device_id} trained in {c.rounds_trained} round{'s' * (c.rounds_trained != 1)}" + (f", model saved to {c.model_path}" if c.model_path else ", no model received")
            for device_id, c in self.clients.items()
        ]
        return f"federation {self.config.federation!r} {state}: " + "; ".join(parts)

    def _await_transfer(self, device_id: str, transfer: str, deadline: float, round_info: TransferInfo | None = None) -> bytes | None:
        """Payload of ``transfer`` once complete and verified; None if rejected, late, or (``round_info``: a round's payload,
        its download progress reported about once a second) a newer round arrived meanwhile."""
        client, reported = self.clients[device_id], time.monotonic()
        assert client.receiver is not None
        while True:
            progress = self._stash.pop(transfer, None)
            if progress is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.stop.is_set():
                    return None
                progress = client.receiver.get(timeout=min(remaining, 0.2))  # also nacks missing chunks
                if progress is None:
                    if round_info is not None and time.monotonic() - reported >= 1.0:
                        reported, got = time.monotonic(), client.receiver.reassembler.received(transfer)
                        self._metrics(device_id, {"phase": "downloading", "round": round_info.round, "done": got or 0, "total": round_info.count})
                    self._process(0)
                    if round_info is not None and device_id in self._pending:
                        return None
                    continue
                if progress.info.transfer != transfer:
                    self._stash[progress.info.transfer] = progress  # e.g. a model pushed while a round was waiting
                    while len(self._stash) > 16:
                        self._stash.popitem(last=False)
                    continue
            if progress.status is Status.COMPLETE and progress.payload is not None:
                return progress.payload
            log.warning("transfer %s for %s failed: %s", transfer, device_id, progress.reason or progress.status.value)
            return None

    def _train_round(self, device_id: str, start: RoundStart, received_at: float) -> None:
        t, client = start.round, self.clients[device_id]
        shown = f"round {t + 1}/{start.rounds}"
        deadline = received_at + start.timeout
        try:
            info = start.transfer_info()
            start.client_plan(self.preset), start.train_config()  # refuse what this agent cannot train before waiting for the payload
        except FeastError as exc:
            log.error("%s: refused the round message for %s: %s", shown, device_id, exc)
            return
        assert client.receiver is not None and client.sender is not None
        client.receiver.expect(info)
        self._metrics(device_id, {"phase": "downloading", "round": t, "done": 0, "total": info.count})
        blob = self._await_transfer(device_id, info.transfer, deadline, round_info=info)
        if blob is None:
            log.warning("%s: no routed payload for %s before the deadline (or a newer round superseded it); skipped", shown, device_id)
            return
        self._metrics(device_id, {"phase": "training", "round": t})
        step = local_step(self.preset, start, blob, client.data, self.config.device, lambda on: setattr(self, "training", on), self.config.amp)
        if step.payload is None or step.result is None:  # the server stops waiting for this device at once
            declined = Declined(federation=self.config.federation, round=t, device=device_id, routed=info.transfer, reason=step.reason[:MAX_REASON])
            self.link.publish(self.topics.events(device_id), declined.encode())
            return
        if time.monotonic() > deadline:
            log.warning("%s: %s finished %.1f s after the server's deadline; sending anyway", shown, device_id, time.monotonic() - deadline)
        up = client.sender.describe(step.payload, round=t, device=device_id)
        update = Update.from_result(
            step.result, federation=self.config.federation, round=t, device=device_id, transfer=up, routed=info.transfer,
            compute_seconds=step.compute_seconds, torch_device=str(self.config.device),
        )
        topic, announcement = self.topics.events(device_id), update.encode()
        self._metrics(device_id, {"phase": "uploading", "round": t, "done": 0, "total": up.count})
        try:
            client.sender.announce_and_send(topic, announcement, step.payload, up, timeout=self.config.send_timeout)
        except LinkError as exc:
            log.error("%s: could not send the update of %s: %s", shown, device_id, exc)
            return
        self.rounds_trained += 1
        client.rounds_trained += 1
        log.info("%s: %s sent its update: loss %.4f, %.1f s training, %.2f MB", shown, device_id, step.result.mean_loss, step.compute_seconds, len(step.payload) / 1e6)
        # Until the server's receipt (while the next client trains): what reached a restarted broker before the server subscribed again is lost.
        self._receipts.add(device_id, client.sender, topic, announcement, up, until=deadline)

    # ------------------------------------------------------------------ models
    def _receive_model(self, message: ModelReady) -> None:
        from feast_edge.agent.model_files import keep_pushed_model

        device_id = message.device
        info = TransferInfo.from_dict(message.transfer)
        client = self.clients[device_id]
        assert client.receiver is not None
        client.receiver.expect(info)
        blob = self._await_transfer(device_id, info.transfer, time.monotonic() + 120.0)
        if blob is None:
            log.error("the model of %s did not arrive; fetch it with feast-agent fetch-model", device_id)
            return
        assert self.config.model_dir is not None
        kept = keep_pushed_model(blob, message, self.config.model_dir)
        if kept is None:
            return
        client.model_path, values = kept
        self._metrics(device_id, values)

    def _metrics(self, device_id: str, values: dict[str, Any]) -> None:
        """Numbers for the server: a model's measurements, or where a round stands (``phase``, chunks ``done`` of ``total``)."""
        self.link.publish(self.topics.events(device_id), Metrics(federation=self.config.federation, round=self.current_round, device=device_id, values=values).encode())
