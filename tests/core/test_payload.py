"""Payloads: safetensors + JSON manifest; anything that does not match the routed envelope is refused."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import save as safetensors_save

from feast_edge.route.envelope import Envelope, route_state
from feast_edge.route.payload import Manifest, PayloadError, decode, encode, read_manifest
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from strategies import TINY_PRESET

TINY = load_preset(str(TINY_PRESET))
ENVELOPE = Envelope(stem_w=2, depths=(1, 0, 1), stage_w=(2, 1, 3))


def _routed(round_index=4):
    model = Supernet(TINY, seed=0)
    state = route_state(model.state_dict(), ENVELOPE.layout(TINY), TINY)
    manifest = Manifest(TINY.name, TINY.digest, TINY.classes, ENVELOPE, round_index, fields={"client": "c7"})
    return state, manifest


def test_round_trip():
    state, manifest = _routed()
    got_manifest, got = decode(encode(state, manifest), TINY, expected=manifest)
    assert got_manifest == manifest
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_manifest_readable_without_tensors():
    state, manifest = _routed()
    assert read_manifest(encode(state, manifest)) == manifest


def _assert_refused(blob, match, expected=None):
    with pytest.raises(PayloadError, match=match):
        decode(blob, TINY, expected=expected)


def test_wrong_shape_is_refused():
    state, manifest = _routed()
    state["stem.conv.weight"] = torch.zeros(40, 1, 3, 3)
    _assert_refused(encode(state, manifest), r"stem.conv.weight has shape \(40, 1, 3, 3\)")


def test_missing_and_extra_tensors_are_refused():
    state, manifest = _routed()
    state.pop("classifier.bias")
    _assert_refused(encode(state, manifest), "1 missing")
    state, manifest = _routed()
    state["evil"] = torch.zeros(1)
    _assert_refused(encode(state, manifest), "1 unexpected")


def test_non_finite_values_are_refused():
    state, manifest = _routed()
    state["stages.0.0.bn1.weight"][0] = float("nan")
    _assert_refused(encode(state, manifest), "NaN or infinite")


def _raw(state, manifest):
    """A payload as a sender that ignores the manifest's dtype would write it (encode itself casts to that dtype)."""
    return safetensors_save(
        {k: v.contiguous() for k, v in state.items()}, metadata={"feast_edge": json.dumps(manifest.to_dict())}
    )


def test_wrong_dtype_is_refused():
    state, manifest = _routed()
    state["classifier.weight"] = state["classifier.weight"].double()
    _assert_refused(_raw(state, manifest), "dtype torch.float64")


def test_other_round_or_envelope_than_routed_is_refused():
    state, manifest = _routed(round_index=4)
    blob = encode(state, manifest)
    _assert_refused(blob, "round 4 does not match the routed round 5", expected=_routed(round_index=5)[1])


def test_other_preset_is_refused():
    state, manifest = _routed()
    other = load_preset("fmnist-small")
    with pytest.raises(PayloadError, match="is for preset 'test-tiny', not 'fmnist-small'"):
        decode(encode(state, manifest), other)


@pytest.mark.parametrize(
    "blob, match",
    [
        (b"", "truncated"),
        (pickle.dumps({"a": 1}), "header length is out of range|not a feast-edge manifest"),
        (safetensors_save({"x": torch.zeros(1)}), "not a feast-edge manifest"),
        (
            safetensors_save({"x": torch.zeros(1)}, metadata={"feast_edge": json.dumps({"format": "x"})}),
            "expected 'feast-edge/payload'",
        ),
    ],
)
def test_garbage_is_refused(blob, match):
    _assert_refused(blob, match)


@pytest.mark.parametrize(
    ("header", "needle"),
    [
        (
            b"[" * 100_000 + b"]" * 100_000,
            "not a feast-edge manifest",
        ),  # nested too deeply for json: RecursionError inside
        (
            json.dumps({"__metadata__": {"feast_edge": "[" * 50_000 + "]" * 50_000}}).encode(),
            "not a feast-edge manifest",
        ),
        (
            json.dumps(
                {
                    "__metadata__": {
                        "feast_edge": json.dumps(
                            {
                                "format": "feast-edge/payload",
                                "version": 1,
                                "preset": "p",
                                "preset_digest": "d",
                                "classes": 1e999,
                                "envelope": {},
                                "round": 0,
                                "kind": "routed",
                            }
                        )
                    }
                }
            )
            .encode()
            .replace(b"Infinity", b"1e999"),
            "manifest",
        ),
    ],
    ids=["deep-header", "deep-manifest", "huge-number"],
)
def test_hostile_headers_are_payload_errors_never_crashes(header: bytes, needle: str):
    with pytest.raises(PayloadError, match=needle):
        read_manifest(len(header).to_bytes(8, "little") + header)


def test_a_header_over_the_limit_is_refused_before_it_is_parsed():
    from feast_edge.route.payload import MAX_HEADER_BYTES

    size = MAX_HEADER_BYTES + 1
    with pytest.raises(PayloadError, match=f"payload header is {size} bytes; the limit is {MAX_HEADER_BYTES}"):
        read_manifest(size.to_bytes(8, "little") + b" " * size)
