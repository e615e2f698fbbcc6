"""The demo's processes: feast-server and the feast-agents, started and followed through their console logs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from feast_edge.errors import FeastError

# The demo gives up on a federation only when it stops moving: no round finished, no update sent and no device done
# with its model for this long. A busy machine makes every step slower, never stuck (every process is the demo's own, so
# feast-server waits for every device: a round takes what the machine gives it); the longest step seen, a loaded
# 2-core machine's export and personalization, took over 360 s.
STALL_S = 600.0
HEARTBEAT_S = 9.0  # while waiting, a status line at least every 10 s (the wait polls every 0.5 s)
_STAMP = re.compile(r"^\d\d:\d\d:\d\d ")  # the console formatter's time stamp (feast_edge.cli.common)
_ROUND = re.compile(r"^round \d+/\d+\s")  # feast-server's line per round


class DemoError(FeastError):
    """The demo cannot run here (no data, no broker, a process failed)."""


def _spawn(command: list[str], log: Path) -> subprocess.Popen:
    handle = open(log, "w")
    # The children are this interpreter with the installed feast_edge: no path games.
    process = subprocess.Popen(
        command, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    handle.close()
    return process


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _lines(path: Path) -> list[str]:
    """A console log's lines without their leading ``HH:MM:SS`` time stamps."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [_STAMP.sub("", line, count=1) for line in text.splitlines()]


class Fleet:
    """feast-server and the feast-agent processes of the demo, followed through their console logs."""

    def __init__(self, logs: Path, agents: list[str], rounds: int) -> None:
        self.logs, self.agents, self.rounds = logs, agents, rounds
        self.processes: dict[str, subprocess.Popen] = {}

    def log(self, name: str) -> Path:
        return self.logs / ("server.log" if name == "server" else f"agent-{name}.log")

    def spawn(self, name: str, command: list[str]) -> None:
        debug_log = self.log(name).with_suffix(".debug.log")
        self.processes[name] = _spawn([*command, "--log-file", str(debug_log)], self.log(name))

    def round_lines(self) -> list[str]:
        return [line for line in _lines(self.log("server")) if _ROUND.match(line)]

    def agent_state(self, name: str) -> tuple[str, int]:
        """How far an agent got ('starting', 'connected', 'registered') and how many updates it sent."""
        lines = _lines(self.log(name))
        sent = sum("sent its update" in line for line in lines)
        if any(line.startswith("registered") for line in lines) or sent:
            return "registered", sent
        return ("connected" if any("connected to" in line for line in lines) else "starting"), sent

    def check_agents(self) -> None:
        """An agent that failed ends the demo (one that finished leaves with status 0 once it has its model)."""
        for name in self.agents:
            process = self.processes.get(name)
            if process is not None and process.poll() not in (None, 0):
                raise DemoError(f"agent {name} exited with status {process.returncode}:\n{_tail(self.log(name))}")

    def progress(self) -> tuple[int, int, int]:
        """How far the federation got: round lines, updates sent, devices done with their model (grows, never falls)."""
        sent = sum(self.agent_state(name)[1] for name in self.agents)
        done = sum(
            any(line.startswith(("exported the model of ", "saved the model of ")) for line in _lines(self.log(name)))
            for name in self.agents
        )
        return len(self.round_lines()), sent, done

    def preparing(self) -> str:
        """After the last round: which devices are still exporting or personalizing the model they were served."""
        steps: dict[str, list[str]] = {"exporting": [], "personalizing": [], "done": []}
        for name in self.agents:
            lines = _lines(self.log(name))
            if not any(line.startswith("exported the model of ") for line in lines):
                steps["exporting"].append(name)
            elif any(line.startswith(f"{name}: personalizing ") for line in lines) and not any(
                line.startswith((f"{name}: personal model written", f"{name} keeps the served model")) for line in lines
            ):
                steps["personalizing"].append(name)
            else:
                steps["done"].append(name)
        busy = "; ".join(f"{step}: {', '.join(names)}" for step, names in steps.items() if names and step != "done")
        return f"devices preparing their models: {len(steps['done'])}/{len(self.agents)} done" + (
            f" ({busy})" if busy else ""
        )

    def status(self, shown: int, since: float) -> str:
        """What the federation is doing now, after ``shown`` round lines, for a heartbeat line."""
        elapsed = f"{time.monotonic() - since:.0f} s"
        if shown >= self.rounds:
            return f"{self.preparing()} ({elapsed})"
        states = {name: self.agent_state(name) for name in self.agents}
        registered = [name for name, (state, _) in states.items() if state == "registered"]
        if shown == 0 and len(registered) < len(self.agents):
            server = "up" if any("connected to" in line for line in _lines(self.log("server"))) else "starting"
            waiting = ", ".join(f"{name} {state}" for name, (state, _) in states.items() if state != "registered")
            return f"feast-server {server}; agents registered {len(registered)}/{len(self.agents)} (waiting: {waiting}) ({elapsed})"
        sent = [name for name, (_, updates) in states.items() if updates > shown]
        return f"round {shown + 1}/{self.rounds} running: updates sent {len(sent)}/{len(self.agents)} ({elapsed})"

    def stop(self) -> None:
        """SIGTERM to every process still running, then wait for all of them."""
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for name in list(self.processes):
            process = self.processes.pop(name)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)

    def follow_federation(self, say: Callable[[str], None]) -> None:
        """Print the server's round lines as they come, and a status line whenever nothing was printed for a while."""
        server = self.processes["server"]
        shown, since, said = 0, time.monotonic(), time.monotonic()
        progress, moved = self.progress(), time.monotonic()
        url = None
        while True:
            running = server.poll() is None
            if url is None:
                url = next(
                    (
                        line.split("dashboard: ", 1)[1]
                        for line in _lines(self.log("server"))
                        if line.startswith("dashboard: ")
                    ),
                    None,
                )
                if url is not None:
                    say(f"dashboard (live while the federation runs): {url}")
            lines = self.round_lines()
            for line in lines[shown:]:
                say(f"  {line}")
                since = said = time.monotonic()
            shown = len(lines)
            if not running:
                break
            self.check_agents()
            now_at = self.progress()
            if now_at != progress:
                progress, moved = now_at, time.monotonic()
            elif time.monotonic() - moved > STALL_S:
                raise DemoError(
                    f"the federation made no progress for {STALL_S:g} s (no round finished, no update sent, no model "
                    f"done):\n{_tail(self.log('server'))}"
                )
            if time.monotonic() - said >= HEARTBEAT_S:
                say(f"  ... {self.status(shown, since)}")
                said = time.monotonic()
            time.sleep(0.5)
        if server.returncode != 0:
            raise DemoError(f"feast-server exited with status {server.returncode}:\n{_tail(self.log('server'))}")

    def await_models(self, received: Path, say: Callable[[str], None]) -> None:
        """Wait until every agent saved the model the server pushed to it."""
        began = said = time.monotonic()
        while True:
            # The manifest is written after the model file: both there, the model is complete.
            have = [name for name in self.agents if (received / f"{name}.json").is_file()]
            if len(have) == len(self.agents) or time.monotonic() - began > 120:
                break
            if time.monotonic() - said >= HEARTBEAT_S:
                say(
                    f"  ... models received by {len(have)}/{len(self.agents)} agents ({time.monotonic() - began:.0f} s)"
                )
                said = time.monotonic()
            time.sleep(0.5)
        missing = [name for name in self.agents if not (received / f"{name}.json").is_file()]
        if missing:
            raise DemoError(f"no model reached {', '.join(missing)}; see {self.logs}")
        say(f"models received by all {len(self.agents)} agents in {relative(received)}")


def relative(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
