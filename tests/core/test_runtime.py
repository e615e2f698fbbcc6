"""--device: auto picks CUDA only when PyTorch sees one; explicit choices are checked with a clear error."""

from __future__ import annotations

import pytest
import torch

from feast_edge.local.torch_device import DeviceError, describe_device, resolve_device


def test_auto_follows_what_pytorch_sees() -> None:
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(" AUTO ") == resolve_device("auto")


def test_cpu_is_always_available_and_says_why_when_auto() -> None:
    assert resolve_device("cpu") == "cpu"
    if not torch.cuda.is_available():
        assert describe_device("cpu", "auto") == "training on cpu (no CUDA device found; --device auto)"
    assert describe_device("cpu", "cpu") == "training on cpu"


@pytest.mark.parametrize("text", ["gpu", "tpu", "cuda:x", "cuda:-1", "mps0"])
def test_unknown_devices_name_the_choices(text: str) -> None:
    with pytest.raises(DeviceError, match="is not one of auto, cpu, cuda or cuda:N"):
        resolve_device(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_cuda_device_is_a_clear_error() -> None:
    for text in ("cuda", "cuda:0"):
        with pytest.raises(DeviceError, match="no CUDA device is available to PyTorch here; use --device auto or cpu"):
            resolve_device(text)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_index_beyond_the_devices_is_refused() -> None:
    assert resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(DeviceError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")
