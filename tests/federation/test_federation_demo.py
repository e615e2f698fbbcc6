"""``feast-edge demo`` end to end, reduced to one round and small shards to keep CI time down.

The full demo (3 rounds, 800 examples per device) is timed in the report; here
the same code path runs with ``--rounds 1``: embedded broker, partition,
``feast-server`` and four ``feast-agent`` processes with different profiles,
export, push, onnxruntime, summary table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from rich.console import Console

from feast_edge.server.demo import own_accuracy, summary_table, thread_plan
from feast_edge.sim.shards import read_index
from feast_edge.util.cores import affinity_cpus

PROFILES = ("raspberry-pi-5", "jetson-nano", "laptop-cpu", "desktop-gpu")


@pytest.mark.slow
@pytest.mark.broker  # the demo's embedded broker is the mosquitto program
@pytest.mark.timeout(900)
def test_demo_trains_exports_and_times_a_model_for_every_device(cli, tmp_path: Path, fashion_mnist_dir: Path) -> None:
    result = cli.run("demo", "--rounds", "1", "--samples", "150", "--out", str(tmp_path / "demo"), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "broker: mosquitto (embedded" in out
    assert "round 1/1  replies 4/4  aggregated" in out
    for name in PROFILES:
        assert (tmp_path / "demo" / "device-models" / f"{name}.onnx").is_file()
        row = next(line for line in out.splitlines() if line.startswith(f"│ {name} "))
        assert row.count("%") == 3  # own acc served, own acc personal, test acc
    assert next(line for line in out.splitlines() if line.startswith("│ mean (")).count("%") == 2
    assert "ONNX files: device-models/DEVICE.onnx, DEVICE.personal.onnx beside it" in out
    assert "personalization on (feast-agent run --personalize auto, the default)" in out
    assert "Wall time" in out
    # The thread plan, read from what each process said it computes with: one thread per agent when there are at
    # least as many agents as cores, every core for the server (it computes while the agents wait).
    logs = tmp_path / "demo" / "logs"
    samples = [c["samples"] for c in read_index(tmp_path / "demo" / "partition")["clients"]]
    server_threads, agent_threads = thread_plan(len(affinity_cpus()), samples)
    for name, threads in zip(PROFILES, agent_threads):
        said = (logs / f"agent-{name}.log").read_text()
        assert f"training with {threads} thread{'s' * (threads != 1)}: --threads {threads}" in said, said
    said = (logs / "server.log").read_text()
    assert f"aggregating with {server_threads} thread{'s' * (server_threads != 1)}: --threads" in said, said


@pytest.mark.parametrize(
    ("cores", "samples", "server", "agents"),
    [
        (2, [400, 900, 300, 1200], 2, [1, 1, 1, 1]),  # agents >= cores: one thread each, 4 = max(cores, agents)
        (4, [100, 300], 4, [2, 2]),
        (8, [100, 300, 200], 8, [2, 3, 3]),  # the cores shared out, the largest shards first
        (1, [100, 300], 1, [1, 1]),
    ],
)
def test_the_demo_thread_plan_takes_max_of_cores_and_agents_while_they_train(cores, samples, server, agents) -> None:
    assert thread_plan(cores, samples) == (server, agents)
    assert sum(agents) == max(cores, len(samples))


def _kept_model(folder: Path, device: str, accuracy: float, personal: dict | None = None) -> dict:
    """A summary row of the demo for a model ``device`` calibrated (held-out ``accuracy``), its personal model's
    manifest beside it when ``personal`` is given."""
    manifest = {"device": device, "calibration": "device", "holdout_accuracy": accuracy, "sha256": device * 8}
    path = folder / f"{device}.onnx"
    (folder / f"{device}.json").write_text(json.dumps(manifest))
    if personal is not None:
        (folder / f"{device}.personal.json").write_text(json.dumps({"served_sha256": device * 8, **personal}))
    return {
        "device": device,
        "budget_macs": 5e6,
        "macs": 4e6,
        "params": 1e5,
        "calibrated": "device (200)",
        "own": own_accuracy(path, manifest),
        "test_accuracy": 0.5,
        "test_images": 100,
        "onnx": f"device-models/{device}.onnx",
        "latency_ms": 0.5,
    }


def test_the_demo_summary_shows_own_accuracy_served_and_personal_the_mean_and_the_worst_of_each(
    tmp_path: Path,
) -> None:
    personal = {"personal_method": "bn", "personal_strength": 1, "holdout_accuracy_personal": 0.85}
    stale = {**personal, "served_sha256": "an earlier served file"}
    rows = [
        _kept_model(tmp_path, "pi", 0.8, personal),
        _kept_model(tmp_path, "nano", 0.75),  # kept the served model: no .personal.json
        _kept_model(tmp_path, "desk", 0.9, stale),  # a personal model of another served file is not this one's
        # The lowest served accuracy, and a personal model far above it: the worst of one column only.
        _kept_model(tmp_path, "jetson", 0.0845, {**personal, "holdout_accuracy_personal": 0.8844}),
    ]
    console = Console(width=250, record=True)
    console.print(summary_table(rows, "demo", server_data=False))
    lines = console.export_text().splitlines()
    cells = {
        c[0]: c for c in ([c.strip() for c in line.strip("│").split("│")] for line in lines if line.startswith("│"))
    }
    assert cells["pi"][5:7] == ["80.00%", "85.00% (bn 1 epoch)"]
    assert cells["nano"][5:7] == ["75.00%", "75.00% (served model kept)"]
    assert cells["desk"][5:7] == ["90.00%", "90.00% (served model kept)"]
    assert cells["mean (4 of 4 devices)"][5:7] == ["63.36%", "84.61%"]
    # Each column's worst with its own device: jetson's served model, nano's (kept) personal one.
    assert cells["worst (each column)"][5:7] == ["jetson 8.45%", "nano 75.00%"]
    assert any("personalization on (feast-agent run --personalize auto, the default)" in line for line in lines)


def test_the_demo_summary_names_the_classes_a_personal_model_was_tuned_to(tmp_path: Path) -> None:
    """Read from the ``.personal.json`` the agent wrote; one written before the field reads as it did."""
    personal = {"personal_method": "head", "personal_strength": 10, "holdout_accuracy_personal": 1.0}
    tuned = {**personal, "personal_classes": ["T-shirt_top", "Pullover", "Shirt"], "personal_task_classes": 10}
    rows = [_kept_model(tmp_path, "jetson", 0.5, tuned), _kept_model(tmp_path, "pi", 0.8, personal)]
    console = Console(width=300, record=True)
    console.print(summary_table(rows, "demo", server_data=False))
    cells = {
        c[0]: c
        for c in ([c.strip() for c in line.strip("│").split("│")] for line in console.export_text().splitlines())
    }
    words = "tuned to 3 of 10 classes: T-shirt_top, Pullover, Shirt; serve the global model for the others"
    assert cells["jetson"][5:7] == ["50.00%", f"100.00% (head 10 epochs; {words})"]
    assert cells["pi"][5:7] == ["80.00%", "100.00% (head 10 epochs)"]


def test_the_demo_summary_cuts_nothing_in_a_narrow_terminal_and_names_the_model_files(tmp_path: Path) -> None:
    rows = [_kept_model(tmp_path, "raspberry-pi-5", 0.8), _kept_model(tmp_path, "desktop-gpu", 0.9)]
    wide = Console(width=160, record=True)
    wide.print(summary_table(rows, "demo", server_data=False))
    text = wide.export_text()
    assert "ONNX files: device-models/DEVICE.onnx, DEVICE.personal.onnx beside it" in text
    assert "│ raspberry-pi-5 " in text  # at 160 columns a device's row is one line
    narrow = Console(width=90, record=True)
    narrow.print(summary_table(rows, "demo", server_data=False))
    text = narrow.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 90
    first_column, served = (
        "".join(line.split("│")[column].strip() for line in text.splitlines() if line.startswith("│"))
        for column in (1, 6)
    )
    assert first_column.startswith("raspberry-pi-5desktop-gpu") and first_column.endswith("worst(eachcolumn)")
    assert served.endswith("raspberry-pi-580.00%")  # the worst served device's name whole, folded over lines


def test_with_server_data_the_summary_has_no_personal_column(tmp_path: Path) -> None:
    console = Console(width=250, record=True)
    console.print(summary_table([_kept_model(tmp_path, "pi", 0.8)], "demo", server_data=True))
    text = console.export_text()
    header = next(line for line in text.splitlines() if "device" in line and "┃" in line)
    assert [c.strip() for c in header.strip("┃").split("┃")][5:7] == ["val acc", "test acc (100)"]
    assert "personal" not in text and "served model kept" not in text
    assert "ONNX files: device-models/DEVICE.onnx" in text  # and no personal file: "personal" is nowhere


def test_the_demo_summary_marks_a_variant_the_serving_rule_chose_smaller(tmp_path: Path) -> None:
    rule = "smaller: better on validation: 87.2% vs 79.3% for the 6.60M variant"
    rows = [{**_kept_model(tmp_path, "pi", 0.8), "chosen_by": rule}, _kept_model(tmp_path, "desk", 0.9)]
    console = Console(width=250, record=True)
    console.print(summary_table(rows, "demo", server_data=False))
    text = console.export_text()
    cells = {c[0]: c for c in ([c.strip() for c in ln.strip("│").split("│")] for ln in text.splitlines() if "│" in ln)}
    assert cells["pi"][2].endswith("*") and not cells["desk"][2].endswith("*")
    assert f"* pi: {rule}" in text


def _amqtt_env() -> dict[str, str]:
    """amqtt as `pip install 'feast-edge[amqtt]'` gives it: installed here, or in the directory make venv puts beside the
    venv (amqtt and flwr cannot share an environment; pyproject.toml says why)."""
    if importlib.util.find_spec("amqtt") is not None:
        return {}
    side = Path(sys.prefix) / "amqtt-side"
    if not (side / "amqtt").is_dir():
        pytest.skip(f"amqtt is not installed (pip install 'feast-edge[amqtt]'; make venv puts it in {side})")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(side), os.environ.get("PYTHONPATH")]))}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_runs_on_the_pure_python_broker(cli, tmp_path: Path, fashion_mnist_dir: Path) -> None:
    # The README's quickstart without root: the four Fashion-MNIST files in a folder of the user's, given with --data.
    own = tmp_path / "fashion-mnist"
    own.mkdir()
    for file in fashion_mnist_dir.iterdir():
        if file.name.startswith(("train-", "t10k-")):
            (own / file.name).symlink_to(file)
    result = cli.run(
        "demo",
        "--data",
        str(own),
        "--rounds",
        "1",
        "--samples",
        "100",
        "--profiles",
        "jetson-nano,raspberry-pi-5",
        "--embedded-broker",
        "amqtt",
        "--out",
        str(tmp_path / "demo"),
        env=_amqtt_env(),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "broker: amqtt (embedded, pure Python)" in result.stdout
    assert "round 1/1  replies 2/2  aggregated" in result.stdout


def test_demo_without_the_data_set_says_how_to_get_it(cli, tmp_path: Path) -> None:
    result = cli.invoke("demo", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "demo"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("error: Fashion-MNIST is not installed in")
    assert "apt-get install dataset-fashion-mnist" in result.stderr
