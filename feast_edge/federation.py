"""One FEAST round as pure steps shared by the simulator and the MQTT federation.

    cohort   = sample_round_cohort(client_ids, m, seed, t)          # server
    plan     = plan_client(cache, budget)                            # server: affordable set, envelope
    routed   = route_state(global_state, plan.layout(...), preset)   # server -> client payload
    state, r = client_update(preset, classes, plan, routed, data, config, lr, seed_for(seed, t, id))   # client
    global   = aggregate_updates(global_state, updates)              # server, updates sorted by client id

Every random choice of round ``t`` is derived from ``(seed, t)`` and the client
id, never from hidden state, so a resumed run and a distributed run draw the
same numbers as one uninterrupted in-process run.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from feast_edge.arch import Arch
from feast_edge.cache import VariantCache
from feast_edge.payload import Manifest
from feast_edge.population import sample_cohort
from feast_edge.preset import Preset
from feast_edge.robust import robust_aggregate
from feast_edge.route import Envelope
from feast_edge.supernet import Supernet
from feast_edge.train import LocalResult, TrainConfig, local_train

# Stream tags keep the random streams of one round independent of each other.
_COHORT, _CLIENT = 1, 2


def round_rng(seed: int, round_index: int) -> np.random.Generator:
    """The generator that draws round ``round_index``'s cohort."""
    return np.random.default_rng([seed, round_index, _COHORT])


def client_seed(seed: int, round_index: int, client_id: str) -> int:
    """Seed of one client's local training in one round (stable across processes and machines)."""
    key = zlib.crc32(client_id.encode("utf-8"))
    return int(np.random.SeedSequence([seed, round_index, _CLIENT, key]).generate_state(1, dtype=np.uint64)[0] >> 1)


def sample_round_cohort(client_ids: Sequence[str], m: int, seed: int, round_index: int) -> list[str]:
    """``m`` of the given clients, uniformly without replacement, sorted (SPEC §4)."""
    ids = sorted(client_ids)
    picked = sample_cohort(len(ids), m, round_rng(seed, round_index))
    return [ids[i] for i in picked]


@dataclass(frozen=True)
class ClientPlan:
    """What the server decides for one client: its affordable variants and their envelope (SPEC §5, §7)."""

    affordable: tuple[Arch, ...]
    global_min: Arch
    envelope: Envelope

    def layout(self, preset: Preset, classes: int):
        return self.envelope.layout(preset, classes)

    def manifest(self, preset: Preset, classes: int, round_index: int, kind: str, device: str | None = None, dtype: str = "float32") -> Manifest:
        """The manifest of this plan's routed payload (``kind="routed"``) or of the update it comes back as, in payload ``dtype``."""
        return Manifest.of(preset, classes, self.envelope, round_index, kind, device, dtype)


def plan_client(cache: VariantCache, budget: float) -> ClientPlan:
    """Affordable set ``A_i = {a : MAC(a) <= b_i}`` (raw budget) and its envelope."""
    affordable = tuple(entry.arch for entry in cache.affordable(budget))
    if not affordable:
        cache.largest_affordable(budget)  # raises the user-facing error naming the smallest variant
    return ClientPlan(affordable, cache.smallest.arch, Envelope.of(affordable))


def client_update(
    preset: Preset,
    classes: int,
    plan: ClientPlan,
    routed_state: Mapping[str, torch.Tensor],
    images: torch.Tensor,
    labels: torch.Tensor,
    config: TrainConfig,
    lr: float,
    seed: int,
    device: str | torch.device = "cpu",
    amp: str = "off",
) -> tuple[dict[str, torch.Tensor], LocalResult]:
    """Build the routed sub-supernet, co-train it on local data (``amp``: feast_edge.accel), return its updated state (SPEC §7)."""
    model = Supernet(preset, classes=classes, layout=plan.layout(preset, classes), seed=None)
    model.load_state_dict(routed_state)
    result = local_train(model, images, labels, plan.affordable, plan.global_min, config, lr=lr, seed=seed, device=device, amp=amp)
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    return state, result


def aggregate_updates(
    global_state: Mapping[str, torch.Tensor],
    updates: Sequence[tuple[str, Mapping[str, torch.Tensor], int]],
    inplace: bool = False,
    *,
    rule: str = "mean",
    trim: float = 0.1,
    clip_norm: float | None = None,
) -> dict[str, torch.Tensor]:
    """Aggregation of ``(client_id, state, n_samples)`` in client-id order: SPEC §6's sparse sample-weighted mean by default.

    ``rule``, ``trim`` and ``clip_norm`` choose a robust rule instead
    (:mod:`feast_edge.robust`). ``inplace=True`` writes the result into
    ``global_state``'s tensors (pass a model's ``state_dict()`` to update the
    model without a copy).
    """
    ordered = sorted(updates, key=lambda u: u[0])
    return robust_aggregate(global_state, [(state, n) for _, state, n in ordered], rule, trim=trim, clip_norm=clip_norm, inplace=inplace)
