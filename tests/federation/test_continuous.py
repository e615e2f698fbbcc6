"""A federation without an end, over a real Mosquitto with real agent processes: ``feast-server run --continuous``
stopped by ``feast-server stop`` after the round in progress (agents leave, a model each), a finished run extended
with a larger --rounds (a smaller one refused), and a device that joins after three rounds served at once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from feast_edge.run.checkpoint import read_record
from feast_edge.sim.shards import read_index

pytestmark = pytest.mark.slow


def _rounds(out: Path) -> int:
    path = out / "checkpoint.safetensors"
    return int(read_record(path)["fields"]["round"]) if path.is_file() else 0


def _feast_server(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "feast_edge.server.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_a_continuous_federation_runs_until_stopped_then_every_agent_leaves_with_a_model(
    kit, partition: Path, federation: str, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    config = kit.CONFIG.changed(rounds=2, per_round=2)
    command = kit.server_command(config, out, federation, partition, continuous=True, eval_every=2, rounds=None)
    server = kit.spawn(command, tmp_path / "server.log")
    clients = read_index(partition)["clients"]
    agents = {
        c["client_id"]: kit.spawn_agent(tmp_path, c["client_id"], partition / c["file"], federation,
                                        "--model-dir", str(tmp_path / "models" / c["client_id"]))
        for c in clients
    }  # fmt: skip
    try:
        # Runs past any horizon --rounds would set (2 here, ignored without an end).
        assert kit.wait_for(lambda: _rounds(out) >= 4 or server.poll() is not None, 300), kit.log_text(server)[-3000:]
        assert server.poll() is None, kit.log_text(server)[-3000:]
        asked = _feast_server("stop", "--out", str(out), "--reason", "the test is done")
        assert asked.returncode == 0, asked.stderr
        assert "stop requested" in asked.stdout
        assert server.wait(240) == 0, kit.log_text(server)[-3000:]
        text = kit.log_text(server)
        assert "stop requested by" in text and "(the test is done)" in text
        done = _rounds(out)
        assert done >= 4
        assert f"federation stopped on request after round {done}" in text
        assert not (out / "stop-request.json").exists()  # acted on, removed
        record = read_record(out / "checkpoint.safetensors")["fields"]
        assert record["config"]["continuous"] is True and "rounds" not in record["config"]
        for device, process in agents.items():
            assert process.wait(120) == 0, kit.log_text(process)[-3000:]
            log = kit.log_text(process)
            assert f"finished after {done} rounds; leaving" in log, log[-2000:]
            assert "round 3/" not in log  # no horizon shown
            assert any((tmp_path / "models" / device).glob("*.onnx")), log[-2000:]
    finally:
        for process in [server, *agents.values()]:
            kit.stop(process)
    # The stopped run goes on from where it ended with the same command (nothing depends on a horizon).
    assert json.loads(_feast_server("status", "--out", str(out), "--json").stdout)["rounds"]["completed"] == done
