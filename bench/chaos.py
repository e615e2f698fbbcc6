"""A federation under random SIGKILLs of its agents, its server and its broker: what survives, what is lost, is the math intact?

    python bench/chaos.py [--rounds 24] [--agents 4] [--seed 0] [--kill-every 10] [--outage 60] [--duration 840] [--quick] [--keep DIR]

Runs its own mosquitto on a free loopback port, one ``feast-server run`` and
``--agents`` ``feast-agent run`` processes (one fmnist-small partition shard
each) and a supervisor that, every ``--kill-every`` seconds on average
(exponential gaps, seeded), SIGKILLs a random running agent, the server or the
broker and restarts it after 1..``--down`` seconds, as systemd would (restarts
wait for the broker; a start that fails is retried). Once half the rounds are
done the broker is killed for ``--outage`` seconds (60; none with ``--quick``).
The server keeps its ``--out``, so every restart resumes from its checkpoint.

The report reads the server's checkpoint (its per-round history) and prints
the rounds completed, the updates lost (cohort members whose update is not in
an aggregate, by cause), the kills of each kind, and two comparisons of the
final weights:

* **replay**: every recorded round recomputed in this process: the same
  cohort members' local co-training (same routed slice, data, lr and client
  seed, as the simulator runs it) aggregated where the server aggregated.
  All randomness derives from the seed and the round, so this is exact
  whatever was lost, and any difference is a bug;
* **undisturbed**: ``feast-edge simulate`` of the same config, which can only
  match when no update was lost and every cohort was the undisturbed one;
  otherwise ``n/a`` with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from feast_edge.run.checkpoint import load_supernet, read_record
from feast_edge.run.cohort import sample_round_cohort
from feast_edge.run.loop import CHECKPOINT, RoundRecord
from feast_edge.server.brokers import free_port, listening
from feast_edge.server.registry import Registry
from feast_edge.sim.replay import replay_rounds
from feast_edge.sim.setup import SimulationConfig
from feast_edge.sim.shards import write_partition
from feast_edge.sim.simulate import Simulation

REPO = Path(__file__).resolve().parent.parent
KINDS = ("agent", "server", "broker")
WEIGHTS = {
    "agent": 3.0,
    "server": 1.0,
    "broker": 1.0,
}  # relative odds that a kill hits one of the kind's running processes
RETRY = 2.0  # seconds before a process that exited with an error is started again


@dataclasses.dataclass
class Supervised:
    """One restartable process: its command, its current run and what happened to it."""

    name: str
    kind: str
    command: list[str]
    logs: Path
    process: subprocess.Popen | None = None
    starts: int = 0
    kills: int = 0
    restart_at: float | None = None  # down (killed or failed) until then
    finished: bool = False  # exited 0: the federation is over for it

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.starts += 1
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{self.name}-{self.starts}.log", "w") as log:
            self.process = subprocess.Popen(
                self.command,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.restart_at = None

    def kill(self, down: float) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)
        self.kills += 1
        self.restart_at = time.monotonic() + down

    def stop(self) -> None:
        if self.running:
            assert self.process is not None
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def texts(self) -> list[str]:
        return [(self.logs / f"{self.name}-{i}.log").read_text(errors="replace") for i in range(1, self.starts + 1)]


class Chaos:
    """The supervisor: starts everything, kills and restarts at random, stops when the server has finished."""

    def __init__(self, args: argparse.Namespace, work: Path, config: SimulationConfig, index: dict) -> None:
        self.args, self.work, self.config = args, work, config
        self.rng = np.random.default_rng(
            [args.seed, 7]
        )  # the kill schedule; the federation's own randomness is config.seed's
        self.port = free_port()
        self.url = f"mqtt://127.0.0.1:{self.port}"
        self.federation = f"chaos-{uuid.uuid4().hex[:8]}"
        self.out = work / "run"
        conf = work / "mosquitto.conf"
        conf.write_text(
            f"user {getpass.getuser()}\npersistence false\nlog_dest stderr\nlistener {self.port} 127.0.0.1\nallow_anonymous true\n"
        )
        logs = work / "logs"
        self.broker = Supervised(
            "broker", "broker", [shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c", str(conf)], logs
        )
        server = [
            sys.executable, "-m", "feast_edge.server.cli", "run", "--insecure", "--broker", self.url, "--out", str(self.out), "--rounds", str(config.training.rounds),
            "--per-round", str(config.population.per_round), "--min-clients", str(args.min_clients), "--round-timeout", str(args.round_timeout),
            "--seed", str(config.seed), "--batch-size", str(config.training.batch_size), "--data", str(work / "partition"), "--federation", self.federation,
            "--no-export", "--eval-every", str(config.training.rounds), "--threads", "1",
        ]  # fmt: skip
        self.server = Supervised("server", "server", server, logs)
        self.agents = [
            Supervised(
                c["client_id"], "agent",
                [
                    sys.executable, "-m", "feast_edge.agent.cli", "run", "--insecure", "--broker", self.url, "--device-id", c["client_id"],
                    "--data", str(work / "partition" / c["file"]), "--federation", self.federation, "--threads", "1", "--register-timeout", "900",
                ],
                logs,
            )
            for c in index["clients"]
        ]  # fmt: skip
        self.events: list[str] = []
        self.began = time.monotonic()
        self.outage_done = args.outage <= 0
        self.outage_until = 0.0

    def say(self, text: str) -> None:
        line = f"{time.monotonic() - self.began:7.1f} s  {text}"
        self.events.append(line)
        print(line, flush=True)

    def completed(self) -> int:
        path = self.out / CHECKPOINT
        try:
            return int(read_record(path)["fields"]["round"]) if path.is_file() else 0
        except Exception:  # noqa: BLE001 - read while the server replaces it: try again on the next tick
            return 0

    def start_broker(self) -> None:
        self.broker.start()
        deadline = time.monotonic() + 10
        while not listening(self.port):
            if time.monotonic() > deadline:
                raise SystemExit(f"mosquitto did not start on port {self.port}; see {self.broker.logs}")
            time.sleep(0.05)

    def run(self) -> bool:
        """Until the server finished (True) or --duration passed (False)."""
        self.start_broker()
        self.server.start()
        for agent in self.agents:
            agent.start()
        next_kill = time.monotonic() + self.rng.exponential(self.args.kill_every)
        deadline = self.began + self.args.duration
        last_round = -1
        while time.monotonic() < deadline:
            now = time.monotonic()
            done = self.completed()
            if done != last_round:
                self.say(f"checkpoint: {done}/{self.config.training.rounds} rounds")
                last_round = done
            self._reap(now)
            if self.server.finished:
                self.say("the server finished the federation")
                self._await_agents(5.0)
                return True
            self._restart(now)
            if not self.outage_done and done >= self.config.training.rounds // 2 and self.broker.running:
                self.broker.kill(self.args.outage)
                self.outage_done, self.outage_until = True, now + self.args.outage
                self.say(f"broker outage: killed for {self.args.outage:g} s")
            elif now >= next_kill:
                if now >= self.outage_until:
                    self._kill_one()
                next_kill = now + self.rng.exponential(self.args.kill_every)
            time.sleep(0.1)
        self.say(f"--duration {self.args.duration:g} s passed before the federation finished")
        return False

    def _await_agents(self, seconds: float) -> None:
        """Agents leave once the server's 'finished' reaches them."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not all(a.finished or not a.running for a in self.agents):
            time.sleep(0.2)
            self._reap(time.monotonic())

    def _reap(self, now: float) -> None:
        for p in [self.server, *self.agents, self.broker]:
            if p.process is None or p.running or p.restart_at is not None or p.finished:
                continue
            code = p.process.returncode
            if code == 0 and p.kind != "broker":
                p.finished = True
                self.say(f"{p.name} exited 0")
            else:
                p.restart_at = now + RETRY
                self.say(f"{p.name} exited with status {code}; restarting in {RETRY:g} s")

    def _restart(self, now: float) -> None:
        if self.broker.restart_at is not None and now >= self.broker.restart_at:
            self.start_broker()
            self.say("broker started again")
        if not self.broker.running:
            return  # systemd would let them fail against a dead broker; waiting for it saves the noise
        for p in [self.server, *self.agents]:
            if p.restart_at is not None and now >= p.restart_at and not p.finished:
                p.start()
                self.say(f"{p.name} started again (start {p.starts})")

    def _kill_one(self) -> None:
        candidates = {
            "agent": [a for a in self.agents if a.running],
            "server": [self.server] if self.server.running else [],
            "broker": [self.broker] if self.broker.running else [],
        }
        kinds = [k for k in KINDS if candidates[k]]
        if not kinds:
            return
        odds = np.array([WEIGHTS[k] for k in kinds])
        kind = kinds[int(self.rng.choice(len(kinds), p=odds / odds.sum()))]
        victim = candidates[kind][int(self.rng.integers(len(candidates[kind])))]
        down = float(self.rng.uniform(1.0, self.args.down))
        victim.kill(down)
        self.say(f"SIGKILL {victim.name} (down {down:.1f} s)")

    def stop(self) -> None:
        for p in [*self.agents, self.server]:
            p.stop()
        self.broker.stop()


# --------------------------------------------------------------------------- what the server recorded, and the replays


def history(out: Path) -> list[RoundRecord]:
    path = out / CHECKPOINT
    return [RoundRecord.from_dict(h) for h in read_record(path)["fields"]["history"]] if path.is_file() else []


def lost(record: RoundRecord) -> int:
    """Cohort members whose update is not in an aggregate."""
    return len(record.cohort) - (len(record.updated) if record.applied else 0)


def budgets(out: Path) -> dict[str, float]:
    registry = Registry(out / "devices.sqlite", readonly=True)
    try:
        return {d.device_id: float(d.budget_macs) for d in registry.devices()}
    finally:
        registry.close()


def replay(
    records: list[RoundRecord], partition: Path, config: SimulationConfig, budget_of: dict[str, float]
) -> dict[str, torch.Tensor]:
    """The recorded rounds recomputed in process (``feast_edge.sim.replay``)."""
    return replay_rounds(records, partition, config, budget_of)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def verdict(diff: float) -> str:
    return (
        "equal (bit-exact)"
        if diff == 0
        else f"equal within {diff:.1e}"
        if diff <= 1e-6
        else f"DIFFERENT (max |diff| {diff:.3g})"
    )


# --------------------------------------------------------------------------- report


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))
    return "\n".join([fmt(header), line, *(fmt(r) for r in rows)])


def failures(chaos: Chaos) -> dict[str, int]:
    """Why processes exited with an error, from the one-line ``error:`` each prints last (or its traceback)."""
    reasons: dict[str, int] = {}
    for p in [chaos.server, *chaos.agents]:
        for text in p.texts():
            lines = [line for line in text.splitlines() if line.startswith("error: ")]
            if not lines:
                if "Traceback" in text:
                    reasons["crashed with a traceback"] = reasons.get("crashed with a traceback", 0) + 1
                continue
            line = lines[-1]
            reason = (
                "refused: device id already online" if "already online" in line
                else "broker unreachable at start" if "cannot reach MQTT broker" in line
                else line[len("error: ") :][:60]
            )  # fmt: skip
            reasons[reason] = reasons.get(reason, 0) + 1
    return reasons


def report(chaos: Chaos, finished: bool, wall: float, partition: Path) -> None:
    config, out = chaos.config, chaos.out
    records = history(out)
    ids = [a.name for a in chaos.agents]
    print()
    print(table(
        [
            (
                str(h.round), ",".join(h.cohort), ",".join(h.updated) or "-", ",".join(h.missing) or "-", ",".join(h.dropped) or "-",
                ",".join(sorted(h.rejected)) or "-", "yes" if h.applied else "no", str(lost(h)), f"{h.seconds:.1f}",
            )
            for h in records
        ],
        ("round", "cohort", "updated", "no reply", "offline", "rejected", "aggregated", "lost", "s"),
    ))  # fmt: skip
    server_logs = chaos.server.texts()
    resumes = sum(len(re.findall(r"resuming from .*? rounds completed", t.replace("\n", " "))) for t in server_logs)
    agent_exits = sum(a.finished for a in chaos.agents)
    total_lost = sum(lost(h) for h in records)
    causes = {
        "no reply by the deadline": sum(len(h.missing) for h in records),
        "went offline mid-round": sum(len(h.dropped) for h in records),
        "rejected": sum(len(h.rejected) for h in records),
        "valid but round below --min-clients": sum(len(h.updated) for h in records if not h.applied),
    }
    final = load_supernet(out / CHECKPOINT)[0].state_dict() if (out / CHECKPOINT).is_file() else None
    if final is None:
        replayed, undisturbed = "n/a (no checkpoint)", "n/a (no checkpoint)"
    else:
        replayed = verdict(max_abs_diff(final, replay(records, partition, config, budgets(out))))
        differ = sum(
            h.cohort != sample_round_cohort(ids, config.population.per_round, config.seed, t)
            for t, h in enumerate(records)
        )
        if total_lost:
            undisturbed = f"n/a ({total_lost} updates lost)"
        elif differ:
            undisturbed = f"n/a (cohorts of {differ} rounds differ: devices were offline when they were drawn)"
        elif len(records) < config.training.rounds:
            undisturbed = f"n/a (only {len(records)} of {config.training.rounds} rounds completed)"
        else:
            sim = chaos.work / "undisturbed"
            Simulation(config, sim).run()
            undisturbed = verdict(max_abs_diff(final, load_supernet(sim / CHECKPOINT)[0].state_dict()))
    reasons = failures(chaos)
    rows = [
        (
            "rounds completed",
            f"{len(records)}/{config.training.rounds}" + ("" if finished else "  (stopped by --duration)"),
        ),
        ("rounds aggregated", str(sum(h.applied for h in records))),
        ("cohort slots", str(sum(len(h.cohort) for h in records))),
        ("updates lost", str(total_lost)),
        *((f"  {cause}", str(n)) for cause, n in causes.items()),
        *(
            (f"kills: {kind}", str(sum(p.kills for p in [chaos.server, chaos.broker, *chaos.agents] if p.kind == kind)))
            for kind in KINDS
        ),
        ("longest broker outage", f"{chaos.args.outage:g} s" if chaos.args.outage > 0 else "-"),
        ("server resumes from its checkpoint", str(resumes)),
        ("failed starts (exited with an error, restarted)", str(sum(reasons.values()))),
        *((f"  {reason}", str(n)) for reason, n in reasons.items()),
        ("agents that saw the end (exit 0)", f"{agent_exits}/{len(chaos.agents)}"),
        ("final weights vs replay of recorded rounds", replayed),
        ("final weights vs undisturbed run", undisturbed),
        ("wall time", f"{wall:.0f} s"),
    ]
    print()
    print(table(rows, ("measure", "value")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--agents", type=int, default=4, help="agent processes, one client each")
    parser.add_argument(
        "--per-round", type=int, default=None, help="cohort size (default: half the agents, at least 2)"
    )
    parser.add_argument("--min-clients", type=int, default=1, help="valid updates a round needs to aggregate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the federation and of the kill schedule")
    parser.add_argument("--kill-every", type=float, default=10.0, help="mean seconds between kills (exponential gaps)")
    parser.add_argument("--down", type=float, default=5.0, help="a killed process stays down 1..DOWN seconds")
    parser.add_argument("--outage", type=float, default=60.0, help="seconds of the one long broker outage (0: none)")
    parser.add_argument("--round-timeout", type=float, default=30.0)
    parser.add_argument("--samples", type=int, default=300, help="training examples per agent on average")
    parser.add_argument("--duration", type=float, default=840.0, help="give up after this many seconds")
    parser.add_argument("--quick", action="store_true", help="4 rounds, 3 agents, no long broker outage")
    parser.add_argument(
        "--keep", type=Path, default=None, help="work in this directory and keep it (logs, run, partition)"
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.agents, args.outage = 4, 3, 0.0
    per_round = args.per_round or max(2, args.agents // 2)
    config = SimulationConfig.of(
        clients=args.agents,
        per_round=per_round,
        rounds=args.rounds,
        train_limit=args.samples * args.agents,
        val_samples=100,
        calib_samples=50,
        test_limit=50,
        eval_every=args.rounds,
        batch_size=32,
        seed=args.seed,
    )
    torch.set_num_threads(1)
    work = args.keep or Path(tempfile.mkdtemp(prefix="feast-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    index = write_partition(config, work / "partition")
    chaos = Chaos(args, work, config, index)
    shards = ", ".join(f"{c['budget_macs'] / 1e6:.1f}M/{c['samples']}" for c in index["clients"])
    print(
        f"chaos: fmnist-small, {args.agents} agents (MACs/examples {shards}), {args.rounds} rounds of {per_round}, --min-clients {args.min_clients}, round timeout {args.round_timeout:g} s; "
        f"a kill every {args.kill_every:g} s on average (odds agent:server:broker {WEIGHTS['agent']:g}:{WEIGHTS['server']:g}:{WEIGHTS['broker']:g}), "
        f"down 1-{args.down:g} s; broker outage {args.outage:g} s; seed {args.seed}; {os.cpu_count()} CPUs; work dir {work}",
        flush=True,
    )
    began = time.monotonic()
    try:
        finished = chaos.run()
    finally:
        chaos.stop()
    report(chaos, finished, time.monotonic() - began, work / "partition")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
