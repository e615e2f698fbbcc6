"""Routed payloads on the wire: safetensors bytes whose header carries a JSON manifest (method §5).

The same container carries the server's routed sub-supernet to a client and
the client's trained slice back. Decoding never unpickles; it checks the
manifest, the preset, and that every tensor has exactly the name, shape and
dtype the envelope implies, and that values are finite, before anything is
returned.

Payloads may travel in half precision (``Manifest.dtype``: float32, float16
or bfloat16; the server chooses it and every round's manifest announces it):
floating tensors are cast for the wire only. :func:`decode` returns float32,
so local training, aggregation and the global model stay float32; an update
must come back in the dtype it was routed in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from feast_edge.errors import PayloadError
from feast_edge.route.envelope import Envelope
from feast_edge.space.preset import Preset
from feast_edge.space.supernet import state_shapes

FORMAT = "feast-edge/payload"
VERSION = 1
META_KEY = "feast_edge"
KINDS = ("routed", "update")
MAX_HEADER_BYTES = 8 * 1024 * 1024  # a full paper-cifar100 supernet's safetensors header is ~0.1 MB
PAYLOAD_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_payload_dtype(name: str) -> str:
    """``name`` if it is a payload dtype, else a PayloadError naming the choices."""
    if name not in PAYLOAD_DTYPES:
        raise PayloadError(f"payload dtype {name!r} is not supported; choose one of {', '.join(PAYLOAD_DTYPES)}")
    return name


def bytes_per_param(name: str) -> int:
    """Bytes one floating parameter takes on the wire in payload dtype ``name``."""
    return PAYLOAD_DTYPES[check_payload_dtype(name)].itemsize


def on_the_wire(state: Mapping[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """``state`` as a payload of dtype ``name`` delivers it: floating tensors rounded to ``name`` and back to float32.

    The simulation applies it where the deployment encodes and decodes, so both compute the same thing.
    """
    dtype = PAYLOAD_DTYPES[check_payload_dtype(name)]
    if dtype == torch.float32:
        return dict(state)
    return {
        key: _cast(key, value, name).to(torch.float32) if value.is_floating_point() else value
        for key, value in state.items()
    }


def _cast(key: str, value: torch.Tensor, name: str) -> torch.Tensor:
    """``value`` in payload dtype ``name``; a PayloadError where a finite value does not fit (float16 tops out at 65,504)."""
    cast = value.to(PAYLOAD_DTYPES[name])
    if not torch.isfinite(cast).all() and torch.isfinite(value).all():
        raise PayloadError(
            f"tensor {key} holds values beyond the range of {name} (max |x| = {value.abs().max():.4g}); use payload dtype bfloat16 or float32"
        )
    return cast


@dataclass(frozen=True)
class Manifest:
    """What a payload claims to be: preset, class count, envelope, round and kind."""

    preset: str
    preset_digest: str
    classes: int
    envelope: Envelope
    round: int
    kind: str = "routed"
    fields: Mapping[str, Any] = field(default_factory=dict)
    dtype: str = "float32"  # of the floating tensors on the wire (PAYLOAD_DTYPES)

    @classmethod
    def of(
        cls,
        preset: Preset,
        classes: int,
        envelope: Envelope,
        round: int,
        kind: str = "routed",
        device: str | None = None,
        dtype: str = "float32",
    ) -> Manifest:
        """The manifest of a ``kind`` payload routing ``envelope`` of ``preset`` in ``round``, optionally naming its device."""
        fields = {} if device is None else {"device": device}
        return cls(
            preset.name,
            preset.digest,
            classes,
            envelope,
            round=round,
            kind=kind,
            fields=fields,
            dtype=check_payload_dtype(dtype),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "preset": self.preset,
            "preset_digest": self.preset_digest,
            "classes": self.classes,
            "envelope": self.envelope.to_dict(),
            "round": self.round,
            "kind": self.kind,
            "fields": dict(self.fields),
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, data: Any) -> "Manifest":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PayloadError(
                f"payload manifest has format {data.get('format') if isinstance(data, dict) else None!r}, expected {FORMAT!r}"
            )
        if data.get("version") != VERSION:
            raise PayloadError(
                f"payload manifest version {data.get('version')!r} is not supported (expected {VERSION}); upgrade feast-edge on both sides"
            )
        try:
            manifest = cls(
                preset=str(data["preset"]),
                preset_digest=str(data["preset_digest"]),
                classes=int(data["classes"]),
                envelope=Envelope.from_dict(data["envelope"]),
                round=int(data["round"]),
                kind=str(data["kind"]),
                fields=dict(data.get("fields") or {}),
                dtype=str(data.get("dtype", "float32")),  # payloads of earlier versions were all float32
            )
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise PayloadError(f"payload manifest is malformed ({type(exc).__name__})") from None
        if manifest.kind not in KINDS:
            raise PayloadError(f"payload kind {manifest.kind!r} is not one of {KINDS}")
        check_payload_dtype(manifest.dtype)
        return manifest


def expected_shapes(preset: Preset, classes: int, envelope: Envelope) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the sub-supernet an envelope routes."""
    return state_shapes(preset, envelope.layout(preset, classes))


def integer_shapes(preset: Preset, envelope: Envelope) -> dict[str, tuple[int, ...]]:
    """The integer buffers (BN batch counters) of the sub-supernet an envelope routes: name -> shape."""
    shapes = expected_shapes(preset, preset.classes, envelope)
    return {n: s for n, s in shapes.items() if n.endswith("num_batches_tracked")}


def encode(state: Mapping[str, torch.Tensor], manifest: Manifest) -> bytes:
    """Serialize a (sub-)supernet state and its manifest, floating tensors in ``manifest.dtype``.

    A finite value that the dtype cannot hold (float16 tops out at 65,504) is a PayloadError, never an
    infinity on the wire.
    """
    tensors = wire_tensors(state, manifest.dtype)
    return safetensors_save(tensors, metadata={META_KEY: json.dumps(manifest.to_dict(), sort_keys=True)})


def wire_tensors(state: Mapping[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """``state`` as it travels in payload dtype ``name``: on the CPU, contiguous, floating tensors cast to ``name``
    (a PayloadError where a finite value does not fit)."""
    dtype = PAYLOAD_DTYPES[check_payload_dtype(name)]
    tensors = {}
    for key, value in state.items():
        value = value.detach().to("cpu")
        if value.is_floating_point() and value.dtype != dtype:
            value = _cast(key, value, name)
        tensors[key] = value.contiguous()
    return tensors


def read_manifest(blob: bytes) -> Manifest:
    """The manifest of a payload, without materializing its tensors (bounded: the header is at most ``MAX_HEADER_BYTES``)."""
    if len(blob) < 8:
        raise PayloadError("payload is truncated (shorter than a safetensors header)")
    size = int.from_bytes(blob[:8], "little")
    if size <= 0 or 8 + size > len(blob):
        raise PayloadError("payload header length is out of range; the payload is truncated or not safetensors")
    if size > MAX_HEADER_BYTES:
        raise PayloadError(f"payload header is {size} bytes; the limit is {MAX_HEADER_BYTES}")
    try:
        header = json.loads(blob[8 : 8 + size])
        meta = header["__metadata__"][META_KEY]
        if not isinstance(meta, str) or len(meta) > MAX_HEADER_BYTES:
            raise TypeError("manifest is not a bounded string")
        return Manifest.from_dict(json.loads(meta))
    except (
        UnicodeDecodeError,
        json.JSONDecodeError,
        KeyError,
        TypeError,
        ValueError,
        RecursionError,
        OverflowError,
    ) as exc:
        if isinstance(exc, PayloadError):
            raise
        raise PayloadError("payload header is not a feast-edge manifest") from None


def decode(blob: bytes, preset: Preset, expected: Manifest | None = None) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Validate and load a payload (floating tensors returned as float32); with ``expected``, the manifest must route the
    same envelope and round in the same dtype."""
    manifest = read_manifest(blob)
    if manifest.preset_digest != preset.digest:
        raise PayloadError(f"payload is for preset {manifest.preset!r}, not {preset.name!r}")
    if expected is not None:
        for name in ("classes", "envelope", "round", "dtype"):
            if getattr(manifest, name) != getattr(expected, name):
                raise PayloadError(
                    f"payload {name} {getattr(manifest, name)!r} does not match the routed {name} {getattr(expected, name)!r}"
                )
    try:
        tensors = safetensors_load(blob)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise PayloadError(f"payload tensors cannot be read ({exc})") from None
    return manifest, checked_tensors(tensors, preset, manifest.classes, manifest.envelope, manifest.dtype)


def checked_tensors(
    tensors: Mapping[str, torch.Tensor], preset: Preset, classes: int, envelope: Envelope, dtype: str
) -> dict[str, torch.Tensor]:
    """``tensors`` if they are exactly the sub-supernet ``envelope`` routes (names, shapes, ``dtype``, finite values),
    floating ones as float32; else a PayloadError naming the first problem. Whatever carried them (a safetensors
    payload, a Flower ArrayRecord) is checked the same way."""
    shapes = expected_shapes(preset, classes, envelope)
    missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or extra:
        raise PayloadError(
            f"payload tensors do not match the envelope ({len(missing)} missing, e.g. {missing[:2]}; {len(extra)} unexpected, e.g. {extra[:2]})"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != shapes[name]:
            raise PayloadError(
                f"payload tensor {name} has shape {tuple(tensor.shape)}, the envelope routes {shapes[name]}"
            )
        want = torch.int64 if name.endswith("num_batches_tracked") else PAYLOAD_DTYPES[dtype]
        if tensor.dtype != want:
            raise PayloadError(f"payload tensor {name} has dtype {tensor.dtype}, expected {want}")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise PayloadError(f"payload tensor {name} holds NaN or infinite values")
    if dtype != "float32":
        return {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in tensors.items()}
    return dict(tensors)
