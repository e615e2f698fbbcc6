"""DashboardState: what writers merge, what readers get (a JSON-ready deep copy), bounds, secrets, versions and waiting."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from feast_edge.dashboard import DashboardState
from feast_edge.dashboard.state import MAX_DEVICES, MAX_STRING, MAX_TEXT


def test_set_device_creates_then_merges() -> None:
    state = DashboardState("federation", "lab")
    state.set_device("pi", budget_macs=6_600_000, online=True, variant={"label": "small", "macs": 1})
    state.set_device("pi", online=False, rounds=3)
    [device] = state.snapshot()["devices"]
    assert device == {
        "name": "pi",
        "budget_macs": 6_600_000,
        "online": False,
        "rounds": 3,
        "variant": {"label": "small", "macs": 1},
    }


def test_devices_are_listed_sorted_by_name() -> None:
    state = DashboardState("federation", "lab")
    for name in ("c", "a", "b"):
        state.set_device(name, online=True)
    assert [d["name"] for d in state.snapshot()["devices"]] == ["a", "b", "c"]


def test_set_run_merges_fields() -> None:
    state = DashboardState("simulation", "sim")
    state.set_run(preset="fmnist-small", rounds_total=5, status="waiting")
    state.set_run(rounds_done=1, status="running")
    assert state.snapshot()["run"] == {
        "preset": "fmnist-small",
        "rounds_total": 5,
        "rounds_done": 1,
        "status": "running",
    }
    state.set_run(
        status="paused"
    )  # a word the page does not know is shown as given, not raised inside the run it watches
    assert state.snapshot()["run"]["status"] == "paused"


def test_secret_named_fields_are_never_stored() -> None:
    state = DashboardState("federation", "lab")
    state.set_run(federation="lab", password="hunter2", mqtt_token="t0k", message="ok")
    state.set_device("pi", budget_macs=1, api_key="k", profile={"name": "pi-5", "client_secret": "s", "Password": "p"})
    text = json.dumps(state.snapshot())
    for secret in ("hunter2", "t0k", '"k"', '"s"', '"p"'):
        assert secret not in text
    assert state.snapshot()["run"] == {"federation": "lab", "message": "ok"}
    assert state.snapshot()["devices"][0]["profile"] == {"name": "pi-5"}


def test_strings_and_counts_are_bounded() -> None:
    state = DashboardState("federation", "x" * 1000)
    long = "d" * 5000
    state.set_device(long, hardware="h" * 5000)
    snapshot = state.snapshot()
    assert len(snapshot["title"]) == MAX_STRING
    assert snapshot["devices"][0]["name"] == long[:MAX_STRING]
    assert len(snapshot["devices"][0]["hardware"]) == MAX_STRING
    for i in range(MAX_DEVICES + 5):
        state.set_device(f"dev-{i:06d}")
    assert len(state.snapshot()["devices"]) == MAX_DEVICES
    state.set_device(long, online=True)  # a known device still updates when the fleet is full
    assert any(d["name"] == long[:MAX_STRING] and d.get("online") for d in state.snapshot()["devices"])


def test_snapshot_is_json_ready_and_a_deep_copy(tmp_path: Path) -> None:
    state = DashboardState("federation", "lab")
    state.set_device("pi", variant={"label": "small"}, last_seen=float("nan"))
    state.end_round(
        {
            "round": 1,
            "loss": float("inf"),
            "val_accuracy": 0.5,
            "devices": {"pi": {"down": 10, "up": 9}},
            "when": tmp_path,
        }
    )
    snapshot = state.snapshot()
    json.dumps(snapshot, allow_nan=False)  # NaN and infinity became None; a Path became text
    assert snapshot["devices"][0]["last_seen"] is None and snapshot["history"][0]["loss"] is None
    snapshot["devices"][0]["variant"]["label"] = "changed"
    snapshot["history"][0]["devices"]["pi"]["down"] = -1
    again = state.snapshot()
    assert again["devices"][0]["variant"]["label"] == "small"
    assert again["history"][0]["devices"]["pi"]["down"] == 10


def test_round_members_move_through_their_states() -> None:
    state = DashboardState("federation", "lab")
    state.start_round(2, ["a", "b"], deadline=1000.0)
    state.member("a", "downloading", done=2, total=5)
    state.member("b", "rejected", reason="payload does not match the routed envelope")
    state.member("stranger", "training")  # not in the round: ignored
    current = state.snapshot()["round"]
    assert current["round"] == 2 and current["deadline"] == 1000.0 and current["finished"] is False
    assert current["members"] == [
        {"device": "a", "state": "downloading", "done": 2, "total": 5, "reason": None},
        {
            "device": "b",
            "state": "rejected",
            "done": None,
            "total": None,
            "reason": "payload does not match the routed envelope",
        },
    ]
    state.member("a", "x" * 1000)  # an unknown state is shown as given (bounded), not raised
    assert state.snapshot()["round"]["members"][0]["state"] == "x" * MAX_STRING


def test_end_round_keeps_the_round_shown_until_the_next_starts() -> None:
    state = DashboardState("federation", "lab")
    state.start_round(1, ["a"], deadline=None)
    state.member("a", "aggregated")
    state.end_round({"round": 1, "val_accuracy": 0.4})
    snapshot = state.snapshot()
    assert snapshot["round"]["finished"] is True and snapshot["round"]["members"][0]["state"] == "aggregated"
    assert snapshot["history"] == [{"round": 1, "val_accuracy": 0.4}]
    state.start_round(2, ["a", "b"], deadline=None)
    assert [m["state"] for m in state.snapshot()["round"]["members"]] == ["routed", "routed"]


def test_models_expose_a_link_never_the_server_path(tmp_path: Path) -> None:
    state = DashboardState("federation", "lab")
    manifest = {
        "device": "pi 5/x",
        "arch": {"d": [0], "e": [0.5], "w": [1, 0]},
        "macs": 5,
        "params": 6,
        "validation_accuracy": 0.5,
        "sha256": "ab",
        "file": "pi.onnx",
    }
    state.set_models([manifest, {"device": "evil", "file": "../../etc/passwd"}], tmp_path)
    [model] = state.snapshot()["models"]
    assert model["url"] == "models/pi%205%2Fx.onnx"
    assert model["variant"] == "d=[0] e=[0.5] w=[1,0]"
    assert str(tmp_path) not in json.dumps(state.snapshot())
    assert state.model_path("pi 5/x") == tmp_path / "pi.onnx"
    assert state.model_path("evil") is None


def test_a_model_calibrated_on_its_device_shows_what_the_device_reported_and_no_link(tmp_path: Path) -> None:
    state = DashboardState("federation", "lab")
    manifest = {"device": "cam", "macs": 5, "rounds": 3, "calibration": "device", "file": "cam.variant.safetensors"}
    (tmp_path / "cam.variant.safetensors").write_bytes(b"weights")
    metrics = {"holdout_accuracy": 0.75, "holdout_samples": 12, "model_sha256": "ef", "model_round": 3, "token": "x"}
    state.set_models([manifest], tmp_path, {"cam": metrics})
    [model] = state.snapshot()["models"]
    assert (model["calibration"], model["accuracy"], model["holdout_samples"], model["sha256"]) == (
        "device",
        0.75,
        12,
        "ef",
    )
    assert model["accuracy_note"] == "calibrated on the device; held-out accuracy on its own data (12 examples)"
    # The weights the server sent for calibration are no download of the page.
    assert model["url"] is None and state.model_path("cam") is None and "token" not in model


def test_version_bumps_on_every_change() -> None:
    state = DashboardState("simulation", "sim")
    seen = [state.version]
    for change in (
        lambda: state.set_run(status="running"),
        lambda: state.set_device("a"),
        lambda: state.start_round(1, ["a"], None),
        lambda: state.member("a", "training"),
        lambda: state.end_round({"round": 1}),
        lambda: state.set_variants([]),
        lambda: state.set_population(0.5),
        lambda: state.add_run({"name": "r", "history": [{"round": 1}]}),
    ):
        change()
        seen.append(state.version)
    assert seen == sorted(set(seen)) and len(seen) == 9


def test_wait_returns_at_the_next_change_or_the_timeout() -> None:
    state = DashboardState("federation", "lab")
    start = state.version
    began = time.monotonic()
    assert state.wait(start, timeout=0.2) == start
    assert time.monotonic() - began >= 0.15
    writer = threading.Timer(0.1, lambda: state.set_device("a"))
    writer.start()
    began = time.monotonic()
    assert state.wait(start, timeout=10.0) == start + 1
    assert time.monotonic() - began < 5.0
    writer.join()


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="dashboard kind 'web'"):
        DashboardState("web", "x")


def test_history_and_round_members_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("feast_edge.dashboard.state.MAX_HISTORY", 5)
    monkeypatch.setattr("feast_edge.dashboard.state.MAX_MEMBERS", 3)
    state = DashboardState("federation", "lab")
    for r in range(1, 9):
        state.end_round({"round": r})
    state.start_round(9, [f"d{i}" for i in range(10)], None)
    snapshot = state.snapshot()
    assert [h["round"] for h in snapshot["history"]] == [4, 5, 6, 7, 8]  # the latest are kept
    assert [m["device"] for m in snapshot["round"]["members"]] == ["d0", "d1", "d2"]


def test_the_served_round_is_named_from_the_manifests_bounded_and_kept_when_none_says() -> None:
    state = DashboardState("federation", "lab")
    assert state.snapshot()["served"] == ""
    state.set_served("weights of round 4 so far: round 4: the newest validated round")
    assert state.snapshot()["served"] == "weights of round 4 so far: round 4: the newest validated round"

    def served_for(reason: str) -> str:
        manifest = {"device": "pi", "file": "pi.onnx", "served_round": {"round": 3, "of": 5, "reason": reason}}
        state.set_models([manifest], Path("models"))
        return state.snapshot()["served"]

    # A reason that names its devices is longer than a label, and kept whole (the page cuts it between words).
    falls = "regressed on 9 of 40 only (" + ", ".join(f"camera-{i:02d} 91.2% -> 88.7%" for i in range(9)) + ")"
    assert served_for(falls) == f"weights of round 3 of 5: {falls}" and len(falls) > MAX_STRING
    # Beyond MAX_TEXT it is cut between words, and ends in an ellipsis.
    endless = ", ".join(f"camera-{i:03d} 91.2% -> 88.7%" for i in range(400))
    served, whole = served_for(endless), f"weights of round 3 of 5: {endless}"
    assert len(served) <= MAX_TEXT and served.endswith("…") and whole.startswith(served[:-1])
    assert whole[len(served) - 1] in " ,", served[-20:]
    one_word = served_for("x" * 10_000)  # no space to cut at: cut at the bound
    assert one_word.startswith("weights of round 3 of 5: xxx") and len(one_word) == MAX_TEXT
    state.set_models([{"device": "pi", "file": "pi.onnx"}], Path("models"))  # an older manifest: no served round
    assert state.snapshot()["served"] == one_word
