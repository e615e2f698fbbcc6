"""The versions a device holds on disk (feast_edge.agent.version_store): installs keep the current and the previous
version's files, refusals keep a record only, the history is bounded, and a power loss at any point of an install or a
rollback leaves a complete model once the store is opened again.

The files are real files with the layout the agent writes (tests/versionfiles.py); their bytes are not models: the
store never reads a model, it moves and verifies files.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from versionfiles import receive, write_model

import feast_edge.agent.version_store as store_module
from feast_edge.agent.held_versions import ADOPTED, FORMAT, HeldVersion, StoreError
from feast_edge.agent.version_store import VersionStore
from feast_edge.util.atomic import atomic_write_bytes
from feast_edge.versions.gate import REFUSED

DEVICE = "jetson"


class PowerLoss(Exception):
    """The machine stopped here."""


def _write_model(folder: Path, payload: bytes, version: int | None, personal: bytes | None = None) -> None:
    write_model(folder, DEVICE, payload, version, personal)


def _receive(store: VersionStore, payload: bytes, version: int, *, install: bool = True, personal=None) -> HeldVersion:
    return receive(store, payload, version, install=install, personal=personal)


def _in_place(model_dir: Path) -> bytes:
    return (model_dir / f"{DEVICE}.onnx").read_bytes()


def _complete(model_dir: Path) -> bool:
    """The current model is whole: its ONNX file is the one its manifest names."""
    manifest = json.loads((model_dir / f"{DEVICE}.json").read_text())
    return hashlib.sha256(_in_place(model_dir)).hexdigest() == manifest["sha256"]


def test_installing_keeps_the_current_and_the_previous_versions_files_and_deletes_older_ones(tmp_path) -> None:
    store = VersionStore(tmp_path, DEVICE)
    for n in (1, 2, 3):
        record = _receive(store, f"model {n}".encode(), n)
        assert _in_place(tmp_path) == f"model {n}".encode() and _complete(tmp_path)
        assert record.seq == n and store.in_place() == record
    held = store.read()
    assert held.current == 3 and held.previous is not None and held.previous.seq == 2
    assert sorted(p.name for p in store.root.iterdir() if p.is_dir()) == ["0002", "0003"]
    assert [bool(v.files) for v in held.versions] == [False, True, True]  # the oldest one's record stays
    on_disk = json.loads((store.root / "state.json").read_text())
    assert (
        on_disk["format"] == FORMAT
        and on_disk["current"] == 3
        and [v["version"] for v in on_disk["versions"]]
        == [
            1,
            2,
            3,
        ]
    )


def test_a_refused_candidate_keeps_its_record_and_none_of_its_files(tmp_path) -> None:
    store = VersionStore(tmp_path, DEVICE)
    _receive(store, b"model 1", 1)
    refused = _receive(store, b"model 2", 2, install=False)
    assert _in_place(tmp_path) == b"model 1" and refused.files == {} and refused.decision == REFUSED
    assert not store.folder(refused.seq).exists()
    assert store.read().current == 1 and store.read().record(2) == refused


def test_a_power_loss_after_the_new_onnx_file_and_before_its_manifest_is_completed_on_reopen(
    tmp_path, monkeypatch
) -> None:
    store = VersionStore(tmp_path, DEVICE)
    _receive(store, b"model 1", 1)
    written: list[str] = []

    def stops_after_the_onnx_file(path, data):
        if written and Path(path).parent == tmp_path:
            raise PowerLoss
        atomic_write_bytes(path, data)
        if Path(path).parent == tmp_path:
            written.append(Path(path).name)

    monkeypatch.setattr(store_module, "atomic_write_bytes", stops_after_the_onnx_file)
    with pytest.raises(PowerLoss):
        _receive(store, b"model 2", 2)
    monkeypatch.undo()
    assert written == [f"{DEVICE}.onnx"] and _in_place(tmp_path) == b"model 2" and not _complete(tmp_path)

    reopened = VersionStore(tmp_path, DEVICE)  # the agent starts again
    with reopened.locked():
        said = reopened.recover(sweep=True)
    assert _complete(tmp_path) and _in_place(tmp_path) == b"model 2"
    assert reopened.in_place() is not None and reopened.in_place().version == 2
    assert len(said) == 1 and "restored version 2" in said[0]


def test_a_power_loss_right_after_the_commit_point_completes_the_install_and_one_before_it_keeps_the_old_model(
    tmp_path, monkeypatch
) -> None:
    store = VersionStore(tmp_path, DEVICE)
    _receive(store, b"model 1", 1)

    def nothing_reaches_the_model_dir(path, data):
        if Path(path).parent == tmp_path:
            raise PowerLoss
        atomic_write_bytes(path, data)

    monkeypatch.setattr(store_module, "atomic_write_bytes", nothing_reaches_the_model_dir)
    with pytest.raises(PowerLoss):
        _receive(store, b"model 2", 2)  # state.json names version 2; the files in place are still version 1's
    monkeypatch.undo()
    assert _in_place(tmp_path) == b"model 1" and store.read().current == 2
    with store.locked():
        store.recover()
    assert _in_place(tmp_path) == b"model 2" and _complete(tmp_path)

    # Before the commit point: a candidate folder half written; the model in place stays, the folder is swept.
    folder = store.begin()
    (folder / f"{DEVICE}.onnx").write_bytes(b"half a model")
    (tmp_path / f".{DEVICE}.onnx.abc123.tmp").write_bytes(b"torn")  # what a cut atomic write leaves
    with store.locked():
        said = store.recover(sweep=True)
    assert _in_place(tmp_path) == b"model 2" and not folder.exists()
    assert not list(tmp_path.glob(".*.tmp")) and any("unfinished" in line for line in said)


def test_a_model_another_tool_wrote_in_place_is_adopted_and_a_model_found_without_versions_too(tmp_path) -> None:
    # An agent before versions left a model: the first open adopts it (its files copied into a version folder).
    _write_model(tmp_path, b"legacy model", None)
    store = VersionStore(tmp_path, DEVICE)
    with store.locked():
        said = store.recover()
    adopted = store.in_place()
    assert adopted is not None and adopted.decision == ADOPTED and adopted.version is None and said
    assert (store.folder(adopted.seq) / f"{DEVICE}.onnx").read_bytes() == b"legacy model"
    _receive(store, b"model 2", 2)

    # fetch-model --out into the folder: a complete model no version holds; it is taken as current, not overwritten.
    _write_model(tmp_path, b"fetched by hand", 5)
    with store.locked():
        store.recover()
    held = store.read()
    assert _in_place(tmp_path) == b"fetched by hand" and held.running.decision == ADOPTED
    assert held.running.version == 5 and held.previous is not None and held.previous.version == 2


def test_the_history_is_bounded_and_the_current_and_previous_files_are_always_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(store_module, "KEEP_RECORDS", 4)
    store = VersionStore(tmp_path, DEVICE)
    for n in range(1, 9):
        _receive(store, f"model {n}".encode(), n, install=n in (1, 2))  # 3 to 8 refused
    held = store.read()
    assert len(held.versions) == 4  # the newest records, and those of the current and previous versions
    assert held.running.version == 2 and held.previous.version == 1
    assert [v.version for v in held.versions] == [1, 2, 7, 8]
    assert sorted(p.name for p in store.root.iterdir() if p.is_dir()) == ["0001", "0002"]


def test_a_rollback_restores_the_previous_version_with_its_personal_model_and_goes_back_one_version_only(
    tmp_path, monkeypatch
) -> None:
    store = VersionStore(tmp_path, DEVICE)
    _receive(store, b"model 1", 1, personal=b"personal 1")
    _receive(store, b"model 2", 2)  # no personal model: the one in place (version 1's) goes
    assert not (tmp_path / f"{DEVICE}.personal.onnx").exists()

    def stops_after_the_onnx_file(path, data):  # a power loss in the middle of the rollback
        if Path(path).name == f"{DEVICE}.json" and Path(path).parent == tmp_path:
            raise PowerLoss
        atomic_write_bytes(path, data)

    monkeypatch.setattr(store_module, "atomic_write_bytes", stops_after_the_onnx_file)
    with store.locked(), pytest.raises(PowerLoss):
        store.rollback(now=2.0e9)
    monkeypatch.undo()
    with store.locked():
        store.recover(sweep=True)  # the agent's start: the folder the cut rollback had not deleted yet goes too
    assert _in_place(tmp_path) == b"model 1" and _complete(tmp_path)
    assert (tmp_path / f"{DEVICE}.personal.onnx").read_bytes() == b"personal 1"
    held = store.read()
    assert held.rollback is not None and (held.rollback.version, held.rollback.running) == (2, 1)
    assert held.record(2).rolled_back == 2.0e9 and not store.folder(2).exists()
    with store.locked(), pytest.raises(StoreError, match="nothing to roll back to"):
        store.rollback()

    # The next version installs over the rolled-back-to one, which becomes the one to go back to.
    _receive(store, b"model 3", 3)
    assert store.read().previous.version == 1


def test_a_second_process_waits_for_the_lock_and_is_told_why_it_gave_up(tmp_path) -> None:
    store = VersionStore(tmp_path, DEVICE)
    with store.locked():
        other = VersionStore(tmp_path, DEVICE)
        with (
            pytest.raises(StoreError, match="another feast-agent is changing the versions of jetson"),
            other.locked(wait=0.3),
        ):
            pass
    with VersionStore(tmp_path, DEVICE).locked(wait=0.3):
        pass  # released


def test_a_device_id_that_is_no_id_and_a_torn_state_file_are_refused_with_the_fix(tmp_path) -> None:
    with pytest.raises(StoreError, match="--device-id"):
        VersionStore(tmp_path, "../etc")
    store = VersionStore(tmp_path, DEVICE)
    store.root.mkdir(parents=True)
    (store.root / "state.json").write_text("{not json")
    with pytest.raises(StoreError, match="move it away"):
        store.read()
    assert os.access(store.root / "state.json", os.R_OK)
