"""The final weights of fixed-seed runs, as digests: what a change to the round's plumbing must not move.

Each case is a command line, or the few a federation takes, of one kind:

* ``simulate``: a ``feast-edge simulate`` (the tiny simulation of tests/simconfigs.py, one PyTorch thread, float32):
  the methods, central DP with fixed and adaptive clipping, local DP, each robust rule, each server optimizer and a
  cohort spread over two processes;
* ``mqtt``: ``feast-edge partition`` of a two-device population, then ``feast-server run`` and a ``feast-agent run``
  per shard through a private mosquitto on a free loopback port, two rounds;
* ``flower``: the same population on Flower's Deployment Engine: the app ``feast-edge flower new`` writes, a
  ``flower-superlink`` and a ``flower-supernode`` per shard (tests/flowerkit.py), ``flwr run``, two rounds.

The command lines are the contract: option names outlive the internals, so the same cases run on an older commit and
on a newer one.

``digest(run)`` hashes the model tensors of a run's last checkpoint (names, dtypes, shapes and bytes), leaving out
what is not weights (a server optimizer's state, the records' timing fields). Floating-point results depend on the
CPU's instruction set, so digests are kept per machine (``machine()``: CPU model, the flags that pick PyTorch's
kernels, torch's version) in tests/data/same-weights.json, beside the commit they were made from: the record's
``commit``, or, for a case added later, the commit its ``since`` names (the cases a change adds are recorded on the
code before the change).

    python tests/sameweights.py record           # add this machine's digests, made by the code in this checkout
    python tests/sameweights.py record --commit C   # ... made by commit C's code (built from git into a temp folder)
    python tests/sameweights.py record --commit C --cases async,secure-sums   # new cases, made by commit C's code
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RECORD = HERE / "data" / "same-weights.json"
sys.path.insert(0, str(HERE))

from ports import free_port  # noqa: E402

from simconfigs import TINY, cli_options, tiny_config  # noqa: E402
from strategies import PRESETS_DIR  # noqa: E402

EXTRA_PREFIX = "extra/"  # feast_edge.run.checkpoint.EXTRA: a server optimizer's state, not weights
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "fma")
CHECKPOINT = "checkpoint.safetensors"  # feast_edge.run.store.CHECKPOINT, in a simulation's and a server's run directory

COMMON = ["--threads", "1", "--amp", "off"]
SIMULATIONS: dict[str, list[str]] = {
    "feast": [],
    "heterofl": ["--method", "heterofl"],
    "scalefl": ["--method", "scalefl"],
    # seeded noise (the default noise comes from the OS and is never replayed)
    "dp-central-fixed-clip": ["--dp-clip", "1.0", "--dp-noise", "0.5", "--dp-seed", "7"],
    "dp-central-adaptive-clip": [
        "--dp-clip",
        "1.0",
        "--dp-noise",
        "0.5",
        "--dp-clip-quantile",
        "0.5",
        "--dp-seed",
        "7",
    ],
    "dp-local": ["--dp-mode", "local", "--dp-clip", "1.0", "--dp-noise", "0.2", "--dp-seed", "7"],
    # five clients a round, so that a trimmed mean (one value off each end) is neither the mean nor the median
    "robust-clip": ["--clients", "5", "--per-round", "5", "--aggregation", "clip"],
    "robust-trimmed-mean": ["--clients", "5", "--per-round", "5", "--aggregation", "trimmed-mean", "--trim", "0.2"],
    "robust-median": ["--clients", "5", "--per-round", "5", "--aggregation", "median"],
    "server-momentum": ["--server-opt", "momentum", "--server-lr", "1.0", "--server-momentum", "0.5"],
    "server-adam": ["--server-opt", "adam", "--server-lr", "0.01"],
    "server-yogi": ["--server-opt", "yogi", "--server-lr", "0.01"],
    "nproc-2": ["--nproc", "2"],
    # recorded on a later commit than the rest (the record's "since"): buffered asynchronous releases on the virtual
    # clock, and per-segment secure sums over a cohort of four (c = 1: every segment over at least 3 clients)
    "async": ["--mode", "async", "--buffer", "2", "--concurrency", "3", "--max-staleness", "4"],
    "secure-sums": ["--per-round", "4", "--secure-agg", "--colluders", "1"],
}


@dataclass(frozen=True)
class Case:
    """One fixed-seed run: its kind (simulate, mqtt or flower) and, for simulate, the options added to COMMON."""

    kind: str
    options: tuple[str, ...] = ()


CASES: dict[str, Case] = {
    **{name: Case("simulate", tuple(options)) for name, options in SIMULATIONS.items()},
    "mqtt-federation": Case("mqtt"),
    "flower-app": Case("flower"),
}

# The federations' population: the tiny simulation's (by its settings' names) over two devices, the preset's smallest
# and largest (two nested sub-models, aggregated where they overlap), both in each of two rounds, validated at the
# end, seed 0. A round waits ROUND_TIMEOUT seconds at most (it takes seconds); a federation's processes finish in
# SECONDS or are stopped.
FEDERATION = {**TINY, "clients": 2, "per_round": 2, "budgets": "0.15M,1.5M", "seed": 0}
FEDERATION_ID = "same-weights"  # the MQTT topics' federation (the broker is the run's own)
ROUND_TIMEOUT = 120.0
SECONDS = 300.0


def machine() -> str:
    """What decides floating-point results here: CPU model (family and model numbers), the kernel-picking flags it
    has, torch's version."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = (
        f"{fields.get('model name', platform.processor() or '?')} (family {fields.get('cpu family', '?')}, "
        f"model {fields.get('model', '?')})"
    )
    flags = set(fields.get("flags", "").split())
    import torch  # noqa: PLC0415 (only where digests are made or compared)

    have = "+".join(f for f in KERNEL_FLAGS if f in flags) or "none"
    return f"{model} [{have}] torch {torch.__version__.split('+')[0]}"


def digest(run: Path) -> str:
    """SHA-256 of the model tensors in ``run``'s last checkpoint."""
    import torch  # noqa: PLC0415

    h = hashlib.sha256()
    with safe_open(run / CHECKPOINT, framework="pt") as f:
        for name in sorted(k for k in f.keys() if not k.startswith(EXTRA_PREFIX)):
            tensor = f.get_tensor(name).contiguous()
            h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            h.update(tensor.flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- the command lines (module form: each
# runs whatever feast_edge the interpreter imports, this checkout's or an older commit's build)


def module(name: str, *args: object) -> list[str]:
    return [sys.executable, "-m", name, *map(str, args)]


def command(case: str, out: Path, data_dir: str) -> list[str]:
    """``feast-edge simulate`` for the simulate ``case``."""
    options = cli_options(tiny_config(data_dir))
    return module("feast_edge.cli", "simulate", *options, *COMMON, *CASES[case].options, "--out", out)


def partition_command(out: Path, data_dir: str) -> list[str]:
    """``feast-edge partition``: the federations' population as shard files and the server's held-out split."""
    f = FEDERATION
    return module(
        "feast_edge.cli", "partition", "--preset", f["preset"], "--clients", f["clients"],
        "--budgets", f["budgets"], "--train-limit", f["train_limit"], "--val-samples", f["val_samples"],
        "--calib-samples", f["calib_samples"], "--seed", f["seed"], "--data", data_dir, "--out", out,
    )  # fmt: skip


def server_command(out: Path, partition: Path, broker: str) -> list[str]:
    """``feast-server run`` of the federation: waits for every device, no export."""
    f = FEDERATION
    return module(
        "feast_edge.server.cli", "run", "--insecure", "--broker", broker, "--federation", FEDERATION_ID,
        "--preset", f["preset"], "--data", partition, "--out", out, "--rounds", f["rounds"],
        "--per-round", f["per_round"], "--min-clients", f["per_round"], "--start-clients", f["clients"],
        "--round-timeout", ROUND_TIMEOUT, "--wait-timeout", ROUND_TIMEOUT, "--seed", f["seed"],
        "--batch-size", f["batch_size"], "--eval-every", f["eval_every"], "--threads", 1, "--no-export",
    )  # fmt: skip


def agent_command(device: str, shard: Path, broker: str) -> list[str]:
    """``feast-agent run`` of one device's shard: one PyTorch thread, float32; it leaves when the federation ends."""
    return module(
        "feast_edge.agent.cli", "run", "--insecure", "--broker", broker, "--federation", FEDERATION_ID,
        "--device-id", device, "--data", shard, "--register-timeout", ROUND_TIMEOUT, *COMMON,
    )  # fmt: skip


def flower_config(out: Path, partition: Path) -> dict[str, object]:
    """``flwr run --run-config`` of the Flower federation: the server's settings, by the app's names for them."""
    f = FEDERATION
    return {
        "out-dir": str(out), "preset": f["preset"], "data": str(partition), "rounds": f["rounds"],
        "per-round": f["per_round"], "min-clients": f["per_round"], "start-clients": f["clients"], "seed": f["seed"],
        "batch-size": f["batch_size"], "eval-every": f["eval_every"], "round-timeout": ROUND_TIMEOUT,
        "wait-timeout": ROUND_TIMEOUT, "export": False,
    }  # fmt: skip


# --------------------------------------------------------------------------- running a case


def simulate(case: str, work: Path, data_dir: str, env: dict[str, str]) -> Path:
    """The simulation's run directory."""
    call(command(case, work, data_dir), work.parent, env, case)
    return work


def mqtt_federation(case: str, work: Path, data_dir: str, env: dict[str, str]) -> Path:
    """``feast-server run`` and an agent per shard through a private mosquitto; the server's run directory."""
    partition, out = work / "partition", work / "run"
    work.mkdir(parents=True, exist_ok=True)
    call(partition_command(partition, data_dir), work, env, case)
    shards = {
        c["client_id"]: partition / c["file"] for c in json.loads((partition / "index.json").read_text())["clients"]
    }
    with private_broker(work / "broker") as broker:
        commands = {"server": server_command(out, partition, broker)}
        commands.update({device: agent_command(device, shard, broker) for device, shard in shards.items()})
        run_together(commands, work / "logs", work, env, case)
    return out


def flower_app(case: str, work: Path, data_dir: str, env: dict[str, str]) -> Path:
    """``flwr run`` of the app ``feast-edge flower new`` writes, one SuperNode per shard; the run directory."""
    from flowerkit import LocalFlower  # noqa: PLC0415 (imports flwr)

    partition, app, out = work / "partition", work / "app", work / "run"
    work.mkdir(parents=True, exist_ok=True)
    call(partition_command(partition, data_dir), work, env, case)
    call(module("feast_edge.cli", "flower", "new", app), work, env, case)
    pyproject = app / "pyproject.toml"  # the run config sets only keys of the app's config table: add the two it lacks
    pyproject.write_text(pyproject.read_text() + f"batch-size = {FEDERATION['batch_size']}\nstart-clients = 1\n")
    # PyTorch's threads in the ServerApp as in the nodes (node config threads): one
    with LocalFlower(work / "deployment", {**env, "OMP_NUM_THREADS": "1"}) as flower:
        for offset in range(FEDERATION["clients"]):
            flower.supernode({"data": str(partition), "offset": offset, "threads": 1})
        flower.wait_nodes(FEDERATION["clients"])
        done = flower.run(app, flower_config(out, partition), timeout=SECONDS)
        if done.status != "finished:completed":
            raise RuntimeError(f"case {case}: flwr run ended {done.status} ({done.details})\n{done.output[-3000:]}")
    return out


RUNNERS: dict[str, Callable[[str, Path, str, dict[str, str]], Path]] = {
    "simulate": simulate,
    "mqtt": mqtt_federation,
    "flower": flower_app,
}


def call(argv: list[str], cwd: Path, env: dict[str, str], case: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(
            f"case {case}: {' '.join(argv[1:4])} failed ({done.returncode}):\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )


def run_together(commands: dict[str, list[str]], logs: Path, cwd: Path, env: dict[str, str], case: str) -> None:
    """Start every command, each logging to ``logs``/NAME.log; all must exit 0 within SECONDS (the others are stopped
    once one fails)."""
    logs.mkdir(parents=True, exist_ok=True)
    processes = {}
    for name, argv in commands.items():
        with open(logs / f"{name}.log", "w") as log:
            processes[name] = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SECONDS
    try:  # until every process has exited, one has failed or the time is up
        while time.monotonic() < deadline and any(p.poll() is None for p in processes.values()):
            if any(p.returncode for p in processes.values()):
                break
            time.sleep(0.2)
    finally:
        for process in processes.values():
            stop(process)
    failed = [name for name, process in processes.items() if process.returncode != 0]
    if failed:
        tails = "\n".join(
            f"--- {n} ({processes[n].returncode})\n{(logs / f'{n}.log').read_text()[-3000:]}" for n in failed
        )
        raise RuntimeError(f"case {case}: {', '.join(failed)} did not finish within {SECONDS:g} s or failed:\n{tails}")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it hangs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@contextmanager
def private_broker(folder: Path) -> Iterator[str]:
    """A mosquitto of this run alone on a free loopback port; its URL."""
    if shutil.which("mosquitto") is None:
        raise RuntimeError("the mqtt cases start a private mosquitto: install it (apt-get install -y mosquitto)")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = folder / "mosquitto.conf"
    conf.write_text(
        f"user {getpass.getuser()}\npersistence false\nlog_dest stderr\n"
        f"listener {port} 127.0.0.1\nallow_anonymous true\n"
    )
    with open(folder / "mosquitto.log", "w") as log:
        broker = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not listening(port):
            if broker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mosquitto did not listen on {port}: {(folder / 'mosquitto.log').read_text()}")
            time.sleep(0.05)
        yield f"mqtt://127.0.0.1:{port}"
    finally:
        stop(broker)


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def run_cases(cases: Iterable[str], work: Path, data_dir: str, pythonpath: str | None = None) -> dict[str, str]:
    """Each case's digest, run in ``work``; ``pythonpath`` first on the path (an older commit's build)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEAST_")}
    env["FEAST_EDGE_PRESET_PATH"] = str(PRESETS_DIR)  # fmnist-tiny by name: an agent loads the preset its shard names
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    work.mkdir(parents=True, exist_ok=True)
    if pythonpath:  # the older build, not this checkout's editable install, must be the one imported
        imported = (
            "import feast_edge as f, feast_edge.server as s, feast_edge.agent as a; "
            "print(f.__file__, s.__file__, a.__file__)"
        )
        where = subprocess.run(
            [sys.executable, "-c", imported], capture_output=True, text=True, env=env, cwd=work, check=True
        ).stdout.split()
        if not all(path.startswith(pythonpath) for path in where):
            raise RuntimeError(f"the build in {pythonpath} is not the feast_edge imported ({' '.join(where)})")
    out = {}
    for case in cases:
        out[case] = digest(RUNNERS[CASES[case].kind](case, work / case, data_dir, env))
    return out


def build_commit(commit: str, into: Path) -> Path:
    """``commit``'s feast_edge installed (no dependencies: this environment's) into ``into``/site; returns that path."""
    source = into / "source"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(source), commit], check=True,
                   capture_output=True)  # fmt: skip
    try:
        site = into / "site"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target",
             str(site), str(source)],
            check=True, capture_output=True,
        )  # fmt: skip
        return site
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(source)], capture_output=True)


def read_record() -> dict:
    return json.loads(RECORD.read_text()) if RECORD.is_file() else {"commit": None, "machines": {}, "since": {}}


def commit_of(record: dict, case: str) -> str:
    """The commit whose code made ``case``'s digests: the record's, or the later one its ``since`` names."""
    return record.get("since", {}).get(case, record["commit"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("record", "show"))
    parser.add_argument("--commit", help="make the digests with this commit's code (default: this checkout's)")
    parser.add_argument("--cases", help="only these cases, comma-separated, recorded as made by --commit (new cases)")
    parser.add_argument("--data", default=os.environ.get("FEAST_FMNIST_DIR", "/usr/share/datasets/fashion-mnist"))
    args = parser.parse_args()
    record = read_record()
    key = machine()
    if args.action == "show":
        print(json.dumps({"machine": key, **record}, indent=2))
        return
    work = Path(tempfile.mkdtemp(prefix="same-weights-"))
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", args.commit or "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        site = build_commit(commit, work) if args.commit else None
        if args.cases:  # cases added after the record's commit, made by this commit's code
            cases = args.cases.split(",")
            unknown = sorted(set(cases) - set(CASES))
            if unknown:
                sys.exit(f"unknown case(s) {', '.join(unknown)}; the cases are {', '.join(CASES)}")
        else:
            if record["commit"] and record["commit"] != commit:
                sys.exit(f"{RECORD} holds digests of commit {record['commit']}, not {commit}: record with --commit it")
            cases = [c for c in CASES if not record["commit"] or commit_of(record, c) == commit]
        digests = run_cases(cases, work, args.data, str(site) if site else None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record["commit"] = record["commit"] or commit
    if args.cases and commit != record["commit"]:
        record.setdefault("since", {}).update(dict.fromkeys(cases, commit))
    record["machines"][key] = {**record["machines"].get(key, {}), **digests}
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"{len(digests)} digests of commit {commit[:12]} on {key} -> {RECORD}")


if __name__ == "__main__":
    main()
