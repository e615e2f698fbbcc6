"""``feast-server status``: devices, rounds and best accuracy of a run directory, for people and (``--json``) for scripts."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest

from feast_edge.run.checkpoint import save_supernet
from feast_edge.run.loop import CHECKPOINT, RoundRecord
from feast_edge.server.registry import Registry
from feast_edge.server.status import ago, read_status
from feast_edge.space.preset import load_preset, load_preset_file
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
from strategies import TINY_PRESET

CONFIG = {"rounds": 3, "preset": "test-tiny", "federation": "lab"}


def _register(out: Path) -> None:
    """Two devices, both heard from; pi-5 (served int8) is online and took part in two aggregates, nano in none."""
    registry = Registry(out / "devices.sqlite")
    common = {"instance": "i0", "preset": "test-tiny", "status": "offline"}
    registry.register(
        "pi-5",
        host="rack-a",
        budget_macs=6_600_000,
        samples=59,
        profile={"name": "raspberry-pi-5"},
        precision="int8",
        **common,
    )
    registry.register(
        "nano", host="rack-b", budget_macs=2_790_000, samples=31, profile={"name": "jetson-nano"}, **common
    )
    registry.set_host_status("rack-a", "online")
    registry.touch("pi-5", participated=True)
    registry.touch("pi-5", participated=True)
    registry.close()


def _checkpoint(out: Path, history: list[dict], best: dict, **fields: object) -> None:
    model = Supernet(load_preset_file(TINY_PRESET), seed=0)
    save_supernet(
        out / CHECKPOINT,
        model,
        kind="federation",
        round=len(history),
        history=history,
        best=best,
        config=CONFIG,
        **fields,
    )


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run after round 2 of 3: round 1 validated best (40%), round 2 left the model unchanged."""
    _register(tmp_path)
    history = [
        asdict(
            RoundRecord(
                round=1, lr=0.02, cohort=["nano", "pi-5"], updated=["pi-5"], applied=True, loss=2.1, val_accuracy=0.4
            )
        ),
        asdict(RoundRecord(round=2, lr=0.01, cohort=["nano", "pi-5"], applied=False, val_accuracy=0.35)),
    ]
    _checkpoint(tmp_path, history, {"round": 1, "val_accuracy": 0.4}, history_format=2)
    return tmp_path


def _row(stdout: str, device: str) -> list[str]:
    line = next(line for line in stdout.splitlines() if line.startswith(f"│ {device} "))
    return [cell.strip() for cell in line.strip("│").split("│")]


def test_status_lists_devices_rounds_and_the_best_round(server_cli, run_dir: Path) -> None:
    result = server_cli.invoke("status", "--out", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert f"run {run_dir}: federation 'lab', preset test-tiny" in result.stdout
    assert "rounds: 2/3 completed; last, round 2: unchanged, val 35.00%" in result.stdout
    # A record from before the served-round rule (no reason stored): the best validation accuracy's round.
    assert "served: weights of round 1 of 2, validation 40.00% (round 1: the best validation accuracy)" in result.stdout
    assert "devices: 1 of 2 online" in result.stdout
    device, host, status, seen, budget, precision, samples, rounds, profile = _row(result.stdout, "pi-5")
    assert (device, host, status, budget, precision, samples, rounds, profile) == (
        "pi-5",
        "rack-a",
        "online",
        "6.60M",
        "int8",
        "59",
        "2",
        "raspberry-pi-5",
    )
    assert re.fullmatch(r"\d+ (s|min|h) ago", seen)
    nano = _row(result.stdout, "nano")
    assert (nano[2], nano[5], nano[7]) == ("offline", "fp32", "0")  # status, precision, rounds


def test_status_json_is_one_object_for_scripts(server_cli, run_dir: Path) -> None:
    result = server_cli.invoke("status", "--out", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["rounds"] == {"completed": 2, "total": 3, "continuous": False}
    assert status["best"] == {"round": 1, "val_accuracy": 0.4}
    assert status["last_round"]["round"] == 2 and status["last_round"]["applied"] is False
    assert [(d["device"], d["status"], d["rounds"], d["profile"], d["precision"]) for d in status["devices"]] == [
        ("nano", "offline", 0, "jetson-nano", "fp32"),
        ("pi-5", "online", 2, "raspberry-pi-5", "int8"),
    ]
    assert all(d["seconds_since_seen"] >= 0 for d in status["devices"])


def test_missing_run_directory_or_registry_is_one_error_line(server_cli, tmp_path: Path) -> None:
    server_cli.assert_user_error(
        server_cli.invoke("status", "--out", str(tmp_path / "nowhere")), "does not exist; point --out at"
    )
    server_cli.assert_user_error(
        server_cli.invoke("status", "--out", str(tmp_path)), "has no device registry (devices.sqlite)"
    )
    assert not (tmp_path / "devices.sqlite").exists()  # status reads; it never creates a registry


def test_a_run_before_its_first_round(tmp_path: Path) -> None:
    _register(tmp_path)
    status = read_status(tmp_path)
    assert (
        status["rounds"] == {"completed": 0, "total": None, "continuous": False}
        and status["last_round"] is None
        and status["best"] is None
    )
    assert len(status["devices"]) == 2


def test_checkpoints_that_counted_rounds_from_zero_are_shown_from_one(tmp_path: Path) -> None:
    _register(tmp_path)
    old = [{"round": 0, "applied": True, "val_accuracy": 0.3}, {"round": 1, "applied": True, "val_accuracy": 0.5}]
    _checkpoint(tmp_path, old, {"round": 1, "val_accuracy": 0.5})  # no history_format: format 1
    status = read_status(tmp_path)
    assert status["last_round"]["round"] == 2 and status["best"] == {"round": 2, "val_accuracy": 0.5}


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.2, "0 s ago"),
        (12, "12 s ago"),
        (89, "89 s ago"),
        (180, "3 min ago"),
        (5 * 3600, "5 h ago"),
        (3 * 86400, "3 d ago"),
        (-2, "0 s ago"),
    ],
)
def test_last_seen_reads_as_elapsed_time(seconds: float, text: str) -> None:
    assert ago(seconds) == text


@pytest.mark.parametrize("federated", [True, False])
def test_status_says_where_the_run_validated(server_cli, tmp_path: Path, federated: bool) -> None:
    out = federation_run(tmp_path / "fed", load_preset_file(TINY_PRESET), federated=federated)
    result = server_cli.invoke("status", "--out", str(out))
    assert result.returncode == 0, result.stderr
    words = (
        f"validation: federated, on 2 devices' held-out data ({HELD_OUT} examples) in the last validated round"
        if federated
        else "validation: on the server's data"
    )
    assert words in result.stdout.splitlines()
    status = json.loads(server_cli.invoke("status", "--out", str(out), "--json").stdout)["validation"]
    assert status["source"] == ("devices" if federated else "server") and status["words"] == words
    assert (status["devices"], status["samples"]) == ((["cam-1", "pi-5"], HELD_OUT) if federated else ([], None))


def test_a_run_without_data_before_its_first_validation_is_federated(tmp_path: Path) -> None:
    _register(tmp_path)
    _checkpoint(tmp_path, [asdict(RoundRecord(round=1, lr=0.02, cohort=["pi-5"]))], {}, data=None)
    validation = read_status(tmp_path)["validation"]
    assert validation["source"] == "devices" and validation["words"] == (
        "validation: federated, on the devices' held-out data"
    )


def test_a_checkpoint_from_before_federated_validation_validated_on_the_server(run_dir: Path) -> None:
    assert read_status(run_dir)["validation"]["words"] == "validation: on the server's data"  # no "data" field


def test_status_shows_each_devices_own_accuracy_served_and_personal_the_mean_and_the_worst(
    server_cli, tmp_path: Path
) -> None:
    preset = load_preset_file(TINY_PRESET)
    out = add_personal_fleet(federation_run(tmp_path / "fed", preset, federated=True), preset)
    result = server_cli.invoke("status", "--out", str(out))
    assert result.returncode == 0, result.stderr  # the markup and the escape in cam-1's reason did not stop it
    assert _row(result.stdout, "pi-5")[9:] == [
        f"{100 * HOLDOUT_ACCURACY:.2f}%",
        f"{100 * PERSONAL_ACCURACY:.2f}% (prior τ=1)",
    ]
    kept = _row(result.stdout, "cam-1")
    assert kept[9] == "70.00%" and kept[10].startswith("70.00% (served model kept: [/bold]\\x1b[31m no method")
    for liar, field in (
        ("liar-range", "personal_accuracy"),
        ("liar-method", "personal_method"),
        ("liar-type", "personal_accuracy"),
    ):
        assert _row(result.stdout, liar)[9:] == ["95.00%", f"invalid report ({field})"], liar
    served, personal = FLEET_OWN_ACCURACY["served"], FLEET_OWN_ACCURACY["personal"]
    assert _row(result.stdout, "mean (2 of 5 devices)")[9:] == [f"{100 * served:.2f}%", f"{100 * personal:.2f}%"]
    assert _row(result.stdout, "worst (each column)")[9:] == ["cam-1 70.00%", "cam-1 70.00%"]
    assert (
        f"own held-out accuracy, served -> personal: mean {100 * served:.2f}% -> {100 * personal:.2f}% over 2 of 5 "
        "devices; worst served cam-1 70.00%, worst personal cam-1 70.00%"
    ) in result.stdout.splitlines()

    status = json.loads(server_cli.invoke("status", "--out", str(out), "--json").stdout)
    assert status["own_accuracy"] == pytest.approx(FLEET_OWN_ACCURACY)
    models = {d["device"]: d["model"] for d in status["devices"]}
    assert (models["pi-5"]["personal_method"], models["pi-5"]["personal_strength"]) == ("prior", 1.0)
    assert models["liar-method"]["personal_method"] is None and models["liar-range"]["personal_accuracy"] is None
    assert "\x1b" not in models["cam-1"]["personal_reason"]  # printable: the escape is shown, not sent


def test_status_of_a_run_whose_models_the_server_calibrated_has_no_own_accuracy(server_cli, tmp_path: Path) -> None:
    out = federation_run(tmp_path / "held", load_preset_file(TINY_PRESET), federated=False)
    status = read_status(out)
    assert status["own_accuracy"] is None and all(d["model"] is None for d in status["devices"])
    result = server_cli.invoke("status", "--out", str(out))
    assert "own acc" not in result.stdout and len(_row(result.stdout, "pi-5")) == 9


def test_status_shows_each_served_variants_class_coverage_and_the_fleets_coverage_problems(
    server_cli, tmp_path: Path
) -> None:
    preset = load_preset("fmnist-small")  # a preset status can load: the warnings name its classes
    out = federation_run(tmp_path / "fed", preset, federated=True)
    registry = Registry(out / "devices.sqlite")
    one_class = {"class_counts": [5] + [0] * 9, "holdout_counts": [1] + [0] * 9}
    register_device(registry, "solo", preset, 3_000_000, {"name": "x", **one_class})
    registry.close()
    result = server_cli.invoke("status", "--out", str(out))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("class coverage: solo holds one class only (T-shirt_top)") for line in lines), lines
    assert "served variants: the classes each saw" in result.stdout
    row = next(line for line in lines if "1.23M" in line and "pi-5" in line)
    assert "3 of 4 (missing d)" in row and "all 4" in row
    status = json.loads(server_cli.invoke("status", "--out", str(out), "--json").stdout)
    assert status["coverage"] == [
        {
            "macs": 1_230_000,
            "devices": ["pi-5"],
            "chosen_by": ["smaller: better on validation: 90.0% vs 60.0% for the 5.50M variant"],
            "trained": "3 of 4 (missing d)",
            "validated": "all 4",
            "calibrated": "-",
        }
    ]
    assert [w for w in status["coverage_warnings"] if "solo" in w] == [
        "solo holds one class only (T-shirt_top): its updates teach the model to answer T-shirt_top whatever it sees"
    ]


@pytest.mark.parametrize("recorded", [True, False])
def test_status_names_the_coverage_warnings_classes_where_the_runs_preset_file_does_not_load(
    server_cli, tmp_path: Path, recorded: bool
) -> None:
    preset = load_preset("fmnist-small")
    # A `preset new` file given by a relative path: status runs in another directory, where it does not load.
    out = federation_run(tmp_path / "fed", preset, federated=True, preset_name="my-preset.toml", classes=recorded)
    registry = Registry(out / "devices.sqlite")
    register_device(registry, "solo", preset, 3_000_000, {"name": "x", "class_counts": [5] + [0] * 9})
    registry.close()
    status = json.loads(server_cli.invoke("status", "--out", str(out), "--json", cwd=tmp_path).stdout)
    solo = [w for w in status["coverage_warnings"] if "solo" in w]
    # The names the run recorded; a run written before they were recorded has none to give.
    assert solo == ([("solo holds one class only (T-shirt_top): its updates teach the model to answer T-shirt_top "
                      "whatever it sees")] if recorded else [])  # fmt: skip


def _cell(stdout: str, device: str, column: int) -> str:
    """The text of one cell of ``device``'s row, over the lines it folds onto."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"│ {device} "))
    words = []
    for line in lines[start:]:
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        if not line.startswith("│") or (line is not lines[start] and cells[0]):
            break
        words.append(cells[column])
    return " ".join(w for w in words if w)


def test_status_names_the_classes_a_personal_model_was_tuned_to(server_cli, tmp_path: Path) -> None:
    preset = load_preset_file(TINY_PRESET)
    out = add_personal_fleet(federation_run(tmp_path / "fed", preset, federated=True), preset, TUNED)
    result = server_cli.invoke("status", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert _cell(result.stdout, "jetson-shirts", 10) == f"100.00% (prior τ=1; {TUNED_WORDS})"
    assert _cell(result.stdout, "pi-5", 10) == f"{100 * PERSONAL_ACCURACY:.2f}% (prior τ=1)"  # a report from before
    assert _cell(result.stdout, "liar-classes", 10) == "invalid report (personal_classes)"
    status = json.loads(server_cli.invoke("status", "--out", str(out), "--json").stdout)
    models = {d["device"]: d["model"] for d in status["devices"]}
    assert (models["jetson-shirts"]["personal_classes"], models["jetson-shirts"]["personal_task_classes"]) == (
        TUNED_CLASSES,
        10,
    )
    assert models["jetson-shirts"]["personal_tuned"] == TUNED_WORDS
    assert (models["pi-5"]["personal_classes"], models["pi-5"]["personal_tuned"]) == (None, "")


def test_status_shows_each_devices_running_version_since_when_and_its_own_accuracy_on_it(
    server_cli, run_dir: Path
) -> None:
    from feast_edge.versions.book import VersionBook
    from feast_edge.versions.gate import from_counts

    book = VersionBook(run_dir / "versions.sqlite")
    book.add(round=1, reason="round 1: the first validated round", weights_sha256="a" * 64, state="direct")
    book.add(round=2, reason="round 2: the newest", weights_sha256="b" * 64, state="canary", canaries=("pi-5",))
    for device in ("pi-5", "nano"):
        book.record(device, 1, "offered")
        book.record(device, 1, "first", running=1, figures={"accuracy": 0.5})
    book.record("pi-5", 2, "offered")
    book.record("pi-5", 2, "refused", figures=from_counts(50, 20, 40, 0, 20).figures(), running=1, reason="worse")
    book.decide(2, "held", "held back: it regressed on 1 of 1 canaries (pi-5 80.0% -> 40.0%)")
    book.record("nano", 2, "offered")
    book.record("nano", 2, "installed", figures=from_counts(40, 30, 28, 4, 2).figures(), running=2)
    book.close()
    status = json.loads(server_cli.invoke("status", "--out", str(run_dir), "--json").stdout)
    versions = status["versions"]
    assert [v["number"] for v in versions["versions"]] == [1, 2] and versions["versions"][1]["state"] == "held"
    assert (versions["installs"], versions["refusals"], versions["rollbacks"], versions["held"]) == (3, 1, 0, 1)
    running = {d["device"]: d["version"] for d in status["devices"]}
    assert running["nano"]["version"] == 2 and running["nano"]["accuracy"] == 0.75  # 30 of its 40 held-out examples
    assert running["pi-5"]["version"] == 1 and running["pi-5"]["accuracy"] == 0.5  # it kept version 1
    text = server_cli.invoke("status", "--out", str(run_dir)).stdout
    assert (
        "versions: 2; the newest, 2 (round 2): held (held back: it regressed on 1 of 1 canaries (pi-5 80.0% -> "
        "40.0%)); 3 installs, 1 refusals, 0 rollbacks, 1 held back"
    ) in " ".join(text.split())
    assert re.fullmatch(r"2 \(since \d+ s ago, own 75\.0%\)", _row(text, "nano")[-1])


def test_status_of_a_run_from_before_versions_has_no_versions(server_cli, run_dir: Path) -> None:
    status = json.loads(server_cli.invoke("status", "--out", str(run_dir), "--json").stdout)
    assert status["versions"] is None and all(d["version"] is None for d in status["devices"])
    assert "versions:" not in server_cli.invoke("status", "--out", str(run_dir)).stdout
