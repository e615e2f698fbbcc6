"""Local DP on the device itself: the update is clipped and noised before it leaves (``feast-agent``; docs/privacy.md).

A server run with ``--dp-mode local`` asks every cohort device for it in the round message (``LocalDp.wire``); a
device started with ``feast-agent run --dp-clip C --dp-noise z`` requires it whatever the server asks, and takes the
stricter of the two (:func:`stricter`). The arithmetic is the simulation's (:mod:`feast_edge.privacy.mechanism`), so
a seeded local-DP federation ends where ``feast-edge simulate --dp-mode local`` does.

The device's own guarantee needs no trust in anyone: each update it sends is the Gaussian mechanism of sensitivity
``2C`` (replace-one) with noise ``z·C``, and :class:`DeviceLedger` composes the ones it sent (no amplification: the
device knows it was sampled, and so may the server).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from feast_edge.privacy.mechanism import client_seed, noise_generator, noised_update, private_update
from feast_edge.privacy.settings import DEFAULT_DELTA, PrivacyError
from feast_edge.space.preset import Preset
from feast_edge.space.supernet import Supernet
from feast_edge.util.atomic import atomic_write_bytes

StateDict = Mapping[str, torch.Tensor]
log = logging.getLogger(__name__)
NORM_SLACK = 8.0  # a Gaussian vector's norm exceeds σ(√d + t) with probability below exp(−t²/2): 1e-14 at t = 8


@dataclass(frozen=True)
class LocalDp:
    """Clip every update to L2 norm ``clip``, add N(0, (noise·clip)²) to every routed parameter; ``seed``: the
    server's ``--dp-seed`` (tests only: None draws from the OS)."""

    clip: float
    noise: float
    seed: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("--dp-clip", self.clip), ("--dp-noise", self.noise)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise PrivacyError(f"{name} {value!r} must be a positive number, e.g. {name} 1")

    def wire(self) -> dict[str, Any]:
        """The round message's ``dp`` field (the seed as decimal text: JSON numbers are exact only to 2^53)."""
        return {"mode": "local", "clip": self.clip, "noise": self.noise} | (
            {} if self.seed is None else {"seed": str(self.seed)}
        )

    @classmethod
    def of_wire(cls, value: Mapping[str, Any]) -> LocalDp | None:
        """The settings of a round message's (validated) ``dp`` field; None for a round without local DP."""
        if not value:
            return None
        seed = value.get("seed")
        return cls(float(value["clip"]), float(value["noise"]), None if seed is None else int(seed))


def check_device_dp(clip: float | None, noise: float | None, delta: float) -> LocalDp | None:
    """A device's own ``--dp-clip``/``--dp-noise``/``--dp-delta``: both or neither, positive, δ in (0, 1); a warning
    where the device cannot compute its ε (no dp-accounting)."""
    if (clip is None) != (noise is None):
        raise PrivacyError(
            "local DP on this device needs both --dp-clip C and --dp-noise z, e.g. --dp-clip 1 --dp-noise 1"
        )
    if not 0 < delta < 1:
        raise PrivacyError(f"--dp-delta {delta:g} must lie in (0, 1), below 1/(this device's examples), e.g. 1e-5")
    if clip is None or noise is None:
        return None
    if not accountant_available():
        log.warning(
            "local DP: this device noises every update, but dp-accounting is not installed, so it cannot compute its "
            "ε; pip install dp-accounting (the ledger keeps every update meanwhile)"
        )
    return LocalDp(clip, noise)


def default_ledger() -> Path:
    """Where a device keeps its privacy ledger unless told: ``$XDG_STATE_HOME/feast-edge/privacy-ledger.json``."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "feast-edge" / "privacy-ledger.json"


def stricter(asked: LocalDp | None, required: LocalDp | None) -> LocalDp | None:
    """What a device applies: the server's request and the device's own requirement, the stricter of each (the
    smaller bound, the larger noise std), so the update is at least as private as either asks."""
    if asked is None or required is None:
        return asked or required
    clip = min(asked.clip, required.clip)
    std = max(asked.noise * asked.clip, required.noise * required.clip)
    return LocalDp(clip, std / clip, asked.seed)


@functools.lru_cache(maxsize=8)
def parameter_names(preset: Preset) -> frozenset[str]:
    """The supernet's trainable tensors (the rest of a state are BN statistics and counters, which DP keeps global)."""
    return frozenset(name for name, _ in Supernet(preset).named_parameters())


def privatize(
    routed: StateDict, trained: StateDict, params: Collection[str], dp: LocalDp, client: str, t: int
) -> dict[str, torch.Tensor]:
    """``trained`` as it may leave the device: its change from ``routed`` clipped to ``dp.clip``, BN statistics back
    to the routed values, N(0, (z·C)²) on every parameter (client ``client``'s generator of round ``t``)."""
    clipped, _ = private_update(routed, trained, params, dp.clip)
    generator = noise_generator(None if dp.seed is None else client_seed(dp.seed, client), t)
    return noised_update(routed, clipped, params, dp.noise * dp.clip, generator)


def noised_norm_bound(dp: LocalDp, numel: int) -> float:
    """What an honest noised update's change can reach: ``C + z·C·(√d + 8)`` over ``d`` coordinates (the server's
    update-norm bound under local DP; a larger one is no honest device's)."""
    return dp.clip + dp.noise * dp.clip * (math.sqrt(numel) + NORM_SLACK)


def accountant_available() -> bool:
    """Whether dp-accounting is installed (a board's minimal install leaves it out: docs/install-device.md)."""
    return importlib.util.find_spec("dp_accounting") is not None


class DeviceLedger:
    """Each device's own ε: the noise multiplier of every noised update it sent, kept in ``path`` across runs.

    ``path`` is a JSON file ``{"device": {"federation": [z, ...]}}``; a missing one starts empty, an unreadable one is
    refused (a device must not forget what it spent)."""

    def __init__(self, path: Path | None, delta: float = DEFAULT_DELTA) -> None:
        self.path, self.delta = path, delta
        self.spent: dict[str, dict[str, list[float]]] = {}
        if path is not None and path.is_file():
            try:
                loaded = json.loads(path.read_text())
                self.spent = {str(d): {str(f): [float(z) for z in zs] for f, zs in feds.items()}
                              for d, feds in loaded.items()}  # fmt: skip
            except (ValueError, TypeError, AttributeError) as exc:
                raise PrivacyError(
                    f"{path} is not a privacy ledger ({exc}); it records what this device has spent: restore it, or "
                    "move it away knowingly to start counting again"
                ) from None

    def record(self, device: str, federation: str, noise: float) -> float | None:
        """Count one more update of ``device`` sent with multiplier ``noise``; its ε at δ over all it sent."""
        self.spent.setdefault(device, {}).setdefault(federation, []).append(noise)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.path, json.dumps(self.spent, indent=1).encode())
        return self.epsilon(device)

    def epsilon(self, device: str) -> float | None:
        """ε at δ of every update ``device`` sent, in every federation (they all saw the same data); None where
        dp-accounting is not installed (a board's minimal install: the ledger still keeps every update)."""
        if not accountant_available():
            return None
        from feast_edge.privacy.accountant import local_epsilon

        return local_epsilon([z for spent in self.spent.get(device, {}).values() for z in spent], self.delta)

    def updates(self, device: str) -> int:
        return sum(len(v) for v in self.spent.get(device, {}).values())
