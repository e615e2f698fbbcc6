"""Leading-slice addressing shared by extraction, routing and aggregation (method §1, §5)."""

from __future__ import annotations

import torch


def leading_index(shape: torch.Size | tuple[int, ...]) -> tuple[slice, ...]:
    """Index of the leading block ``[:shape[0], :shape[1], ...]``."""
    return tuple(slice(0, n) for n in shape)


def leading_slice(tensor: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """View of the leading block of ``tensor`` with the given shape (which must fit)."""
    if len(shape) != tensor.dim() or any(n > m for n, m in zip(shape, tensor.shape)):
        raise ValueError(f"shape {tuple(shape)} is not a leading slice of a tensor of shape {tuple(tensor.shape)}")
    return tensor[leading_index(shape)]
