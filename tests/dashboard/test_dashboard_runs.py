"""Finished runs as a dashboard: a real simulation's results.json, a federation's run directory, several runs compared, bad paths."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from feast_edge.dashboard import DashboardError, load_runs
from feast_edge.dashboard.runs import BYTES_PER_PARAM
from feast_edge.run.checkpoint import save_supernet
from feast_edge.run.loop import CHECKPOINT, HISTORY_FORMAT
from feast_edge.server.registry import Registry
from feast_edge.space.arch import Arch
from feast_edge.space.preset import Preset
from feast_edge.space.supernet import Supernet
from rundirs import (
    FLEET_OWN_ACCURACY,
    HELD_OUT,
    HOLDOUT_ACCURACY,
    PERSONAL_ACCURACY,
    TUNED,
    TUNED_CLASSES,
    TUNED_WORDS,
    add_personal_fleet,
    federation_run,
    register_device,
)

ARCH = {"d": [0, 0, 0], "e": [0.5, 0.5, 0.5], "w": [0, 0, 0, 0]}


def test_a_simulation_run_fills_the_page(finished_run) -> None:
    run = finished_run.out  # 2 clients, both in each of its 2 rounds
    results = json.loads((run / "results.json").read_text())
    snapshot = load_runs([run]).snapshot()
    assert snapshot["kind"] == "runs" and snapshot["title"].startswith(f"{run.name}: feast, seed 0, fmnist-tiny")
    assert (
        snapshot["run"]["status"] == "finished"
        and snapshot["run"]["rounds_done"] == snapshot["run"]["rounds_total"] == finished_run.rounds == 2
    )
    assert [(v["label"], v["macs"], v["test_accuracy"]) for v in snapshot["variants"]] == [
        (v["label"], v["macs"], v["test_accuracy"]) for v in results["variants"]
    ]
    assert snapshot["population_accuracy"] == pytest.approx(results["population_accuracy"])
    assert len(snapshot["history"]) == len(results["rounds"]) == 2
    for t, (entry, record) in enumerate(zip(snapshot["history"], results["rounds"]), start=1):
        assert (
            entry["round"] == t
            and entry["val_accuracy"] == record["val_accuracy"]
            and entry["train_macs"] == record["train_macs"]
        )
        assert (
            entry["bytes_down"] == BYTES_PER_PARAM * record["routed_params"]
            and entry["broadcast_bytes"] == BYTES_PER_PARAM * record["full_params"]
        )
        assert record["cohort"] == ["client-000", "client-001"]
        # synchronous rounds on the virtual clock: its time, and no staleness
        assert entry["clock"] == record["clock"] > 0 and entry["staleness_max"] is None
    assert snapshot["history"][0]["clock"] < snapshot["history"][1]["clock"]
    assert [d["name"] for d in snapshot["devices"]] == ["client-000", "client-001"]
    for device, budget, served in zip(snapshot["devices"], results["population"]["budgets"], results["served"]):
        assert device["budget_macs"] == budget and device["variant"]["macs"] == results["variants"][served]["macs"]
        assert device["rounds"] == 2 and device["last_upload"]["status"] == "accepted"
    assert snapshot["models"] == [] and snapshot["runs"] == []


def test_several_runs_are_compared(simulation_run: Path, tmp_path: Path) -> None:
    other = tmp_path / "a" / simulation_run.name
    shutil.copytree(simulation_run, other)
    snapshot = load_runs([simulation_run, other]).snapshot()
    assert [r["name"] for r in snapshot["runs"]] == [
        str(simulation_run),
        str(other),
    ]  # the same folder name: told apart by path
    for run in snapshot["runs"]:
        assert (
            run["method"] == "feast"
            and run["seed"] == 0
            and len(run["variants"]) == len(snapshot["runs"][0]["variants"]) > 0
        )
        assert run["history"][0]["val_accuracy"] is not None
    assert snapshot["devices"] == [] and snapshot["history"] == []
    assert snapshot["run"]["rounds_done"] == snapshot["run"]["rounds_total"] == 2


def _federation_run(out: Path, tiny: Preset) -> Path:
    """What ``feast-server run`` leaves: a checkpoint with 2 of 3 rounds, the registry, one exported model."""
    out.mkdir()
    history = [
        {
            "round": r,
            "lr": 0.1,
            "cohort": ["cam-1", "pi-5"],
            "updated": ["cam-1", "pi-5"] if r == 1 else ["pi-5"],
            "rejected": {} if r == 1 else {"cam-1": "bad digest"},
            "loss": 1.5,
            "routed_params": 1000,
            "full_params": 5000,
            "train_macs": 10**9,
            "seconds": 3.0,
            "val_accuracy": 0.2 * r,
        }
        for r in (1, 2)
    ]
    config = {"federation": "lab", "preset": tiny.name, "rounds": 3, "method": "feast", "seed": 7}
    save_supernet(
        out / CHECKPOINT,
        Supernet(tiny, seed=0),
        kind="federation",
        fingerprint="x",
        config=config,
        round=2,
        history=history,
        history_format=HISTORY_FORMAT,
        best={},
        registry=[],
    )
    registry = Registry(out / "devices.sqlite")
    for name, budget, precision in (("cam-1", 2_000_000, "fp32"), ("pi-5", 6_000_000, "int8")):
        register_device(registry, name, tiny, budget, precision=precision)
    registry.close()
    models = out / "models"
    models.mkdir()
    (models / "pi-5.onnx").write_bytes(b"onnx")
    manifest = {
        "device": "pi-5",
        "arch": ARCH,
        "macs": 123,
        "params": 45,
        "validation_accuracy": 0.4,
        "file": "pi-5.onnx",
        "sha256": "cd" * 32,
        "size": 4,
    }
    (models / "index.json").write_text(json.dumps({"models": [manifest]}))
    return out


def test_a_federation_run_directory(tmp_path: Path, tiny: Preset) -> None:
    out = _federation_run(tmp_path / "fed", tiny)
    state = load_runs([out])
    snapshot = state.snapshot()
    assert snapshot["title"] == f"fed: federation 'lab', {tiny.name}"
    assert (
        snapshot["run"]["rounds_done"] == 2
        and snapshot["run"]["rounds_total"] == 3
        and snapshot["run"]["status"] == "waiting"
    )
    assert [h["val_accuracy"] for h in snapshot["history"]] == [0.2, 0.4]
    cam, pi = snapshot["devices"]
    assert (
        cam["name"],
        cam["budget_macs"],
        cam["rounds"],
        cam["last_upload"]["status"],
        cam["last_upload"]["reason"],
    ) == ("cam-1", 2_000_000, 1, "rejected", "bad digest")
    assert cam["profile"] == "raspberry-pi-5" and cam["hardware"] == "4x Cortex-A76" and cam["last_seen"] <= time.time()
    assert pi["variant"] == {"label": str(Arch.from_dict(ARCH)), "macs": 123, "params": 45}
    assert (cam["precision"], pi["precision"]) == ("fp32", "int8")
    [model] = snapshot["models"]
    assert model["url"] == "models/pi-5.onnx" and model["validation_accuracy"] == 0.4
    assert state.model_path("pi-5") == out / "models" / "pi-5.onnx"
    assert [(v["macs"], v["val_accuracy"]) for v in snapshot["variants"]] == [(123, 0.4)]
    assert snapshot["population_accuracy"] == pytest.approx(
        0.4
    )  # the mean over devices of the exported models' accuracy


def test_a_federation_without_server_data_says_it_validated_and_calibrated_on_the_devices(
    tmp_path: Path, tiny: Preset
) -> None:
    state = load_runs([federation_run(tmp_path / "fed", tiny, federated=True)])
    snapshot = state.snapshot()
    assert snapshot["run"]["validation"] == f"validation: federated, on 2 devices' held-out data ({HELD_OUT} examples)"
    assert [h["validated_on"] for h in snapshot["history"]] == [
        {"source": "devices", "devices": 2, "samples": HELD_OUT}
    ] * 2
    [model] = snapshot["models"]
    assert model["calibration"] == "device" and model["accuracy"] == model["holdout_accuracy"] == HOLDOUT_ACCURACY
    assert model["accuracy_note"] == "calibrated on the device; held-out accuracy on its own data (40 examples)"
    assert model["validation_accuracy"] is None and model["sha256"] == "ef" * 32  # the ONNX file the device exported
    # The server holds only the weights it sent: no download link, nothing served.
    assert model["url"] is None and state.model_path("pi-5") is None
    assert snapshot["variants"] == [] and snapshot["population_accuracy"] == pytest.approx(HOLDOUT_ACCURACY)
    # Beside it, its personal model: the device's own held-out accuracy and how it made it.
    assert (model["personal_accuracy"], model["personal_method"], model["personal_note"]) == (
        PERSONAL_ACCURACY,
        "prior",
        "prior τ=1",
    )
    assert snapshot["own_accuracy"] == {
        "devices": 1,
        "counted": 1,
        "served": HOLDOUT_ACCURACY,
        "personal": PERSONAL_ACCURACY,
        "worst_served_device": "pi-5",
        "worst_served": HOLDOUT_ACCURACY,
        "worst_personal_device": "pi-5",
        "worst_personal": PERSONAL_ACCURACY,
        "served_worst_decile": HOLDOUT_ACCURACY,
        "personal_worst_decile": PERSONAL_ACCURACY,
    }


def test_the_devices_own_accuracy_has_a_mean_and_a_worst_device_and_lying_reports_count_for_nothing(
    tmp_path: Path, tiny: Preset
) -> None:
    out = add_personal_fleet(federation_run(tmp_path / "fed", tiny, federated=True), tiny)
    snapshot = load_runs([out]).snapshot()
    models = {m["device"]: m for m in snapshot["models"]}
    assert (
        models["cam-1"]["personal_accuracy"] == models["cam-1"]["accuracy"] and models["cam-1"]["personal_method"] == ""
    )
    assert models["cam-1"]["personal_note"].startswith("served model kept: [/bold]\\x1b[31m no method")
    for liar, field in (
        ("liar-range", "personal_accuracy"),
        ("liar-method", "personal_method"),
        ("liar-type", "personal_accuracy"),
    ):
        model = models[liar]
        assert model["accuracy"] == 0.95 and model["personal_accuracy"] is None, liar
        assert (model["personal_method"], model["personal_note"]) == (None, f"invalid report ({field})"), liar
    assert snapshot["own_accuracy"] == pytest.approx(FLEET_OWN_ACCURACY)


def test_a_federation_on_server_data_says_so(tmp_path: Path, tiny: Preset) -> None:
    state = load_runs([federation_run(tmp_path / "fed", tiny, federated=False)])
    snapshot = state.snapshot()
    assert snapshot["run"]["validation"] == "validation: on the server's data"
    assert [h["validated_on"] for h in snapshot["history"]] == [{"source": "server"}] * 2
    [model] = snapshot["models"]
    assert (model["calibration"], model["accuracy"], model["accuracy_note"]) == (
        "server",
        0.4,
        "validation, on the server's data",
    )
    assert model["url"] == "models/pi-5.onnx" and state.model_path("pi-5") == tmp_path / "fed" / "models" / "pi-5.onnx"
    assert model["personal_accuracy"] is None and snapshot["own_accuracy"] is None  # no own accuracy to set it beside


def test_compared_federations_say_where_each_validated(tmp_path: Path, tiny: Preset) -> None:
    runs = [federation_run(tmp_path / name, tiny, federated=name == "own") for name in ("own", "held")]
    compared = load_runs(runs).snapshot()["runs"]
    assert [(r["name"], r["validation"]) for r in compared] == [
        ("own", f"validation: federated, on 2 devices' held-out data ({HELD_OUT} examples)"),
        ("held", "validation: on the server's data"),
    ]
    assert compared[0]["history"][0]["validated_on"]["source"] == "devices"


def test_a_device_report_of_another_export_is_not_this_models(tmp_path: Path, tiny: Preset) -> None:
    out = federation_run(tmp_path / "fed", tiny, federated=True)
    registry = Registry(out / "devices.sqlite")
    registry.touch("pi-5", metrics={"holdout_accuracy": 0.99, "model_round": 1})  # an export after round 1
    registry.close()
    [model] = load_runs([out]).snapshot()["models"]
    assert model["accuracy"] is None and model["accuracy_note"] == "calibrated on the device; no report from it yet"


def test_paths_that_are_not_run_directories(tmp_path: Path) -> None:
    with pytest.raises(
        DashboardError, match=f"^run directory {tmp_path / 'gone'} does not exist; a run directory holds results.json"
    ):
        load_runs([tmp_path / "gone"])
    with pytest.raises(
        DashboardError,
        match=f"^{tmp_path} is not a run directory: it holds neither results.json nor checkpoint.safetensors",
    ):
        load_runs([tmp_path])
    with pytest.raises(DashboardError, match="^give at least one run directory"):
        load_runs([])
    (tmp_path / "results.json").write_text("{not json")
    with pytest.raises(DashboardError, match=f"^cannot read {tmp_path / 'results.json'}"):
        load_runs([tmp_path])


def test_a_personal_model_tuned_to_fewer_classes_shows_them_on_the_page(tmp_path: Path, tiny: Preset) -> None:
    out = add_personal_fleet(federation_run(tmp_path / "fed", tiny, federated=True), tiny, TUNED)
    models = {m["device"]: m for m in load_runs([out]).snapshot()["models"]}
    shirts = models["jetson-shirts"]
    assert (shirts["personal_classes"], shirts["personal_task_classes"]) == (TUNED_CLASSES, 10)
    assert shirts["personal_tuned"] == TUNED_WORDS and shirts["personal_note"] == "prior τ=1"
    assert (models["pi-5"]["personal_tuned"], models["pi-5"]["personal_classes"]) == ("", None)
    assert models["liar-classes"]["personal_note"] == "invalid report (personal_classes)"
