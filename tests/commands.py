"""The ``feast-server`` and ``feast-agent`` command lines of the tests, written once: as a user types them, run as
processes of this checkout.

``server_command(config, ...)`` is the ``feast-server run`` that reproduces a simulation config (the subprocess twin
of tests/federation/conftest.py's ``server_config``); ``agent_command`` is a ``feast-agent run`` with the tests'
settings (one intra-op thread, float32); ``spawn`` starts either with its output in a log file; ``share_the_cores``
(called by tests/conftest.py) gives every process a test starts its xdist worker's share of the cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import MutableMapping
from pathlib import Path

from feast_edge.sim.setup import SimulationConfig

REPO = Path(__file__).resolve().parent.parent
LOCAL = "mqtt://127.0.0.1:1883"  # the broker make test starts (make broker)


def share_the_cores(environ: MutableMapping[str, str], cores: int) -> None:
    """Give the processes tests start the worker's share of ``cores`` as PyTorch's default threads (OMP_NUM_THREADS).

    Every ``feast-server``, ``feast-agent`` or ``feast-edge simulate`` without ``--threads`` takes one thread per core;
    under pytest-xdist every worker's processes would do so at once (three workers on two cores: six threads or more).
    ``environ`` gets cores // workers, at least 1, under more than one worker; an OMP_NUM_THREADS already there is kept."""
    workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // workers)))


def command_options(options: dict[str, object]) -> list[str]:
    """``{"round_timeout": 30, "no_export": True, "data": None}`` as ``--round-timeout 30 --no-export`` (None: left out)."""
    argv: list[str] = []
    for name, value in options.items():
        if value is None or value is False:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv


def reproducing(config: SimulationConfig) -> dict[str, object]:
    """The server settings (ServerConfig's names) that reproduce ``config``'s simulation: its preset, population and
    schedule, validated every round, waiting for all of its clients before the first round."""
    return dict(
        preset=config.preset,
        rounds=config.training.rounds,
        per_round=config.population.per_round,
        min_clients=config.population.per_round,
        start_clients=config.population.clients,
        round_timeout=120.0,
        wait_timeout=180.0,
        seed=config.seed,
        batch_size=config.training.batch_size,
        eval_every=1,
    )


def server_command(
    config: SimulationConfig,
    out: Path,
    federation: str,
    partition: Path | None = None,
    *,
    broker: str = LOCAL,
    command: str = "run",
    **options: object,
) -> list[str]:
    """``feast-server run`` as a user types it, with the settings that reproduce ``config``'s simulation (the
    subprocess twin of :func:`server_config`): it waits for all of ``config``'s clients before its first round.
    ``options`` change or add options by their Python names (``round_timeout=30``, ``no_export=True``); None drops one."""
    settings = {**reproducing(config), "insecure": True, "broker": broker, "out": out, "federation": federation}
    settings.update(data=partition, threads=1, **options)
    return [sys.executable, "-m", "feast_edge.server.cli", command, *command_options(settings)]


def agent_command(device_id: str, data: Path | str, federation: str, *extra: str, broker: str = LOCAL) -> list[str]:
    """``feast-agent run`` as a user types it: one intra-op thread, float32 (``extra`` adds options; the last given wins)."""
    return [
        sys.executable,
        "-m",
        "feast_edge.agent.cli",
        "run",
        "--insecure",
        "--broker",
        broker,
        "--device-id",
        device_id,
        "--data",
        str(data),
        "--federation",
        federation,
        "--threads",
        "1",
        "--register-timeout",
        "120",
        # float32 as the simulations these federations are compared with (--amp auto picks bf16 on a CPU that has it);
        # a test that asks for another --amp passes it in extra (the last one given wins)
        "--amp",
        "off",
        *extra,
    ]


def spawn(command: list[str], log_path: Path) -> subprocess.Popen:
    """``command`` as a process of this checkout, its output in ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    process.log_path = log_path  # type: ignore[attr-defined]
    return process
