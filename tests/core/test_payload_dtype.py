"""Half-precision payloads (issue 12): float16/bfloat16 on the wire, float32 everywhere else (feast_edge/route/payload.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save as safetensors_save

from feast_edge.aggregate.robust import aggregate_updates
from feast_edge.errors import PayloadError
from feast_edge.protocol import RoundStart
from feast_edge.route.envelope import Envelope, route_state
from feast_edge.route.payload import (
    PAYLOAD_DTYPES,
    Manifest,
    bytes_per_param,
    decode,
    encode,
    on_the_wire,
    read_manifest,
)
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from feast_edge.transport.errors import ProtocolError
from feast_edge.transport.frames import describe
from strategies import TINY_PRESET

TINY = load_preset(str(TINY_PRESET))
ENVELOPE = Envelope(stem_w=2, depths=(1, 0, 1), stage_w=(2, 1, 3))


def _routed(dtype: str) -> tuple[dict[str, torch.Tensor], Manifest]:
    state = route_state(Supernet(TINY, seed=0).state_dict(), ENVELOPE.layout(TINY), TINY)
    return state, Manifest.of(TINY, TINY.classes, ENVELOPE, 3, "routed", "c1", dtype)


def _data_bytes(blob: bytes) -> int:
    """The tensor data of a safetensors blob: all but its length prefix and JSON header."""
    return len(blob) - 8 - int.from_bytes(blob[:8], "little")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_payload_is_half_the_bytes_and_decodes_to_float32(dtype: str) -> None:
    state, manifest = _routed(dtype)
    blob = encode(state, manifest)
    full = encode(state, dataclasses.replace(manifest, dtype="float32"))
    floats = sum(v.numel() for v in state.values() if v.is_floating_point())
    assert (
        _data_bytes(full) - _data_bytes(blob) == floats * 2
    )  # two bytes less per floating value; the integer counters stay
    got_manifest, got = decode(blob, TINY, expected=manifest)
    assert got_manifest.dtype == dtype and read_manifest(blob).dtype == dtype
    for name, value in got.items():
        assert value.dtype == (torch.int64 if name.endswith("num_batches_tracked") else torch.float32)
    expected = on_the_wire(state, dtype)  # what the simulation uses in place of encode + decode
    assert all(torch.equal(got[k], expected[k]) for k in state)
    weight = "classifier.weight"
    error = (got[weight] - state[weight]).abs().max().item()
    assert (
        0 < error <= state[weight].abs().max().item() * (2**-8 if dtype == "float16" else 2**-7)
    )  # rounded, by at most half an ulp


def test_an_update_must_come_back_in_the_routed_dtype() -> None:
    state, routed = _routed("float16")
    update = dataclasses.replace(routed, dtype="float32")
    with pytest.raises(PayloadError, match="payload dtype 'float32' does not match the routed dtype 'float16'"):
        decode(encode(state, update), TINY, expected=routed)
    lying = safetensors_save(
        {k: v.contiguous() for k, v in state.items()}, metadata={"feast_edge": json.dumps(routed.to_dict())}
    )  # float32 data, float16 manifest
    with pytest.raises(PayloadError, match="has dtype torch.float32, expected torch.float16"):
        decode(lying, TINY, expected=routed)


def test_values_beyond_float16_are_an_error_not_an_infinity() -> None:
    state, manifest = _routed("float16")
    state["classifier.bias"][0] = 1e6
    with pytest.raises(PayloadError, match="beyond the range of float16.*use payload dtype bfloat16 or float32"):
        encode(state, manifest)
    with pytest.raises(PayloadError, match="beyond the range of float16"):
        on_the_wire(state, "float16")
    _, got = decode(encode(state, dataclasses.replace(manifest, dtype="bfloat16")), TINY)
    assert got["classifier.bias"][0].item() == pytest.approx(1e6, rel=2**-8)


def test_unknown_dtypes_and_old_manifests() -> None:
    state, manifest = _routed("float32")
    with pytest.raises(
        PayloadError, match="payload dtype 'float8' is not supported; choose one of float32, float16, bfloat16"
    ):
        Manifest.of(TINY, TINY.classes, ENVELOPE, 3, dtype="float8")
    old = {k: v for k, v in manifest.to_dict().items() if k != "dtype"}  # a payload of an earlier version: float32
    assert Manifest.from_dict(old).dtype == "float32"
    with pytest.raises(PayloadError, match="not supported"):
        Manifest.from_dict({**manifest.to_dict(), "dtype": "int8"})
    assert [bytes_per_param(n) for n in PAYLOAD_DTYPES] == [4, 2, 2]


def test_round_start_announces_the_dtype_and_refuses_others() -> None:
    transfer = describe(b"x", federation="lab", round=0, device="d1").to_dict()
    fields = dict(
        federation="lab",
        round=0,
        device="d1",
        instance="i1",
        transfer=transfer,
        deadline=1.0,
        timeout=5.0,
        rounds=3,
        lr=0.1,
        seed="7",
        plan={},
    )
    with pytest.raises(ProtocolError, match="payload_dtype"):
        RoundStart(**fields, payload_dtype="float64")


def test_aggregation_of_half_precision_updates_accumulates_in_float32() -> None:
    """Many clients' float16 updates: the mean is taken in float32 (an exact float64 reference), never in float16."""
    global_state = {"w": torch.zeros(64)}
    rng = torch.Generator().manual_seed(0)
    updates = []
    for i in range(40):
        value = (
            1000.0 + torch.rand(64, generator=rng) * 3
        )  # float16 spacing at 1000 is 0.5: a float16 running sum would be far off
        updates.append((f"c{i}", on_the_wire({"w": value}, "float16"), 10 + i))
    aggregate_updates(global_state, updates, inplace=True)
    assert global_state["w"].dtype == torch.float32
    weights = torch.tensor([float(n) for _, _, n in updates], dtype=torch.float64)
    reference = sum(w * u["w"].double() for w, (_, u, _) in zip(weights, updates)) / weights.sum()
    assert torch.allclose(
        global_state["w"].double(), reference, rtol=0, atol=2e-3
    )  # float32 rounding of 40 sums near 1000
    in_half = torch.zeros(64, dtype=torch.float16)
    for w, (_, u, _) in zip(weights, updates):
        in_half += (u["w"] * w / weights.sum()).half()
    assert (in_half.double() - reference).abs().max() > 0.05  # what a float16 accumulation would have cost
