"""DP over MQTT computes what DP in simulation computes, with the same core: central DP (the server clips, noises and
accounts) and local DP (each ``feast-agent`` clips and noises its own update before it leaves).

Three ``feast-agent run`` processes train the partitioned shards of a small simulation for two rounds through the
Mosquitto at 127.0.0.1:1883 under ``--dp-clip/--dp-noise`` with a fixed ``--dp-seed``; the final weights and every
round's ε equal the simulator's. A server without data under DP neither collects the devices' held-out counts nor
their BN statistics; a device that requires local DP declines the rounds of a server that does not run it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from feast_edge.privacy.accountant import local_epsilon
from feast_edge.run.loop import CHECKPOINT
from feast_edge.server.app import FederationServer
from feast_edge.server.config import ServerConfig, ServerError
from feast_edge.server.status import read_status, status_lines
from feast_edge.sim.shards import read_index
from feast_edge.sim.simulate import Simulation
from feast_edge.transport.broker import LinkConfig

DP = dict(dp_clip=0.5, dp_noise=0.6, dp_seed=21)


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["central", "local"])
def test_a_private_federation_equals_the_private_simulation(kit, tmp_path: Path, partition: Path, mode: str) -> None:
    dp = DP | {"dp_mode": mode}
    config = kit.CONFIG.changed(**dp)
    simulated = Simulation(config, tmp_path / "simulation").run()
    fed = kit.new_federation()
    out = tmp_path / "federation"
    server = kit.ServerThread(kit.server_config(config, out, partition, fed, **dp)).start()
    agents = {}
    try:
        for i, entry in enumerate(read_index(partition)["clients"]):
            cid = entry["client_id"]
            # Local DP: the first device also requires it itself, at the server's settings (the stricter of equals).
            own = ["--dp-clip", "0.5", "--dp-noise", "0.6"] if mode == "local" and i == 0 else []
            extra = [*own, "--dp-ledger", str(tmp_path / f"ledger-{cid}.json")]
            agents[cid] = kit.spawn_agent(out / "logs", cid, partition / entry["file"], fed, *extra)
        history = server.join(timeout=300)
    finally:
        codes = {cid: kit.stop(p) for cid, p in agents.items()}
        server.close()
        kit.clear_retained(fed)
    assert all(code == 0 for code in codes.values()), codes
    got, want = kit.weights(out / CHECKPOINT), kit.weights(tmp_path / "simulation" / CHECKPOINT)
    assert all(torch.equal(got[k], want[k]) for k in got), f"differ by {kit.max_abs_diff(got, want)}"
    assert [h.dp for h in history] == [r["dp"] for r in simulated["rounds"]]
    assert all(h.samples == len(h.updated) for h in history)  # uniform weights, whatever the devices registered
    assert ",epsilon,clip," in (out / "rounds.csv").read_text().splitlines()[0]
    if mode == "local":  # each device counted what it sent, in its own ledger
        sent = {cid: sum(cid in h.updated for h in history) for cid in agents}
        for cid, n in sent.items():
            ledger = tmp_path / f"ledger-{cid}.json"
            assert (json.loads(ledger.read_text()) if n else {}) == ({cid: {fed: [0.6] * n}} if n else {})
        first = next(iter(agents))
        assert f"local DP ε = {local_epsilon([0.6] * sent[first], 1e-5):.3g}" in kit.log_text(agents[first])
    status = read_status(out)
    assert status["privacy"]["epsilon"] == history[-1].dp["epsilon"] and status["privacy"]["rounds"] == 2
    assert any(line.startswith("privacy: ε = ") for line in status_lines(status))


def test_a_server_without_data_keeps_the_devices_statistics_on_the_devices_under_dp(tmp_path: Path) -> None:
    private = ServerConfig.of(out=str(tmp_path / "dp"), preset="fmnist-small", **DP)
    assert not private.federated_statistics
    # the server's environment offers no validator under DP (server.environment), unconnected
    assert FederationServer(private, LinkConfig()).loop.validator is None
    plain = ServerConfig.of(out=str(tmp_path / "plain"), preset="fmnist-small")
    assert plain.federated_statistics and FederationServer(plain, LinkConfig()).loop.validator is not None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dp_clip": 1.0}, "needs both --dp-clip C and --dp-noise z"),
        (
            {"dp_clip": 1.0, "dp_noise": 1.0, "aggregation": "trimmed-mean"},
            "--aggregation trimmed-mean does not compose",
        ),
        ({"dp_seed": 3}, "--dp-seed needs --dp-clip and --dp-noise"),
        ({"dp_clip": 1.0, "dp_noise": 1.0, "dp_mode": "local", "dp_clip_quantile": 0.5}, "central only"),
    ],
)
def test_the_server_refuses_dp_settings_that_cannot_hold(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ServerError, match=message):
        ServerConfig.of(out=str(tmp_path), **changes)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--dp-clip", "1", "--dp-noise", "0"], "--dp-noise 0.0 must be a positive noise multiplier"),
        (["--dp-clip", "-1", "--dp-noise", "1"], "--dp-clip -1.0 must be a positive L2 norm"),
        (["--dp-clip", "1", "--dp-noise", "1", "--aggregation", "median"], "--aggregation median does not compose"),
        (["--dp-clip", "1", "--dp-noise", "1", "--dp-clip-quantile", "1.5"], "--dp-clip-quantile 1.5 must be"),
        (["--dp-epsilon", "8"], "--dp-epsilon needs --dp-clip and --dp-noise"),
    ],
)
def test_feast_server_run_refuses_bad_dp_settings_before_anything_is_written(server_cli, tmp_path, args, fragment):
    nowhere = "mqtt://127.0.0.1:9"  # never reached: the options are refused before any connection
    result = server_cli.invoke("run", "--insecure", "--broker", nowhere, "--out", str(tmp_path / "run"), *args)
    server_cli.assert_user_error(result, fragment)
    assert result.returncode == 2 and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.timeout(300)
def test_a_device_that_requires_local_dp_declines_a_server_without_it(kit, tmp_path: Path, partition: Path) -> None:
    fed, out = kit.new_federation(), tmp_path / "federation"
    config = kit.CONFIG.changed(rounds=1, per_round=3)  # every device in the cohort, the strict one too
    server = kit.ServerThread(kit.server_config(config, out, partition, fed, min_clients=2)).start()
    agents, ledger = {}, tmp_path / "ledger.json"
    try:
        for i, entry in enumerate(read_index(partition)["clients"]):
            own = ["--dp-clip", "1", "--dp-noise", "1", "--dp-ledger", str(ledger)] if i == 0 else []
            agents[entry["client_id"]] = kit.spawn_agent(
                out / "logs", entry["client_id"], partition / entry["file"], fed, *own
            )
        history = server.join(timeout=200)
    finally:
        for p in agents.values():
            kit.stop(p)
        server.close()
        kit.clear_retained(fed)
    strict = next(iter(agents))
    [record] = history
    assert strict in record.declined and "requires local differential privacy" in record.declined[strict]
    assert strict not in record.updated and len(record.updated) == len(agents) - 1
    assert not ledger.exists()  # nothing was noised, nothing spent
