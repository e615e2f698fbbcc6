"""A preset written by ``feast-edge preset new`` for 3x64x64 images, trained by a real federation over Mosquitto.

``feast-server run`` (no data of its own) and two ``feast-agent run`` processes
on image folders of their own classes all load the preset from its file and
find its cache beside it (``my-task.cache.json``); each device ends with a
64x64 ONNX model, BN calibrated on its own images, that runs in onnxruntime.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from imagefolders import write_image_folder
from PIL import Image

from feast_edge.data.images import load_fashion_mnist
from feast_edge.space.preset import load_preset_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CLASSES = ("T-shirt_top", "Trouser", "Pullover", "Dress", "Coat")  # Fashion-MNIST's labels 0..4
# device -> (its classes, its budget, how its camera writes files)
DEVICES = {"cam-a": ((0, 1, 2), "2M", "png-64"), "cam-b": ((2, 3, 4), "6M", "jpeg-80x60")}
PER_CLASS = 20


def test_a_user_preset_federates_on_the_devices_images(kit, cli, federation, tmp_path, fashion_mnist_dir):
    preset_file = tmp_path / "my-task.toml"
    made = cli.invoke(
        "preset", "new", "--input", "3x64x64", "--classes", ",".join(CLASSES), "--budgets", "2M..200M",
        "--mean", "0.29", "--std", "0.35", "--out", str(preset_file),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    built = cli.invoke("cache", "build", "--preset", str(preset_file), "--population", "16", "--generations", "4")
    assert built.returncode == 0 and (tmp_path / "my-task.cache.json").is_file(), built.stderr
    train = load_fashion_mnist(fashion_mnist_dir, "train")
    for k, (device, (classes, _, style)) in enumerate(DEVICES.items()):
        write_image_folder(
            tmp_path / "data" / device, dict.fromkeys(classes, PER_CLASS), style, train, CLASSES, k * PER_CLASS
        )

    log_file, models = tmp_path / "server.log", tmp_path / "models"
    command = [
        sys.executable, "-m", "feast_edge.server.cli", "run", "--insecure", "--broker", kit.LOCAL, "--federation", federation,
        "--preset", str(preset_file), "--out", str(tmp_path / "server"), "--rounds", "1", "--per-round", "2",
        "--min-clients", "2", "--batch-size", "16", "--eval-every", "1", "--round-timeout", "120",
        "--wait-timeout", "120", "--threads", "1",
    ]  # fmt: skip
    with open(log_file, "w") as log:
        server = subprocess.Popen(command, cwd=kit.REPO, stdout=log, stderr=subprocess.STDOUT)
    agents = {
        device: kit.spawn_agent(
            tmp_path / "logs",
            device,
            tmp_path / "data" / device,
            federation,
            "--preset",
            str(preset_file),
            "--budget",
            budget,
            "--model-dir",
            str(models),
        )  # fmt: skip
        for device, (_, budget, _) in DEVICES.items()
    }
    try:
        for device, agent in agents.items():
            assert kit.wait_for(lambda: agent.poll() is not None, timeout=240), kit.log_text(agent)
            assert agent.returncode == 0, kit.log_text(agent)[-3000:] + log_file.read_text()[-3000:]
        assert server.wait(60) == 0, log_file.read_text()[-3000:]
    finally:
        for agent in agents.values():
            kit.stop(agent)
        kit.stop(server)

    preset = load_preset_file(preset_file)
    for device, (classes, budget, _) in DEVICES.items():
        log = kit.log_text(agents[device])
        assert f"federation '{federation}' finished after 1 of 1 rounds" in log, log[-2000:]
        assert f"{len(classes)} of the task's 5 classes" in log, log[-2000:]
        manifest = json.loads((models / f"{device}.json").read_text())
        assert manifest["preset"] == "my-task" and manifest["macs"] <= float(budget[:-1]) * 1e6
        session = ort.InferenceSession(str(models / f"{device}.onnx"), providers=["CPUExecutionProvider"])
        feed = session.get_inputs()[0]
        assert feed.shape[1:] == [3, 64, 64]
        image = next((tmp_path / "data" / device / CLASSES[classes[0]]).iterdir())
        pixels = preset.task.image_tensor(Image.open(image)).unsqueeze(0).float().div(255).numpy()
        logits = session.run(None, {feed.name: pixels})[0]
        assert logits.shape == (1, 5) and np.isfinite(logits).all()
    served = log_file.read_text()
    assert re.search(r"preset my-task, \d+ cached variants", served)  # the cache beside the preset, found by the server
    assert "round 1: federated validation (median of 2 device(s)" in served
    assert "BN statistics of the devices' data, combined (federated)" in served
