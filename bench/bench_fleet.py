"""Hundreds of devices on one server: registration time, per-round overhead and peak memory for K = 50, 100, 200 virtual devices.

    PYTHONPATH=. python bench/bench_fleet.py [--sizes 50,100,200] [--rounds 2] [--samples 8] [--agents 1] [--compare HEAD] [--profile DIR]

For each K a real ``feast-server run`` and ``--agents`` real ``feast-agent run --clients K/agents`` processes
(console-script modules, subprocesses) federate over the local broker, in their own federation and run
directory: preset fmnist-small, every device at a 1.5M-MAC budget (the cache's smallest variant, so local
compute is tiny), ``--samples`` Fashion-MNIST examples per device, every device in every round's cohort
(``--per-round K --min-clients K``), no server data (no validation, no export). Measured per K:

* registration: from the moment every agent is connected (its "connected" log line, timed here) to the
  last device's ``first_seen`` in the server's registry (``devices.sqlite``); also from the agents' launch
  (process start, data, MQTT subscriptions included);
* per-round overhead: the server's round wall time (``RoundRecord.seconds``) minus the sum of the devices'
  reported compute (one agent process trains its clients one after the other, so all of it is on the
  critical path; with several agents, minus the largest per-agent sum); also the server's send (route,
  encode, publish every payload) and aggregate seconds;
* CPU seconds and peak RSS (``ru_maxrss`` from ``wait4``) of the server and of the agent processes.

The last lines print each metric's growth from one K to the next (same code): K doubling and the ratio about 2
means linear in K.
``--compare REF`` runs git revision REF's code (``git archive``, read-only) too, each K right before the working
tree's, and adds the ratios tree / REF. ``--registration-only`` stops each K once every device registered (and
counts the registration messages the server handled); ``--profile DIR`` runs the server and the agents under
cProfile and prints their top functions.
"""

from __future__ import annotations

import argparse
import os
import pstats
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from feast_edge.run.checkpoint import read_record  # noqa: E402
from feast_edge.transport.broker import LinkConfig  # noqa: E402
from feast_edge.transport.retained import clear_retained  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FMNIST = "/usr/share/datasets/fashion-mnist"
TRAIN_EXAMPLES = 60_000


class Child:
    """A console-script module in its own process, logging to a file; its rusage is read when it is reaped."""

    def __init__(
        self, name: str, module: str, args: list[str], log: Path, profile: Path | None, tree: Path = REPO
    ) -> None:
        self.name, self.log = name, log
        runner = ["-m", "cProfile", "-o", str(profile / f"{name}.prof")] if profile is not None else []
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(tree),
        }  # ``tree``'s feast_edge ahead of the installed one
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                [sys.executable, *runner, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT, cwd=tree, env=env
            )
        self.launched = time.time()
        self.rss_mb = self.cpu_s = 0.0
        self.code: int | None = None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def reap(self, block: bool) -> bool:
        """Collect the exit status, peak RSS and CPU time once the process ended; True when it has."""
        if self.code is not None:
            return True
        pid, status, usage = os.wait4(self.process.pid, 0 if block else os.WNOHANG)
        if pid == 0:
            return False
        self.code = os.waitstatus_to_exitcode(status)
        self.process.returncode = self.code
        self.rss_mb, self.cpu_s = usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime
        return True

    def kill(self) -> None:
        if self.code is None:
            self.process.kill()
            self.reap(block=True)


def wait_line(child: Child, pattern: str, timeout: float) -> float:
    """time.time() when ``pattern`` first appears in the child's log (polled every 20 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, child.text()):
            return time.time()
        if child.reap(block=False):
            raise SystemExit(f"{child.name} exited ({child.code}) before '{pattern}':\n{child.text()[-3000:]}")
        time.sleep(0.02)
    raise SystemExit(f"{child.name}: no '{pattern}' within {timeout:g} s:\n{child.text()[-3000:]}")


def registered(out: Path) -> tuple[int, float]:
    """(devices in the server's registry, the last one's first_seen)."""
    try:
        with sqlite3.connect(f"file:{out / 'devices.sqlite'}?mode=ro", uri=True) as db:
            count, last = db.execute("SELECT COUNT(*), MAX(first_seen) FROM devices").fetchone()
    except sqlite3.Error:
        return 0, 0.0
    return int(count), float(last or 0.0)


def repeats(server: Child, agents: list[Child]) -> dict[str, Any]:
    """Registration messages the server handled per device, and its "registered but never receives" warnings."""
    debug = (server.log.parent / "server-debug.log").read_text(errors="replace")
    devices = len(set(re.findall(r"registered (\S+) \(host", debug)))
    return {
        "per_device": len(re.findall(r"registered \S+ \(host", debug)) / max(devices, 1),
        "never_receives": debug.count("never receives"),
    }


def checkout(ref: str, into: Path) -> Path:
    """The files of git revision ``ref`` in ``into``, importable as feast_edge (read-only for the repository: git archive)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    # pyproject.toml maps server/ and device_agent/ to feast_edge.server and feast_edge.agent.
    (into / "feast_edge" / "server").symlink_to("../server")
    (into / "feast_edge" / "agent").symlink_to("../device_agent")
    return into


def run_fleet(k: int, args: argparse.Namespace, tmp: Path, tree: Path = REPO, label: str = "tree") -> dict[str, Any]:
    """One federation of ``k`` virtual devices, run by the code in ``tree``; its measurements."""
    federation = f"fleet{uuid.uuid4().hex[:10]}"
    out, logs = tmp / f"run-{label}-{k}", tmp / f"logs-{label}-{k}"
    logs.mkdir(parents=True)
    profile = None if args.profile is None else Path(args.profile) / f"{label}-k{k}"
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
    common = ["--broker", args.broker, "--federation", federation, "--threads", "1"]
    server = Child(
        "server",
        "feast_edge.server.cli",
        [
            "run",
            "--insecure",
            *common,
            "--out",
            str(out),
            "--preset",
            "fmnist-small",
            "--rounds",
            str(args.rounds),
            "--per-round",
            str(k),
            "--min-clients",
            str(k),
            "--round-timeout",
            "1200",
            "--wait-timeout",
            "1200",
            "--batch-size",
            "8",
            "--local-epochs",
            "1",
            "--no-export",
            *(["--log-file", str(logs / "server-debug.log")] if args.registration_only else []),
        ],
        logs / "server.log",
        profile,
        tree,
    )
    agents: list[Child] = []
    try:
        wait_line(server, r"connected to .* as federation", 120)
        per_agent = [k // args.agents + (i < k % args.agents) for i in range(args.agents)]
        shards = max(1, TRAIN_EXAMPLES // (args.samples * k))  # each agent cuts shard i of N, then K_i clients from it
        for i, clients in enumerate(per_agent):
            agents.append(
                Child(
                    f"agent{i}",
                    "feast_edge.agent.cli",
                    [
                        "run",
                        "--insecure",
                        *common,
                        "--device-id",
                        f"a{i}",
                        "--data",
                        FMNIST,
                        "--clients",
                        str(clients),
                        "--shard",
                        f"{i % shards}/{shards}",
                        "--budget",
                        "1.5M",
                        "--register-timeout",
                        "1200",
                    ],
                    logs / f"agent{i}.log",
                    profile,
                    tree,
                )
            )
        connected = max(wait_line(a, r"connected to .*; hosting", 300) for a in agents)
        deadline = time.monotonic() + args.timeout
        if args.registration_only:
            while registered(out)[0] < k:
                if time.monotonic() > deadline or not all(not c.reap(block=False) for c in (server, *agents)):
                    raise SystemExit(f"K={k}: {registered(out)[0]} of {k} devices registered; logs in {logs}")
                time.sleep(0.1)
            time.sleep(args.settle)  # repeated registrations still in flight are counted too
            for c in (server, *agents):
                c.process.terminate()
                c.reap(block=True)
            count, last = registered(out)
            return {
                "code": label,
                "K": k,
                "launch_s": last - min(a.launched for a in agents),
                "register_s": last - connected,
                "repeats": repeats(server, agents),
            }
        while not all(c.reap(block=False) for c in (server, *agents)):
            if time.monotonic() > deadline:
                raise SystemExit(f"K={k}: the federation did not finish within {args.timeout:g} s; logs in {logs}")
            time.sleep(0.1)
        for c in (server, *agents):
            if c.code != 0:
                raise SystemExit(f"{c.name} exited with {c.code}:\n{c.text()[-3000:]}")
    finally:
        for c in (server, *agents):
            c.kill()
        clear_retained(LinkConfig(broker=args.broker), f"feast/{federation}/#")
    count, last = registered(out)
    assert count == k, f"{count} of {k} devices registered"
    history = read_record(out / "checkpoint.safetensors")["fields"]["history"]
    rounds = []
    for h in history:
        assert len(h["updated"]) == k, f"round {h['round']}: {len(h['updated'])} of {k} updates entered the aggregate"
        # Per agent its clients train one after another: the critical path holds the largest per-agent sum.
        compute = max(
            sum(s for d, s in h["compute_seconds"].items() if d.startswith(f"a{i}-") or d == f"a{i}")
            for i in range(args.agents)
        )
        rounds.append(
            {
                "seconds": h["seconds"],
                "compute": compute,
                "send": h["send_seconds"],
                "aggregate": h["aggregate_seconds"],
            }
        )
    mean = {key: sum(r[key] for r in rounds) / len(rounds) for key in rounds[0]}
    if profile is not None:
        for c in (server, *agents[:1]):
            print(f"\n--- K={k} {c.name}: top functions by cumulative time (cProfile, main thread) ---")
            pstats.Stats(str(profile / f"{c.name}.prof")).sort_stats("cumulative").print_stats(25)
    return {
        "code": label,
        "K": k,
        "launch_s": last - min(a.launched for a in agents),
        "register_s": last - connected,
        "round_s": mean["seconds"],
        "compute_s": mean["compute"],
        "overhead_s": mean["seconds"] - mean["compute"],
        "send_s": mean["send"],
        "aggregate_s": mean["aggregate"],
        "server_cpu_s": server.cpu_s,
        "server_rss_mb": server.rss_mb,
        "agent_cpu_s": sum(a.cpu_s for a in agents),
        "agent_rss_mb": max(a.rss_mb for a in agents),
    }


COLUMNS = [
    ("K", "K", "{:d}"),
    ("launch_s", "launch→registered s", "{:.2f}"),
    ("register_s", "register s", "{:.2f}"),
    ("round_s", "round s", "{:.2f}"),
    ("compute_s", "Σ compute s", "{:.2f}"),
    ("overhead_s", "overhead s", "{:.2f}"),
    ("send_s", "send s", "{:.2f}"),
    ("aggregate_s", "aggregate s", "{:.3f}"),
    ("server_cpu_s", "server CPU s", "{:.1f}"),
    ("server_rss_mb", "server peak MB", "{:.0f}"),
    ("agent_cpu_s", "agent CPU s", "{:.1f}"),
    ("agent_rss_mb", "agent peak MB", "{:.0f}"),
]


def table(results: list[dict[str, Any]]) -> str:
    """Measurements per code and K, then growth ratios (K over the previous K, same code) and, with two codes, tree / ref."""
    lines = ["| code | " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    lines += [f"| {r['code']} | " + " | ".join(fmt.format(r[key]) for key, _, fmt in COLUMNS) + " |" for r in results]
    codes = list(dict.fromkeys(r["code"] for r in results))
    for code in codes:
        mine = [r for r in results if r["code"] == code]
        for a, b in zip(mine, mine[1:]):
            lines.append(
                f"| {code} | {b['K']}/{a['K']} | "
                + " | ".join(_ratio(b[key], a[key]) for key, _, _ in COLUMNS[1:])
                + " |"
            )
    if len(codes) == 2:
        ref, tree = ({r["K"]: r for r in results if r["code"] == c} for c in codes)
        for k in ref:
            lines.append(
                f"| {codes[1]}/{codes[0]} | {k} | "
                + " | ".join(_ratio(tree[k][key], ref[k][key]) for key, _, _ in COLUMNS[1:])
                + " |"
            )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default="mqtt://127.0.0.1:1883")
    parser.add_argument("--sizes", default="50,100,200", help="comma-separated numbers of virtual devices")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8, help="training examples per device")
    parser.add_argument("--agents", type=int, default=1, help="agent processes the K devices are split over")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one federation may take")
    parser.add_argument(
        "--compare",
        metavar="REF",
        default=None,
        help="also run git revision REF (e.g. HEAD), each K right before the working tree",
    )
    parser.add_argument(
        "--registration-only", action="store_true", help="stop once every device registered; report registration only"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=5.0,
        help="--registration-only: seconds to keep listening after the last registration",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="run under cProfile, keep the .prof files in this directory and print the top functions",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if not Path(FMNIST).is_dir():
        raise SystemExit(f"Fashion-MNIST is not in {FMNIST}; apt-get install dataset-fashion-mnist")
    if args.samples * max(sizes) > TRAIN_EXAMPLES or args.agents < 1 or args.agents > min(sizes):
        raise SystemExit("--samples x K must fit in 60,000 examples and 1 <= --agents <= the smallest K")
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} CPUs)")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        codes = [("tree", REPO)]
        if args.compare is not None:
            try:
                codes.insert(0, (args.compare, checkout(args.compare, Path(tmp) / "ref")))
            except subprocess.CalledProcessError as exc:
                raise SystemExit(
                    f"--compare {args.compare}: git archive failed ({exc.stderr.decode(errors='replace').strip()}); name a commit of this repository"
                ) from None
        for k in sizes:
            for label, tree in codes:
                started = time.monotonic()
                results.append(run_fleet(k, args, Path(tmp), tree, label))
                print(
                    f"K={k} ({label}): done in {time.monotonic() - started:.0f} s; load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    print(
        f"\n{args.rounds} round(s), {args.samples} examples per device, {args.agents} agent process(es), every device in every cohort; round figures are per-round means\n"
    )
    if args.registration_only:
        for r in results:
            print(
                f"K={r['K']} ({r['code']}): launch->registered {r['launch_s']:.2f} s, connected->registered {r['register_s']:.2f} s, "
                f"{r['repeats']['per_device']:.2f} registration messages per device, {r['repeats']['never_receives']} 'never receives' warnings"
            )
        return
    results.sort(key=lambda r: ([c for c, _ in codes].index(r["code"]), r["K"]))
    print(table(results))


if __name__ == "__main__":
    main()
