"""Supernet checkpoints: safetensors tensors + a JSON header, written atomically.

Nothing is unpickled: the file is a safetensors container whose metadata entry
``feast_edge`` holds a JSON record (format, preset, class count, user fields).
Loading validates the record, the preset and every tensor name and shape
before a model is built.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_save

from feast_edge.errors import CheckpointError, PresetError
from feast_edge.space.geometry import supernet_layout
from feast_edge.space.preset import Preset
from feast_edge.space.supernet import Supernet
from feast_edge.util.atomic import atomic_write_bytes, check_writable

FORMAT = "feast-edge/supernet"
MODEL_FORMAT = "feast-edge/model"  # any other module (the harness's baseline networks), described by its model record
VERSION = 1
META_KEY = "feast_edge"
EXTRA = "extra/"  # name prefix of tensors stored beside the model's (a server optimizer's state), covered by the digest


def state_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies of every tensor in the state dict."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in module.state_dict().items()}


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order: what a checkpoint's record vouches for."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        if tensor.numel():
            digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def _with_extra(tensors: dict[str, torch.Tensor], extra: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The model's tensors and, under :data:`EXTRA`, the run's other state (CPU, contiguous copies)."""
    for name, tensor in (extra or {}).items():
        tensors[EXTRA + name] = tensor.detach().to("cpu").contiguous().clone()
    return tensors


def save_supernet(
    path: str | os.PathLike[str],
    supernet: Supernet,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
    **fields: Any,
) -> Path:
    """Atomically write ``supernet`` (full physical tensors) with JSON-serialisable ``fields`` and the tensors' digest.

    ``extra_tensors`` (a server optimizer's state) are stored beside the weights under :data:`EXTRA` and covered by the
    same digest; loading returns them as the record's ``"extra_tensors"``.
    """
    if supernet.layout != supernet_layout(supernet.preset, supernet.classes):
        raise ValueError("save_supernet stores full supernets only; routed sub-supernets travel as payloads")
    path = check_writable(path, "checkpoint")
    tensors = _with_extra(state_tensors(supernet), extra_tensors)
    record = {
        "format": FORMAT,
        "version": VERSION,
        "preset": supernet.preset.to_dict(),
        "preset_digest": supernet.preset.digest,
        "classes": supernet.classes,
        "content_sha256": tensors_digest(tensors),
        "fields": fields,
    }
    blob = safetensors_save(tensors, metadata={META_KEY: json.dumps(record, sort_keys=True)})
    return atomic_write_bytes(path, blob)


def save_module(
    path: str | os.PathLike[str],
    module: torch.nn.Module,
    model: dict[str, Any],
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
    **fields: Any,
) -> Path:
    """Atomically write a module that is not a supernet; ``model`` (JSON) describes its architecture and is checked on load."""
    path = check_writable(path, "checkpoint")
    tensors = _with_extra(state_tensors(module), extra_tensors)
    record = {
        "format": MODEL_FORMAT,
        "version": VERSION,
        "model": model,
        "content_sha256": tensors_digest(tensors),
        "fields": fields,
    }
    return atomic_write_bytes(path, safetensors_save(tensors, metadata={META_KEY: json.dumps(record, sort_keys=True)}))


def load_module(path: str | os.PathLike[str], module: torch.nn.Module, model: dict[str, Any]) -> dict[str, Any]:
    """Load a :func:`save_module` checkpoint into ``module`` after checking its model record, names, shapes, digest and values."""
    record = read_record(path, MODEL_FORMAT)
    if json.dumps(record.get("model"), sort_keys=True) != json.dumps(model, sort_keys=True):
        raise CheckpointError(
            f"checkpoint {path} holds another model ({record.get('model')}), not {model}; pass the checkpoint of this run"
        )
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    state = _read_tensors(path, expected, f"model {model.get('method', '')}".strip())
    _check_content(path, record, state)
    module.load_state_dict(_split_extra(state, record))
    return record


def _read_tensors(
    path: str | os.PathLike[str], expected: dict[str, tuple[int, ...]], what: str
) -> dict[str, torch.Tensor]:
    """Every expected tensor of a checkpoint and its :data:`EXTRA` ones, refusing missing, unexpected or mis-shaped ones."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        names = set(f.keys())
        extra = {name for name in names if name.startswith(EXTRA)}
        missing = sorted(set(expected) - names)
        unexpected = sorted(names - set(expected) - extra)
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint {path} does not match {what} "
                f"({len(missing)} tensors missing, e.g. {missing[:2]}; {len(unexpected)} unexpected, e.g. {unexpected[:2]}); "
                "it is corrupt or was written by another program"
            )
        state = {}
        for name, shape in expected.items():
            tensor = f.get_tensor(name)
            if tuple(tensor.shape) != shape:
                raise CheckpointError(
                    f"checkpoint {path}: tensor {name} has shape {tuple(tensor.shape)}, {what} needs {shape}; "
                    "the file is corrupt or belongs to another model"
                )
            state[name] = tensor
        for name in extra:
            state[name] = f.get_tensor(name)
    return state


def _split_extra(state: dict[str, torch.Tensor], record: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's tensors of a checked ``state``; the :data:`EXTRA` ones go to ``record["extra_tensors"]``."""
    extra = {name[len(EXTRA) :]: tensor for name, tensor in state.items() if name.startswith(EXTRA)}
    if extra:
        record["extra_tensors"] = extra
    return {name: tensor for name, tensor in state.items() if not name.startswith(EXTRA)}


def _check_content(path: str | os.PathLike[str], record: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """The bytes on disk must be the ones written, and finite: a flipped tensor keeps the file's size and structure."""
    stored_digest = record.get("content_sha256")
    if stored_digest is not None and tensors_digest(state) != stored_digest:
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its tensors do not match the SHA-256 its record was written with (the file changed on disk)"
        )
    broken = [
        name for name, tensor in state.items() if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    if broken:
        raise CheckpointError(
            f"checkpoint {path} holds NaN or infinite values (in {len(broken)} tensors, e.g. {broken[0]}); it cannot be resumed or exported"
        )


def keep_previous(current: Path, previous: Path) -> None:
    """Keep ``current`` as ``previous`` before it is replaced: a hard link (no copy), the new file is then written beside it."""
    if not current.is_file():
        return
    staging = previous.with_name(previous.name + ".tmp")
    staging.unlink(missing_ok=True)
    try:
        os.link(current, staging)
    except OSError:  # a file system without hard links: copy instead
        shutil.copyfile(current, staging)
    os.replace(staging, previous)


def read_record(path: str | os.PathLike[str], format: str | None = FORMAT) -> dict[str, Any]:
    """The validated JSON record of a checkpoint, without reading its tensors."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path} does not exist; pass the path of a .safetensors file written by feast-edge"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not a safetensors checkpoint ({exc}); pass a file written by feast-edge (pickled .pt files are never loaded)"
        ) from None
    try:
        record = json.loads(meta[META_KEY])
    except (KeyError, json.JSONDecodeError, RecursionError):
        raise CheckpointError(
            f"{path} is a safetensors file but not a feast-edge checkpoint (no valid '{META_KEY}' header); pass a checkpoint written by feast-edge"
        ) from None
    if not isinstance(record, dict) or record.get("format") not in (FORMAT, MODEL_FORMAT):
        raise CheckpointError(
            f"{path} has format {record.get('format') if isinstance(record, dict) else None!r}, expected {format!r}; pass a feast-edge checkpoint"
        )
    if format is not None and record["format"] != format:
        what = "a supernet" if format == FORMAT else "a baseline model"
        raise CheckpointError(
            f"{path} holds a {record['format']!r} checkpoint, not {what}; pass a checkpoint of the right kind"
        )
    if record.get("version") != VERSION:
        raise CheckpointError(
            f"{path} has checkpoint version {record.get('version')!r}; this feast-edge reads version {VERSION}, upgrade or re-export it"
        )
    return record


def checkpoint_preset(record: dict[str, Any], path: str | os.PathLike[str] = "<checkpoint>") -> Preset:
    try:
        preset = Preset.from_dict(record["preset"])
    except (KeyError, PresetError) as exc:
        raise CheckpointError(
            f"checkpoint {path} carries an invalid preset ({exc}); re-create the checkpoint"
        ) from None
    if preset.digest != record.get("preset_digest"):
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its preset digest does not match its preset; re-create the checkpoint"
        )
    return preset


def load_supernet(
    path: str | os.PathLike[str],
    preset: Preset | None = None,
    device: str | torch.device = "cpu",
) -> tuple[Supernet, dict[str, Any]]:
    """Load a checkpoint; with ``preset`` given, refuse one of another preset."""
    record = read_record(path)
    stored = checkpoint_preset(record, path)
    if preset is not None and preset.digest != stored.digest:
        raise CheckpointError(
            f"checkpoint {path} holds a supernet of preset {stored.name!r}, not {preset.name!r}; "
            f"pass --preset {stored.name} or a checkpoint trained with {preset.name}"
        )
    classes = record.get("classes")
    if not isinstance(classes, int) or classes < 1:
        raise CheckpointError(f"checkpoint {path} has an invalid class count {classes!r}; re-create the checkpoint")
    model = Supernet(stored, classes=classes, seed=None)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state = _read_tensors(path, expected, f"preset {stored.name!r}")
    _check_content(path, record, state)
    model.load_state_dict(_split_extra(state, record))
    return model.to(device), record
