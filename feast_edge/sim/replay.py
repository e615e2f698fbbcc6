"""Recompute a federation from its record: the rounds a server (or a simulation) logged, replayed in process.

All randomness of a round derives from the seed and the round index, so the
aggregated updates a round recorded can be recomputed exactly, however many
other updates were lost or refused: a run disturbed by kills, restarts and
outages must end with the weights this replay gives (``bench/chaos.py``,
``tests/federation/test_chaos.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from feast_edge.aggregate.robust import aggregate_updates
from feast_edge.aggregate.server_opt import ServerOptimizer, routed_masks
from feast_edge.cache.variants import load_cache
from feast_edge.local.update import client_update
from feast_edge.route.envelope import route_state
from feast_edge.route.plans import plan_client
from feast_edge.run.cohort import client_seed
from feast_edge.run.loop import RoundRecord
from feast_edge.sim.setup import SimulationConfig
from feast_edge.sim.shards import read_index, read_shard
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet


def replay_rounds(
    records: Sequence[RoundRecord], partition: Path, config: SimulationConfig, budgets: Mapping[str, float]
) -> dict[str, torch.Tensor]:
    """The global state after ``records``: each applied round's updated clients co-trained again on their shards in
    ``partition`` with the budgets they registered, and aggregated as the run loop does (method §5–§6, then the server optimizer's step)."""
    preset = load_preset(config.preset)
    cache = load_cache(preset, config.cache)
    model = Supernet(preset, seed=config.seed)
    state = model.state_dict()
    opt = config.server_optimizer()
    optimizer = None if opt.identity else ServerOptimizer(opt, {n: tuple(p.shape) for n, p in model.named_parameters()})
    shards = {e["client_id"]: read_shard(partition / e["file"]) for e in read_index(partition)["clients"]}
    for t, record in enumerate(records):
        if not record.applied:
            continue
        updates = []
        for client in record.updated:
            plan = plan_client(cache, budgets[client])
            routed = route_state(state, plan.layout(preset, preset.classes), preset)
            shard = shards[client]
            seed = client_seed(config.seed, t, client)
            new_state, result = client_update(
                preset, preset.classes, plan, routed, shard.images, shard.labels, config.train_config(), record.lr, seed
            )
            weight = record.capped.get(client, [0, result.num_samples])[1]  # as the run loop weighed it
            updates.append((client, new_state, weight))
        before = optimizer.snapshot(state) if optimizer is not None else None
        aggregate_updates(
            state,
            updates,
            inplace=True,
            rule=config.aggregation.rule,
            trim=config.aggregation.trim,
            clip_norm=config.aggregation.clip_norm,
        )
        if optimizer is not None:
            optimizer.step(state, before, routed_masks(state, [u[1] for u in updates], list(optimizer.shapes)))
    return state
