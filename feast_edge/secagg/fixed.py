"""Fixed-point integers modulo 2^32: what a device masks and the server sums (secure aggregation, feast_edge.secagg).

    encode(x) = round(clip(x, -B, B) · 2^f) mod 2^32        decode(z) = signed(z) / 2^f

A sum of m encoded values is the encoding of their sum, exactly, while |Σ x| · 2^f < 2^31: with every |x| ≤ B,
``for_sum(m, B)`` picks the largest f for which m · B · 2^f < 2^31 cannot wrap. Four bytes per value, as a float32
upload: secure sums cost no more bandwidth than the plain sparse upload. Values beyond ±B are clipped before
encoding (a device cannot add more than B per coordinate to a sum it cannot be checked in).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BITS = 32
MODULUS = 1 << BITS
HALF = 1 << (BITS - 1)
DEFAULT_BOUND = 8.0  # |w · (θ' - θ_t)| per value before encoding; a local training run's change stays far below


class FixedPointError(ValueError):
    """The fixed-point range cannot hold the sum asked for."""


@dataclass(frozen=True)
class FixedPoint:
    """Encoding of values in [-bound, bound] with ``frac`` fractional bits, modulo 2^32."""

    bound: float
    frac: int

    @classmethod
    def for_sum(cls, contributors: int, bound: float) -> FixedPoint:
        """The finest encoding whose sum of ``contributors`` values of at most ``bound`` each cannot wrap."""
        if contributors < 1 or not bound > 0:
            raise FixedPointError(f"a sum needs at least 1 contributor and a bound > 0 (got {contributors}, {bound})")
        frac = (BITS - 1) - math.ceil(math.log2(contributors * bound)) - 1  # one bit of margin for rounding
        if frac < 8:
            raise FixedPointError(
                f"{contributors} values of at most {bound:g} leave {frac} fractional bits in {BITS}-bit fixed point; "
                "lower the clipping bound"
            )
        return cls(bound, frac)

    @property
    def resolution(self) -> float:
        return 2.0**-self.frac

    def encode(self, values: np.ndarray) -> np.ndarray:
        """``values`` (floats) clipped to ±bound, as uint32 fixed point."""
        clipped = np.clip(np.asarray(values, dtype=np.float64), -self.bound, self.bound)
        return np.round(clipped * (1 << self.frac)).astype(np.int64).astype(np.uint32)

    def decode(self, encoded: np.ndarray) -> np.ndarray:
        """uint32 fixed point (a sum of encodings) as float64, read as signed 32-bit."""
        return np.asarray(encoded, dtype=np.uint32).view(np.int32).astype(np.float64) / (1 << self.frac)
