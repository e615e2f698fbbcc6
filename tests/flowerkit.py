"""A local Flower Deployment Engine for tests and benchmarks: a real ``flower-superlink`` and ``flower-supernode`` processes
on loopback, and ``flwr run`` / ``flwr ls`` as a user types them (flwr 1.42); and ``LoopbackGrid``, Flower's Grid
delivering each Message to feast-edge's ClientApp handlers in the test's own process.

    with LocalFlower(tmp) as flower:
        flower.supernode({"data": "/path/partition", "offset": 0, "threads": 1})
        flower.wait_nodes(3)
        run = flower.run(app_dir, {"out-dir": "/abs/run", "rounds": 2})   # blocks until the run finished
        assert run.status == "finished:completed", run.details

Every process gets its own FLWR_HOME under ``root`` (nothing is written to ~/.flwr); Flower's telemetry, update check
and runtime dependency installation are off (nothing is fetched); on exit every process started here, and every
process they started (SuperExec, flwr-serverapp, flwr-clientapp), is stopped.

    grid = LoopbackGrid()                                   # after set_flower_identity()
    grid.add(100, {"data": "/path/partition", "offset": 0})   # a node: its node config, handlers to replace
    FlowerFederation(ServerConfig(...), grid).run()
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from ports import free_port

from feast_edge.flower import clientapp
from strategies import FMNIST_TINY

BIN = Path(sys.executable).parent  # the venv's bin: flower-superlink, flwr, and what Flower starts by name
CONNECTION = "feast-test"  # the [superlink.<name>] entry of the CLI's config.toml
QUIET = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "PYTHONUNBUFFERED": "1",
}


def toml_value(value: Any) -> str:
    """A node-config or run-config value as TOML (strings double-quoted, booleans lower case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def config_string(config: dict[str, Any]) -> str:
    return " ".join(f"{key}={toml_value(value)}" for key, value in config.items())


@dataclass
class FlowerRun:
    run_id: str
    status: str  # finished:completed | finished:failed | ...
    details: str
    output: str  # what `flwr run --stream` printed (the ServerApp's log)
    seconds: float


def _children() -> dict[int, list[int]]:
    table: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            table.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    return table


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class LocalFlower:
    """One SuperLink and its SuperNodes under ``root`` (see the module docstring)."""

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **QUIET, **(env or {}), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.env.pop("VIRTUAL_ENV", None)
        self.port = free_port()
        self.procs: list[subprocess.Popen] = []
        self.seen: set[int] = set()
        self.nodes = 0
        cli_home = self.root / "cli"
        cli_home.mkdir(exist_ok=True)
        (cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )

    def __enter__(self) -> LocalFlower:
        self._start("superlink", ["flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(self.port)])
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"flower-superlink did not listen on {self.port}; see {self.root / 'superlink.log'}")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self, name: str, command: list[str]) -> subprocess.Popen:
        home = self.root / name
        home.mkdir(exist_ok=True)
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - the process writes it until stop()
        proc = subprocess.Popen(
            [str(BIN / command[0]), *command[1:]],
            cwd=home,
            env={**self.env, "FLWR_HOME": str(home / "flwr_home")},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def supernode(self, node_config: dict[str, Any]) -> subprocess.Popen:
        """Start one SuperNode with this ``--node-config``."""
        self.nodes += 1
        command = [
            "flower-supernode",
            "--insecure",
            "--superlink",
            f"127.0.0.1:{self.port}",
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--node-config",
            config_string(node_config),
        ]
        return self._start(f"supernode{self.nodes}", command)

    def flwr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """The ``flwr`` CLI against this SuperLink."""
        return subprocess.run(
            [str(BIN / "flwr"), *args],
            cwd=self.root,
            env={**self.env, "FLWR_HOME": str(self.root / "cli")},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def wait_nodes(self, count: int, timeout: float = 120.0) -> None:
        """Until ``count`` SuperNodes are online at the SuperLink."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = self.flwr("supernode", "ls", CONNECTION, "--format", "json")
            try:
                listed = json.loads(got.stdout or "{}")
            except json.JSONDecodeError:
                listed = {}
            online = [n for n in listed.get("nodes", []) if n.get("status") == "online"]
            if len(online) >= count:
                return
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited; see the logs in {self.root}")
            time.sleep(1.0)
        raise TimeoutError(
            f"fewer than {count} SuperNodes came online in {timeout:.0f} s; logs in {self.root}; "
            f"the last 'flwr supernode ls' (exit {got.returncode}) said:\n{got.stdout[-2000:]}{got.stderr[-2000:]}"
        )

    def run(self, app: Path, run_config: dict[str, Any], timeout: float = 600.0) -> FlowerRun:
        """``flwr run APP --run-config ... --stream``, then the run's status from ``flwr ls``."""
        overrides = [arg for key, value in run_config.items() for arg in ("--run-config", f"{key}={toml_value(value)}")]
        began = time.monotonic()
        self._snapshot()
        got = self.flwr("run", str(app), CONNECTION, *overrides, "--stream", timeout=timeout)
        self._snapshot()
        output = got.stdout + got.stderr
        match = re.search(r"Successfully started run (\d+)", output)
        if got.returncode != 0 or not match:
            raise RuntimeError(f"flwr run failed (exit {got.returncode}):\n{output}")
        listed = json.loads(self.flwr("ls", CONNECTION, "--run-id", match.group(1), "--format", "json").stdout)
        run = listed["runs"][0]
        return FlowerRun(match.group(1), run["status"], run.get("status-details", ""), output, time.monotonic() - began)

    def _snapshot(self) -> None:
        table, todo = _children(), [p.pid for p in self.procs]
        while todo:
            for child in table.get(todo.pop(), []):
                self.seen.add(child)
                todo.append(child)

    def stop(self, grace: float = 8.0) -> None:
        """SIGTERM every process started here, then SIGKILL whatever (and whatever they started) is left."""
        self._snapshot()
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in self.seen:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.procs.clear()

    def logs(self) -> str:
        """Every process's log (for assertion messages)."""
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(self.root.glob("*.log"))
        )


Handler = Callable[[Message, Context], Message]


def set_flower_identity() -> None:
    """The identity Flower's processes give themselves (a ServerApp or ClientApp creates Messages under it)."""
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


class LoopbackGrid:
    """Flower's Grid as far as the ServerApp uses it, delivering each Message to a node's handlers in this process."""

    def __init__(self, run_config: dict | None = None) -> None:
        self.nodes: dict[int, tuple[dict, dict[str, Handler]]] = {}
        self.run_config = {"preset": str(FMNIST_TINY), **(run_config or {})}  # the run trains kit.CONFIG's preset

    def add(self, node: int, node_config: dict, **handlers: Handler) -> None:
        defaults = {"query": clientapp.register, "train": clientapp.train, "evaluate": clientapp.evaluate}
        self.nodes[node] = (node_config, {**defaults, **handlers})

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            config, handlers = self.nodes[node]
            context = Context(
                run_id=1, node_id=node, node_config=config, state=RecordDict(), run_config=self.run_config
            )
            reply = handlers[message.metadata.message_type](message, context)
            if reply is not None:
                replies.append(reply)
        return replies


def loopback_federation(kit, out: Path, data: Path | str, grid: LoopbackGrid, **changes: Any):
    """The Flower ServerApp's federation over ``grid``: one round of kit.CONFIG's settings on ``data`` (a partition,
    or "" for a server without data), evaluated every round; ``changes`` override any ServerConfig field."""
    from feast_edge.flower.serverapp import FlowerFederation
    from feast_edge.server.app import ServerConfig

    settings: dict[str, Any] = {
        "out": str(out),
        "preset": kit.CONFIG.preset,
        "rounds": 1,
        "per_round": 3,
        "min_clients": 2,
        "start_clients": 2,
        "seed": kit.CONFIG.seed,
        "batch_size": kit.CONFIG.training.batch_size,
        "eval_every": 1,
        "data": str(data) or None,  # "": a server without data (as the run config's data = "")
        "wait_timeout": 5.0,
        **changes,
    }
    return FlowerFederation(ServerConfig.of(**settings), grid)
