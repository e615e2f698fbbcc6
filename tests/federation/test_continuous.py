"""A federation without an end, over a real Mosquitto with real agent processes: ``feast-server run --continuous``
stopped by ``feast-server stop`` after the round in progress (agents leave, a model each), a finished run extended
with a larger --rounds (a smaller one refused), and a device that joins after three rounds served at once."""

from __future__ import annotations

import json
import math
import signal
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
        # A crash mid-run loses no round: the same command goes on from the last checkpoint, the agents stay.
        assert kit.wait_for(lambda: _rounds(out) >= 2 or server.poll() is not None, 300), kit.log_text(server)[-3000:]
        server.kill()
        server.wait(30)
        crashed_at = _rounds(out)
        server = kit.spawn(command, tmp_path / "server-again.log")
        # Runs past any horizon --rounds would set (2 here, ignored without an end).
        assert kit.wait_for(lambda: _rounds(out) >= crashed_at + 2 or server.poll() is not None, 300), kit.log_text(
            server
        )[-3000:]
        assert server.poll() is None, kit.log_text(server)[-3000:]
        assert f"resuming from {out / 'checkpoint.safetensors'}: {crashed_at} rounds completed" in kit.log_text(server)
        # An agent that crashes comes back with the same command and takes part again.
        restarted = clients[0]
        agents[restarted["client_id"]].kill()
        agents[restarted["client_id"]].wait(30)
        back = _rounds(out)
        agents[restarted["client_id"]] = kit.spawn_agent(
            tmp_path / "again", restarted["client_id"], partition / restarted["file"], federation,
            "--model-dir", str(tmp_path / "models" / restarted["client_id"]),
        )  # fmt: skip
        assert kit.wait_for(lambda: _rounds(out) >= back + 2 or server.poll() is not None, 300)
        asked = _feast_server("stop", "--out", str(out), "--reason", "the test is done")
        assert asked.returncode == 0, asked.stderr
        assert "stop requested" in asked.stdout
        assert server.wait(240) == 0, kit.log_text(server)[-3000:]
        text = kit.log_text(server)
        assert "stop requested by" in text and "(the test is done)" in text
        done = _rounds(out)
        assert done >= crashed_at + 2
        history = read_record(out / "checkpoint.safetensors")["fields"]["history"]
        assert [h["round"] for h in history] == list(range(1, done + 1))  # none lost, none twice
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
    status = json.loads(_feast_server("status", "--out", str(out), "--json").stdout)
    assert status["rounds"] == {"completed": done, "total": None, "continuous": True}
    assert f"rounds: {done} completed (no end: --continuous)" in _feast_server("status", "--out", str(out)).stdout


def test_a_finished_run_is_extended_with_more_rounds_and_refused_with_fewer(
    kit, partition: Path, federation: str, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    config = kit.CONFIG.changed(rounds=2, per_round=2)
    clients = read_index(partition)["clients"]
    agents = {
        c["client_id"]: kit.spawn_agent(tmp_path, c["client_id"], partition / c["file"], federation, "--stay")
        for c in clients
    }
    try:
        first = kit.spawn(
            kit.server_command(config, out, federation, partition, no_export=True), tmp_path / "first.log"
        )
        assert first.wait(300) == 0, kit.log_text(first)[-3000:]
        assert _rounds(out) == 2
        two = read_record(out / "checkpoint.safetensors")["fields"]["history"]
        longer = kit.spawn(
            kit.server_command(config, out, federation, partition, no_export=True, rounds=4), tmp_path / "longer.log"
        )
        assert longer.wait(300) == 0, kit.log_text(longer)[-3000:]
        text = kit.log_text(longer)
        assert "the run is extended (rounds 2 -> 4); it goes on from round 2" in text
        assert "resuming from" in text and "2 of 4 rounds completed" in text
        assert _rounds(out) == 4
        history = read_record(out / "checkpoint.safetensors")["fields"]["history"]
        assert [h["round"] for h in history] == [1, 2, 3, 4]
        assert history[:2] == two  # the rounds done stay as they were
        # Rounds 3-4 follow the cosine over the new horizon of 4 rounds.
        assert history[2]["lr"] == pytest.approx(history[0]["lr"] * 0.5 * (1 + math.cos(math.pi * 2 / 4)))
        shorter = _feast_server(*kit.server_command(config, out, federation, partition, no_export=True, rounds=3)[3:])
        assert shorter.returncode == 2
        assert "has completed 4 rounds, more than --rounds 3: give --rounds 4 or more to go on, or --continuous" in (
            shorter.stderr
        )
        assert "Traceback" not in shorter.stderr
        other = _feast_server(
            *kit.server_command(config, out, federation, partition, no_export=True, rounds=5, seed=9)[3:]
        )
        assert other.returncode == 2 and "differs in: seed" in other.stderr  # only the horizon may change
    finally:
        for process in agents.values():
            kit.stop(process)


def test_a_device_that_joins_after_three_rounds_gets_the_served_model_within_one_round(
    kit, partition: Path, federation: str, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    config = kit.CONFIG.changed(rounds=200, per_round=2)  # ended by feast-server stop once checked
    clients = read_index(partition)["clients"]
    early, late = clients[:2], clients[2]
    command = kit.server_command(config, out, federation, partition, start_clients=2, eval_every=1)
    server = kit.spawn(command, tmp_path / "server.log")
    agents = [kit.spawn_agent(tmp_path, c["client_id"], partition / c["file"], federation) for c in early]
    try:
        assert kit.wait_for(lambda: _rounds(out) >= 3 or server.poll() is not None, 300), kit.log_text(server)[-3000:]
        joined_after = _rounds(out)
        assert joined_after < 200
        models = tmp_path / "late-models"
        agents.append(kit.spawn_agent(tmp_path, late["client_id"], partition / late["file"], federation,
                                      "--model-dir", str(models)))  # fmt: skip
        assert kit.wait_for(lambda: any(models.glob("*.onnx")) or server.poll() is not None, 300)
        got_at = _rounds(out)
        assert server.poll() is None and got_at < 200, "the late device's model came only at the end"
        text = kit.log_text(server)
        sent = [line for line in text.splitlines() if "offered version" in line and late["client_id"] in line]
        assert sent, text[-3000:]
        served_round = int(sent[0].split("(round ")[1].split(")")[0])
        assert served_round <= got_at
        # feast-agent fetch-model works during the run: the served round's models were exported when it was chosen.
        # The server answers between its steps; a served round's export (every round here) can hold it a while on a
        # loaded machine, hence the long wait.
        fetched = subprocess.run(
            [sys.executable, "-m", "feast_edge.agent.cli", "fetch-model", "--broker", kit.LOCAL, "--federation",
             federation, "--device-id", early[0]["client_id"], "--out", str(tmp_path / "fetched.onnx"), "--timeout",
             "240", "--repeats", "3"],
            cwd=kit.REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert fetched.returncode == 0, fetched.stderr[-2000:]
        assert (tmp_path / "fetched.onnx").is_file() and server.poll() is None
        assert _feast_server("stop", "--out", str(out)).returncode == 0  # a finite run ends on request too
        assert server.wait(300) == 0, kit.log_text(server)[-3000:]
        # The devices there from the start got theirs at the end, as in any finite run.
        assert f"sent round" not in "".join(
            line for line in text.splitlines() if early[0]["client_id"] in line and "models to" in line
        )
    finally:
        for process in [server, *agents]:
            kit.stop(process)


def test_sigterm_ends_a_run_after_its_round_and_a_stop_ends_a_wait_for_devices_at_once(
    kit, partition: Path, federation: str, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    config = kit.CONFIG.changed(rounds=2, per_round=2)
    command = kit.server_command(config, out, federation, partition, continuous=True, rounds=None, no_export=True)
    clients = read_index(partition)["clients"]
    server = kit.spawn(command, tmp_path / "server.log")
    agents = [kit.spawn_agent(tmp_path, c["client_id"], partition / c["file"], federation) for c in clients]
    try:
        assert kit.wait_for(lambda: _rounds(out) >= 1 or server.poll() is not None, 300), kit.log_text(server)[-3000:]
        server.send_signal(signal.SIGTERM)
        assert server.wait(240) == 0, kit.log_text(server)[-3000:]
        text = kit.log_text(server)
        assert "stop requested by SIGTERM" in text and "federation stopped on request after round" in text
        for process in agents:
            assert process.wait(120) == 0, kit.log_text(process)[-2000:]
    finally:
        for process in [server, *agents]:
            kit.stop(process)
    # No device online: the server waits; a stop ends the wait at once, nothing lost.
    waiting = kit.spawn(command, tmp_path / "waiting.log")
    try:
        assert kit.wait_for(lambda: "waiting for devices" in kit.log_text(waiting), 60), kit.log_text(waiting)
        asked = time.monotonic()
        assert _feast_server("stop", "--out", str(out)).returncode == 0
        assert waiting.wait(60) == 0, kit.log_text(waiting)[-3000:]
        assert time.monotonic() - asked < 30
        assert "stopped on request while waiting for devices before round" in kit.log_text(waiting)
    finally:
        kit.stop(waiting)
    refused = _feast_server("stop", "--out", str(tmp_path / "nowhere"))
    assert refused.returncode == 2 and "is not a run directory" in refused.stderr and "Traceback" not in refused.stderr
