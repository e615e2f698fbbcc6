"""Brokers the demo (and the tests) start for themselves on a free loopback port: Mosquitto, provisioned or open, or amqtt.

A provisioned Mosquitto runs the configuration ``feast-server provision``
wrote: TLS only, client certificates whose CN is the identity, the ACL, no
anonymous clients. amqtt (the pure-Python fallback when Mosquitto is not
installed) enforces none of that: it is anonymous and plain TCP, and only the
message signatures of the credentials bundles protect the federation.
"""

from __future__ import annotations

import getpass
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from feast_edge.errors import FeastError

MOSQUITTO = "mosquitto"
AMQTT = "amqtt"
KINDS = ("auto", MOSQUITTO, AMQTT)


class BrokerError(FeastError):
    """No broker could be started here."""


@dataclass
class Broker:
    url: str
    kind: str
    process: subprocess.Popen | None = None
    enforces: str = "nothing: anonymous, plain TCP"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def mosquitto_binary() -> str | None:
    """The mosquitto executable: on PATH, or in sbin (Debian installs it there, off a normal user's PATH)."""
    found = shutil.which("mosquitto")
    for candidate in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto"):
        if found is None and os.access(candidate, os.X_OK):
            found = candidate
    return found


def resolve_kind(kind: str) -> str:
    """``auto`` becomes mosquitto when installed, else amqtt; an unusable choice is a BrokerError naming the fix."""
    if kind not in KINDS:
        raise BrokerError(f"--embedded-broker {kind!r} is not {', '.join(KINDS)}")
    mosquitto = mosquitto_binary()
    if kind == "auto":
        kind = MOSQUITTO if mosquitto else AMQTT
    if kind == MOSQUITTO and not mosquitto:
        raise BrokerError(
            "the mosquitto binary is not installed; install it (apt-get install mosquitto) or use --embedded-broker amqtt"
        )
    if kind == AMQTT and importlib.util.find_spec("amqtt") is None:
        raise BrokerError(
            "no MQTT broker available: install mosquitto (apt-get install mosquitto) or amqtt (pip install 'feast-edge[amqtt]'), or pass --broker URL"
        )
    return kind


def start_mosquitto(config: Path, port: int, log: Path, *, url: str, enforces: str) -> Broker:
    """Run ``mosquitto -c config`` (listening on ``port``) until it accepts connections."""
    binary = mosquitto_binary()
    if binary is None:
        raise BrokerError("the mosquitto binary is not installed; install it (apt-get install mosquitto)")
    broker = Broker(url, f"mosquitto (embedded, {binary}) on 127.0.0.1:{port}", enforces=enforces)
    # Ready when it says so ("mosquitto version … running", after its listeners opened): a test connection to a TLS
    # listener would only add a failed-handshake line to its log.
    return _start([binary, "-c", str(config)], log, broker, ready=lambda: " running" in log.read_text(errors="replace"))


def start_broker(workdir: Path, kind: str = "auto") -> Broker:
    """An open MQTT broker (anonymous, plain TCP) on a free loopback port: mosquitto if installed (or asked for), else amqtt."""
    kind, port = resolve_kind(kind), free_port()
    if kind == MOSQUITTO:
        conf = workdir / "mosquitto.conf"
        # mosquitto started as root drops to its own user; keep ours so it can write its log.
        conf.write_text(
            f"user {getpass.getuser()}\npersistence false\nlog_dest stderr\nlistener {port} 127.0.0.1\nallow_anonymous true\n"
        )
        return start_mosquitto(
            conf, port, workdir / "broker.log", url=f"mqtt://127.0.0.1:{port}", enforces="nothing: anonymous, plain TCP"
        )
    conf = workdir / "amqtt.yaml"
    conf.write_text(
        "listeners:\n  default:\n    type: tcp\n"
        f"    bind: 127.0.0.1:{port}\n"
        "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n    allow_anonymous: true\n"
    )
    command = [sys.executable, "-c", "from amqtt.scripts.broker_script import main; main()", "-c", str(conf)]
    broker = Broker(
        f"mqtt://127.0.0.1:{port}",
        f"amqtt (embedded, pure Python) on 127.0.0.1:{port}",
        enforces="nothing: anonymous, plain TCP, no ACL",
    )
    return _start(command, workdir / "broker.log", broker, ready=lambda: listening(port))


def _start(command: list[str], log_path: Path, broker: Broker, ready: Callable[[], bool]) -> Broker:
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 15
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise BrokerError(f"the embedded broker did not start; see {log_path}")
        time.sleep(0.1)
    broker.process = process
    return broker
