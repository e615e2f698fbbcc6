"""A device that runs other work: the agent trains on the cores that are free, at a lower priority, and a simulation
keeps one thread count for the whole run (feast_edge.util.cores, feast_edge.util.priority).

Real processes: ``feast-server run`` and ``feast-agent run`` through the Mosquitto at 127.0.0.1:1883, and
``feast-edge simulate``; the busy sibling is a Python process spinning on the same CPUs. No timing is asserted (that
is bench/bench_threads.py's job): only which count the processes chose, said and used.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from feast_edge.sim.shards import read_index
from simconfigs import cli_options, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CPUS = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else []
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs (and an affinity mask) to share")


def _on_cpus(cpus: list[int]):
    return lambda: os.sched_setaffinity(0, cpus)


@contextmanager
def busy_sibling(cpus: list[int]) -> Iterator[subprocess.Popen]:
    """A process at normal priority that keeps one CPU of ``cpus`` busy until the block ends."""
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=_on_cpus(cpus))
    try:
        yield process
    finally:
        process.kill()
        process.wait(10)


def _free_env() -> dict[str, str]:
    """The environment without the tests' OMP_NUM_THREADS: the process chooses from its cores as a user's would."""
    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTHONUNBUFFERED": "1"}


@needs_two_cpus
@pytest.mark.broker
def test_an_agent_beside_a_busy_sibling_trains_on_one_thread_at_a_lower_priority(
    kit, tmp_path: Path, federation: str, partition: Path
) -> None:
    client = read_index(partition)["clients"][0]
    config = kit.CONFIG.changed(rounds=1, per_round=1)
    server = kit.spawn(
        kit.server_command(config, tmp_path / "run", federation, partition, start_clients=1, no_export=True),
        tmp_path / "server.log",
    )
    # The agent as a user starts it: no --threads (the last one given wins), no --nice, on the two CPUs it shares.
    command = kit.agent_command(client["client_id"], partition / client["file"], federation, "--threads", "0")
    command.remove("--threads")
    command.remove("1")
    agent_log = tmp_path / "agent.log"
    try:
        with busy_sibling(CPUS), open(agent_log, "w") as log:
            agent = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=_free_env(), preexec_fn=_on_cpus(CPUS)
            )
            try:
                assert kit.wait_for(lambda: "training with" in agent_log.read_text(), timeout=300), (
                    agent_log.read_text() + (tmp_path / "server.log").read_text()
                )
                nice = psutil.Process(agent.pid).nice()
                assert kit.wait_for(lambda: agent.poll() is not None, timeout=300), agent_log.read_text()
            finally:
                kit.stop(agent)
        text = agent_log.read_text()
        assert agent.returncode == 0, text
        # One thread, said with its reason: the sibling (and any other work on those CPUs) keeps at least one busy.
        assert re.search(r"training with 1 thread: [12] of 2 cores busy with other work", text), text
        assert "running at niceness 10" in text and nice == 10, text
    finally:
        kit.stop(server)


def _simulate(out: Path, *extra: str, env: dict[str, str] | None = None) -> dict:
    config = tiny_config(rounds=1)
    result = subprocess.run(
        [sys.executable, "-m", "feast_edge.cli", "simulate", *cli_options(config), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        env=env or _free_env(),
        preexec_fn=_on_cpus(CPUS) if CPUS else None,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr + result.stdout[-2000:]
    return json.loads((out / "results.json").read_text()) | {"stdout": result.stdout}


@needs_two_cpus
def test_simulate_records_its_threads_and_pinned_threads_give_the_same_weights_under_load(
    fashion_mnist_dir, tmp_path: Path
) -> None:
    quiet = _simulate(tmp_path / "quiet", "--threads", "1")
    with busy_sibling(CPUS):
        loaded = _simulate(tmp_path / "loaded", "--threads", "1")
        chosen = _simulate(tmp_path / "chosen")
    assert quiet["threads"] == loaded["threads"] == {"intra_op": 1, "chosen": "--threads"}
    a, b = (
        load_file(tmp_path / "quiet" / "checkpoint.safetensors"),
        load_file(tmp_path / "loaded" / "checkpoint.safetensors"),
    )
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # Without --threads: the free cores at the start, one count for the run, recorded with its reason and said.
    assert chosen["threads"]["intra_op"] == 1 and "busy with other work" in chosen["threads"]["chosen"]
    assert "1 intra-op thread per process for the whole run: " in chosen["stdout"]
