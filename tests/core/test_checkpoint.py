"""Checkpoints: safetensors + JSON, atomic, validated; never unpickled."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import save_file

from feast_edge.errors import CheckpointError, FeastError
from feast_edge.run.checkpoint import load_supernet, read_record, save_supernet
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from strategies import TINY_PRESET

TINY = load_preset(str(TINY_PRESET))


def test_round_trip_preserves_every_tensor(tmp_path):
    model = Supernet(TINY, seed=5)
    path = save_supernet(tmp_path / "ckpt.safetensors", model, round=3, note="x")
    loaded, record = load_supernet(path, TINY)
    assert record["fields"] == {"round": 3, "note": "x"}
    assert loaded.preset == TINY
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert not list(tmp_path.glob(".*.tmp")), "temporary file left behind"


def test_other_preset_is_refused(tmp_path):
    path = save_supernet(tmp_path / "tiny.safetensors", Supernet(TINY))
    with pytest.raises(
        CheckpointError, match=r"holds a supernet of preset 'test-tiny', not 'fmnist-small'; pass --preset test-tiny"
    ):
        load_supernet(path, load_preset("fmnist-small"))


def test_pickle_file_is_refused_not_loaded(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    with pytest.raises(CheckpointError, match="not a safetensors checkpoint"):
        load_supernet(path)


def test_foreign_safetensors_file_is_refused(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(CheckpointError, match="not a feast-edge checkpoint"):
        read_record(path)


def test_tampered_tensor_shape_is_refused(tmp_path):
    model = Supernet(TINY)
    path = save_supernet(tmp_path / "ckpt.safetensors", model)
    record_meta = {"feast_edge": __import__("json").dumps(read_record(path))}
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["stem.conv.weight"] = torch.zeros(3, 1, 3, 3)
    save_file(state, str(path), metadata=record_meta)
    with pytest.raises(CheckpointError, match=r"stem.conv.weight has shape \(3, 1, 3, 3\)"):
        load_supernet(path)


def test_missing_file_and_unwritable_dir(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_supernet(tmp_path / "nope.safetensors")
    with pytest.raises(FeastError, match="does not exist; create it"):
        save_supernet(tmp_path / "no" / "such" / "dir.safetensors", Supernet(TINY))


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = save_supernet(tmp_path / "ckpt.safetensors", Supernet(TINY, seed=1))
    good = path.read_bytes()

    def boom(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(OSError, match="disk full"):
        save_supernet(path, Supernet(TINY, seed=2))
    assert path.read_bytes() == good
    assert not list(tmp_path.glob(".*.tmp"))


def _overwrite_tensor_bytes(path, name: str, value: float) -> None:
    """Overwrite one float32 tensor's bytes in place: the file keeps its size and its header."""
    import json as _json
    import struct

    blob = bytearray(path.read_bytes())
    size = int.from_bytes(blob[:8], "little")
    header = _json.loads(blob[8 : 8 + size])
    begin, end = header[name]["data_offsets"]
    start = 8 + size + begin
    blob[start : 8 + size + end] = struct.pack("<f", value) * ((end - begin) // 4)
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize("value", [float("nan"), 1e30], ids=["nan", "scaled"])
def test_tensor_bytes_changed_on_disk_are_detected(tmp_path, value):
    path = save_supernet(tmp_path / "ckpt.safetensors", Supernet(TINY, seed=1))
    name = next(k for k, v in Supernet(TINY).state_dict().items() if v.is_floating_point() and v.dim() == 4)
    size = path.stat().st_size
    _overwrite_tensor_bytes(path, name, value)
    assert path.stat().st_size == size
    with pytest.raises(CheckpointError, match="is corrupt: its tensors do not match the SHA-256"):
        load_supernet(path, TINY)


def test_a_checkpoint_written_with_nan_is_refused(tmp_path):
    model = Supernet(TINY, seed=1)
    with torch.no_grad():
        next(p for p in model.parameters() if p.dim() == 4).fill_(float("nan"))
    path = save_supernet(tmp_path / "nan.safetensors", model)  # its digest vouches for the NaN bytes: still refused
    with pytest.raises(CheckpointError, match="holds NaN or infinite values"):
        load_supernet(path, TINY)
