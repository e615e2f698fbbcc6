"""Control messages (transport kinds and FEAST's round protocol): round trips, conversions, and every malformed input ends in ProtocolError."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feast_edge.protocol import (
    Calibrate,
    Declined,
    Evaluate,
    Evaluated,
    Finished,
    Metrics,
    ModelReady,
    ModelRequest,
    Register,
    Registered,
    RoundStart,
    SecAggBox,
    SecAggKeys,
    SecAggReveal,
    SecAggRoster,
    SecAggShares,
    SecAggUnmask,
    Update,
    VersionReport,
)
from feast_edge.transport.errors import ProtocolError
from feast_edge.transport.frames import describe
from feast_edge.transport.messages import MAX_MESSAGE_BYTES, MessageFilter, Nack, Presence, Receipt, known_kinds, parse

COMMON: dict[str, Any] = {"federation": "lab", "round": 3, "device": "jetson-1"}
INFO = describe(b"payload", federation="lab", round=3, device="jetson-1").to_dict()
ARCH = {"d": [0, 0, 0, 0], "e": [0.25] * 4, "w": [0] * 5}
PLAN = {"affordable": [ARCH], "global_min": ARCH}
ROUND = {"instance": "a1", "timeout": 60.0, "rounds": 10, "lr": 0.025, "seed": "7", "plan": PLAN}
EXAMPLES = [
    Presence(**COMMON, state="online", role="device"),
    Nack(**COMMON, transfer="t1", missing=(0, 5, 7)),
    Receipt(**COMMON, transfer="t1", ok=False, reason="sha256 mismatch"),
    Register(
        **COMMON,
        host="jetson-1",
        instance="a1",
        preset="fmnist-small",
        preset_digest="d",
        budget_macs=25_000_000,
        samples=600,
        profile={"cores": 4},
        precision="int8",
        features=("evaluate-candidates", "a-later-feature"),
    ),
    Registered(**COMMON, instance="a1", accepted=False, reason="device id jetson-1 is already online"),
    Evaluate(
        **COMMON,
        instance="a1",
        transfer=INFO,
        timeout=60.0,
        plan=PLAN,
        probes=(0,),
        calibration=500,
        candidates=(INFO,),
    ),
    Calibrate(**COMMON, instance="a1", transfer=INFO, timeout=60.0, plan=PLAN, variants=(0,), calibration=200),
    Evaluated(**COMMON, routed="t1", results=(41, 50), calibrated_on=500, candidates=(43, 50)),
    RoundStart(
        **COMMON,
        instance="a1",
        transfer=INFO,
        deadline=1.7e9,
        timeout=60.0,
        rounds=10,
        lr=0.025,
        seed=str(2**63 - 1),
        plan=PLAN,
        train={"batch_size": 64},
    ),
    Update(**COMMON, transfer=INFO, routed="t0", samples=600, metrics={"loss": 1.25}),
    Metrics(**COMMON, values={"accuracy": 0.5}),
    Declined(**COMMON, routed="t1", reason="training diverged (loss nan, or non-finite weights)"),
    ModelRequest(**COMMON),
    VersionReport(
        **COMMON,
        version=3,
        decision="refused",
        running=2,
        examples=50,
        new_correct=30,
        old_correct=40,
        new_only=2,
        old_only=12,
        reason="",
    ),  # fmt: skip
    ModelReady(**COMMON, transfer=INFO, manifest={"macs": 24957968}),
    Finished(**COMMON, rounds=10, completed=10, instance="a1b2", model=True),
    SecAggKeys(**COMMON, routed="t0", c_key="ab" * 32, s_key="cd" * 32),
    SecAggRoster(**COMMON, routed="t0", keys={"dev-1": ["ab" * 32, "cd" * 32], "dev-2": ["01" * 32, "23" * 32]}),
    SecAggShares(**COMMON, routed="t0", shares={"dev-2": "AAEC"}, commitments={"0123456789abcdef": "ef" * 32}),
    SecAggBox(**COMMON, routed="t0", shared=("dev-1", "dev-2"), shares={"dev-2": "AAEC"}),
    SecAggUnmask(**COMMON, routed="t0", masked=("dev-1", "dev-2")),
    SecAggReveal(
        **COMMON,
        routed="t0",
        shares={"dev-1": {"index": 1, "b": {"0123456789abcdef": "00" * 16}}, "dev-2": {"index": 2, "s": "11" * 32}},
    ),
]


def wire(**changes: Any) -> bytes:
    body = {"v": 1, "kind": "nack", **COMMON, "msg_id": "m1", "transfer": "t1", "missing": [1, 2]}
    body.update(changes)
    return json.dumps({k: v for k, v in body.items() if v is not ...}).encode()


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.kind)
def test_round_trip(message: Any) -> None:
    data = message.encode()
    assert parse(data) == message
    assert b" " not in data[:20]  # compact separators


def test_every_registered_kind_has_an_example() -> None:
    assert sorted(m.kind for m in EXAMPLES) == known_kinds()


EVALUATE = {"instance": "a1", "transfer": INFO, "timeout": 60.0, "plan": PLAN, "probes": [0]}
OTHER_ROUND = describe(b"payload", federation="lab", round=2, device="jetson-1").to_dict()
REGISTER = {"host": "h", "instance": "a", "preset": "p", "preset_digest": "d", "budget_macs": 1, "samples": 1}
CALIBRATE = {"instance": "a1", "transfer": INFO, "timeout": 60.0, "plan": PLAN, "variants": [0]}


@pytest.mark.parametrize(
    ("kind", "fields", "needle"),
    [
        ("evaluate", {**EVALUATE, "probes": []}, "1 to 16 variants"),
        ("evaluate", {**EVALUATE, "probes": [0] * 17}, "1 to 16 variants"),
        ("evaluate", {**EVALUATE, "probes": [1]}, "distinct indices"),
        ("evaluate", {**EVALUATE, "probes": [0, 0]}, "distinct indices"),
        ("evaluate", {**EVALUATE, "probes": [ARCH]}, "must be an integer"),
        ("evaluate", {**EVALUATE, "calibration": 0}, "'calibration'"),
        ("evaluate", {**EVALUATE, "plan": {"affordable": []}}, "lacks global_min"),
        ("evaluate", {**EVALUATE, "timeout": -1}, "'timeout' must be > 0"),
        ("evaluate", {**EVALUATE, "instance": "a/b"}, "instance id"),
        ("round", {**ROUND, "transfer": INFO, "deadline": 1.0, "instance": ""}, "instance id"),
        ("calibrate", {**CALIBRATE, "variants": []}, "'variants' must name 1 to 16"),
        ("calibrate", {**CALIBRATE, "variants": [3]}, "distinct indices"),
        ("calibrate", {**CALIBRATE, "variants": [0, 0]}, "distinct indices"),
        ("calibrate", {**CALIBRATE, "calibration": 10**7}, "'calibration'"),
        ("calibrate", {**CALIBRATE, "payload_dtype": "float64"}, "'payload_dtype'"),
        ("evaluated", {"routed": "t1", "results": [3, 2]}, "correct <= total"),
        ("evaluated", {"routed": "t1", "results": [-1, 2]}, r"must be in \[0, 2\^53\]"),
        ("evaluated", {"routed": "t1", "results": [1.5, 2]}, "must be an integer"),
        ("evaluated", {"routed": "t1", "results": [1, 2, 3]}, "pairs"),
        ("evaluated", {"routed": "t1", "results": [0, 2**41]}, "correct <= total"),
        ("evaluated", {"routed": "t1", "results": [1, 2] * 17}, "at most 16"),
        ("evaluated", {"routed": "t1", "results": [[1, 2]]}, "must be an integer"),
        ("evaluated", {"routed": "t1", "results": [1, 2], "calibrated_on": 2**45}, "out of range"),
        ("evaluate", {**EVALUATE, "candidates": [INFO] * 4}, "at most 3 further models"),
        ("evaluate", {**EVALUATE, "candidates": [OTHER_ROUND]}, "transfers of this device and round"),
        ("evaluate", {**EVALUATE, "candidates": [{"transfer": "t2"}]}, "transfer"),
        ("evaluate", {**EVALUATE, "candidates": ["t2"]}, "must be a JSON object"),
        ("evaluated", {"routed": "t1", "results": [1, 2], "candidates": [1, 2, 3, 4, 5, 6, 7, 8]}, "at most 3"),
        ("evaluated", {"routed": "t1", "results": [1, 2, 1, 2], "candidates": [1, 2]}, "as many pairs as 'results'"),
        ("evaluated", {"routed": "t1", "results": [], "candidates": [1, 2]}, "as many pairs as 'results'"),
        ("evaluated", {"routed": "t1", "results": [1, 2], "candidates": [3, 2]}, "correct <= total"),
        ("register", {**REGISTER, "features": ["Evaluate"]}, "lower-case letters, digits and '-'"),
        ("register", {**REGISTER, "features": ["x" * 65]}, "lower-case letters"),
        ("register", {**REGISTER, "features": ["a", "a"]}, "must not repeat"),
        ("register", {**REGISTER, "features": [f"f{i}" for i in range(65)]}, "at most 64 names"),
        ("register", {**REGISTER, "features": "evaluate-candidates"}, "must be a list of strings"),
        (
            "register",
            {
                "host": "h",
                "instance": "a",
                "preset": "p",
                "preset_digest": "d",
                "budget_macs": 1,
                "samples": 1,
                "task_digest": "xyz",
            },
            "SHA-256",
        ),
        (
            "register",
            {
                "host": "h",
                "instance": "a",
                "preset": "p",
                "preset_digest": "d",
                "budget_macs": 1,
                "samples": 1,
                "precision": "fp8",
            },
            "field 'precision' must be one of fp32, int8",
        ),
        ("registered", {"instance": "a", "accepted": True, "validation": "cloud"}, "'server' or 'devices'"),
    ],
)
def test_evaluation_and_task_fields_are_bounded(kind: str, fields: dict[str, Any], needle: str) -> None:
    body = {"v": 1, "kind": kind, **COMMON, "msg_id": "m1", **fields}
    with pytest.raises(ProtocolError, match=needle):
        parse(json.dumps(body).encode())


def test_message_ids_are_unique() -> None:
    assert Metrics(**COMMON, values={}).msg_id != Metrics(**COMMON, values={}).msg_id


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[1, 2]", "must be a JSON object"),
        (wire(v=2), "protocol version 2"),
        (wire(v=...), "protocol version None"),
        (wire(kind="launch"), "unknown message kind 'launch'"),
        (wire(kind=5), "unknown message kind"),
        (wire(round="3"), "'round' must be an integer"),
        (wire(round=True), "'round' must be an integer"),
        (wire(round=-1), r"must be in \[0, 2\^53\]"),
        (wire(device="a/b"), "topic level separator"),
        (wire(federation=""), "federation id is empty"),
        (wire(msg_id=...), "lacks msg_id"),
        (wire(missing=[]), "at least one missing"),
        (wire(missing=[1, "2"]), r"'missing\[1\]' must be an integer"),
        (wire(missing=list(range(5000))), "limit is 4096"),
        (wire(transfer=...), "missing 1 required keyword-only argument: 'transfer'"),
        (wire(extra=1), "unknown fields extra"),
        (
            b'{"v": 1, "kind": "metrics", "federation": "lab", "round": 1, "device": "d", "msg_id": "m", "values": {"x": NaN}}',
            "NaN",
        ),
        (b"[" * 50_000, "nested too deeply"),
        (b" " * (MAX_MESSAGE_BYTES + 1), "exceeds the 65536-byte limit"),
    ],
)
def test_malformed_messages_raise_protocol_error(data: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle):
        parse(data)


def test_oversize_message_is_refused_before_decoding() -> None:
    big = Metrics(**COMMON, values={"x": "y" * 100}).encode()
    with pytest.raises(ProtocolError, match="exceeds the 64-byte limit"):
        parse(big, max_bytes=64)


def test_kind_specific_checks() -> None:
    with pytest.raises(ProtocolError, match="'state' must be one of online, offline"):
        Presence(**COMMON, state="asleep")
    with pytest.raises(ProtocolError, match="transfer description lacks"):
        RoundStart(**COMMON, transfer={"size": 3}, deadline=1.0, **ROUND)
    with pytest.raises(ProtocolError, match="finite number"):
        RoundStart(**COMMON, transfer=INFO, deadline=float("inf"), **ROUND)
    with pytest.raises(ProtocolError, match="'seed' must be a decimal integer"):
        RoundStart(**COMMON, transfer=INFO, deadline=1.0, **{**ROUND, "seed": "-1"})
    with pytest.raises(ProtocolError, match="outside the horizon"):
        RoundStart(**COMMON, transfer=INFO, deadline=1.0, **{**ROUND, "rounds": 3})
    with pytest.raises(ProtocolError, match="plan.affordable"):
        RoundStart(**COMMON, transfer=INFO, deadline=1.0, **{**ROUND, "plan": {"affordable": [], "global_min": ARCH}})
    with pytest.raises(ProtocolError, match="instance id"):
        Registered(**COMMON, instance="a/b", accepted=True)


@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_crash_parse(data: bytes) -> None:
    try:
        parse(data)
    except ProtocolError:
        pass


_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=5), st.lists(st.integers(-2, 2), max_size=3)
)
_KEYS = ["v", "kind", "federation", "round", "device", "msg_id", "transfer", "missing", "ok"]


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.fixed_dictionaries({}, optional={key: _VALUES for key in _KEYS}))
def test_arbitrary_json_objects_never_crash_parse(body: dict[str, Any]) -> None:
    try:
        parse(json.dumps(body).encode())
    except ProtocolError:
        pass


def test_filter_drops_duplicates_stale_and_foreign() -> None:
    gate = MessageFilter("lab", current_round=3)

    def nack(**changes: Any) -> Nack:
        return Nack(**{**COMMON, **changes}, transfer="t1", missing=(1,))

    msg = nack()
    assert gate.verdict(msg) is None
    assert "duplicate" in gate.verdict(msg)  # type: ignore[operator]
    assert "stale: round 3 < current round 4" == gate.verdict(nack(round=2))  # rounds read 1-based
    assert "federation 'other'" in gate.verdict(nack(federation="other"))  # type: ignore[operator]
    assert gate.accept(nack(round=4))
    gate.advance(5)
    gate.advance(1)  # never moves backwards
    assert not gate.accept(nack(round=4))


def test_filter_exempts_presence_registration_and_metrics_from_staleness() -> None:
    gate = MessageFilter("lab", current_round=9)
    will = Presence(**{**COMMON, "round": 0}, state="offline")
    assert gate.accept(will) and gate.accept(will)  # a last will repeats with the same id
    assert gate.accept(Metrics(**{**COMMON, "round": 0}, values={"onnx_latency_ms": 0.9}))  # e.g. after the last round
    assert gate.accept(
        Register(
            **{**COMMON, "round": 0}, host="h", instance="i", preset="p", preset_digest="d", budget_macs=1, samples=1
        )
    )


def test_filter_memory_is_bounded() -> None:
    gate = MessageFilter("lab", memory=2)
    first = Metrics(**COMMON, values={})
    assert gate.accept(first)
    for _ in range(2):
        assert gate.accept(Metrics(**COMMON, values={}))
    assert gate.accept(first)  # forgotten: memory holds only the last two ids


def test_round_start_carries_the_plan_and_settings_exactly() -> None:
    from feast_edge.cache.variants import load_cache
    from feast_edge.local.recipe import TrainConfig
    from feast_edge.route.plans import plan_client
    from feast_edge.space.preset import load_preset

    preset = load_preset("fmnist-small")
    plan = plan_client(load_cache(preset), 12e6)
    train = TrainConfig(lr=0.01, batch_size=32, variants="min+max", augment=False)
    info = describe(b"routed", federation="lab", round=3, device="jetson-1")
    sent = RoundStart.from_plan(
        plan,
        federation="lab",
        round=3,
        device="jetson-1",
        instance="a1",
        transfer=info,
        sent_at=1.7e9,
        timeout=60.0,
        rounds=10,
        lr=0.02,
        seed=2**63 - 5,
        train=train,
    )
    received = parse(sent.encode())
    assert isinstance(received, RoundStart)
    assert received.client_plan(preset) == plan
    assert received.train_config() == train
    assert received.client_seed == 2**63 - 5
    assert received.transfer_info() == info
    assert received.deadline == 1.7e9 + 60.0


def test_round_start_plan_of_another_preset_is_refused() -> None:
    from feast_edge.cache.variants import load_cache
    from feast_edge.errors import FeastError
    from feast_edge.local.recipe import TrainConfig
    from feast_edge.route.plans import plan_client
    from feast_edge.space.preset import load_preset

    plan = plan_client(load_cache(load_preset("paper-cifar100")), 600e6)
    info = describe(b"routed", federation="lab", round=0, device="d")
    message = RoundStart.from_plan(
        plan,
        federation="lab",
        round=0,
        device="d",
        instance="a1",
        transfer=info,
        sent_at=0.0,
        timeout=5.0,
        rounds=1,
        lr=0.1,
        seed=1,
        train=TrainConfig(),
    )
    with pytest.raises(FeastError, match="out of range"):
        message.client_plan(load_preset("fmnist-small"))
    with pytest.raises(ProtocolError, match="unknown training settings"):
        RoundStart(
            **{
                **{
                    k: getattr(message, k)
                    for k in (
                        "federation",
                        "round",
                        "device",
                        "instance",
                        "transfer",
                        "deadline",
                        "timeout",
                        "rounds",
                        "lr",
                        "seed",
                        "plan",
                    )
                },
                "train": {"bogus": 1},
            }
        ).train_config()


def test_update_reports_the_local_result() -> None:
    from feast_edge.local.cotrain import LocalResult

    result = LocalResult(
        num_samples=600,
        samples_seen=1200,
        num_batches=19,
        mean_loss=1.5,
        role_losses={"max": 1.0},
        variants_per_batch={3: 19},
        arch_batches={},
        train_macs=123_456,
        lr=0.02,
    )
    info = describe(b"update", federation="lab", round=3, device="jetson-1")
    update = parse(
        Update.from_result(
            result,
            federation="lab",
            round=3,
            device_id="jetson-1",
            transfer=info,
            routed="t0",
            compute_seconds=2.5,
            torch_device="cpu",
        ).encode()
    )
    assert isinstance(update, Update)
    assert (update.samples, update.loss, update.samples_seen, update.compute_seconds, update.train_macs) == (
        600,
        1.5,
        1200,
        2.5,
        123_456,
    )
    assert update.transfer_info() == info
    other = describe(b"update", federation="lab", round=2, device="jetson-1")
    with pytest.raises(ProtocolError, match="round 2"):
        Update(
            federation="lab", round=3, device="jetson-1", transfer=other.to_dict(), routed="t0", samples=1
        ).transfer_info()


def test_a_diverged_loss_still_makes_a_valid_message() -> None:
    from feast_edge.local.cotrain import LocalResult

    result = LocalResult(
        num_samples=10,
        samples_seen=10,
        num_batches=1,
        mean_loss=float("nan"),
        role_losses={"max": float("inf")},
        variants_per_batch={1: 1},
        arch_batches={},
        train_macs=1,
        lr=0.1,
    )
    info = describe(b"update", federation="lab", round=3, device="jetson-1")
    message = Update.from_result(
        result,
        federation="lab",
        round=3,
        device_id="jetson-1",
        transfer=info,
        routed="t0",
        compute_seconds=1.0,
        torch_device="cpu",
    )
    again = parse(message.encode())  # NaN and infinities have no JSON number: they travel as null
    assert again.metrics["loss"] is None and again.metrics["role_losses"] == {"max": None}


def test_an_agent_sends_nothing_for_diverged_training() -> None:
    import torch

    from feast_edge.local.cotrain import stayed_finite

    assert stayed_finite({"w": torch.ones(3), "n": torch.tensor(1)}, 0.5)
    assert not stayed_finite({"w": torch.ones(3)}, float("nan"))
    assert not stayed_finite({"w": torch.tensor([1.0, float("inf")])}, 0.5)


def test_a_declined_message_needs_a_bounded_reason() -> None:
    from feast_edge.protocol import MAX_REASON

    for reason in ("", "x" * (MAX_REASON + 1)):
        with pytest.raises(ProtocolError, match="needs a reason"):
            Declined(**COMMON, routed="t1", reason=reason)


SECAGG = {"v": 1, **COMMON, "msg_id": "m1", "routed": "t0"}


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"kind": "secagg_keys", "c_key": "AB" * 32, "s_key": "cd" * 32}, "64 lowercase hex"),
        ({"kind": "secagg_keys", "c_key": "ab" * 31, "s_key": "cd" * 32}, "64 lowercase hex"),
        ({"kind": "secagg_roster", "keys": {f"d{i}": ["ab" * 32, "cd" * 32] for i in range(257)}}, "1 to 256 distinct"),
        ({"kind": "secagg_shares", "shares": {f"d{i}": "AAEC" for i in range(65)}, "commitments": {}}, "more than 64"),
        ({"kind": "secagg_roster", "keys": {"d1": ["ab" * 32]}}, "two public keys"),
        ({"kind": "secagg_shares", "shares": {"d2": "not base64!"}, "commitments": {}}, "not base64"),
        ({"kind": "secagg_shares", "shares": {"d2": "A" * 6000}, "commitments": {}}, "at most 4096 bytes"),
        ({"kind": "secagg_shares", "shares": {}, "commitments": {"short": "ef" * 32}}, "16 lowercase hex"),
        ({"kind": "secagg_box", "shared": ["d1"], "shares": {"d2": "AAEC"}}, "not in 'shared'"),
        ({"kind": "secagg_unmask", "masked": ["d1", "d1"]}, "distinct devices"),
        ({"kind": "secagg_reveal", "shares": {"d1": {"index": 0, "s": "11" * 32}}}, "index of d1 must be 1-255"),
        ({"kind": "secagg_reveal", "shares": {"d1": {"index": 1, "s": "11" * 32, "b": {}}}}, "either 's' or 'b'"),
        (
            {"kind": "secagg_reveal", "shares": {"d1": {"index": 1, "b": {"0123456789abcdef": "11" * 32}}}},
            "32 lowercase",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else v["kind"],
)
def test_secure_aggregation_stages_refuse_malformed_input_at_the_wire(body: dict, named: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(named)):
        parse(json.dumps({**SECAGG, **body}).encode())


def test_a_round_with_malformed_secure_terms_is_refused_at_the_wire() -> None:
    envelope = {"stem_w": 0, "depths": [0, 0, 0, 0], "stage_w": [0, 0, 0, 0]}
    good = {"colluders": 1, "threshold": 2, "bound": 8.0, "frac": 20, "cohort": {"jetson-1": envelope, "pi-2": envelope},
            "counts": {"jetson-1": 50, "pi-2": 40}, "degree": 0, "clip": 0.0}  # fmt: skip
    start = RoundStart(**COMMON, **ROUND, transfer=INFO, deadline=1.0, secure=good)
    assert parse(start.encode()).secure_block().weight("pi-2") == 40 / 50
    for bad, named in (
        ({**good, "threshold": 3}, "threshold or frac outside its range"),
        ({**good, "counts": {"jetson-1": 50}}, "a count for each cohort device"),
        ({**good, "threshold": 1, "cohort": {"pi-2": envelope}, "counts": {"pi-2": 40}}, "cohort without this device"),
        ({**good, "extra": 1}, "must hold colluders"),
        ({**good, "degree": 2}, "degree' must be below the cohort's size"),
        ({**good, "clip": -1.0}, "secure.clip' must be a number"),
    ):
        with pytest.raises(ProtocolError, match=named):
            RoundStart(**COMMON, **ROUND, transfer=INFO, deadline=1.0, secure=bad)
