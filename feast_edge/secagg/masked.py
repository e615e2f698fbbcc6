"""A masked upload on the wire: safetensors (never a pickle) of each segment's masked values (uint32) and the device's
integer buffers (BN batch counters: public, taken as a maximum), checked against what the round expects before use."""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load, save

from feast_edge.errors import FeastError

MASKED, PUBLIC = "masked.", "public."
HEADER_BYTES = 1024  # a masked upload's header: the metadata, and per tensor its name, dtype, shape and offsets
ENTRY_BYTES = 256


class MaskedError(FeastError):
    """A masked upload that is not what the round expects."""


def encode_masked(
    masked: Mapping[str, np.ndarray], integers: Mapping[str, torch.Tensor], round: int, device: str
) -> bytes:
    tensors = {MASKED + s: np.ascontiguousarray(v, dtype=np.uint32) for s, v in masked.items()}
    tensors.update({PUBLIC + n: t.detach().cpu().numpy().astype(np.int64) for n, t in integers.items()})
    meta = {"kind": "masked", "round": str(round), "device": device}
    return save(tensors, metadata=meta)


def upload_bound(lengths: Mapping[str, int], integers: Mapping[str, tuple[int, ...]]) -> int:
    """The most bytes a masked upload of these segments (id -> values) and integer buffers (name -> shape) takes."""
    ints = sum(8 * int(np.prod(shape)) for shape in integers.values())
    return 4 * sum(lengths.values()) + ints + HEADER_BYTES + ENTRY_BYTES * (len(lengths) + len(integers))


def decode_masked(
    blob: bytes, lengths: Mapping[str, int], integers: Mapping[str, tuple[int, ...]], round: int, device: str
) -> tuple[dict[str, np.ndarray], dict[str, torch.Tensor]]:
    """The masked values (segment -> uint32) and integer buffers of ``blob``, which must hold exactly the segments
    ``lengths`` expects (id -> values) and at most the ``integers`` (name -> shape) of the device's slice."""
    try:
        tensors = load(blob)
        meta = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")]).get("__metadata__") or {}
    except (SafetensorError, ValueError, TypeError, OverflowError) as exc:
        raise MaskedError(f"the masked upload is not a safetensors file: {exc}") from None
    if meta != {"kind": "masked", "round": str(round), "device": device}:
        raise MaskedError(f"the masked upload's header names {str(meta)[:80]}, not this device's round {round + 1}")
    masked = {k[len(MASKED) :]: v for k, v in tensors.items() if k.startswith(MASKED)}
    public = {k[len(PUBLIC) :]: v for k, v in tensors.items() if k.startswith(PUBLIC)}
    if len(masked) + len(public) != len(tensors) or set(masked) != set(lengths):
        raise MaskedError(
            f"the masked upload holds segments {sorted(masked)[:4]}; the round expects {sorted(lengths)[:4]}"
        )
    for s, values in masked.items():
        if values.dtype != np.uint32 or values.shape != (lengths[s],):
            raise MaskedError(
                f"segment {s} holds {values.dtype} {values.shape}; the round expects uint32 ({lengths[s]},)"
            )
    out = {}
    for name, values in public.items():
        if name not in integers or values.dtype != np.int64 or values.shape != tuple(integers[name]):
            raise MaskedError(f"integer buffer {name!r} is not one of the device's slice (int64 {integers.get(name)})")
        out[name] = torch.from_numpy(values.copy())
    return masked, out
