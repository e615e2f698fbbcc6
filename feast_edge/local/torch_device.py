"""Where PyTorch runs: ``--device auto | cpu | cuda[:N]``, resolved and checked in one place."""

from __future__ import annotations

import re

import torch

from feast_edge.errors import FeastError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_CUDA = re.compile(r"^cuda(:\d+)?$")


class DeviceError(FeastError, ValueError):
    """A requested torch device does not exist here."""


def resolve_device(requested: str = "auto") -> str:
    """``auto`` is ``cuda`` when PyTorch sees a CUDA device, else ``cpu``; ``cpu`` and ``cuda[:N]`` are checked."""
    text = requested.strip().lower()
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return "cpu"
    if not _CUDA.match(text):
        raise DeviceError(f"--device {requested!r} is not one of {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"--device {requested}: no CUDA device is available to PyTorch here; use --device auto or cpu (or install a CUDA build of torch)"
        )
    index = int(text.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise DeviceError(
            f"--device {requested}: PyTorch sees {torch.cuda.device_count()} CUDA device(s); use cuda:0..cuda:{torch.cuda.device_count() - 1}"
        )
    return text


def describe_device(device: str, requested: str = "auto") -> str:
    """One line for people: which device trains, and why (``auto`` says what it found)."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        return f"training on {device} ({name})" + (" - found by --device auto" if requested == "auto" else "")
    return "training on cpu" + (" (no CUDA device found; --device auto)" if requested == "auto" else "")
