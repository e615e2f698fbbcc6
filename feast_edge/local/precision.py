"""How local training uses the device it runs on: mixed precision, host→device copies, determinism.

``--amp`` picks the precision of the forward and backward passes; the weights, the optimizer state and
every payload stay float32 (PyTorch's own ``torch.autocast`` and ``torch.amp.GradScaler``):

* ``off``: float32 throughout (the reference arithmetic, and ``feast-edge simulate``'s default);
* ``auto``: on a CUDA device, bfloat16 autocast where the GPU supports it (Ampere and later, Jetson
  Orin), else float16 autocast with a gradient scaler (Volta/Turing, Jetson Xavier/Nano). On the CPU,
  bfloat16 autocast where the CPU's flags show native bfloat16 arithmetic (:func:`cpu_has_native_bf16`:
  x86 ``avx512_bf16``/``amx_bf16``, e.g. Sapphire Rapids, Zen 4; Arm ``bf16``, e.g. Neoverse V1, Apple
  M2), where one co-training step took 0.51x the time of float32; float32 on every other CPU, where
  bfloat16 is emulated and slower than float32;
* ``bf16`` / ``fp16``: that autocast dtype, on CUDA or the CPU (fp16 always with a gradient scaler).

The scaler multiplies the loss before ``backward`` so float16 gradients do not underflow, divides the
gradients back before they are clipped and decayed, and skips the SGD step of a batch whose gradients
overflowed (then lowers the scale): the step sees exactly the unscaled gradients of a float32 run.

Determinism: every random draw of local training (shuffling, augmentation parameters, the ``a_rand``
picks) comes from seeded CPU generators, so the same seed makes the same draws on any device. On the CPU
the arithmetic is bit-reproducible run to run. On CUDA, cuDNN's convolution algorithms and atomic
adds in some backward kernels make floating-point sums order-dependent: runs agree to float tolerance,
not bit for bit, unless :func:`set_deterministic` asks PyTorch for deterministic kernels (slower).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from feast_edge.errors import FeastError

AMP_MODES = ("off", "auto", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The /proc/cpuinfo line and the flags in it that show native bfloat16 arithmetic, per platform.machine().
# oneDNN's own query (torch.ops.mkldnn._is_mkldnn_bf16_supported) says yes on plain AVX-512 too, where
# bfloat16 is emulated and slower than float32: the point of ``auto`` is speed, so the flags decide.
_BF16_FLAGS = {
    "x86_64": ("flags", ("amx_bf16", "avx512_bf16")),
    "aarch64": ("Features", ("bf16",)),
}
_CPUINFO = Path("/proc/cpuinfo")


class AmpError(FeastError, ValueError):
    """A mixed-precision mode this device cannot run."""


@dataclass(frozen=True)
class Precision:
    """The resolved precision of one device's training passes: ``mode`` is ``off``, ``bf16`` or ``fp16``."""

    mode: str = "off"
    device_type: str = "cpu"
    reason: str = field(default="", compare=False)  # why ``auto`` chose ``mode`` (shown by describe)

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES.get(self.mode)

    @property
    def scaled(self) -> bool:
        """float16 needs a gradient scaler (its exponent range loses small gradients); bfloat16 does not."""
        return self.mode == "fp16"

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context the forward passes (and the losses) run in."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scaler(self) -> GradientStep:
        """A fresh per-round step helper (a new GradScaler when float16 needs one)."""
        return GradientStep(torch.amp.GradScaler(self.device_type) if self.scaled else None)

    def describe(self) -> str:
        text = "float32" if self.mode == "off" else f"{self.mode} autocast"
        text += " with a gradient scaler" if self.scaled else ""
        return text + (f" ({self.reason})" if self.reason else "")


class GradientStep:
    """``backward`` and ``step`` of one batch, through a GradScaler when there is one (plain calls otherwise)."""

    def __init__(self, scaler: torch.amp.GradScaler | None) -> None:
        self.grad_scaler = scaler
        self.skipped = 0  # steps skipped because the scaled gradients overflowed

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.grad_scaler is None else self.grad_scaler.scale(loss)).backward()

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        params: Iterable[nn.Parameter],
        clip_norm: float,
        before_step: Callable[[], None],
    ) -> None:
        """Unscale, clip to ``clip_norm``, run ``before_step`` (e.g. weight decay), then the optimizer step."""
        params = list(params)
        if self.grad_scaler is None:
            nn.utils.clip_grad_norm_(params, clip_norm)
            before_step()
            optimizer.step()
            return
        self.grad_scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(params, clip_norm)
        before_step()
        scale = self.grad_scaler.get_scale()
        self.grad_scaler.step(optimizer)  # skipped when an unscaled gradient is inf/NaN
        self.grad_scaler.update()
        if self.grad_scaler.get_scale() < scale:
            self.skipped += 1


PLAIN = Precision()
PLAIN_STEP = GradientStep(None)


def check_amp(mode: str) -> str:
    """``mode`` if it is one of :data:`AMP_MODES`, else an AmpError naming them."""
    if mode not in AMP_MODES:
        raise AmpError(f"--amp {mode!r} is unknown; choose one of {', '.join(AMP_MODES)}")
    return mode


def _native_bf16_from_cpuinfo(text: str, machine: str) -> str | None:
    """The flag in /proc/cpuinfo ``text`` that shows native bfloat16 arithmetic on a ``machine`` CPU, else None."""
    if machine not in _BF16_FLAGS:
        return None
    key, wanted = _BF16_FLAGS[machine]
    for line in text.splitlines():
        name, colon, value = line.partition(":")
        if colon and name.strip() == key:  # every core lists the same flags: the first line decides
            present = set(value.split())
            return next((flag for flag in wanted if flag in present), None)
    return None


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (its flags, not a guess); False where /proc/cpuinfo is unreadable."""
    try:
        text = _CPUINFO.read_text(errors="replace")
    except OSError:
        return False
    return _native_bf16_from_cpuinfo(text, platform.machine()) is not None


def resolve_amp(mode: str, device: str | torch.device) -> Precision:
    """The precision ``mode`` means on ``device`` (``auto`` asks the GPU or the CPU's flags; a GPU without bfloat16 refuses ``bf16``)."""
    check_amp(mode)
    kind = torch.device(device).type
    if mode == "auto" and kind == "cpu":
        if cpu_has_native_bf16():
            return Precision("bf16", kind, "auto: the CPU has native bfloat16")
        return Precision("off", kind, "auto: the CPU has no native bfloat16")
    if mode == "off" or (mode == "auto" and kind != "cuda"):
        return Precision("off", kind)
    if kind == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
        if mode == "auto":
            return Precision("bf16" if bf16 else "fp16", kind)
        if mode == "bf16" and not bf16:
            raise AmpError(
                f"--amp bf16: {torch.cuda.get_device_name(torch.device(device))} has no bfloat16 support; use --amp fp16 (or auto)"
            )
    return Precision(mode, kind)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; to a GPU from pinned host memory without blocking the host (the copy overlaps compute)."""
    if device.type != "cuda" or tensor.device == device:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def set_deterministic(enabled: bool = True) -> None:
    """Ask PyTorch for deterministic kernels (CUDA: cuBLAS workspace, no cuDNN autotuning); a no-op for results on the CPU."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=False)
    torch.backends.cudnn.benchmark = not enabled and torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic = enabled
