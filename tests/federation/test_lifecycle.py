"""A federation ends cleanly: agents exit 0 with a summary, --stay keeps waiting, a late agent is told it is over.

Real processes as a user runs them: ``feast-server run --serve`` and
``feast-agent run`` through the Mosquitto at 127.0.0.1:1883.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from feast_edge.sim.shards import read_index

# feast-server and feast-agent processes through the broker at 127.0.0.1:1883.
pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.timeout(600)]


def _exited(process: subprocess.Popen) -> bool:
    return process.poll() is not None


def test_agents_leave_when_the_federation_finishes(kit, tmp_path: Path, federation: str, partition: Path) -> None:
    clients = read_index(partition)["clients"]
    out = tmp_path / "run"
    server_log = tmp_path / "server.log"
    command = kit.server_command(
        kit.CONFIG.changed(rounds=1), out, federation, partition,
        wait_timeout=120, start_clients=None, seed=None, batch_size=None, serve=True,
    )  # fmt: skip
    with open(server_log, "w") as log:
        server = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True)
    first = kit.spawn_agent(
        tmp_path,
        clients[0]["client_id"],
        partition / clients[0]["file"],
        federation,
        "--model-dir",
        str(tmp_path / "models"),
    )
    staying = kit.spawn_agent(tmp_path, clients[1]["client_id"], partition / clients[1]["file"], federation, "--stay")
    late = None
    try:
        assert kit.wait_for(lambda: _exited(first), timeout=300), (
            f"the agent did not leave after the last round:\n{kit.log_text(first)}\n{server_log.read_text()}"
        )
        assert first.returncode == 0, kit.log_text(first)
        summary = kit.log_text(first)
        assert (
            f"federation '{federation}' finished after 1 of 1 rounds: {clients[0]['client_id']} trained in 1 round, model saved to "
            in summary
        ), summary
        assert (tmp_path / "models" / f"{clients[0]['client_id']}.onnx").is_file()
        # --stay: told the run is over, it keeps waiting for the next one.
        assert kit.wait_for(lambda: "finished after 1 of 1 rounds" in kit.log_text(staying), timeout=30), kit.log_text(
            staying
        )
        time.sleep(1.0)
        assert not _exited(staying), kit.log_text(staying)
        # An agent that registers after the end is told so, and leaves with status 0 too.
        late = kit.spawn_agent(tmp_path, clients[2]["client_id"], partition / clients[2]["file"], federation)
        assert kit.wait_for(lambda: _exited(late), timeout=120), kit.log_text(late)
        assert late.returncode == 0 and "has already finished (1 rounds)" in kit.log_text(late), kit.log_text(late)
        assert kit.stop(staying) == 0
    finally:
        for process in (first, staying, late):
            if process is not None:
                kit.stop(process)
        kit.stop(server)
    for text in (server_log.read_text(), kit.log_text(first), kit.log_text(staying), kit.log_text(late)):
        # Nothing at error level on a normal path (console lines are "HH:MM:SS error: ..." at that level).
        assert not re.search(r"^\d\d:\d\d:\d\d (error|critical):|ERROR|Traceback", text, flags=re.M), text


def test_export_and_serve_work_from_the_run_directory_alone(
    kit, tmp_path: Path, federation: str, partition: Path, server_cli, agent_cli
) -> None:
    """After a run: `feast-server export --out` re-exports from the checkpoint, `serve` answers `fetch-model`."""
    clients = read_index(partition)["clients"][:2]
    out = tmp_path / "run"
    ran = subprocess.Popen(
        kit.server_command(
            kit.CONFIG.changed(rounds=1),
            out,
            federation,
            wait_timeout=120,
            start_clients=None,
            seed=None,
            batch_size=None,
            eval_every=None,
        ),  # fmt: skip
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    agents = [kit.spawn_agent(tmp_path, c["client_id"], partition / c["file"], federation) for c in clients]
    try:
        output, _ = ran.communicate(timeout=300)
        assert ran.returncode == 0, output
        assert all(kit.wait_for(lambda a=a: a.poll() is not None, timeout=60) for a in agents), (
            "agents did not leave after the last round"
        )
    finally:
        for a in agents:
            kit.stop(a)
    # Without --data the run's export left each device its variant's weights to calibrate on its own data; these agents
    # keep no model (no --model-dir) and say so, so the server does not wait for their reports.
    assert "weights for BN calibration on each device" in output and "no calibrated-model report" not in output
    exported = server_cli.run(
        "export", "--out", str(out), "--data", str(partition), "--log-level", "warning", timeout=300
    )
    assert exported.returncode == 0, exported.stderr
    assert (
        all(c["client_id"] in exported.stdout for c in clients)
        and (out / "models" / f"{clients[0]['client_id']}.onnx").is_file()
    )
    serving = subprocess.Popen(
        [sys.executable, "-m", "feast_edge.server.cli", "serve", "--broker", kit.LOCAL, "--out", str(out)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        fetched = agent_cli.run(
            "fetch-model",
            "--broker",
            kit.LOCAL,
            "--device-id",
            clients[0]["client_id"],
            "--federation",
            federation,
            "--out",
            str(tmp_path / "m.onnx"),
            "--repeats",
            "5",
            "--timeout",
            "60",
            timeout=180,
        )
    finally:
        kit.stop(serving)
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    assert "sha256" in fetched.stdout and "verified" in fetched.stdout
    assert (tmp_path / "m.onnx").read_bytes() == (out / "models" / f"{clients[0]['client_id']}.onnx").read_bytes()
    assert not re.search(r"ERROR|Traceback", fetched.stderr), fetched.stderr
