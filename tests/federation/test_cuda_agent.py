"""What a device agent on a GPU runs: profiling on the GPU, one local round with AMP, the update it would send.

These tests need a CUDA device and skip, with the reason, where PyTorch sees none (bench/gpu_check.sh
runs them on a GPU machine). The arithmetic they rely on is tested on the CPU in tests/core/test_accel.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from feast_edge.cache.variants import load_cache
from feast_edge.data.images import load_fashion_mnist
from feast_edge.local.cotrain import stayed_finite
from feast_edge.local.recipe import TrainConfig
from feast_edge.local.update import client_update
from feast_edge.route.envelope import route_state
from feast_edge.route.payload import decode, encode
from feast_edge.route.plans import plan_client
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (PyTorch sees none here)"),
]


@pytest.mark.slow  # a feast-agent process
def test_feast_agent_profile_times_on_the_gpu(agent_cli, tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    result = agent_cli.run(
        "profile",
        "--device",
        "cuda",
        "--runtime",
        "torch",
        "--variants",
        "4",
        "--repeats",
        "5",
        "--holdout",
        "1",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    profile = json.loads(out.read_text())
    assert profile["device"] == "cuda" and profile["hardware"]["cuda_name"] == torch.cuda.get_device_name(0)
    assert profile["budget_macs"] > 0 and profile["latency_b_ms_per_mmac"] > 0 and len(profile["holdout"]) == 1


@pytest.mark.slow  # a feast-agent process
def test_onnxruntime_cuda_provider_profiles_when_installed(agent_cli, tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDAExecutionProvider here (pip install onnxruntime-gpu)")
    out = tmp_path / "ort.json"
    result = agent_cli.run(
        "profile",
        "--device",
        "cuda",
        "--provider",
        "cuda",
        "--variants",
        "4",
        "--repeats",
        "5",
        "--holdout",
        "1",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "CUDAExecutionProvider" in json.loads(out.read_text())["runtime"]


@pytest.mark.parametrize("amp", ["off", "auto", "fp16"])
def test_a_local_round_on_the_gpu_gives_an_update_the_server_accepts(amp, fashion_mnist_dir) -> None:
    preset = load_preset("fmnist-small")
    cache = load_cache(preset)
    plan = plan_client(cache, cache.entries[len(cache.entries) // 2].macs)
    data = load_fashion_mnist(fashion_mnist_dir, "train")
    state = route_state(Supernet(preset, seed=0).state_dict(), plan.layout(preset, preset.classes), preset)
    config = TrainConfig(batch_size=64)
    new_state, result = client_update(
        preset, preset.classes, plan, state, data.images[:512], data.labels[:512], config, 0.05, 11, "cuda", amp
    )
    assert stayed_finite(new_state, result.mean_loss) and result.num_batches == 8
    assert all(
        t.device.type == "cpu" and t.dtype == state[k].dtype for k, t in new_state.items()
    )  # float32 on the host, as sent
    manifest = plan.manifest(preset, preset.classes, 0, "update", "gpu-device")
    _, received = decode(encode(new_state, manifest), preset, expected=manifest)
    assert all(torch.equal(received[k], new_state[k]) for k in new_state)
    _, cpu = client_update(
        preset, preset.classes, plan, state, data.images[:512], data.labels[:512], config, 0.05, 11, "cpu"
    )
    assert abs(result.mean_loss - cpu.mean_loss) < 0.1 * abs(cpu.mean_loss)  # the same draws, the GPU's arithmetic
