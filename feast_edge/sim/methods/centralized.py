"""The centralized reference: FEAST's supernet and co-training loss on the pooled client data, no federation.

What the same data would give without federated constraints, in the same
harness: the global supernet itself is trained on the union of every client's
shard, with method §7's loss taken over the whole cached range (``a_max`` the
largest cached variant, ``a_min`` the smallest, ``a_rand`` any in between),
the preset's recipe (augmentation, batch size) and the run's learning-rate
schedule, and evaluated exactly like FEAST (every cached variant after its own
BN recalibration; devices served the largest variant within budget).

Matched in optimizer steps: round ``t`` takes as many SGD steps as the
federation's cohort of round ``t`` takes in total (``Σ_i epochs·⌈n_i/B⌉``,
the same cohorts as every other method), drawn from one shuffle of the pooled
data per round (seeded by ``(seed, t)``; a round longer than the pool wraps
around a second shuffle). Compute per step is larger than an average client's,
since every step trains the largest cached variant; the training-compute proxy
in the results says how much. The SGD momentum restarts every round, as a
client's does, so the only difference to the federation is the data each step
sees and the variants it trains.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from feast_edge.local.cotrain import local_train
from feast_edge.run.collect import ClientUpdate
from feast_edge.sim.methods.feast import Feast

_POOL = 31  # stream tag of the per-round shuffles of the pooled data


class Centralized(Feast):
    name = "centralized"
    averaging = False  # it trains the global model itself: there is no aggregate to step from
    summary = "centralized reference: the same supernet and co-training loss on the pooled client data, step-matched"

    def payload_params(self, plan: Any) -> int:
        return 0  # nothing travels

    def round_steps(self, cohort: Sequence[str]) -> int:
        """The federation's optimizer steps in a round with this cohort: Σ_i epochs·⌈n_i/B⌉."""
        train = self.config.train_config()
        sizes = self.setup.population.sizes
        return sum(
            train.epochs * math.ceil(int(sizes[self.setup.client_ids.index(c)]) / train.batch_size) for c in cohort
        )

    def pooled_indices(self, t: int, count: int) -> np.ndarray:
        """``count`` pooled-data indices for round ``t``: consecutive shuffles of every client's shard."""
        pooled = np.concatenate([np.asarray(s) for s in self.setup.population.partition.shards])
        rng = np.random.default_rng([self.config.seed, t, _POOL])
        draws = [rng.permutation(pooled) for _ in range(-(-count // len(pooled)))]
        return np.concatenate(draws)[:count]

    def collect(
        self,
        t: int,
        cohort: Sequence[str],
        plans: Mapping[str, Any],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> list[ClientUpdate]:
        """Train the global supernet in place for the cohort's step count (``global_state`` aliases it)."""
        train = self.config.train_config()
        index = self.pooled_indices(t, self.round_steps(cohort) * train.batch_size)
        rows = torch.tensor(self.setup.pool[index], dtype=torch.long)
        images, labels = self.setup.train_set.images[rows], self.setup.train_set.labels[rows]
        began = time.perf_counter()
        one_pass = train.__class__(**{**train.__dict__, "epochs": 1})  # the step count already covers the epochs
        cache = self.setup.cache
        result = local_train(
            self.model,
            images,
            labels,
            cache.archs,
            cache.smallest.arch,
            one_pass,
            lr=lr,
            seed=self.config.seed * 1_000_003 + t,
            device=self.config.device,
        )
        self.model.to("cpu")
        return [
            ClientUpdate(
                "pooled",
                {},
                result.num_samples,
                loss=result.mean_loss,
                samples_seen=result.samples_seen,
                train_macs=result.train_macs,
                compute_seconds=time.perf_counter() - began,
                variants_per_batch={str(k): v for k, v in result.variants_per_batch.items()},
            )
        ]

    def aggregate(
        self,
        t: int,
        global_state: Mapping[str, torch.Tensor],
        updates: Sequence[ClientUpdate],
        plans: Mapping[str, Any],
    ) -> None:
        """Nothing to fold in: :meth:`collect` trained the global model itself."""
