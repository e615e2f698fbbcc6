"""ServerConfig's ablation is ``variants``; checkpoints store it under the key runs kept before the rename ("method")."""

from __future__ import annotations

from pathlib import Path

import pytest

from feast_edge.run.checkpoint import save_supernet
from feast_edge.run.loop import CHECKPOINT, HISTORY_FORMAT, RoundRecord
from feast_edge.server.app import FederationServer, ServerConfig, ServerError
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from feast_edge.transport.broker import LinkConfig

BROKER = "mqtt://127.0.0.1:1883"  # never connected to: the tests only build servers


def test_the_fingerprint_keeps_the_key_runs_stored_before_the_rename(tmp_path: Path) -> None:
    decisive = ServerConfig.of(out=str(tmp_path), variants="min+max").decisive()
    assert decisive["method"] == "min+max" and "variants" not in decisive


def test_a_config_stored_with_the_old_method_key_loads_as_variants(tmp_path: Path) -> None:
    """What feast-server run wrote before --method was renamed --variants: export and serve still read its settings."""
    preset = load_preset("fmnist-small")
    config = {
        "preset": preset.name,
        "rounds": 3,
        "per_round": 2,
        "min_clients": 2,
        "seed": 7,
        "method": "min+max+kd",
        "federation": "lab",
    }
    save_supernet(
        tmp_path / CHECKPOINT,
        Supernet(preset, seed=0),
        kind="federation",
        fingerprint="x",
        config=config,
        round=1,
        history=[],
        history_format=HISTORY_FORMAT,
        best={},
        registry=[],
        data=None,
    )
    stored = ServerConfig.stored(tmp_path)
    assert (stored.training.variants, stored.training.rounds, stored.seed, stored.federation) == (
        "min+max+kd",
        3,
        7,
        "lab",
    )
    assert stored.decisive()["method"] == "min+max+kd"


def _checkpointed(config: ServerConfig) -> None:
    """A run of ``config`` with one completed round in its --out."""
    server = FederationServer(config, LinkConfig(broker=BROKER))
    try:
        server.loop.history.append(RoundRecord(round=1, lr=0.1, cohort=["a", "b"]))
        server.loop.save(CHECKPOINT)
    finally:
        server.close()


def test_a_run_resumes_with_the_same_variants_and_refuses_others(tmp_path: Path) -> None:
    config = ServerConfig.of(out=str(tmp_path), rounds=2, variants="min")
    _checkpointed(config)
    again = FederationServer(config, LinkConfig(broker=BROKER))
    try:
        assert again.resume() == 1
    finally:
        again.close()
    other = FederationServer(ServerConfig.of(out=str(tmp_path), rounds=2, variants="max"), LinkConfig(broker=BROKER))
    try:
        with pytest.raises(ServerError, match=r"other settings \(differs in: method, train\)"):
            other.resume()
    finally:
        other.close()


def test_the_server_runs_the_optimizer_it_is_given_and_records_it(tmp_path: Path) -> None:
    config = ServerConfig.of(out=str(tmp_path), server_opt="yogi", server_lr=0.02, server_betas=(0.8, 0.9))
    opt = config.run_concerns().server_opt
    assert (opt.name, opt.lr, opt.betas) == ("yogi", 0.02, (0.8, 0.9))
    assert config.decisive()["server_optimizer"] == {"name": "yogi", "lr": 0.02, "betas": (0.8, 0.9), "tau": 1e-3}
    plain = ServerConfig.of(out=str(tmp_path), server_opt="avg", server_lr=1.0)
    assert "server_optimizer" not in plain.decisive() and plain.run_concerns().server_opt.identity
    with pytest.raises(ServerError, match="--server-tau"):
        ServerConfig.of(out=str(tmp_path), server_opt="adam", server_tau=0.0)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (dict(mode="async", eval_every=10), "--secure-agg with --mode async: each update's staleness weight"),
        (dict(aggregation="median"), "--secure-agg with --aggregation median: a robust rule needs each device's"),
        (dict(server_opt="adam"), "--secure-agg with --server-opt adam: the server optimizer's step"),
        (dict(dp_mode="local", dp_clip=1.0, dp_noise=1.0), "--secure-agg with --dp-mode local: local DP's noise"),
        (dict(dp_clip=1.0, dp_noise=1.0, dp_clip_quantile=0.5), "--secure-agg with --dp-clip-quantile"),
        (dict(per_round=257), "--per-round 257: a round's roster of keys travels in one message"),
        (dict(per_round=80, secagg_neighbours=70), "sealed shares for its 70 neighbours travel in one message"),
        (dict(per_round=2, min_clients=2), "--per-round 2: a segment is revealed only over --colluders \\+ 2 = 3"),
    ],
)
def test_secure_aggregation_refuses_what_needs_single_updates_or_a_cohort_the_stages_cannot_carry(
    tmp_path: Path, changes: dict, named: str
) -> None:
    with pytest.raises(ServerError, match=named):
        ServerConfig.of(out=str(tmp_path), secure_agg=True, rounds=10, **changes)


def test_secure_aggregation_is_in_the_fingerprint_and_runs_without_the_loop_s_weight_cap(tmp_path: Path) -> None:
    config = ServerConfig.of(out=str(tmp_path), secure_agg=True, colluders=2, secagg_bound=4.0)
    decisive = config.decisive()
    assert (decisive["secure_agg"], decisive["colluders"], decisive["secagg_bound"]) == (True, 2, 4.0)
    assert config.aggregation.max_weight_ratio > 0  # the counts that weigh each device are capped by the collector
    assert config.run_concerns().weight_cap() == 0.0  # the loop's own cap would need each update
    assert "secure_agg" not in ServerConfig.of(out=str(tmp_path)).decisive()


def test_asynchronous_rounds_refuse_what_needs_the_devices_between_releases_and_record_their_settings(
    tmp_path: Path,
) -> None:
    base = dict(out=str(tmp_path), mode="async", buffer=2, concurrency=4, rounds=10)
    with pytest.raises(ServerError, match="without --data: the devices would validate the model every 1 releases"):
        ServerConfig.of(**base, eval_every=1)
    assert ServerConfig.of(**base, eval_every=10).schedule.rules() is not None  # validated once, after the last
    central = dict(dp_mode="central", dp_clip=1.0, dp_noise=1.0, dp_epsilon=1000.0, eval_every=10)
    with pytest.raises(ServerError, match="central DP weighs every buffered update alike.*add --staleness constant"):
        ServerConfig.of(**base, **central)
    config = ServerConfig.of(**base, **central, staleness="constant")
    assert config.run_concerns().server_opt.lr == pytest.approx(0.25)  # a release moves a quarter of the way
    decisive = config.decisive()
    assert (decisive["mode"], decisive["buffer"], decisive["concurrency"], decisive["staleness"]) == (
        "async",
        2,
        4,
        "constant",
    )
    assert "mode" not in ServerConfig.of(out=str(tmp_path)).decisive()  # synchronous runs keep their fingerprint


def test_serve_average_is_refused_where_no_round_is_validated_and_taken_where_one_is(tmp_path: Path) -> None:
    dp = dict(dp_clip=1.0, dp_noise=1.0, dp_epsilon=1000.0)
    with pytest.raises(ServerError, match="--serve-average 3: this run validates no round .*drop --serve-average, or"):
        ServerConfig.of(out=str(tmp_path), serve_average=3, **dp)
    assert ServerConfig.of(out=str(tmp_path), serve_average=1, **dp).validation.serve_average == 1  # own weights
    assert ServerConfig.of(out=str(tmp_path), **dp).validation.serve_average is None
    assert ServerConfig.of(out=str(tmp_path), serve_average=3).validation.serve_average == 3  # devices validate
