"""What a payload must be before it enters the aggregation (method §5, §6): leading slices and a sample count.

Both checks raise :class:`PayloadError` at the boundary where a client's
payload enters, so the aggregation itself (:mod:`feast_edge.aggregate.sparse`)
and its accumulator (:mod:`feast_edge.aggregate.accumulate`) only ever see
valid ones.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np
import torch

from feast_edge.errors import PayloadError

StateDict = Mapping[str, torch.Tensor]


def check_payload(global_state: StateDict, local_state: StateDict) -> None:
    """Raise :class:`PayloadError` unless every local tensor is a leading slice of the same-named global one (method §5)."""
    for name, local in local_state.items():
        if name not in global_state:
            raise PayloadError(
                f"payload tensor '{name}' does not exist in the global model; "
                "route clients from this global state dict (same preset and classes)"
            )
        if not isinstance(local, torch.Tensor):
            raise PayloadError(f"payload entry '{name}' is a {type(local).__name__}, not a tensor; send a state dict")
        glob = global_state[name]
        if local.dim() != glob.dim() or any(n > m for n, m in zip(local.shape, glob.shape)):
            raise PayloadError(
                f"payload tensor '{name}' has shape {tuple(local.shape)}, which is not a leading slice of the global "
                f"shape {tuple(glob.shape)}; route the client from this global model's envelope"
            )
        if local.is_floating_point() != glob.is_floating_point():
            raise PayloadError(
                f"payload tensor '{name}' has dtype {local.dtype} but the global tensor has {glob.dtype}; "
                "send floating tensors for weights and integer tensors for counters"
            )


def check_samples(n_samples: float) -> float:
    """Validated aggregation weight ``n_i`` (a positive, finite sample count)."""
    ok = (
        isinstance(n_samples, numbers.Real) and not isinstance(n_samples, (bool, np.bool_)) and math.isfinite(n_samples)
    )
    if not ok or n_samples <= 0:
        raise PayloadError(f"sample count {n_samples!r} must be a positive finite number (the client's shard size)")
    return float(n_samples)
