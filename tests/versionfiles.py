"""A device's model versions made on disk the way feast-agent run leaves them, without models: files with the layout the
agent writes (an ONNX file and its manifest holding its SHA-256, a personal pair naming the served file's hash),
received through the store as feast_edge.agent.install_gate does. The store never reads a model: it moves and verifies
files, so bytes stand in for ONNX graphs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from feast_edge.agent.held_versions import HeldVersion
from feast_edge.agent.version_store import VersionStore
from feast_edge.versions.gate import INSTALLED, REFUSED


def write_model(folder: Path, device: str, payload: bytes, version: int | None, personal: bytes | None = None) -> None:
    """A served model's files as the agent writes them into ``folder`` (and a personal pair when given)."""
    (folder / f"{device}.onnx").write_bytes(payload)
    served = hashlib.sha256(payload).hexdigest()
    manifest = {"sha256": served, "federation": "lab", "rounds": 7, **({"model_version": version} if version else {})}
    (folder / f"{device}.json").write_text(json.dumps(manifest))
    if personal is not None:
        (folder / f"{device}.personal.onnx").write_bytes(personal)
        about = {"sha256": hashlib.sha256(personal).hexdigest(), "served_sha256": served}
        (folder / f"{device}.personal.json").write_text(json.dumps(about))


def receive(
    store: VersionStore,
    payload: bytes,
    version: int,
    *,
    install: bool = True,
    personal: bytes | None = None,
    federation: str = "lab",
    **fields: object,
) -> HeldVersion:
    """What install_gate does around its decision: a folder, the prepared files, recover, commit."""
    folder = store.begin()
    write_model(folder, store.device, payload, version, personal)
    record = HeldVersion(
        seq=0,
        federation=federation,
        version=version,
        round=7,
        rounds=7,
        decision=INSTALLED if install else REFUSED,
        at=1.0e9,
        **fields,  # type: ignore[arg-type]
    )
    with store.locked():
        store.recover()
        return store.commit(folder, record, install=install)
