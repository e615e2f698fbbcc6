"""What arrives in a Flower Message is checked before it is used: arrays, protocol messages, run and node settings.

Real Flower records (flwr.app) built as an attacker would: arrays whose metadata lies about their bytes, pickled
object arrays, NaN, tensors the envelope does not route, tampered bytes, oversized and malformed messages.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from feast_edge import __version__
from feast_edge.cache.variants import load_cache
from feast_edge.errors import PayloadError
from feast_edge.flower import records
from feast_edge.flower.serverapp.run_config import FLOWER_REFUSES, RENAMED, refused_keys, run_config_keys, server_config
from feast_edge.personalize.fleet import OwnRow
from feast_edge.personalize.tuned import Tuned
from feast_edge.protocol import Declined, Register, RoundStart, Update
from feast_edge.route.envelope import route_state
from feast_edge.route.plans import plan_client
from feast_edge.server.config import ServerConfig, ServerError
from feast_edge.settings import flat_types
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from feast_edge.transport.errors import ProtocolError

PRESET = load_preset("fmnist-small")


@pytest.fixture(scope="module")
def routed() -> dict:
    """A 6M-MAC device's routed slice of a fresh supernet, its plan, and the transfer that describes it."""
    plan = plan_client(load_cache(PRESET), 6e6)
    state = route_state(Supernet(PRESET, seed=0).state_dict(), plan.layout(PRESET, PRESET.classes), PRESET)
    info = records.describe(state, federation="feast", round=0, device="client-000", kind="routed")
    return {"plan": plan, "state": state, "info": info}


def _read(record: ArrayRecord, routed: dict, dtype: str = "float32", info=None) -> dict[str, torch.Tensor]:
    return records.read_arrays(record, PRESET, routed["plan"].envelope, dtype, info or routed["info"])


def _npy(value: np.ndarray, allow_pickle: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, value, allow_pickle=allow_pickle)
    return buffer.getvalue()


def test_a_routed_slice_travels_bit_exact_in_order(routed: dict) -> None:
    got = _read(records.array_record(routed["state"]), routed)
    assert list(got) == list(routed["state"])
    assert all(torch.equal(got[k], routed["state"][k]) and got[k].dtype == routed["state"][k].dtype for k in got)


def test_a_float16_slice_comes_back_as_float32_of_the_rounded_values(routed: dict) -> None:
    wire = records.wire(routed["state"], "float16")
    info = records.describe(wire, federation="feast", round=0, device="client-000", kind="routed")
    got = _read(records.array_record(wire), routed, "float16", info)
    name = next(k for k, v in routed["state"].items() if v.is_floating_point())
    assert got[name].dtype == torch.float32 and torch.equal(got[name], routed["state"][name].half().float())


def test_bfloat16_is_refused_naming_the_dtypes_that_travel() -> None:
    with pytest.raises(PayloadError, match=r"NumPy has no bfloat16\); use float32 or float16"):
        records.check_flower_dtype("bfloat16")


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_arrays_that_are_not_the_envelope_are_refused(routed: dict, change: str) -> None:
    record = records.array_record(routed["state"])
    if change == "missing":
        del record[next(iter(record.keys()))]
    else:
        record["attacker.weight"] = Array(np.zeros(3, dtype=np.float32))
    with pytest.raises(PayloadError, match="do not match the envelope"):
        _read(record, routed)


def test_an_array_whose_metadata_lies_about_its_shape_is_refused_before_it_is_read(routed: dict) -> None:
    record = records.array_record(routed["state"])
    name = next(iter(record.keys()))
    record[name] = Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=_npy(np.zeros(3, np.float32)))
    with pytest.raises(PayloadError, match=f"array {name} is numpy.ndarray float32 \\(3,\\); the envelope routes"):
        _read(record, routed)


def test_bytes_beyond_what_the_shape_needs_are_refused_before_np_load(routed: dict) -> None:
    record = records.array_record(routed["state"])
    name, value = next((k, v) for k, v in routed["state"].items() if v.is_floating_point())
    bloated = _npy(value.numpy()) + b"\0" * (value.numel() * 4 + 10_000)
    record[name] = Array(dtype="float32", shape=tuple(value.shape), stype="numpy.ndarray", data=bloated)
    with pytest.raises(PayloadError, match="bytes; its shape needs at most"):
        _read(record, routed)


def test_a_header_that_disagrees_with_the_metadata_is_refused(routed: dict) -> None:
    record = records.array_record(routed["state"])
    name, value = next((k, v) for k, v in routed["state"].items() if v.is_floating_point() and v.dim() == 1)
    wrong = np.zeros(value.shape, dtype=np.int32)  # the same byte count, another dtype in the .npy header
    record[name] = Array(dtype="float32", shape=tuple(value.shape), stype="numpy.ndarray", data=_npy(wrong))
    with pytest.raises(PayloadError, match=r"\.npy header declares \(\(\d+,\), dtype\('int32'\)\)"):
        _read(record, routed)


def test_a_pickled_object_array_is_never_unpickled(routed: dict) -> None:
    record = records.array_record(routed["state"])
    name, value = next((k, v) for k, v in routed["state"].items() if v.is_floating_point() and v.dim() == 1)
    evil = np.empty(value.shape, dtype=object)
    data = _npy(evil, allow_pickle=True)
    record[name] = Array(dtype="float32", shape=tuple(value.shape), stype="numpy.ndarray", data=data)
    with pytest.raises(PayloadError, match=r"\.npy header declares .*dtype\('O'\)"):
        _read(record, routed)


@pytest.mark.parametrize("claim", [(1 << 40,), (1 << 20, 1 << 20), "garbage"])
def test_a_header_claiming_a_huge_array_is_refused_before_numpy_allocates(routed: dict, claim) -> None:
    """Issue 35: the declared shape matched, the bytes were few, the .npy header inside claimed 2^40 elements; only a
    MemoryError stopped np.load. The header is parsed and compared first."""
    record = records.array_record(routed["state"])
    name, value = next((k, v) for k, v in routed["state"].items() if v.is_floating_point() and v.dim() == 1)
    data = _npy(value.numpy())
    shown = str(tuple(value.shape)).encode()
    forged = (
        data.replace(shown, str(claim).encode().ljust(len(shown))) if claim != "garbage" else b"\x93NUMPY\x01\x00junk"
    )
    record[name] = Array(dtype="float32", shape=tuple(value.shape), stype="numpy.ndarray", data=forged)
    with pytest.raises(PayloadError, match=r"\.npy header declares"):
        _read(record, routed)


def test_nan_and_tampered_bytes_are_refused(routed: dict) -> None:
    state = dict(routed["state"])
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name] = state[name].clone()
    state[name].view(-1)[0] = float("nan")
    info = records.describe(state, federation="feast", round=0, device="client-000", kind="routed")
    with pytest.raises(PayloadError, match="NaN or infinite"):
        _read(records.array_record(state), routed, info=info)
    tampered = dict(routed["state"])
    tampered[name] = tampered[name] + 1.0  # well-formed, but not what the transfer describes
    with pytest.raises(PayloadError, match="do not match their transfer"):
        _read(records.array_record(tampered), routed)


def test_protocol_messages_are_read_with_the_bounded_parser(routed: dict) -> None:
    declined = Declined(federation="feast", round=0, device="client-000", routed="registration", reason="no data")
    assert records.read_message(records.reply_content(declined), Register, Declined) == declined
    with pytest.raises(ProtocolError, match="is a declined message, expected RoundStart"):
        records.read_message(records.reply_content(declined), RoundStart)
    with pytest.raises(ProtocolError, match="carries no feast-edge message"):
        records.read_message(RecordDict({"feast": ConfigRecord({"message": 7})}), Update)
    huge = json.dumps({"v": 1, "kind": "declined", "reason": "x" * 100_000})
    with pytest.raises(ProtocolError, match="exceeds the 65536-byte limit"):
        records.read_message(RecordDict({"feast": ConfigRecord({"message": huge})}), Declined)
    deep = "[" * 50_000 + "]" * 50_000
    with pytest.raises(ProtocolError):
        records.read_message(RecordDict({"feast": ConfigRecord({"message": deep[:60_000]})}), Declined)


def test_the_query_names_this_version_the_federation_and_the_preset() -> None:
    content = records.query_content(PRESET, "lab-1")
    assert records.sent_field(content, "feast_edge") == __version__
    assert records.sent_field(content, "federation") == "lab-1"
    assert records.sent_field(RecordDict(), "feast_edge") == ""


@pytest.mark.parametrize(
    ("run_config", "message"),
    [
        ({"rounds": 2}, "run config needs out-dir"),
        ({"out-dir": "runs/x"}, "must be an absolute path"),
        ({"out-dir": "/tmp/x", "roundz": 2}, "keys feast-edge does not know: roundz"),
        (
            {"out-dir": "/tmp/x", "mode": "async", "buffer": 5},
            "run config buffer, mode: buffered asynchronous rounds run in feast-edge simulate --mode async",
        ),
        (
            {"out-dir": "/tmp/x", "secure-agg": True, "colluders": 1},
            "run config colluders, secure-agg: secure aggregation per routed segment runs in feast-server run",
        ),
        ({"out-dir": "/tmp/x", "rounds": "two"}, "rounds = 'two' must be a int"),
        ({"out-dir": "/tmp/x", "rounds": 0}, "--rounds 0 must be at least 1"),
        ({"out-dir": "/tmp/x", "server-betas": "0.9"}, "betas"),
        ({"out-dir": "/tmp/x", "export": "yes"}, "export = 'yes' must be true or false"),
        ({"out-dir": "/tmp/x", "payload-dtype": "bfloat16"}, "run config payload-dtype: .* use float32 or float16"),
    ],
)
def test_a_bad_run_config_is_refused_naming_the_key(run_config: dict, message: str) -> None:
    with pytest.raises(ServerError, match=message):
        server_config(run_config)


def test_every_server_setting_is_taken_by_a_run_config_or_refused_with_its_concerns_reason() -> None:
    taken, refused = run_config_keys(), refused_keys()
    for key in flat_types(ServerConfig):
        dashed = key.replace("_", "-")
        assert [dashed in taken, RENAMED.get(key) in taken, dashed in refused].count(True) == 1, key
    assert set(refused.values()) <= set(FLOWER_REFUSES)
    assert refused["secagg-neighbours"] == refused["secure-agg"] == "secure"
    assert {"mode", "dp-clip", "chunk-size", "bn-rule", "recipe"} <= set(refused)


@pytest.mark.parametrize("key", sorted(refused_keys()))
def test_a_refused_key_is_refused_with_its_reason_never_as_an_unknown_one(key: str) -> None:
    with pytest.raises(ServerError) as refused:
        server_config({"out-dir": "/tmp/x", key: 1})
    assert str(refused.value) == f"run config {key}: {FLOWER_REFUSES[refused_keys()[key]]}"


def test_a_run_config_becomes_feast_servers_settings() -> None:
    config, export = server_config(
        {"out-dir": "/tmp/x", "rounds": 3, "server-lr": 1, "server-betas": "0.8,0.9", "data": "", "export": False}
    )
    assert (
        config.out,
        config.training.rounds,
        config.aggregation.server_lr,
        config.aggregation.server_betas,
        config.data,
    ) == (
        "/tmp/x",
        3,
        1.0,
        (0.8, 0.9),
        None,
    )
    assert export is False


NAMES = PRESET.task.classes
ROW = OwnRow("jetson", 6_000_000, "prior", 1.0, 40, 20, 38, "chose prior", 0.5, Tuned(NAMES[:3], 10))


def test_a_nodes_personal_row_brings_the_classes_its_personal_model_was_tuned_to() -> None:
    got = records.read_personal(records.personal_content(ROW), 40, NAMES)
    assert got == ROW and got.tuned.words().startswith("tuned to 3 of 10 classes: ")
    old = OwnRow("jetson", 6_000_000, "prior", 1.0, 40, 20, 38, "chose prior", 0.5)  # a node from before the classes
    assert records.read_personal(records.personal_content(old), 40, NAMES).tuned is None


def _kept(config, metrics) -> None:
    """A row of a node that kept the served model (no method, no strength, the same counts), classes and all."""
    config["method"] = ""
    metrics.pop("strength")
    metrics["personal-correct"] = metrics["served-correct"]


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda c, m: c.__setitem__("classes", ["Shirt", "Shirt"]), "names a class twice"),
        (lambda c, m: c.__setitem__("classes", ["Unicorn"]), "are not the task's"),
        (lambda c, m: m.__setitem__("task-classes", 9), "are not the task's"),
        (lambda c, m: m.__setitem__("task-classes", 10**6), "whole number of classes"),
        (lambda c, m: c.__setitem__("classes", "Shirt"), "list of 1 to"),
        (lambda c, m: c.__setitem__("classes", ["a/b"]), "cannot name a folder"),
        (lambda c, m: m.pop("task-classes"), "whole number of classes"),
        (lambda c, m: _kept(c, m), "keeps the served model but names classes"),
    ],
    ids=["twice", "unknown", "other-task", "huge", "not-a-list", "bad-name", "no-count", "kept"],
)
def test_classes_that_do_not_add_up_refuse_the_row(change, fragment) -> None:
    content = records.personal_content(ROW)
    change(content.config_records[records.FEAST], content.metric_records[records.PERSONAL])
    with pytest.raises(ProtocolError, match=fragment):
        records.read_personal(content, 40, NAMES)
