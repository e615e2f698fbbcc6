"""``--threads`` reaches PyTorch and onnxruntime in every feast-agent command that computes (issue 38, item 3).

Each test records what the runtimes were set to while the command ran: every onnxruntime session the command opens
(its own ``intra_op_num_threads``, read back from the session) and PyTorch's thread count at that moment. The count
asked for is one more than PyTorch's current one, so a command that forgets to apply it cannot pass.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime
import pytest
import torch
from PIL import Image
from safetensors.torch import save
from timers import noise_free

from feast_edge.agent.local_data import LocalClient
from feast_edge.agent.model_files import FetchedModel, keep_model, keep_pushed_model
from feast_edge.agent.on_device import calibrate_served_variant
from feast_edge.errors import FeastError
from feast_edge.evaluate.onnx_export import export_onnx
from feast_edge.space.arch import Arch
from feast_edge.space.extract import extract
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from strategies import FMNIST_TINY

PRESET = load_preset(str(FMNIST_TINY))
CLASSES = ("Coat", "Sneaker")


@pytest.fixture
def asked() -> int:
    """A thread count PyTorch does not have now."""
    return torch.get_num_threads() + 1


@pytest.fixture
def sessions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(intra-op threads, PyTorch's threads) of every onnxruntime session opened while the test runs."""
    seen: list[tuple[int, int]] = []

    class Recorded(onnxruntime.InferenceSession):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            seen.append((self.get_session_options().intra_op_num_threads, torch.get_num_threads()))

    monkeypatch.setattr(onnxruntime, "InferenceSession", Recorded)
    return seen


@pytest.fixture(scope="module")
def variant() -> tuple[Arch, torch.nn.Module]:
    arch = Arch.smallest(PRESET)
    return arch, extract(Supernet(PRESET, seed=1), arch).eval()


@pytest.fixture(scope="module")
def model(variant, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, net = variant
    path = tmp_path_factory.mktemp("model") / "pi.onnx"
    export_onnx(net, path, PRESET, arch)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two class folders of four grey 28x28 PNG files each."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for name in CLASSES:
        (root / name).mkdir()
        for i in range(4):
            Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


def _own_data(n: int = 40) -> LocalClient:
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=generator)
    labels = torch.arange(n) % 10
    return LocalClient(
        "pi", images, labels, None, None, None, "test images", holdout_images=images[:10], holdout_labels=labels[:10]
    )


@pytest.mark.parametrize("command", ["predict", "evaluate"])
def test_predict_and_evaluate_run_on_the_threads_asked_for(agent_cli, model, images, sessions, asked, command):
    target = [str(images)] if command == "predict" else ["--data", str(images)]
    result = agent_cli.invoke(command, "--model", str(model), *target, "--threads", str(asked), "--json")
    assert result.returncode == 0, result.stderr
    assert sessions == [(asked, asked)]


def test_without_threads_both_runtimes_keep_their_own_default(agent_cli, model, images, sessions):
    before = torch.get_num_threads()
    result = agent_cli.invoke("predict", "--model", str(model), str(images), "--json")
    assert result.returncode == 0, result.stderr
    assert sessions == [(0, before)]  # 0: onnxruntime's own choice


def test_profile_times_every_variant_on_the_threads_asked_for(agent_cli, sessions, asked, monkeypatch, tmp_path):
    noise_free(monkeypatch, {"fp32": (0.5, 0.2)})  # every session still opens and runs; the clock cannot refuse it
    out = tmp_path / "pi.json"
    result = agent_cli.invoke(
        "profile", "--preset", str(FMNIST_TINY), "--out", str(out), "--variants", "2", "--holdout", "0",
        "--repeats", "1", "--latency-target-ms", "1000", "--threads", str(asked),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sessions == [(asked, asked)] * 2
    assert json.loads(out.read_text())["hardware"]["torch_threads"] == asked


def test_fetch_model_times_the_model_on_the_threads_asked_for(agent_cli, model, sessions, asked, monkeypatch, tmp_path):
    blob = model.read_bytes()
    manifest = {"sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob), "arch": {}, "macs": 1, "params": 1}
    torch_threads = []

    def fetched(link, federation, device_id, out, **kwargs):  # the server's answer, without a broker
        torch_threads.append(torch.get_num_threads())
        path, latency = keep_model(blob, manifest, out, threads=kwargs["threads"])
        return FetchedModel(path, manifest, latency)

    monkeypatch.setattr("feast_edge.agent.model_files.fetch_model", fetched)
    result = agent_cli.invoke(
        "fetch-model", "--broker", "mqtt://127.0.0.1:1", "--device-id", "pi", "--out", str(tmp_path / "pi.onnx"),
        "--threads", str(asked), "--repeats", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert torch_threads == [asked]
    assert sessions == [(asked, asked)]
    assert f"onnxruntime latency (batch 1, CPU, {asked} threads)" in result.stdout


def test_run_trains_on_the_threads_asked_for_and_hands_them_to_the_agent(
    agent_cli, images, asked, monkeypatch, tmp_path
):
    seen = []

    class Stopped:  # the agent the CLI builds, stopped before it connects
        def __init__(self, config, link, hosted) -> None:
            seen.append((config.threads, torch.get_num_threads()))
            raise FeastError("stopped by the test")

    monkeypatch.setattr("feast_edge.agent.agent.Agent", Stopped)
    result = agent_cli.invoke(
        "run", "--insecure", "--broker", "mqtt://127.0.0.1:1", "--device-id", "pi", "--data", str(images),
        "--preset", str(FMNIST_TINY), "--budget", "1M", "--threads", str(asked),
    )  # fmt: skip
    assert result.returncode == 2 and result.stderr.endswith("error: stopped by the test\n"), result.stderr
    assert seen == [(asked, asked)]


def test_a_received_model_is_timed_on_the_agents_threads(model, sessions, tmp_path):
    blob = model.read_bytes()
    message = SimpleNamespace(device="pi", manifest={"sha256": hashlib.sha256(blob).hexdigest(), "macs": 1})
    assert keep_pushed_model(blob, message, tmp_path, threads=3) is not None
    assert keep_pushed_model(blob, message, tmp_path) is not None
    assert [intra for intra, _ in sessions] == [3, 1]  # without --threads: one thread, comparable between devices


def test_a_variant_exported_on_the_device_is_timed_on_the_agents_threads(variant, sessions, tmp_path):
    arch, net = variant
    blob = save({k: v.contiguous() for k, v in net.state_dict().items()})
    manifest = {
        "device": "pi",
        "arch": arch.to_dict(),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "preset": PRESET.name,
        "preset_digest": PRESET.digest,
        "calibration": "device",
        "calibration_samples": 20,
        "rounds": 1,
    }
    calibrate_served_variant(blob, manifest, _own_data(), PRESET, tmp_path / "pi.onnx", threads=3)
    assert [intra for intra, _ in sessions] == [3]
