"""feast-edge's Flower ClientApp: a SuperNode trains FEAST's routed slices on its own data, as ``feast-agent`` does.

    query   -> a Register: the node's device id, MAC budget, training examples and the task its data was checked
               against (or a Declined with the reason: no data, data that violates the task, another feast-edge)
    train   -> the RoundStart and routed slice checked (``records.read_arrays``), the agent's own step
               (``feast_edge.agent.step.train_state``: ``client_update`` on the node's data), an Update and the
               trained slice back; or a Declined with the reason
    evaluate -> (run config ``personalize``, after the last round) the node's served variant checked
               (``records.ServedVariant.read``), its BN calibrated on the node's training split where the ServerApp
               holds no data, then the agent's personalization step (``personal_step``) on the node's training
               split, counted on its held-out split: the counts back (MetricRecord "personal"); or a Declined
    evaluate -> (a validated round of a run without server data: ``validation_records.is_validation``) the routed
               slice checked (``validation_records.read_validation``), each target variant BN-recalibrated on the
               node's training split (class-balanced) and counted on its held-out split (``held_out_counts``, as the
               agent's ``answer_evaluation``): an Evaluated back; a node without a held-out split declines

The node's settings come from ``flower-supernode --node-config`` (Flower's simulation sets ``partition-id``):

    data       what ``feast-agent run --data`` takes: an image folder, manifest CSV, CIFAR or Fashion-MNIST folder,
               a shard file or partition directory from ``feast-edge partition`` (required)
    profile    a device profile (name or .json) for the MAC budget; or
    budget     a MAC budget (25M, 1.5G); a shard file carries its own
    name       the device id (default: the shard's client id, else ``node-<node id>``)
    shard      "i/N" of a shared folder; partition-id / offset: which client of a partition directory
    holdout    the share of the node's own examples held out (default: feast-agent's)
    device     cpu, cuda, cuda:1, auto (default cpu); threads: torch CPU threads (0: torch's default)

The preset is the run's (``[tool.flwr.app.config] preset``), so every node trains what the ServerApp routes. On
Flower's Simulation Engine (node config: ``partition-id`` only) the run config's ``node-data``, a partition
directory written by ``feast-edge partition``, gives each simulated node its shard, and ``node-holdout`` the share
of it held out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from feast_edge import __version__
from feast_edge.agent.local_data import LocalClient, client_budgets, load_clients
from feast_edge.agent.step import Assignment, Declined, Job, train_state
from feast_edge.budget.derive import parse_macs
from feast_edge.budget.profile import load_profile, profile_summary
from feast_edge.cache.variants import VariantCache, load_cache
from feast_edge.errors import FeastError
from feast_edge.evaluate.federated import calibrated_static, held_out_counts, routed_supernet
from feast_edge.flower import log_to_stderr, records, validation_records
from feast_edge.local.torch_device import resolve_device
from feast_edge.personalize.fleet import OwnRow
from feast_edge.personalize.select import personal_step
from feast_edge.protocol import MAX_REASON, Register, RoundStart, Update
from feast_edge.protocol import Declined as DeclinedMessage
from feast_edge.space.cost import count_macs
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import Preset, load_preset
from feast_edge.transport.errors import ProtocolError, TopicError
from feast_edge.transport.topics import validate_id

log = logging.getLogger(__name__)

NODE_KEYS = ("data", "profile", "budget", "name", "shard", "offset", "partition-id", "holdout", "device", "threads")
REGISTRATION = "registration"  # the "routed" id a declined registration names
PERSONALIZATION = "personalization"  # the "routed" id a declined evaluate message names
VALIDATION = "validation"  # the "routed" id a declined validation names when its own is unreadable
MAX_CALIBRATION = 100_000  # training examples a served variant is calibrated on at most (the agent's bound)


@dataclass(frozen=True)
class Node:
    """What this SuperNode brings: its client (device id and data), budget, serving precision and profile."""

    client: LocalClient
    preset: Preset
    cache: VariantCache
    budget_macs: int
    precision: str
    profile: dict[str, Any]
    torch_device: str


_nodes: dict[tuple[Any, ...], Node] = {}  # one load per node config and preset in this process
_lock = threading.Lock()


def _text(config: Mapping[str, Any], key: str) -> str | None:
    value = config.get(key)
    return None if value is None or value == "" else str(value)


def node_of(node_config: Mapping[str, Any], run_config: Mapping[str, Any], node_id: int) -> Node:
    """This node's client from its node config (read once per process); FeastError naming the key and the fix."""
    unknown = sorted(set(node_config) - set(NODE_KEYS) - {"num-partitions"})
    key = (
        tuple(sorted((k, str(v)) for k, v in node_config.items())),
        str(run_config.get("preset")),
        str(run_config.get("node-holdout")),
        node_id,
    )
    with _lock:
        if key in _nodes:
            return _nodes[key]
        if unknown:
            log.warning("node config keys %s are not feast-edge's (%s); ignored", unknown, ", ".join(NODE_KEYS))
        data = _text(node_config, "data") or _simulated_data(node_config, run_config)
        if data is None:
            raise FeastError(
                "this SuperNode has no data: start it with --node-config \"data='/path/to/images' profile='NAME'\" "
                "(an image folder, manifest CSV, Fashion-MNIST folder, or a shard from feast-edge partition)"
            )
        if _text(node_config, "profile") and _text(node_config, "budget"):
            raise FeastError("node config: give either profile or budget, not both (a profile carries its budget)")
        preset = load_preset(str(run_config.get("preset") or "fmnist-small"))
        cache = load_cache(preset, _text(run_config, "cache"))
        profile = load_profile(str(node_config["profile"])) if _text(node_config, "profile") else None
        if profile is not None and profile.preset != preset.name:
            raise FeastError(
                f"node config: profile {profile.name} was derived for preset {profile.preset}, the run trains "
                f"{preset.name}; re-profile with 'feast-agent profile --preset {preset.name}'"
            )
        offset = int(node_config.get("offset", node_config.get("partition-id", 0)) or 0)
        holdout = float(node_config["holdout"]) if _text(node_config, "holdout") else None
        if holdout is None and not _text(node_config, "data") and _text(run_config, "node-holdout"):
            holdout = float(run_config["node-holdout"])  # a simulated node's share of its node-data shard
        name = _text(node_config, "name") or f"node-{node_id}"
        hosted = load_clients(data, name, 1, _text(node_config, "shard"), offset, task=preset.task, holdout=holdout)
        budget = parse_macs(str(node_config["budget"])) if _text(node_config, "budget") else None
        budget = budget if budget is not None else (profile.budget_macs if profile is not None else None)
        budgets = client_budgets(hosted, preset, cache, budget)
        client = hosted[0]
        threads = int(node_config.get("threads", 0) or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        node = Node(
            client=client,
            preset=preset,
            cache=cache,
            budget_macs=budgets[client.device_id],
            precision=profile.precision if profile is not None and budget is None else "fp32",
            profile=profile_summary(profile) if profile is not None else {},
            torch_device=str(resolve_device(str(node_config.get("device") or "cpu"))),
        )
        _nodes[key] = node
        return node


def _simulated_data(node_config: Mapping[str, Any], run_config: Mapping[str, Any]) -> str | None:
    """On Flower's Simulation Engine a node config holds only ``partition-id``: its data is then the run config's
    ``node-data`` (a partition directory from ``feast-edge partition``), client ``partition-id`` of it."""
    if "partition-id" in node_config and _text(run_config, "node-data"):
        return str(run_config["node-data"])
    return None


def _version_problem(message: Message) -> str:
    server = records.sent_field(message.content, "feast_edge")
    if server == __version__:
        return ""
    return (
        f"this SuperNode runs feast-edge {__version__}, the ServerApp {server or 'an unknown version'}: "
        "install the same feast-edge version on every SuperNode and where the ServerApp runs"
    )


def _federation(message: Message) -> str:
    """The federation the ServerApp names (a valid id), else "flower"."""
    name = records.sent_field(message.content, "federation")
    try:
        return validate_id(name, "federation id")
    except TopicError:
        return "flower"


def _declined(message: Message, *, round: int, device: str, routed: str, reason: str) -> Message:
    declined = DeclinedMessage(
        federation=_federation(message),
        round=round,
        device=device,
        routed=routed,
        reason=reason[:MAX_REASON] or "declined",
    )
    return Message(records.reply_content(declined), reply_to=message)


app = ClientApp()


@app.query()
def register(message: Message, context: Context) -> Message:
    """Answer the ServerApp's question once: this node's Register, or why it cannot take part."""
    log_to_stderr()
    fallback = f"node-{context.node_id}"
    problem = _version_problem(message)
    if problem:
        return _declined(message, round=0, device=fallback, routed=REGISTRATION, reason=problem)
    try:
        node = node_of(context.node_config, context.run_config, context.node_id)
    except FeastError as exc:
        log.error("this SuperNode cannot take part: %s", exc)
        return _declined(message, round=0, device=fallback, routed=REGISTRATION, reason=str(exc))
    client = node.client
    registration = Register.for_client(
        federation=_federation(message),
        device_id=client.device_id,
        host=fallback,
        instance=str(context.node_id),
        preset=node.preset,
        budget_macs=node.budget_macs,
        samples=client.samples,
        profile=node.profile,
        holdout=client.holdout,
        precision=node.precision,
        # Per class, as the agent registers them: the ServerApp's validation explains a node's figures by its classes.
        class_counts=_per_class(client.labels, node.preset.classes),
        holdout_counts=_per_class(client.holdout_labels, node.preset.classes),
    )
    return Message(records.reply_content(registration), reply_to=message)


def _per_class(labels: torch.Tensor, classes: int) -> tuple[int, ...]:
    """Examples per class of ``labels``, for every class of the task."""
    return tuple(int(n) for n in torch.bincount(labels.long(), minlength=classes)[:classes].tolist())


@app.train()
def train(message: Message, context: Context) -> Message:
    """One round: the routed slice trained on this node's data (the MQTT agent's step), or why not."""
    log_to_stderr()
    fallback = f"node-{context.node_id}"
    try:
        start = records.read_message(message.content, RoundStart)
    except ProtocolError as exc:
        return _declined(message, round=0, device=fallback, routed=REGISTRATION, reason=f"refused the round: {exc}")
    assert isinstance(start, RoundStart)
    routed_id = str(start.transfer.get("transfer", REGISTRATION))[:64] if isinstance(start.transfer, dict) else ""
    where = dict(round=start.round, device=start.device, routed=routed_id or REGISTRATION)
    problem = _version_problem(message)
    if problem:
        return _declined(message, **where, reason=problem)
    try:
        node = node_of(context.node_config, context.run_config, context.node_id)
        if start.device != node.client.device_id:
            raise FeastError(f"the round is for device {start.device!r}; this SuperNode is {node.client.device_id!r}")
        assignment = Assignment.parse(start, node.preset)
        routed_record = message.content.array_records.get(records.ROUTED)
        if routed_record is None:
            raise FeastError('the round carries no routed slice (ArrayRecord "routed")')
        routed = records.read_arrays(
            routed_record, node.preset, assignment.plan.envelope, start.payload_dtype, assignment.transfer
        )
        job = Job.of_state(assignment, routed, node.client, node.preset, node.torch_device, "off")
    except (FeastError, ProtocolError) as exc:
        log.error("round %d: refused the round for %s: %s", start.round + 1, start.device, exc)
        return _declined(message, **where, reason=f"refused the round: {exc}")
    log.info(
        "%s: %s trains %d variants on %d examples",
        job.shown,
        job.device_id,
        len(job.plan.affordable),
        node.client.samples,
    )
    trained = train_state(job)
    if isinstance(trained, Declined):
        return _declined(message, **where, reason=trained.reason)
    try:
        state = records.wire(trained.state, start.payload_dtype)
    except FeastError as exc:
        return _declined(message, **where, reason=f"the update cannot be encoded: {exc}")
    info = records.describe(state, federation=start.federation, round=start.round, device=start.device, kind="update")
    update = Update.from_result(
        trained.result,
        federation=start.federation,
        round=start.round,
        device_id=start.device,
        transfer=info,
        routed=assignment.transfer.transfer,
        compute_seconds=trained.compute_seconds,
        torch_device=node.torch_device,
    )
    return Message(records.update_content(update, state), reply_to=message)


def validate(message: Message, context: Context) -> Message:
    """A validated round of a run without server data: each target of the routed slice BN-recalibrated on this node's
    training split (class-balanced) and counted on its held-out split, as the agent's ``answer_evaluation`` does; the
    counts back (never an example), or why not (a node without a held-out split declines)."""
    where = {"round": 0, "device": f"node-{context.node_id}", "routed": VALIDATION}
    problem = _version_problem(message)
    if problem:
        return _declined(message, **where, reason=problem)
    try:
        node = node_of(context.node_config, context.run_config, context.node_id)
        client = node.client
        where["device"] = client.device_id
        asked = validation_records.read_validation(message.content, node.preset)
        where.update(round=asked.request.round, routed=asked.request.transfer_info().transfer)
        if asked.request.device != client.device_id:
            raise FeastError(
                f"the validation is for device {asked.request.device!r}; this SuperNode is {client.device_id!r}"
            )
        affordable = {e.arch for e in node.cache.affordable(node.budget_macs)}
        if not all(arch in affordable for arch in asked.targets):
            raise FeastError("it names a variant above this node's MAC budget")
    except (FeastError, ProtocolError) as exc:
        log.error("validation: refused the request: %s", exc)
        return _declined(message, **where, reason=f"refused the validation: {exc}")
    if client.holdout == 0 or client.samples == 0:
        reason = (
            "this node holds no examples out to validate on (node config holdout, or run config node-holdout on "
            "Flower's Simulation Engine)"
        )
        return _declined(message, **where, reason=reason)
    began = time.perf_counter()
    examples = min(asked.request.calibration, MAX_CALIBRATION)
    counted = [
        held_out_counts(
            routed_supernet(node.preset, asked.plan, routed),
            asked.targets,
            client.images,
            client.holdout_images,
            client.holdout_labels,
            examples,
            node.torch_device,
            train_labels=client.labels,
        )
        for routed in [asked.routed, *asked.candidates]  # the round's model, then each further candidate
    ]
    log.info(
        "round %d: %s validated %d variant(s) of %d candidate model(s) on its %d held-out examples (%.1f s)",
        asked.request.round + 1,
        client.device_id,
        len(counted[0]),
        len(counted),
        client.holdout,
        time.perf_counter() - began,
    )
    return Message(asked.answer(counted[0], min(examples, client.samples), counted[1:]), reply_to=message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """After the last round: the node's served variant personalized on its training split and both counted on its
    held-out split (the device agent's ``personal_step``); the counts back, or why not. A validation request (a run
    without server data) is answered by ``validate``."""
    log_to_stderr()
    if validation_records.is_validation(message.content):
        return validate(message, context)
    where = {"round": 0, "device": f"node-{context.node_id}", "routed": PERSONALIZATION}
    problem = _version_problem(message)
    if problem:
        return _declined(message, **where, reason=problem)
    try:
        node = node_of(context.node_config, context.run_config, context.node_id)
        client = node.client
        where["device"] = client.device_id
        asked, served = records.ServedVariant.read(message.content, node.preset)
        if asked.device != client.device_id:
            raise FeastError(
                f"the served variant is for device {asked.device!r}; this SuperNode is {client.device_id!r}"
            )
        if asked.calibration == "device":  # the ServerApp holds no data: BN on this node's own training split
            if client.samples == 0:
                raise FeastError("this node has no training examples to calibrate BN on")
            examples = min(asked.calibration_samples, MAX_CALIBRATION)
            calibrated_static(served, node.preset, client.images, examples, labels=client.labels)
    except (FeastError, ProtocolError) as exc:
        log.error("personalization: refused the served variant: %s", exc)
        return _declined(message, **where, reason=f"refused the served variant: {exc}")
    began = time.perf_counter()
    outcome, own = personal_step(
        served,
        client.images,
        client.labels,
        client.holdout_images,
        client.holdout_labels,
        node.preset,
        asked.choice,
        seed=asked.seed,
        device=node.torch_device,
    )
    macs = count_macs(arch_layout(node.preset, asked.arch))
    row = OwnRow.of(client.device_id, macs, outcome, own, time.perf_counter() - began)
    tuned = "" if row.tuned is None else row.tuned.words()
    log.info(
        "%s: %s; held-out: %d/%d right served, %d personal%s",
        client.device_id,
        outcome.reason,
        own.served,
        own.examples,
        own.personal,
        f"; {tuned}" if tuned else "",
    )
    return Message(records.personal_content(row), reply_to=message)
