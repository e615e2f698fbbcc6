"""A preset written by ``feast-edge preset new`` for 3x64x64 images, trained by a real federation over Mosquitto.

The server thread and an agent process both load the preset from its file and
find its cache beside it (``my-task.cache.json``); the agent receives a 64x64
ONNX model per hosted client and it runs in onnxruntime.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image

from feast_edge.data.images import load_fashion_mnist
from feast_edge.space.preset import load_preset_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CLASSES = ("T-shirt_top", "Trouser", "Pullover", "Dress", "Coat")  # Fashion-MNIST's labels 0..4


def _png_folder(root: Path, fashion_mnist_dir: Path, per_class: int) -> None:
    data = load_fashion_mnist(fashion_mnist_dir, "train")
    for label, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in (data.labels == label).nonzero().flatten()[:per_class].tolist():
            image = Image.fromarray(data.images[i, 0].numpy(), "L").convert("RGB").resize((64, 64))
            image.save(root / name / f"{i}.png")


def test_a_user_preset_federates(kit, cli, federation, tmp_path, fashion_mnist_dir):
    images = tmp_path / "images"
    _png_folder(images / "train", fashion_mnist_dir, 16)
    _png_folder(images / "test", fashion_mnist_dir, 2)
    preset_file = tmp_path / "my-task.toml"
    steps = [
        ("preset", "new", "--input", "3x64x64", "--classes-from", str(images), "--budgets", "2M..200M"),
        ("cache", "build", "--preset", str(preset_file), "--population", "16", "--generations", "4"),
    ]
    made = cli.invoke(*steps[0], "--out", str(preset_file))
    assert made.returncode == 0, made.stderr
    built = cli.invoke(*steps[1])
    assert built.returncode == 0 and (tmp_path / "my-task.cache.json").is_file(), built.stderr
    partition = tmp_path / "partition"
    split = cli.invoke(
        "partition",
        "--preset",
        str(preset_file),
        "--dataset",
        "imagefolder",
        "--data",
        str(images),
        "--clients",
        "2",
        "--budgets",
        "2M,6M",
        "--val-samples",
        "10",
        "--calib-samples",
        "10",
        "--out",
        str(partition),
    )
    assert split.returncode == 0, split.stderr

    out, received, log_file = tmp_path / "server", tmp_path / "received", tmp_path / "server.log"
    command = [
        sys.executable, "-m", "feast_edge.server.cli", "run", "--broker", kit.LOCAL, "--federation", federation,
        "--preset", str(preset_file), "--out", str(out), "--data", str(partition), "--rounds", "1",
        "--per-round", "2", "--min-clients", "2", "--batch-size", "16", "--eval-every", "1",
        "--round-timeout", "120", "--wait-timeout", "120", "--threads", "1",
    ]  # fmt: skip
    with open(log_file, "w") as log:
        server = subprocess.Popen(command, cwd=kit.REPO, stdout=log, stderr=subprocess.STDOUT)
    agent = kit.spawn_agent(
        tmp_path / "logs", "lab", partition, federation, "--clients", "2", "--preset", str(preset_file),
        "--model-dir", str(received),
    )  # fmt: skip
    try:
        assert kit.wait_for(lambda: agent.poll() is not None, timeout=240), kit.log_text(agent)
        assert agent.returncode == 0, kit.log_text(agent) + log_file.read_text()
        assert server.wait(60) == 0, log_file.read_text()
    finally:
        kit.stop(agent)
        kit.stop(server)
    summary = kit.log_text(agent)
    assert f"federation '{federation}' finished after 1 of 1 rounds: client-000 trained in 1 round" in summary
    preset = load_preset_file(preset_file)
    for client, budget in (("client-000", 2e6), ("client-001", 6e6)):
        manifest = json.loads((received / f"{client}.json").read_text())
        assert manifest["macs"] <= budget and manifest["preset"] == "my-task"
        session = ort.InferenceSession(str(received / f"{client}.onnx"), providers=["CPUExecutionProvider"])
        feed = session.get_inputs()[0]
        pixels = preset.task.image_tensor(Image.open(next((images / "test" / "Dress").glob("*.png"))))
        logits = session.run(None, {feed.name: pixels.unsqueeze(0).float().div(255).numpy()})[0]
        assert logits.shape == (1, 5) and np.isfinite(logits).all()
