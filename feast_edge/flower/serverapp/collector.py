"""Flower nodes as feast-edge devices, and the run loop's Collector over Flower's Grid.

NodeBook.refresh()       each new node asked once who it is ("query" -> a Register), decided on by the DeviceBook;
                         nodes that left go offline
FlowerCollector.collect  per cohort node a "train" Message (RoundStart + routed slice); each reply checked
                         (records.read_arrays, the update-norm bound) -> ClientUpdate, or declined / rejected /
                         incomplete with its reason; a reply never stops the run
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from flwr.app import Message
from flwr.serverapp import Grid

from feast_edge.errors import FeastError
from feast_edge.flower import records
from feast_edge.protocol import Declined, Register, Registered, Update
from feast_edge.route.envelope import route_state
from feast_edge.route.plans import ClientPlan
from feast_edge.run.collect import ClientUpdate, Collected
from feast_edge.server.collect import RoundTerms, registered_budget, update_of
from feast_edge.server.config import ServerConfig
from feast_edge.server.devices import DeviceBook
from feast_edge.server.waiting import WaitTimeout
from feast_edge.transport.errors import ProtocolError
from feast_edge.transport.messages import Presence

log = logging.getLogger(__name__)

POLL_SECONDS = 2.0  # how often the Grid is asked for nodes while a round waits for enough of them
QUERY_TIMEOUT = 120.0  # seconds a node has to answer the registration query (its data is read meanwhile)


def _host(node: int) -> str:
    return f"node-{node}"


class NodeBook:
    """Flower nodes as feast-edge devices: each node asked once who it is (a Register), decided on by the DeviceBook."""

    def __init__(self, grid: Grid, devices: DeviceBook, federation: str) -> None:
        self.grid, self.devices, self.federation = grid, devices, federation
        self.device_of: dict[int, str] = {}  # accepted node -> its device id
        self.answered: dict[int, str] = {}  # node -> why it takes no part (declined or refused), logged once
        self._answer: Registered | None = None

    def node(self, device: str) -> int | None:
        return next((n for n, d in self.device_of.items() if d == device), None)

    def refresh(self) -> list[str]:
        """Ask new nodes who they are, follow nodes that left; the accepted devices online, sorted."""
        nodes = set(self.grid.get_node_ids())
        for node in sorted(set(self.device_of) - nodes):
            self.devices.on_presence(self._presence(node, "offline"))
            log.info("%s (%s) left", self.device_of.pop(node), _host(node))
        new = sorted(nodes - set(self.device_of) - set(self.answered))
        if new:
            content = records.query_content(self.devices.preset, self.federation)
            asked = [Message(content, dst_node_id=n, message_type="query") for n in new]
            for reply in self.grid.send_and_receive(asked, timeout=QUERY_TIMEOUT):
                self._registration(reply)
        return self.devices.online()

    def _presence(self, node: int, state: str) -> Presence:
        return Presence(federation=self.federation, round=0, device=_host(node), state=state, role="device")

    def _registration(self, reply: Message) -> None:
        node = reply.metadata.src_node_id
        if reply.has_error():
            log.warning("%s could not answer the registration query: %s", _host(node), reply.error.reason[:200])
            return  # asked again at the next refresh
        try:
            message = records.read_message(reply.content, Register, Declined)
        except ProtocolError as exc:
            self._refuse(node, f"its answer is not a registration: {exc}")
            return
        if isinstance(message, Declined):
            self._refuse(node, f"it declined: {message.reason}")
            return
        assert isinstance(message, Register)
        if message.host != _host(node) or message.instance != str(node):
            self._refuse(node, f"it registers as host {message.host!r}, but it is {_host(node)}")
            return
        self.devices.on_presence(self._presence(node, "online"))
        self._answer = None
        self.devices.on_register(message)
        answer = self._answer
        if answer is None or not answer.accepted:
            self.devices.on_presence(self._presence(node, "offline"))
            self._refuse(node, answer.reason if answer is not None else "no answer")
            return
        self.device_of[node] = message.device

    def _refuse(self, node: int, reason: str) -> None:
        self.answered[node] = reason
        log.warning("%s takes no part in the run: %s", _host(node), reason)

    def reply(self, device: str, answer: Registered) -> None:
        """The DeviceBook's answer to the registration just handled (nothing goes back to the node)."""
        self._answer = answer


class FlowerCollector:
    """The run loop's :class:`Collector` over Flower's Grid: cohorts among accepted nodes, a Message per member."""

    def __init__(self, grid: Grid, nodes: NodeBook, terms: RoundTerms, settings: ServerConfig) -> None:
        self.grid, self.nodes, self.terms, self.settings = grid, nodes, terms, settings

    def clients(self, needed: int) -> list[str]:
        """Block until ``needed`` accepted nodes are connected (``--wait-timeout``: WaitTimeout past it)."""
        limit = self.settings.network.wait_timeout
        end = time.monotonic() + limit if limit else None
        while True:
            online = self.nodes.refresh()
            if len(online) >= needed:
                return online
            if end is not None and time.monotonic() > end:
                raise WaitTimeout(f"{len(online)} of the {needed} nodes a round needs joined within {limit:.0f} s")
            time.sleep(POLL_SECONDS)

    def fleet(self) -> list[str]:
        """Every accepted node, connected or not."""
        return [d.device_id for d in self.nodes.devices.registry.devices()]

    def budget(self, client: str) -> float:
        return registered_budget(self.nodes.devices.registry, client)

    def collect(
        self,
        t: int,
        cohort: Sequence[str],
        plans: Mapping[str, ClientPlan],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> Collected:
        began = time.monotonic()
        messages, routed = [], {}
        for device in cohort:
            node = self.nodes.node(device)
            if node is None:
                continue
            message, info = self._round(t, device, plans[device], global_state, lr)
            routed[node] = (device, plans[device], info)
            messages.append(Message(message, dst_node_id=node, message_type="train", group_id=str(t)))
        got = Collected([], send_seconds=time.monotonic() - began)
        valid: dict[str, ClientUpdate] = {}
        for reply in self.grid.send_and_receive(messages, timeout=self.settings.network.round_timeout):
            node = reply.metadata.src_node_id
            if node not in routed or routed[node][0] in valid or routed[node][0] in got.declined:
                got.ignored.append(f"{_host(node)}: a reply nobody in this round's cohort was asked for")
                continue
            device, plan, info = routed[node]
            outcome = self._reply(t, device, plan, info, reply, global_state)
            if isinstance(outcome, ClientUpdate):
                valid[device] = outcome
            else:
                kind, reason = outcome
                {"declined": got.declined, "incomplete": got.incomplete, "rejected": got.rejected}[kind][device] = (
                    reason
                )
                log.warning("round %d: no update from %s (%s): %s", t + 1, device, kind, reason)
        got.updates = [valid[d] for d in sorted(valid)]
        settled = set(valid) | set(got.declined) | set(got.incomplete) | set(got.rejected)
        got.missing = [d for d in cohort if d not in settled]
        return got

    def _round(
        self, t: int, device: str, plan: ClientPlan, global_state: Mapping[str, torch.Tensor], lr: float
    ) -> tuple[Any, Any]:
        """The train content for ``device``: its RoundStart and routed slice; and the routed slice's transfer."""
        terms = self.terms
        state = records.wire(
            route_state(global_state, plan.layout(terms.preset, terms.preset.classes), terms.preset),
            terms.payload_dtype,
        )
        info = records.describe(state, federation=self.nodes.federation, round=t, device=device, kind="routed")
        registered = self.nodes.devices.registry.get(device)
        start = terms.round_start(
            plan, self.nodes.federation, t, device, registered, info, self.settings.network.round_timeout, lr
        )
        return records.train_content(start, state), info

    def _reply(
        self,
        t: int,
        device: str,
        plan: ClientPlan,
        routed: Any,
        reply: Message,
        global_state: Mapping[str, torch.Tensor],
    ) -> ClientUpdate | tuple[str, str]:
        """A node's reply to round ``t``: its valid update, or (declined | incomplete | rejected, why)."""
        if reply.has_error():
            return "incomplete", f"the ClientApp failed: {reply.error.reason[:300]}"
        try:
            message = records.read_message(reply.content, Update, Declined)
            if isinstance(message, Declined):
                return "declined", message.reason
            assert isinstance(message, Update)
            if (message.device, message.round, message.routed) != (device, t, routed.transfer):
                return (
                    "rejected",
                    f"its update answers {message.device!r} round {message.round + 1}, not this round's slice",
                )
            registered = self.nodes.devices.registry.get(device)
            if registered is None or not 1 <= message.samples <= registered.samples:
                return (
                    "rejected",
                    f"it reports {message.samples} examples; it registered {registered.samples if registered else 0}",
                )
            arrays = reply.content.array_records.get(records.UPDATE)
            if arrays is None:
                return "rejected", 'its update carries no trained slice (ArrayRecord "update")'
            state = records.read_arrays(
                arrays, self.terms.preset, plan.envelope, self.terms.payload_dtype, message.transfer_info()
            )
        except (FeastError, ProtocolError) as exc:
            return "rejected", str(exc)
        except Exception as exc:  # noqa: BLE001 - whatever a reply holds, it is the reply's fault: refuse it, never stop
            return "rejected", f"unreadable reply ({type(exc).__name__})"
        checked = update_of(
            device,
            state,
            message,
            global_state,
            self.terms.max_update_norm,
            self_reported=device not in self.nodes.devices.shard_samples,
        )
        return ("rejected", checked) if isinstance(checked, str) else checked
