"""FEAST on Flower's Deployment Engine computes exactly what the simulator computes: real processes, same weights.

A real ``flower-superlink`` and five ``flower-supernode`` processes on loopback (tests/flowerkit.py), the app
project written by ``feast-edge flower new``, the run started with ``flwr run`` as a user starts it. Three nodes
hold the shards of kit.CONFIG's population on fmnist-small (the Flower path's real-size guard) (``feast-edge partition``); a fourth has no data and a fifth holds images of classes the
task does not have: both decline at registration with their reason and the run goes on. After two rounds the
global weights must equal that simulation's bit for bit, each node's ONNX file must run in
onnxruntime, and ``feast-edge report`` / the dashboard must read the run directory like any other.

Why the Deployment Engine and not Flower's Simulation Engine: the Simulation Engine needs Ray (flwr[simulation],
a ~70 MB runtime that starts its own cluster services), too heavy for the 2-core CI machine; the Deployment
Engine is what a lab runs, and it is what the per-device data path needs (each SuperNode reads its own data).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image

from feast_edge.cache.variants import load_cache
from feast_edge.dashboard.runs import read_run
from feast_edge.data.images import load_fashion_mnist
from feast_edge.run.checkpoint import read_record
from feast_edge.run.loop import CHECKPOINT
from feast_edge.sim.setup import SimulationConfig
from feast_edge.sim.shards import read_index, write_partition
from feast_edge.sim.simulate import Simulation
from feast_edge.space.preset import load_preset
from flowerkit import LocalFlower

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _app(tmp: Path, kit) -> Path:
    """The project ``feast-edge flower new`` writes, with the two settings kit.CONFIG adds to its config table."""
    app = tmp / "app"
    done = subprocess.run(
        [sys.executable, "-m", "feast_edge.cli", "flower", "new", str(app), "--rounds", "2"],
        capture_output=True,
        text=True,
        cwd=kit.REPO,
    )
    assert done.returncode == 0, done.stderr
    pyproject = app / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + "batch-size = 32\nstart-clients = 3\n")  # as a user edits it
    return app


def _wrong_task_folder(root: Path) -> Path:
    """Images of a class Fashion-MNIST does not have."""
    folder = root / "wrong-task" / "giraffe"
    folder.mkdir(parents=True)
    for i in range(4):
        Image.fromarray(np.full((28, 28), 40 * i, dtype=np.uint8)).save(folder / f"{i}.png")
    return folder.parent


@pytest.fixture(scope="module")
def config(kit) -> SimulationConfig:
    """kit.CONFIG's population on fmnist-small: this module is the Flower path's real-size guard."""
    return kit.CONFIG.changed(preset="fmnist-small")


@pytest.fixture(scope="module")
def partition(config: SimulationConfig, tmp_path_factory: pytest.TempPathFactory, fashion_mnist_dir: Path) -> Path:
    """``config``'s shards (read-only for the tests), with the server's held-out split."""
    out = tmp_path_factory.mktemp("partition-small")
    write_partition(config, out)
    return out


@pytest.fixture(scope="module")
def flower_run(
    kit, config: SimulationConfig, tmp_path_factory: pytest.TempPathFactory, partition: Path
) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("flower")
    app, out = _app(tmp, kit), tmp / "run"
    run_config = {
        "out-dir": str(out),
        "preset": config.preset,
        "rounds": config.training.rounds,
        "per-round": config.population.per_round,
        "min-clients": config.population.per_round,
        "seed": config.seed,
        "batch-size": config.training.batch_size,
        "start-clients": config.population.clients,
        "eval-every": 1,
        "data": str(partition),
        "round-timeout": 300.0,
        "wait-timeout": 300.0,
    }
    with LocalFlower(tmp / "deployment") as flower:
        for i, _ in enumerate(read_index(partition)["clients"]):
            flower.supernode({"data": str(partition), "offset": i, "threads": 1})
        flower.supernode({"threads": 1})  # no data
        flower.supernode({"data": str(_wrong_task_folder(tmp)), "budget": "20M", "threads": 1})
        flower.wait_nodes(5)
        run = flower.run(app, run_config, timeout=700)
        yield {"run": run, "out": out, "logs": flower.logs()}


def test_the_run_completes_and_its_weights_equal_the_simulation(
    kit, flower_run: dict, config: SimulationConfig, tmp_path: Path
) -> None:
    run = flower_run["run"]
    assert run.status == "finished:completed", f"{run.details}\n{run.output}\n{flower_run['logs']}"
    simulated = kit.simulated_weights(config, tmp_path / "simulation")
    got = kit.weights(flower_run["out"] / CHECKPOINT)
    diff = kit.max_abs_diff(got, simulated)
    assert all(torch.equal(got[k], simulated[k]) for k in got), f"Flower run and simulation differ by {diff}"


def test_rounds_use_the_simulators_cohorts_and_every_update(
    kit, flower_run: dict, config: SimulationConfig, tmp_path: Path
) -> None:
    record = read_record(flower_run["out"] / CHECKPOINT)
    history = record["fields"]["history"]
    sim = Simulation(config, tmp_path)
    assert [h["round"] for h in history] == [1, 2]
    for t, h in enumerate(history):
        assert h["cohort"] == sim.run_round(t).cohort
        assert h["updated"] == h["cohort"] and h["applied"] and not h["rejected"] and not h["missing"]
        assert 0 <= h["val_accuracy"] <= 1


def test_nodes_without_data_or_with_data_outside_the_task_decline_with_their_reason(flower_run: dict) -> None:
    output = flower_run["run"].output
    assert "takes no part in the run: it declined: this SuperNode has no data" in output, output
    assert "giraffe" in output and "is not one of the task's 10 classes" in output, output
    assert output.count("takes no part in the run") == 2, output


def test_each_node_gets_its_largest_affordable_variant_as_onnx(
    kit, flower_run: dict, config: SimulationConfig, partition: Path, fashion_mnist_dir: Path
) -> None:
    out, preset = flower_run["out"], load_preset(config.preset)
    cache = load_cache(preset)
    index = json.loads((out / "models" / "index.json").read_text())
    budgets = {e["client_id"]: e["budget_macs"] for e in read_index(partition)["clients"]}
    models = {m["device"]: m for m in index["models"]}
    assert sorted(models) == sorted(budgets)
    test = load_fashion_mnist(fashion_mnist_dir, "test")
    images = (test.images[:64].float() / 255.0).numpy()
    for device, budget in budgets.items():
        entry = cache.largest_affordable(budget)
        assert models[device]["macs"] == entry.macs and models[device]["arch"] == entry.arch.to_dict()
        session = ort.InferenceSession(str(out / "models" / models[device]["file"]), providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        logits = session.run(None, {name: images})[0]
        assert logits.shape == (64, preset.classes) and np.isfinite(logits).all()


def test_report_and_dashboard_read_the_run_directory(kit, flower_run: dict, tmp_path: Path) -> None:
    out = flower_run["out"]
    report = subprocess.run(
        [sys.executable, "-m", "feast_edge.cli", "report", str(out), "--out", str(tmp_path / "report")],
        capture_output=True,
        text=True,
        cwd=kit.REPO,
    )
    assert report.returncode == 0, report.stderr
    assert out.name in (tmp_path / "report" / "report.md").read_text()
    data = read_run(out)
    assert [entry["round"] for entry in data.summary()["history"]] == [1, 2]
    assert sorted(data.devices) == ["client-000", "client-001", "client-002"] and len(data.manifests) == 3
