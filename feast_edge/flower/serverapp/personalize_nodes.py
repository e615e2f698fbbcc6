"""The ServerApp's last step with run config ``personalize``: every accepted node personalizes its served variant.

served variant   the largest cached variant the node's budget affords, of the checkpoint the run serves (the best
                 if validated, else the last); BN calibrated on the ServerApp's data (``calibrated_variant``, as
                 ``feast-edge simulate`` does), or by the node on its own training split where the run holds none
evaluate         one Message per node (``records.ServedVariant``); the ClientApp runs ``personal_step`` and
                 answers its held-out counts, checked here against what the node registered
personalization.json in the run directory: every node's row (with the classes its personal model was tuned to), and
                 the mean and worst decile of the nodes' own held-out accuracy, served and personal
                 (``feast_edge.personalize.fleet``); a line per node whose personal model was tuned to fewer classes
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

from flwr.app import Message

from feast_edge.evaluate.evaluation import calibrated_variant
from feast_edge.flower import records
from feast_edge.flower.serverapp.collector import NodeBook
from feast_edge.personalize.fleet import OwnRow, personalization_record, tuned_lines
from feast_edge.personalize.select import Choice
from feast_edge.protocol import Declined
from feast_edge.run.checkpoint import load_supernet, read_record
from feast_edge.server.host import RunHost
from feast_edge.space.arch import Arch
from feast_edge.space.extract import extract
from feast_edge.space.static import StaticResNet
from feast_edge.transport.errors import ProtocolError
from feast_edge.util.atomic import atomic_write_bytes

log = logging.getLogger(__name__)

PERSONALIZATION = "personalization.json"


def personalize_nodes(host: RunHost, nodes: NodeBook, choice: Choice) -> dict[str, Any]:
    """Ask every node ``nodes`` accepted into ``host``'s run to personalize its served variant; write and return the
    personalization record."""
    config = host.config
    source = host.loop.selected_checkpoint()
    model = load_supernet(source, host.preset)[0]
    rounds = int(read_record(source).get("fields", {}).get("round", 0))
    where = "device" if host.data is None else "server"
    served: dict[Arch, StaticResNet] = {}
    messages, asked = [], {}
    serving = host.serving(nodes.devices.registry.devices())  # the variant each device was served (its export's rule)
    for node, device in sorted(nodes.device_of.items()):
        registered = nodes.devices.registry.get(device)
        if registered is None or device not in serving:
            continue
        entry = host.cache.entries[serving[device].index]
        if entry.arch not in served:
            served[entry.arch] = (
                extract(model, entry.arch)
                if host.data is None
                else calibrated_variant(model, entry.arch, host.data.calibration_images).cpu()
            )
        request = records.ServedVariant(
            federation=config.federation,
            device=device,
            arch=entry.arch,
            choice=choice,
            calibration=where,
            calibration_samples=config.validation.calib_samples,
            seed=config.seed,
            rounds=rounds,
        )
        messages.append(Message(request.content(served[entry.arch]), dst_node_id=node, message_type="evaluate"))
        asked[node] = (device, int(registered.profile.get("holdout", 0) or 0), int(entry.macs))
    rows: list[OwnRow] = []
    refused: dict[str, str] = {}
    for reply in nodes.grid.send_and_receive(messages, timeout=config.network.round_timeout):
        node = reply.metadata.src_node_id
        if node not in asked or asked[node][0] in refused or any(r.client == asked[node][0] for r in rows):
            continue
        device, holdout, macs = asked[node]
        outcome = _row(reply, device, holdout, host.preset.task.classes)
        if isinstance(outcome, OwnRow):
            rows.append(replace(outcome, served_macs=macs))  # the variant the ServerApp sent, whatever the node says
        else:
            refused[device] = outcome
            log.warning("personalization: no counts from %s: %s", device, outcome)
    answered = {r.client for r in rows} | set(refused)
    for device, _, _ in asked.values():
        if device not in answered:
            refused[device] = "no answer"
    record = personalization_record(
        rows,
        str(choice),
        calibration=where,
        calibration_samples=config.validation.calib_samples
        if where == "device"
        else int(host.data.calibration_images.shape[0]),
        checkpoint=source.name,
        rounds=rounds,
        seed=config.seed,
        refused=dict(sorted(refused.items())),
    )
    atomic_write_bytes(host.out / PERSONALIZATION, (json.dumps(record, indent=1) + "\n").encode())
    _log_summary(record["summary"])
    for line in tuned_lines(record["clients"]):  # what the nodes' personal models forgot
        log.info("personalization: %s", line)
    return record


def _row(reply: Message, device: str, holdout: int, names: tuple[str, ...]) -> OwnRow | str:
    """A node's evaluate reply as its row, or why it holds none (declined, failed, impossible counts)."""
    if reply.has_error():
        return f"the ClientApp failed: {reply.error.reason[:300]}"
    if records.PERSONAL not in reply.content.metric_records:
        try:
            declined = records.read_message(reply.content, Declined)
        except ProtocolError as exc:
            return f"its answer holds no counts: {exc}"
        return f"it declined: {declined.reason}"
    try:
        row = records.read_personal(reply.content, holdout, names)
    except ProtocolError as exc:
        return f"its counts were refused: {exc}"
    if row.client != device:
        return f"its counts are for {row.client!r}"
    return row


def _log_summary(summary: dict[str, Any]) -> None:
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.2f}%"

    log.info(
        "personalization (%s): own held-out accuracy over %d nodes, mean %s served -> %s personal, worst decile %s "
        "-> %s; %d of %d chose a personal model (%d tuned to fewer than all the task's classes), %.1f s of device time",
        summary["choice"],
        summary["measured"],
        pct(summary["served_mean"]),
        pct(summary["personal_mean"]),
        pct(summary["served_worst_decile"]),
        pct(summary["personal_worst_decile"]),
        summary["personalized"],
        summary["clients"],
        summary["tuned_to_fewer_classes"],
        summary["device_seconds_total"],
    )
