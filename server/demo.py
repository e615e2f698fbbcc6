"""``feast-edge demo``: a whole deployment on one machine, from broker to one ONNX model per device.

1. an MQTT broker: the one given with ``--broker``, else an embedded one on a free
   loopback port (the ``mosquitto`` binary when installed, else the pure-Python
   amqtt broker);
2. a partition of Fashion-MNIST whose client budgets are the device profiles'
   (``feast-edge partition``), so every agent trains its own shard;
3. ``feast-server run`` and one ``feast-agent run --profile P`` process per profile;
4. the rounds, then the per-device export (largest affordable variant,
   BN-recalibrated, ONNX) pushed to each agent;
5. each agent's received file checked, timed in onnxruntime and tested on the
   Fashion-MNIST test split; a summary table.
"""

from __future__ import annotations

import getpass
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from feast_edge.errors import FeastError

MOSQUITTO = "mosquitto"
AMQTT = "amqtt"
SERVER_TIMEOUT = 600.0  # seconds the demo waits for the federation before giving up


class DemoError(FeastError):
    """The demo cannot run here (no data, no broker, a process failed)."""


@dataclass
class Broker:
    url: str
    kind: str
    process: subprocess.Popen | None = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_broker(workdir: Path, kind: str = "auto") -> Broker:
    """An MQTT broker on a free loopback port: mosquitto if installed (or asked for), else amqtt."""
    port = _free_port()
    log = open(workdir / "broker.log", "w")
    if kind == "auto":
        kind = MOSQUITTO if shutil.which("mosquitto") else AMQTT
    if kind == MOSQUITTO:
        if not shutil.which("mosquitto"):
            raise DemoError("the mosquitto binary is not installed; install it (apt-get install mosquitto) or use --embedded-broker amqtt")
        conf = workdir / "mosquitto.conf"
        # mosquitto started as root drops to its own user; keep ours so it can write its log.
        conf.write_text(f"user {getpass.getuser()}\npersistence false\nlog_dest stderr\nlistener {port} 127.0.0.1\nallow_anonymous true\n")
        command = [shutil.which("mosquitto") or "mosquitto", "-c", str(conf)]
        label = f"mosquitto (embedded, {shutil.which('mosquitto')})"
    elif kind == AMQTT:
        if importlib.util.find_spec("amqtt") is None:
            raise DemoError("no MQTT broker available: install mosquitto (apt-get install mosquitto) or amqtt (pip install amqtt), or pass --broker URL")
        conf = workdir / "amqtt.yaml"
        conf.write_text(
            "listeners:\n  default:\n    type: tcp\n"
            f"    bind: 127.0.0.1:{port}\n"
            "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n    allow_anonymous: true\n"
        )
        command = [sys.executable, "-c", "from amqtt.scripts.broker_script import main; main()", "-c", str(conf)]
        label = "amqtt (embedded, pure Python)"
    else:
        raise DemoError(f"--embedded-broker {kind!r} is not auto, mosquitto or amqtt")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 15
    while not _listening(port):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise DemoError(f"the embedded {kind} broker did not start; see {workdir / 'broker.log'}")
        time.sleep(0.1)
    return Broker(f"mqtt://127.0.0.1:{port}", f"{label} on 127.0.0.1:{port}", process)


def _check_data(data: Path) -> None:
    names = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    missing = [n for n in names if not (data / n).is_file() and not (data / f"{n}.gz").is_file()]
    if missing:
        raise DemoError(
            f"Fashion-MNIST is not installed in {data} (missing {', '.join(missing)}); install it with "
            "'sudo apt-get install dataset-fashion-mnist' (it goes to /usr/share/datasets/fashion-mnist) or pass --data DIR"
        )


def _spawn(command: list[str], log: Path) -> subprocess.Popen:
    handle = open(log, "w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    repo = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH", "")) if p)
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    handle.close()
    return process


def _stop(process: subprocess.Popen, timeout: float = 20.0) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    return process.returncode


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _test_accuracy(path: Path, images: Any, labels: Any) -> float:
    from feast_edge.onnx_export import INPUT_NAME, OUTPUT_NAME, measure_latency, onnx_session

    session = onnx_session(path, threads=1)
    correct = 0
    for start in range(0, len(labels), 500):
        x = images[start : start + 500].float().div(255.0).numpy().astype(np.float32)
        logits = session.run([OUTPUT_NAME], {INPUT_NAME: x})[0]
        correct += int((logits.argmax(axis=1) == labels[start : start + 500].numpy()).sum())
    return correct / len(labels)


def run_demo(
    *,
    broker: str | None,
    rounds: int,
    samples: int,
    profiles: list[str],
    data: Path,
    out: Path | None,
    seed: int,
    console: Console,
    embedded_broker: str = "auto",
    test_samples: int = 2000,
) -> list[dict[str, Any]]:
    """Run the demo (see the module docstring); returns one summary row per device."""
    from feast_edge.profile import load_profile
    from feast_edge.data import load_fashion_mnist
    from feast_edge.shards import write_partition
    from feast_edge.simulate import SimulationConfig

    began = time.monotonic()
    _check_data(data)
    if len(profiles) < 2:
        raise DemoError("--profiles needs at least two device profiles")
    loaded = [load_profile(p) for p in profiles]
    presets = {p.preset for p in loaded}
    if len(presets) != 1:
        raise DemoError(f"the profiles were derived for different presets ({', '.join(sorted(presets))}); pick profiles of one preset")
    preset = presets.pop()
    names = [p.name for p in loaded]
    if len(set(names)) != len(names):
        raise DemoError("each profile may appear once (its name is the device id)")
    out = Path("feast-demo") if out is None else out
    for part in ("partition", "server", "device-models", "logs"):  # a fresh run every time; nothing else in --out is touched
        shutil.rmtree(out / part, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    owned: Broker | None = None
    processes: dict[str, subprocess.Popen] = {}
    try:
        if broker is None:
            owned = start_broker(logs, embedded_broker)
            broker_url = owned.url
            console.print(f"broker: {owned.kind}", soft_wrap=True, highlight=False)
        else:
            broker_url = broker
            console.print(f"broker: {broker} (given with --broker)", soft_wrap=True, highlight=False)
        n = len(loaded)
        config = SimulationConfig(
            preset=preset, data_dir=str(data), clients=n, per_round=n, rounds=rounds, budgets=tuple(p.budget_macs for p in loaded),
            train_limit=samples * n, val_samples=1000, calib_samples=200, seed=seed,
        )
        index = write_partition(config, out / "partition")
        console.print(
            f"data: {samples * n} Fashion-MNIST training examples split over {n} devices by budget "
            f"({', '.join(str(c['samples']) for c in index['clients'])}); server holds 1000 validation + 200 calibration",
            soft_wrap=True, highlight=False,
        )
        federation = f"demo-{uuid.uuid4().hex[:8]}"
        python = sys.executable
        server_cmd = [
            python, "-m", "feast_edge.server.cli", "run", "--broker", broker_url, "--out", str(out / "server"), "--preset", preset,
            "--rounds", str(rounds), "--per-round", str(n), "--min-clients", str(max(1, n // 2)), "--start-clients", str(n),
            "--round-timeout", "180", "--seed", str(seed), "--data", str(out / "partition"), "--federation", federation,
            "--eval-every", "1", "--wait-timeout", "180", "--threads", "1",
        ]
        processes["server"] = _spawn(server_cmd, logs / "server.log")
        received = out / "device-models"
        for profile, entry in zip(loaded, index["clients"]):
            agent_cmd = [
                python, "-m", "feast_edge.agent.cli", "run", "--broker", broker_url, "--device-id", profile.name,
                "--data", str(out / "partition" / entry["file"]), "--profile", profiles[names.index(profile.name)], "--device", "cpu",
                "--federation", federation, "--threads", "1", "--model-dir", str(received), "--register-timeout", "180",
            ]
            processes[profile.name] = _spawn(agent_cmd, logs / f"agent-{profile.name}.log")
        console.print(
            f"started feast-server and {n} feast-agent processes ({', '.join(f'{p.name} {p.budget_macs / 1e6:.1f}M MACs' for p in loaded)}); "
            f"federation {federation!r}, logs in {logs}",
            soft_wrap=True, highlight=False,
        )
        shown = 0
        server = processes["server"]
        deadline = time.monotonic() + SERVER_TIMEOUT
        while server.poll() is None:
            for name, process in processes.items():
                if name != "server" and process.poll() is not None:
                    raise DemoError(f"agent {name} exited with status {process.returncode}:\n{_tail(logs / f'agent-{name}.log')}")
            lines = [line for line in (logs / "server.log").read_text(errors="replace").splitlines() if line.startswith("round ")]
            for line in lines[shown:]:
                console.print(f"  {line}", soft_wrap=True, highlight=False)
            shown = len(lines)
            if time.monotonic() > deadline:
                raise DemoError(f"the federation did not finish within {SERVER_TIMEOUT:g} s:\n{_tail(logs / 'server.log')}")
            time.sleep(0.5)
        for line in [line for line in (logs / "server.log").read_text(errors="replace").splitlines() if line.startswith("round ")][shown:]:
            console.print(f"  {line}", soft_wrap=True, highlight=False)
        if server.returncode != 0:
            raise DemoError(f"feast-server exited with status {server.returncode}:\n{_tail(logs / 'server.log')}")
        wait_until = time.monotonic() + 120
        while not all((received / f"{name}.onnx").is_file() for name in names) and time.monotonic() < wait_until:
            time.sleep(0.5)
        missing = [name for name in names if not (received / f"{name}.onnx").is_file()]
        if missing:
            raise DemoError(f"no model reached {', '.join(missing)}; see {logs}")
        for name in names:
            _stop(processes.pop(name))
        test = load_fashion_mnist(data, "test")
        images, labels = test.images[:test_samples], test.labels[:test_samples]
        rows = []
        for profile in loaded:
            path = received / f"{profile.name}.onnx"
            manifest = json.loads(path.with_suffix(".json").read_text())
            latency = measure_latency(path, repeats=50)
            rows.append(
                {
                    "device": profile.name, "budget_macs": profile.budget_macs, "macs": manifest["macs"], "params": manifest["params"],
                    "validation_accuracy": manifest["validation_accuracy"], "test_accuracy": _test_accuracy(path, images, labels),
                    "onnx": _shown(path), "latency_ms": latency["median_ms"], "predicted_ms": profile.latency_ms(manifest["macs"]),
                }
            )
        table = Table(title=f"feast-edge demo: {n} devices, {rounds} rounds, {preset}")
        for col in ("device", "budget", "variant MACs", "params", "val acc", f"test acc ({len(labels)})", "ONNX file", "onnxruntime ms"):
            table.add_column(col, justify="left" if col in ("device", "ONNX file") else "right")
        for r in rows:
            table.add_row(
                r["device"], f"{r['budget_macs'] / 1e6:.2f}M", f"{r['macs'] / 1e6:.2f}M", f"{r['params'] / 1e6:.3f}M",
                f"{100 * r['validation_accuracy']:.2f}%", f"{100 * r['test_accuracy']:.2f}%", r["onnx"], f"{r['latency_ms']:.3f}",
            )
        # Outside a terminal rich would squeeze the table into 80 columns.
        (console if console.is_terminal else Console(file=console.file, width=200)).print(table)
        console.print(
            f"onnxruntime latency: batch 1, one thread, this machine's CPU (the profiles' budgets describe the real devices). "
            f"Wall time {time.monotonic() - began:.1f} s; everything is in {out}.",
            soft_wrap=True, highlight=False,
        )
        return rows
    finally:
        for process in processes.values():
            _stop(process)
        if owned is not None:
            owned.stop()
