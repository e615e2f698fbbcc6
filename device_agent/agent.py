"""The device agent: registers its (virtual) clients, trains each routed sub-supernet it is sent, returns the slice.

One agent process holds one MQTT connection (presence ``status/{host}``) and
hosts one or more clients, each with its own device id, data and budget. For
every ``round`` message it receives it runs exactly what the simulator runs for
that client (``step.train``, which calls ``feast_edge.local.update.client_update``)
with exactly the inputs the server sent: the routed tensors, the learning rate,
the client seed, the affordable variants and the training settings
(docs/protocol.md §7).

The pieces, one job each: ``inbox.py`` (paho's thread: parse and queue),
``registration.py`` (registrations, the server's presence, the federation's
end), ``client_round.py`` (one client's round around ``step.train``), ``downloads.py``
(waiting for a transfer), ``model_files.py`` (a pushed model), ``install_gate.py`` (installed only if not worse
than the one it runs; ``version_store.py`` holds the versions). This module
wires them and runs the loop: paho's network thread only parses and queues; the
agent's own thread (the caller of :meth:`Agent.run`) handles the queue, trains
and uploads, so a long local epoch never stalls acknowledgements, nacks or
presence.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from feast_edge.agent.client_round import RoundRunner
from feast_edge.agent.config import AgentConfig
from feast_edge.agent.growth import FolderWatch, Grown
from feast_edge.agent.hosted import Hosted
from feast_edge.agent.inbox import Inbox, Incoming
from feast_edge.agent.local_data import LocalClient, client_budgets
from feast_edge.agent.profiling import evaluation_macs
from feast_edge.agent.registration import HEARTBEAT, AgentError, Registration
from feast_edge.agent.secure_round import SecureRounds
from feast_edge.agent.step import largest_payload
from feast_edge.cache.variants import load_cache
from feast_edge.errors import FeastError
from feast_edge.personalize.select import Choice
from feast_edge.protocol import Evaluate, Finished, Metrics, ModelReady, Registered, RoundStart, RoutedRequest
from feast_edge.space.preset import load_preset
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.errors import ProtocolError
from feast_edge.transport.frames import TransferInfo
from feast_edge.transport.link import Link
from feast_edge.transport.messages import MessageFilter, Presence
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import Confirmations
from feast_edge.util.cores import Threads

log = logging.getLogger(__name__)

__all__ = ["Agent", "AgentConfig", "AgentError"]

STEPS = {"evaluate": "validating", "calibrate": "calibrating BN statistics"}  # a request's step, for the threads line


class Agent:
    """One agent process: a link, its clients, a loop that trains what the server routes."""

    def __init__(self, config: AgentConfig, link_config: LinkConfig, clients: list[LocalClient]) -> None:
        self.config = config
        self.personalize = Choice.parse(config.personalize)  # a bad setting is refused before anything connects
        self.preset = load_preset(config.preset)
        cache = load_cache(self.preset, config.cache)
        budgets = client_budgets(clients, self.preset, cache, config.budget_macs)
        # What each client offers to evaluate for the federation's validation: above its budget, memory allowing.
        evaluate = {
            d: evaluation_macs(config.evaluate_up_to, cache, self.preset, config.torch_device, b)
            for d, b in budgets.items()
        }
        self.instance = uuid.uuid4().hex[:16]
        self.topics = Topics(config.federation)
        presence = Presence(federation=config.federation, round=0, device=config.host, state="online", role="device")
        self.link = Link(link_config, presence=presence)
        max_payload = largest_payload(self.preset)
        self.clients = {
            c.device_id: Hosted.on(
                self.link, self.topics, c, budgets[c.device_id], chunk_size=config.chunk_size, max_payload=max_payload
            )
            for c in clients
        }
        self.stop = threading.Event()
        # --threads N fixes PyTorch's threads; 0 chooses them from the free cores before each step (feast_edge.util.cores).
        self.threads = Threads(config.threads, logger=log)
        self.current_round = 0
        self.secure = SecureRounds(self.preset, self.link, self.topics, self.stop)
        self.inbox = Inbox(self.topics, self._expect_announced, on_secure=self.secure.offer)
        self.inbox.instance = self.instance
        self.registration = Registration(
            config, self.preset, self.instance, self.link, self.topics, self.clients, evaluate
        )
        self.watch = FolderWatch(self.clients, config.rescan)  # new images between rounds (feast_edge.agent.growth)
        self._receipts = Confirmations()  # uploads awaiting the server's receipt
        self.rounds = RoundRunner(
            config, self.preset, self.link, self.topics, self.inbox, self._receipts, self._metrics, self.stop
        )
        self.rounds.secure = self.secure
        self.rounds.between_steps = lambda: self.threads.refresh("training")
        self._filter = MessageFilter(config.federation)
        self._pending: dict[str, Incoming] = {}  # device -> its latest round message
        self._models: list[ModelReady] = []
        self._evaluations: list[Incoming] = []  # federated-validation requests, answered between rounds
        self._horizon: int | None = None  # the federation's rounds, from its round messages

    # ------------------------------------------------------------------ connection
    def start(self, timeout: float = 10.0) -> None:
        """Subscribe every topic (all in the one SUBSCRIBE sent on connect), then connect (LinkError with a fix)."""
        self.inbox.subscribe(self.link, self.clients, self.config.host, self.registration.say_online)
        if self.config.model_dir is not None:
            Path(self.config.model_dir).mkdir(parents=True, exist_ok=True)
            self._recover_versions()
        self.link.connect(timeout=timeout)
        classes = len(self.preset.task.classes)
        hosting = ", ".join(
            f"{d} ({c.data.samples} samples + {c.data.holdout} held out"
            + (f" + {c.data.test_samples} for testing" if c.data.test_samples else "")
            + f", {len(c.data.classes_present)} of the task's "
            f"{classes} classes, {c.budget_macs / 1e6:.2f}M MACs)"
            for d, c in self.clients.items()
        )
        log.info(
            "agent %s (instance %s) connected to %s; hosting %s",
            self.config.host,
            self.instance,
            self.link.address,
            hosting,
        )

    def close(self) -> None:
        """Leave: offline presence and DISCONNECT (none if the server refused us: the id's owner stays online)."""
        self.registration.leave()
        self.link.close()
        self.threads.close()

    def register(self, timeout: float | None = None) -> bool:
        """Register every client (False if ``stop`` was set first); AgentError when refused or no server answers."""
        timeout = self.config.register_timeout if timeout is None else timeout
        return self.registration.wait(self._process, self.stop, timeout)

    @property
    def finished(self) -> bool:
        """The server said the federation is over, for every hosted client."""
        return self.registration.finished

    @property
    def training(self) -> bool:
        """True while a client trains (a stop signal then interrupts it at once)."""
        return self.rounds.training

    @property
    def rounds_trained(self) -> int:
        return sum(c.rounds_trained for c in self.clients.values())

    # ------------------------------------------------------------------ the loop (the agent's thread)
    def run(self, max_rounds: int | None = None) -> None:
        """Serve rounds (and model announcements) until the federation finishes (unless ``stay``) or ``stop`` is set."""
        idle_since = last_note = time.monotonic()
        while not self.stop.is_set():
            self._process(
                0 if self._pending or self._models or self._evaluations else 0.2
            )  # work waiting: no idle wait
            self._receipts.check(cancelled=lambda device_id: device_id in self._pending or self.stop.is_set())
            now = time.monotonic()
            self.registration.retry(now)
            if not self.finished:  # between two steps, busy or not: a device in every round still grows
                with self._guarded("the rescan of the data folder"):
                    for grown in self.watch.poll(now):
                        self._grown(grown)
            busy = bool(self._pending or self._models or self._evaluations)
            if self.finished and not busy and not self.config.stay:
                return  # before the heartbeat: an agent that leaves never says it waits for the next run
            if not busy and now - last_note >= HEARTBEAT:
                self._heartbeat(now - idle_since)
                last_note = now
            while self._evaluations and not self.stop.is_set():
                incoming = self._evaluations.pop(0)
                with self._guarded(f"the {incoming.message.kind} request of round {incoming.message.round + 1}"):
                    self._settle(incoming)
                    self.threads.use(STEPS.get(incoming.message.kind, incoming.message.kind))
                    self.rounds.answer(self.clients[incoming.message.device], incoming)
            if self._pending:
                device_id = min(self._pending, key=lambda d: (self._pending[d].message.round, self._pending[d].at))
                incoming = self._pending.pop(device_id)
                with self._guarded(f"round {incoming.message.round + 1} of {device_id}"):
                    self._settle(incoming)
                    self.threads.use("training")
                    self.rounds.run(self.clients[device_id], incoming)
                if max_rounds is not None and self.rounds_trained >= max_rounds:
                    return
            while self._models and not self.stop.is_set():
                model = self._models.pop(0)
                with self._guarded(f"the model of {model.device}"):
                    self.threads.use("preparing the served model")
                    self._receive_model(model)
            if busy:
                idle_since = last_note = time.monotonic()  # a wait starts when the work ends, not when it began

    def summary(self) -> str:
        """One line for people: what each hosted client did in this federation."""
        ends = {(f.completed, f.rounds) for f in self.registration.ended.values()}
        done = ", ".join(f"{done} of {total} rounds" if total else f"{done} rounds" for done, total in sorted(ends))
        parts = [
            f"{device_id} trained in {c.rounds_trained} round{'s' * (c.rounds_trained != 1)}"
            + (f", model saved to {c.model_path}" if c.model_path else ", no model received")
            for device_id, c in self.clients.items()
        ]
        state = f"finished after {done}" if ends else "did not finish"
        return f"federation {self.config.federation!r} {state}: " + "; ".join(parts)

    def _grown(self, grown: Grown) -> None:
        """A client's folder changed: train on it from the next round if the server's registered count allows that
        (an update may not claim more samples than registered), else once it accepts the new counts."""
        client = self.clients[grown.device_id]
        if grown.after.samples <= client.data.samples:
            client.data, client.staged, client.accepted_at = grown.after, None, None
            when = "trains on them from its next round"
        else:
            client.staged, client.accepted_at = grown.after, None
            when = "trains on them once the server accepts their counts"
        log.info("its folder changed: %s; it registers the new counts and %s", grown.describe(), when)
        self.registration.update(grown.device_id)

    def _settle(self, incoming: Incoming) -> None:
        client = self.clients[incoming.message.device]
        if client.settle(incoming.number):
            log.info(
                "%s trains on its %d images from round %d on",
                client.device_id,
                client.data.samples,
                incoming.message.round + 1,
            )

    def _heartbeat(self, idle: float) -> None:
        server = {None: "not seen yet", True: "online", False: "offline"}[self.registration.server_online]
        last = self._horizon is not None and self.current_round + 1 >= self._horizon
        if self.finished:
            what = "the server's next run"
        else:
            what = "the end of the federation (export, models)" if last else "the next round"
        log.info(
            "waiting for %s (server %s; %d round(s) trained so far); %.0f s", what, server, self.rounds_trained, idle
        )

    def _process(self, timeout: float) -> None:
        """Handle queued messages; wait up to ``timeout`` for the first one."""
        incoming = self.inbox.get(timeout)
        while incoming is not None:
            with self._guarded(f"{incoming.message.kind} for {incoming.message.device}"):
                self._handle(incoming)
            incoming = self.inbox.get(0)

    @contextmanager
    def _guarded(self, what: str) -> Iterator[None]:
        """Whatever network input holds, a bug or bad input ends that step, never the agent (refusals do)."""
        try:
            yield
        except AgentError:
            raise
        except Exception as exc:
            log.warning("could not handle %s: %s", what, exc, exc_info=not isinstance(exc, FeastError))

    def _handle(self, incoming: Incoming) -> None:
        message = incoming.message
        if incoming.channel == "server" and isinstance(message, Presence):
            if self.registration.on_server(message):  # a restarted server: its rounds may restart from an older id
                self._filter = MessageFilter(self.config.federation)
            return
        verdict = self._filter.verdict(message)
        if verdict is not None:
            log.info("ignored %s for %s: %s", message.kind, message.device, verdict)
        elif isinstance(message, Registered):
            self.registration.on_registered(message, incoming.number)
        elif isinstance(message, Finished):
            self.registration.on_finished(message)
        elif isinstance(message, RoundStart):
            self._horizon = message.rounds or None  # 0: no end
            self._filter.advance(message.round)
            self.current_round = max(self.current_round, message.round)
            previous = self._pending.get(message.device)
            if previous is not None:
                was = previous.message.round
                log.info("round %d for %s supersedes its unstarted round %d", message.round, message.device, was)
            self._pending[message.device] = incoming
        elif isinstance(message, RoutedRequest):  # evaluate or calibrate
            self._evaluations.append(incoming)
        elif isinstance(message, ModelReady):
            self._on_model(message)
        else:
            log.info("ignored unexpected %s message for %s", message.kind, message.device)

    # ------------------------------------------------------------------ models
    def _on_model(self, message: ModelReady) -> None:
        if message.request:
            return  # answers a fetch-model request, not ours
        if not message.available:
            log.info("server: no model for %s: %s", message.device, message.reason)
        elif self.config.model_dir is None:
            file = message.manifest.get("file")
            log.info(
                "server announced the model of %s (%s); fetch it with feast-agent fetch-model", message.device, file
            )
            # The server waits for a device's report of the model it calibrates; this one keeps none (no --model-dir).
            self._metrics(message.device, {"model_round": message.manifest.get("rounds", 0), "model_kept": False})
        else:
            self._models.append(message)

    def _receive_model(self, message: ModelReady) -> None:
        """Prepare a pushed model as a version, install it only if not worse (install_gate), tell the server."""
        from feast_edge.agent.install_gate import receive_version  # onnxruntime only once a model comes
        from feast_edge.agent.model_files import pushed_blob

        assert self.config.model_dir is not None
        client = self.clients[message.device]
        blob = pushed_blob(message, client.downloads, stop=self.stop.is_set)
        if blob is None:
            return
        outcome = receive_version(
            blob,
            message,
            self.config.model_dir,
            data=client.data,
            preset=self.preset,
            federation=self.config.federation,
            personalize=self.personalize,
            torch_device=self.config.torch_device,
            threads=self.config.threads or 0,  # the latency is timed on one thread unless --threads fixes them
        )
        if outcome is None:
            return
        client.model_path = outcome.served
        report = outcome.report(self.config.federation, self.current_round, message.device)
        if report is not None:
            self.link.publish(self.topics.events(message.device), report.encode())
        self._metrics(message.device, outcome.metrics)

    def _recover_versions(self) -> None:
        """Before anything else: each client's current model complete and its own (version_store.recover)."""
        from feast_edge.agent.version_store import VersionStore

        assert self.config.model_dir is not None
        for device in self.clients:
            with self._guarded(f"the model versions of {device}"):
                store = VersionStore(self.config.model_dir, device)
                with store.locked():
                    store.recover(sweep=True)

    # ------------------------------------------------------------------ callbacks of the inbox and the round runner
    def _expect_announced(self, device_id: str, message: RoundStart | ModelReady | RoutedRequest) -> None:
        """Paho's thread: take the chunks of an announced transfer from the first one on (they follow at once)."""
        try:  # a bad description (or one over the receiver's limits) is refused, with its reason, by the agent's thread
            infos = [TransferInfo.from_dict(message.transfer)]
            if isinstance(message, Evaluate):  # its further candidate models follow the first
                infos += message.candidate_infos()
            for info in infos:
                if info.device == device_id and info.round == message.round:
                    self.clients[device_id].receiver.expect(info)
        except ProtocolError:
            pass

    def _metrics(self, device_id: str, values: dict[str, Any]) -> None:
        """Numbers for the server: a model's measurements, or where a round stands (``phase``, ``done``/``total``)."""
        metrics = Metrics(federation=self.config.federation, round=self.current_round, device=device_id, values=values)
        self.link.publish(self.topics.events(device_id), metrics.encode())
