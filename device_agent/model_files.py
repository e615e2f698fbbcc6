"""A device's exported model: receive it (pushed, or fetch-model), verify its SHA-256, save it, time it in onnxruntime."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feast_edge.agent.downloads import Downloads
from feast_edge.agent.local_data import LocalClient
from feast_edge.agent.on_device import calibrate_served_variant
from feast_edge.agent.threads import latency_threads
from feast_edge.errors import FeastError
from feast_edge.evaluate.onnx_export import measure_latency
from feast_edge.personalize.select import Choice
from feast_edge.protocol import ModelReady, ModelRequest
from feast_edge.space.preset import Preset
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.chunks import Reassembler, Status
from feast_edge.transport.errors import ProtocolError, TopicError
from feast_edge.transport.frames import DEFAULT_CHUNK_SIZE, TransferInfo
from feast_edge.transport.link import Link, Received
from feast_edge.transport.messages import parse
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import ChunkReceiver
from feast_edge.util.atomic import atomic_write_bytes, check_writable

log = logging.getLogger(__name__)

REQUEST_RETRY = 3.0  # seconds between repeats of a model request nobody answered yet


class ModelError(FeastError):
    """A model could not be fetched, verified or run."""


def save_model(blob: bytes, manifest: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Check ``blob`` against the manifest's SHA-256, then write it and the manifest (``.json`` beside it) atomically."""
    digest = hashlib.sha256(blob).hexdigest()
    if digest != manifest.get("sha256"):
        raise ModelError(
            f"the received model hashes to {digest}, its manifest says {manifest.get('sha256')}; it was not saved, fetch it again"
        )
    path = check_writable(path, "model file")
    atomic_write_bytes(path, blob)
    atomic_write_bytes(path.with_suffix(".json"), (json.dumps(manifest, indent=1) + "\n").encode())
    return path


def keep_model(
    blob: bytes, manifest: dict[str, Any], path: str | os.PathLike[str], threads: int = 0
) -> tuple[Path, dict[str, float]]:
    """Save a received model (SHA-256 checked) and time it in onnxruntime (``threads``: --threads): its path and latency."""
    saved = save_model(blob, manifest, path)
    return saved, measure_latency(saved, threads=latency_threads(threads))


def keep_pushed_model(
    blob: bytes, message: ModelReady, model_dir: str | os.PathLike[str], threads: int = 0
) -> tuple[Path, dict[str, Any]] | None:
    """Save a model the server pushed after the last round; its path and the metrics to report, or None (logged) if unusable."""
    device_id, manifest = message.device, message.manifest
    try:
        path, latency = keep_model(blob, manifest, Path(model_dir) / f"{device_id}.onnx", threads)
    except FeastError as exc:
        log.error("the model of %s is unusable: %s", device_id, exc)
        return None
    log.info(
        "saved the model of %s to %s (%s MACs); onnxruntime latency %.3f ms",
        device_id,
        path,
        manifest.get("macs"),
        latency["median_ms"],
    )
    return path, {
        "onnx_latency_ms": latency["median_ms"],
        "model_sha256": manifest.get("sha256"),
        "model_macs": manifest.get("macs"),
    }


def pushed_blob(
    message: ModelReady, downloads: Downloads, stop: Callable[[], bool], timeout: float = 120.0
) -> bytes | None:
    """Wait for the model announced by ``message``; None (logged) if it did not arrive."""
    blob = downloads.wait(TransferInfo.from_dict(message.transfer), time.monotonic() + timeout, abandon=stop)
    if blob is None:
        log.error("the model of %s did not arrive; fetch it with feast-agent fetch-model", message.device)
    return blob


def prepare_pushed_model(
    blob: bytes,
    message: ModelReady,
    folder: str | os.PathLike[str],
    *,
    data: LocalClient,
    preset: Preset,
    personalize: Choice | None = None,
    torch_device: str = "cpu",
    threads: int = 0,
) -> tuple[Path, dict[str, Any]] | None:
    """Keep a pushed model in ``folder`` (a version's own, feast_edge.agent.version_store): an ONNX file as it is
    (:func:`keep_pushed_model`), a variant's weights calibrated on ``data`` first (``on_device.calibrate_served_variant``,
    which also writes the personal model when ``personalize`` is given); its served file's path and the metrics to
    report, or None (logged) if unusable. ``threads``: --threads."""
    if message.manifest.get("calibration") not in ("device", "federated"):
        kept = keep_pushed_model(blob, message, folder, threads)
        if kept is not None and personalize is not None and personalize.method != "off":
            # An ONNX file the server exported (it holds data): the device has no weights to personalize.
            why = "the server exported this model as ONNX (it holds data): personalization needs the variant's weights, which a server without data sends"
            log.info("%s keeps the served model alone: %s", message.device, why)
            kept[1].update({"personal_method": "", "personal_reason": why, "personal_accuracy": None})
        return kept
    try:
        return calibrate_served_variant(
            blob,
            message.manifest,
            data,
            preset,
            Path(folder) / f"{message.device}.onnx",
            personalize=personalize,
            torch_device=torch_device,
            threads=threads,
        )
    except FeastError as exc:
        log.error("the model of %s is unusable: %s", message.device, exc)
        return None


@dataclass(frozen=True)
class FetchedModel:
    path: Path
    manifest: dict[str, Any]
    latency: dict[str, float]


def _ask(link: Link, topic: str, request: bytes, replies: queue.Queue[ModelReady], timeout: float) -> ModelReady | None:
    """Publish ``request`` every few seconds until a reply arrives (a server that starts later still hears it) or ``timeout``."""
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        link.publish(
            topic, request, timeout=min(remaining, 10.0)
        )  # the same msg_id each time: a server answers it once
        try:
            return replies.get(timeout=min(REQUEST_RETRY, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            continue
    return None


def _manifest_preset(manifest: dict) -> Preset:
    """The preset a model manifest names, loaded here by name (built in, or on FEAST_EDGE_PRESET_PATH)."""
    from feast_edge.errors import PresetError
    from feast_edge.space.preset import load_preset

    name = manifest.get("preset")
    # A name from the network, never a path: load_preset would also open a .toml file it names.
    if (
        not isinstance(name, str)
        or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name)
        or name.endswith(".toml")
    ):
        raise ModelError("the model manifest names no valid preset; pass --preset with the server's preset")
    try:
        return load_preset(name)
    except PresetError as exc:
        raise ModelError(
            f"the model is a variant of preset {name!r}, which this device does not have ({exc}); pass --preset "
            "with the server's preset file"
        ) from None


def fetch_model(
    link_config: LinkConfig,
    federation: str,
    device_id: str,
    out: str | os.PathLike[str],
    *,
    timeout: float = 30.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    repeats: int = 50,
    data: Callable[[Preset], LocalClient] | None = None,
    preset: Preset | None = None,
    threads: int = 0,
) -> FetchedModel:
    """Ask the server for ``device_id``'s ONNX model, download it in chunks, verify, save and time it.

    A server without data sends the variant's weights instead (``"calibration": "device"``): they are calibrated
    on ``data(preset)`` (this device's own, read for that preset's task) and exported here, as ``feast-agent run
    --model-dir`` does. ``preset``: the one the device trains; None takes the preset the model's manifest names.
    ``threads``: --threads (PyTorch's is set by the caller; the latency is timed on :func:`latency_threads`)."""
    out = check_writable(out, "model file")
    topics = Topics(federation)
    replies: queue.Queue[ModelReady] = queue.Queue()
    request = ModelRequest(federation=federation, round=0, device=device_id)

    def on_ctrl(received: Received) -> None:
        try:
            message = parse(received.payload)
        except ProtocolError as exc:
            log.warning("dropped malformed message on %s: %s", received.topic, exc)
            return
        if isinstance(message, ModelReady) and message.device == device_id and message.request == request.msg_id:
            replies.put(message)

    link = Link(link_config)  # no presence: this is a tool, not the device's agent
    try:
        topics.ctrl(device_id)
    except TopicError as exc:
        raise ModelError(f"--device-id: {exc}") from None
    link.subscribe(topics.ctrl(device_id), on_ctrl)
    link.connect(timeout=min(timeout, 10.0))
    try:
        receiver = ChunkReceiver(
            link,
            topics,
            "down",
            device=device_id,
            reassembler=Reassembler(federation=federation, max_chunk_size=chunk_size),
        )
        answer = _ask(link, topics.events(device_id), request.encode(), replies, timeout)
        if answer is None:
            raise ModelError(
                f"no feast-server answered the model request of {device_id} on federation {federation!r} within {timeout:g} s; "
                "is 'feast-server run --serve' or 'feast-server serve' running there with the same --federation?"
            )
        if not answer.available:
            raise ModelError(f"the server has no model for {device_id}: {answer.reason}")
        info = TransferInfo.from_dict(answer.transfer)
        receiver.expect(info)
        deadline = time.monotonic() + max(timeout, 60.0)
        blob = None
        while blob is None:
            remaining = deadline - time.monotonic()
            progress = receiver.get(timeout=max(0.0, remaining)) if remaining > 0 else None
            if progress is None:
                raise ModelError(
                    f"the model of {device_id} ({info.size} bytes) did not arrive completely within {max(timeout, 60.0):g} s; try again"
                )
            if progress.info.transfer != info.transfer:
                continue
            if progress.status is not Status.COMPLETE or progress.payload is None:
                raise ModelError(f"the model transfer was rejected: {progress.reason}; try again")
            blob = progress.payload
    finally:
        link.close()
    if answer.manifest.get("calibration") in ("device", "federated"):
        if data is None:
            raise ModelError(
                f"the server holds no data: the model of {device_id} is exported on the device; pass --data "
                "(this device's data, as for feast-agent run) to export it here and measure it on its held-out split"
            )
        if preset is None:
            preset = _manifest_preset(answer.manifest)
        path, _ = calibrate_served_variant(blob, answer.manifest, data(preset), preset, out, threads=threads)
        manifest = json.loads(path.with_suffix(".json").read_text())
        return FetchedModel(path, manifest, measure_latency(path, repeats=repeats, threads=latency_threads(threads)))
    path = save_model(blob, answer.manifest, out)
    return FetchedModel(path, answer.manifest, measure_latency(path, repeats=repeats, threads=latency_threads(threads)))
