"""feast-server's live view (server/live.py): what the run thread tells it becomes the dashboard's fleet, round and history."""

from __future__ import annotations

from pathlib import Path

import pytest

from feast_edge.cache.variants import load_cache
from feast_edge.dashboard.state import DashboardState
from feast_edge.route.plans import plan_client
from feast_edge.run.loop import RoundRecord
from feast_edge.server.live import LiveView
from feast_edge.server.registry import Registry
from feast_edge.space.preset import load_preset
from feast_edge.transport.chunks import Reassembler
from feast_edge.transport.frames import describe, encode_frame

PRESET = load_preset("fmnist-small")
CACHE = load_cache(PRESET)
PROFILE = {"name": "jetson-nano", "hardware": {"cpu": "4x Arm Cortex-A57", "cuda_name": "Tegra X1"}}


@pytest.fixture
def view(tmp_path: Path) -> LiveView:
    registry = Registry(tmp_path / "devices.sqlite")
    registry.register(
        "nano",
        host="nano",
        instance="i1",
        budget_macs=2_790_000,
        samples=134,
        preset=PRESET.name,
        profile=PROFILE,
        status="online",
        precision="int8",
    )
    registry.register(
        "desk",
        host="desk",
        instance="i2",
        budget_macs=39_150_000,
        samples=2014,
        preset=PRESET.name,
        profile={"name": "desktop-gpu"},
        status="offline",
    )
    return LiveView(DashboardState("federation", "t"), PRESET, CACHE, registry, rounds=3, federation="lab")


def _member(view: LiveView, device: str) -> dict:
    return next(m for m in view.state.snapshot()["round"]["members"] if m["device"] == device)


def test_the_fleet_shows_budget_precision_served_variant_envelope_and_presence(view: LiveView) -> None:
    view.refresh({"nano"}, force=True)
    devices = {d["name"]: d for d in view.state.snapshot()["devices"]}
    nano, desk = devices["nano"], devices["desk"]
    assert nano["online"] is True and desk["online"] is False
    assert nano["hardware"] == "Tegra X1" and nano["profile"] == "jetson-nano" and nano["budget_macs"] == 2_790_000
    assert (nano["precision"], desk["precision"]) == ("int8", "fp32")  # the precision each budget is for
    served = CACHE.largest_affordable(39_150_000)
    assert desk["variant"]["macs"] == served.macs and desk["variant"]["params"] == served.params
    assert desk["envelope"]["params"] == plan_client(CACHE, 39_150_000).envelope.params(PRESET)
    assert nano["envelope"]["params"] < desk["envelope"]["params"]


def test_a_round_moves_each_member_through_its_states_to_its_outcome(view: LiveView) -> None:
    view.round_started(0, ["nano", "desk"], timeout=60)
    snap = view.state.snapshot()["round"]
    assert snap["round"] == 1 and {m["state"] for m in snap["members"]} == {"routed"}
    view.routed("nano", 450_000, 2, 112_000)
    view.device_progress("nano", {"phase": "downloading", "round": 0, "done": 1, "total": 2})
    assert (_member(view, "nano")["state"], _member(view, "nano")["done"], _member(view, "nano")["total"]) == (
        "downloading",
        1,
        2,
    )
    view.device_progress("nano", {"phase": "training", "round": 0})
    assert _member(view, "nano")["state"] == "training"
    # The server's own count of upload chunks, from its reassembler.
    uploads = Reassembler(federation="lab")
    blob = bytes(300)
    info = describe(blob, federation="lab", round=0, device="nano", chunk_size=100)
    uploads.add(encode_frame(info, 0, blob[:100]))
    view.tick({"nano"}, uploads)
    assert (_member(view, "nano")["state"], _member(view, "nano")["done"], _member(view, "nano")["total"]) == (
        "uploading",
        1,
        3,
    )
    view.upload_done("nano", 300, 3)
    assert (_member(view, "nano")["state"], _member(view, "nano")["done"], _member(view, "nano")["total"]) == (
        "uploading",
        3,
        3,
    )
    view.member("desk", "rejected", reason="its update changes the routed slice too much")
    view.device_progress("desk", {"phase": "training", "round": 0})  # late news never undoes a rejection
    record = RoundRecord(
        round=1,
        lr=0.05,
        cohort=["nano", "desk"],
        updated=["nano"],
        rejected={"desk": "too much"},
        applied=True,
        full_params=1000,
        seconds=3.0,
    )
    view.round_finished(record, probes=[{"label": "1.39M", "macs": 1_390_000, "params": 20_000, "val_accuracy": 0.5}])
    snap = view.state.snapshot()
    assert _member(view, "nano")["state"] == "aggregated" and _member(view, "desk")["state"] == "rejected"
    entry = snap["history"][-1]
    assert (
        entry["round"] == 1
        and entry["bytes_down"] == 450_000
        and entry["bytes_up"] == 300
        and entry["broadcast_bytes"] == 4000
    )
    assert entry["devices"]["nano"] == {"down": 450_000, "up": 300}
    devices = {d["name"]: d for d in snap["devices"]}
    assert (
        devices["desk"]["last_upload"]["status"] == "rejected"
        and devices["nano"]["last_upload"]["status"] == "accepted"
    )
    assert snap["variants"][0]["val_accuracy"] == 0.5 and snap["run"]["rounds_done"] == 1


def test_asynchronous_jobs_join_the_step_in_flight_and_a_release_clears_the_released_ones(view: LiveView) -> None:
    view.jobs_started(0, ["nano", "desk"], timeout=60)
    view.device_progress("desk", {"phase": "training", "round": 0})
    view.upload_done("nano", 300, 3)
    view.buffer(1, 2, {"desk": 0})
    view.jobs_started(0, ["pi"], timeout=60)  # nano is buffered; pi joins; desk keeps training
    assert {m["device"]: m["state"] for m in view.state.snapshot()["round"]["members"]} == {
        "nano": "uploading",
        "desk": "training",
        "pi": "routed",
    }
    assert view.state.snapshot()["run"]["buffer"] == {"held": 1, "size": 2, "in_flight": {"desk": 0}}
    record = RoundRecord(
        round=1, lr=0.05, cohort=["nano", "pi"], updated=["nano", "pi"], applied=True, staleness={"nano": 0, "pi": 0}
    )
    view.round_finished(record)
    view.jobs_started(1, ["nano"], timeout=60)  # the released ones leave the step; desk, still training, stays
    members = {m["device"]: m["state"] for m in view.state.snapshot()["round"]["members"]}
    assert members == {"desk": "training", "nano": "routed"}
    devices = {d["name"]: d for d in view.state.snapshot()["devices"]}
    assert devices["pi"]["last_upload"]["staleness"] == 0 and devices["nano"]["job"]["version"] == 1


@pytest.mark.parametrize("outcome", ["declined", "incomplete"])
def test_a_device_that_declined_or_whose_upload_did_not_complete_shows_that_outcome_and_its_reason(
    view: LiveView, outcome: str
) -> None:
    view.round_started(0, ["nano", "desk"], timeout=60)
    view.device_progress("nano", {"phase": "training", "round": 0})
    record = RoundRecord(round=1, lr=0.05, cohort=["nano", "desk"], missing=["desk"], **{outcome: {"nano": "why"}})
    view.round_finished(record)
    assert (_member(view, "nano")["state"], _member(view, "nano")["reason"]) == (outcome, "why")
    assert _member(view, "desk")["state"] == "late"
    devices = {d["name"]: d for d in view.state.snapshot()["devices"]}
    assert devices["nano"]["last_upload"] == {"round": 1, "status": outcome, "reason": "why"}
    assert devices["desk"]["last_upload"]["status"] == "late"


@pytest.mark.parametrize(
    "values",
    [
        {"phase": "exploding", "round": 0},  # not a phase
        {"phase": "training", "round": 7},  # another round
        {"phase": "downloading", "round": 0, "done": -5, "total": 10**12},  # counts out of range are dropped, not shown
    ],
)
def test_device_reports_that_do_not_fit_the_round_change_nothing_or_only_in_range(view: LiveView, values: dict) -> None:
    view.round_started(0, ["nano"], timeout=60)
    view.device_progress("nano", values)
    view.device_progress("stranger", {"phase": "training", "round": 0})
    member = _member(view, "nano")
    assert member["state"] in ("routed", "downloading")
    assert member.get("done") in (None, 0) and member.get("total") in (None, 0)
    assert all(m["device"] != "stranger" for m in view.state.snapshot()["round"]["members"])


def test_exported_models_give_the_population_accuracy_and_join_the_validation_points(
    view: LiveView, tmp_path: Path
) -> None:
    view.round_started(0, ["nano"], timeout=60)
    probe = {"label": "1.39M", "macs": 1_390_000, "params": 20_000, "val_accuracy": 0.4}
    view.round_finished(
        RoundRecord(round=1, lr=0.05, cohort=["nano"], updated=["nano"], applied=True, val_accuracy=0.4), probes=[probe]
    )
    manifests = [
        {
            "device": "nano",
            "macs": 2_700_000,
            "params": 30_000,
            "validation_accuracy": 0.5,
            "sha256": "a" * 64,
            "file": "nano.onnx",
        },
        {
            "device": "desk",
            "macs": 39_000_000,
            "params": 800_000,
            "validation_accuracy": 0.7,
            "sha256": "b" * 64,
            "file": "desk.onnx",
        },
    ]
    view.models(manifests, tmp_path)
    snap = view.state.snapshot()
    assert snap["population_accuracy"] == pytest.approx(0.6)
    assert [v["macs"] for v in snap["variants"]] == [1_390_000, 2_700_000, 39_000_000]
    assert {m["device"] for m in snap["models"]} == {"nano", "desk"}


def test_a_server_without_data_shows_federated_validation_and_the_devices_own_accuracy(
    view: LiveView, tmp_path: Path
) -> None:
    live = LiveView(
        DashboardState("federation", "t"),
        PRESET,
        CACHE,
        view.registry,
        rounds=3,
        federation="lab",
        validation="devices",
    )
    assert live.state.snapshot()["run"]["validation"] == "validation: federated, on the devices' held-out data"
    live.round_started(0, ["nano", "desk"], timeout=60)
    validation = {"source": "devices", "devices": ["desk", "nano"], "missing": [], "samples": 57, "points": {}}
    record = RoundRecord(
        round=1, lr=0.05, cohort=["nano", "desk"], updated=["nano", "desk"], applied=True, val_accuracy=0.5
    )
    record.validation = validation
    probe = {"label": "variant 0", "macs": 1_390_000, "params": 20_000, "val_accuracy": 0.5}
    live.round_finished(record, probes=[probe])
    snap = live.state.snapshot()
    assert snap["run"]["validation"] == "validation: federated, on 2 devices' held-out data (57 examples)"
    assert snap["history"][-1]["validated_on"] == {"source": "devices", "devices": 2, "samples": 57}
    assert snap["variants"][0]["label"] == "variant 0"
    manifest = {
        "device": "nano",
        "macs": 2_700_000,
        "rounds": 1,
        "calibration": "device",
        "file": "nano.variant.safetensors",
    }
    live.models([manifest], tmp_path)  # exported: the device has yet to calibrate it
    [model] = live.state.snapshot()["models"]
    assert model["accuracy"] is None and model["accuracy_note"] == "calibrated on the device; no report from it yet"
    assert model["personal_accuracy"] is None and model["personal_note"] == "no report"
    assert live.state.snapshot()["population_accuracy"] is None
    assert live.state.snapshot()["own_accuracy"]["counted"] == 0
    report = {"holdout_accuracy": 0.81, "holdout_samples": 13, "model_round": 1}
    personal = {"personal_method": "head", "personal_strength": 3, "personal_accuracy": 0.9, "personal_reason": "chose"}
    live.models([manifest], tmp_path, {"nano": {**report, **personal}})
    snap = live.state.snapshot()
    [model] = snap["models"]
    assert (model["calibration"], model["holdout_accuracy"], model["url"]) == ("device", 0.81, None)
    assert (model["personal_accuracy"], model["personal_note"]) == (0.9, "head 3 epochs")
    assert (snap["own_accuracy"]["served"], snap["own_accuracy"]["personal"]) == (0.81, 0.9)
    assert snap["population_accuracy"] == pytest.approx(0.81)  # the served models' accuracy, as before
    assert [v["macs"] for v in snap["variants"]] == [1_390_000]  # a device's own accuracy is no validation point


def test_a_server_with_data_says_it_validated_there(view: LiveView) -> None:
    live = LiveView(
        DashboardState("federation", "t"), PRESET, CACHE, view.registry, rounds=3, federation="lab", validation="server"
    )
    live.round_started(0, ["nano"], timeout=60)
    live.round_finished(
        RoundRecord(round=1, lr=0.05, cohort=["nano"], updated=["nano"], applied=True, val_accuracy=0.4)
    )
    live.round_started(1, ["nano"], timeout=60)
    live.round_finished(RoundRecord(round=2, lr=0.05, cohort=["nano"], updated=["nano"], applied=True))
    snap = live.state.snapshot()
    assert snap["run"]["validation"] == "validation: on the server's data"
    assert [h["validated_on"] for h in snap["history"]] == [{"source": "server"}, None]
