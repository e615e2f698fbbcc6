"""A simulation's cohort spread over processes with torch.distributed (``feast-edge simulate --nproc N``, or ``torchrun``).

Rank 0 runs the simulation exactly as one process does (``Simulation``, its
run loop, checkpoints and results); only collecting a round's updates changes.
:class:`SpreadCollector` splits the cohort over the ranks by training cost
(:func:`assign`), broadcasts the round (a JSON header, then the global state as
safetensors bytes), trains its own share and receives the other ranks'
updates. Every other rank builds the same setup and method from the same
config and :func:`serve`\\ s rounds until rank 0 says stop. A client's update is
the same function of the same inputs wherever it runs and the updates come
back in cohort order, so the arithmetic is that of one process: the same seed
and the same intra-op threads give the same weights, bit for bit on CPU.

Everything crosses as bytes in uint8 tensors (JSON headers, safetensors
blobs), never as pickled objects. gloo carries them on CPU, NCCL between GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from feast_edge.run.collect import Collected
from feast_edge.settings import flat
from feast_edge.sim.collect import InProcessCollector
from feast_edge.sim.methods import Method, method_class
from feast_edge.sim.ranks import (
    TIMEOUT,
    Channel,
    DistributedError,
    World,
    affordable_indices,
    channel_device,
    connect,
    cut_to,
    pack_updates,
    pick_backend,
    plans_digest,
    torchrun_world,
    unpack_updates,
    worker_device,
)
from feast_edge.sim.setup import Setup, SimulationConfig, build_setup
from feast_edge.util.cores import threads_now

_JOINED = "feast-edge/joined/"


def check_spread(config: SimulationConfig, nproc: int) -> None:
    """One-line errors for a process count a run cannot use (before any data is read)."""
    if nproc < 1:
        raise DistributedError(f"--nproc {nproc} must be at least 1 (1: one process)")
    if nproc > config.population.per_round:
        raise DistributedError(
            f"--nproc {nproc} exceeds the cohort (--per-round {config.population.per_round}): every process trains at least one client a round; "
            f"lower --nproc to at most {config.population.per_round} or raise --per-round"
        )
    if nproc > 1 and method_class(config.method).collect is not Method.collect:
        raise DistributedError(
            f"--method {config.method} trains one pooled model, it has no cohort of clients to spread over processes; run it with --nproc 1"
        )


def assign(cohort: Sequence[str], costs: Sequence[float], size: int) -> list[list[str]]:
    """The cohort over ``size`` ranks, greedy longest-processing-time first: the costliest member to the least-loaded rank.

    Deterministic (ties go to the earlier member and the lower rank); each part keeps cohort order, and no part is
    empty while there are at least ``size`` members.
    """
    loads, parts = [0.0] * size, [[] for _ in range(size)]
    for i in sorted(range(len(cohort)), key=lambda i: (-costs[i], i)):
        r = min(range(size), key=lambda r: (loads[r], len(parts[r]), r))
        parts[r].append(i)
        loads[r] += costs[i]
    return [[cohort[i] for i in sorted(p)] for p in parts]


class SpreadCollector(InProcessCollector):
    """Rank 0's collector: the cohort split over the ranks by training cost, the updates put back in cohort order."""

    def __init__(
        self, setup: Setup, method: Method, channel: Channel, rounds: int, *, self_reported: bool = False
    ) -> None:
        super().__init__(setup, method, self_reported=self_reported)
        self.channel, self.rounds, self.closed = channel, rounds, False
        self.sizes = {cid: int(n) for cid, n in zip(setup.client_ids, setup.population.sizes)}

    def collect(
        self,
        t: int,
        cohort: Sequence[str],
        plans: Mapping[str, Any],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> Collected:
        if self.on_start is not None:
            self.on_start(t, cohort, plans)
        cohort = list(cohort)
        parts = assign(
            cohort, [self.method.train_cost(plans[c]) * self.sizes[c] for c in cohort], self.channel.world.size
        )
        header = {
            "round": t,
            "lr": lr,
            "cohort": cohort,
            "parts": parts,
            "plans": plans_digest(plans, cohort),
            "affordable": affordable_indices(plans, cohort, self.setup.cache),
        }
        self.channel.broadcast(json.dumps(header).encode())
        self.channel.broadcast(save_tensors({k: v.detach().cpu().contiguous() for k, v in global_state.items()}))
        delivered = self.method.delivered(global_state)
        got = {c: self.method.train_one(t, c, plans[c], delivered, lr) for c in parts[0]}
        for data in self.channel.gather(b""):
            got.update({u.client: u for u in unpack_updates(data)})
        if sorted(got) != sorted(cohort):
            raise DistributedError(
                f"round {t + 1}: updates came back for {sorted(got)}, the cohort is {cohort}; the processes disagree, rerun"
            )
        if t + 1 >= self.rounds:
            self.close()  # the final test runs on rank 0 alone
        return self.collected([got[c] for c in cohort])

    def close(self) -> None:
        """Tell every other rank to stop (once)."""
        if not self.closed:
            self.closed = True
            self.channel.broadcast(json.dumps({"stop": True}).encode())


def serve(setup: Setup, method: Method, channel: Channel) -> int:
    """A worker rank: train its share of every round rank 0 broadcasts until told to stop; returns the rounds served."""
    budgets = {cid: float(b) for cid, b in zip(setup.client_ids, setup.population.budgets)}
    served = 0
    while True:
        header = json.loads(channel.broadcast())
        if header.get("stop"):
            return served
        state = load_tensors(channel.broadcast())
        t, cohort = int(header["round"]), list(header["cohort"])
        plans = method.plans(t, cohort, budgets.__getitem__)
        if header.get("affordable"):  # a secure round's plans, cut to what it reveals
            plans = cut_to(plans, header["affordable"], setup.cache)
        if plans_digest(plans, cohort) != header["plans"]:
            raise DistributedError(
                f"rank {channel.world.rank} planned round {t + 1} differently from rank 0; every process must run the same feast-edge version and options"
            )
        delivered = method.delivered(state)
        updates = [
            method.train_one(t, c, plans[c], delivered, float(header["lr"]))
            for c in header["parts"][channel.world.rank]
        ]
        channel.gather(pack_updates(updates))
        served += 1


class LocalWorkers:
    """The other ``nproc - 1`` processes of ``--nproc N`` on this machine, started at once so they load data alongside rank 0."""

    def __init__(
        self, config: SimulationConfig, nproc: int, threads: int, backend: str, command: Sequence[str]
    ) -> None:
        self.world = World(0, nproc, 0, nproc)
        self.backend = backend
        self.store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        job = json.dumps(
            {"config": flat(config), "threads": threads, "backend": backend, "port": self.store.port}
        ).encode()
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, nproc):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(nproc),
            }
            proc = subprocess.Popen(list(command), stdin=subprocess.PIPE, env=env)
            self.procs.append(proc)
            proc.stdin.write(job)
            proc.stdin.close()

    def check(self) -> None:
        """Raise when a worker process has exited (it printed why)."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                how = (
                    f"was killed by signal {-proc.returncode}"
                    if proc.returncode < 0
                    else f"exited with status {proc.returncode} (its error is above)"
                )
                raise DistributedError(
                    f"simulation process {rank} of {self.world.size} {how}; rerun (--resume continues from the last checkpoint)"
                )

    def connect(self) -> Channel:
        """Wait until every worker has built its setup, then join the process group as rank 0."""
        keys = [f"{_JOINED}{r}" for r in range(1, self.world.size)]
        while not self.store.check(keys):
            self.check()
            time.sleep(0.05)
        connect(self.world, self.backend, self.store)
        return Channel(self.world, channel_device(self.backend, self.world), self.check)

    def stop(self, grace: float = 30.0) -> None:
        """Wait for the workers (they stop once told), terminate any still running after ``grace`` seconds."""
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Spread:
    """How this process takes part in a simulation: alone, as rank 0 (with local workers or under torchrun), or as a worker."""

    def __init__(
        self,
        config: SimulationConfig,
        nproc: int = 1,
        threads: int = 0,
        backend: str = "auto",
        command: Sequence[str] = (),
    ) -> None:
        """``command`` starts a local worker (it runs :func:`serve_local`); needed for ``nproc > 1`` outside torchrun."""
        launched = torchrun_world()
        if launched is not None and nproc > 1:
            raise DistributedError(
                "--nproc starts processes on this machine; under torchrun leave it out and give torchrun --nproc-per-node"
            )
        check_spread(config, launched.size if launched is not None else nproc)
        if launched is None and nproc > 1 and not command:
            raise DistributedError(
                "--nproc > 1 needs the command that starts a worker process (feast-edge simulate passes it)"
            )
        self.config, self.launched, self.command = config, launched, tuple(command)
        self.world = launched or World(0, nproc, 0, nproc)
        self.backend = pick_backend(backend, config.device, self.world.local_size)
        if threads == 0 and launched is None:
            # One count for the whole run, from the cores free now, shared out by --nproc: the count changes PyTorch's
            # summation order, so it is recorded (results.json) and never changes mid-run (docs/simulation.md).
            free = threads_now()
            threads = max(1, free.threads // nproc)
            self.chosen = free.reason if nproc == 1 else f"{free.reason}, shared out by --nproc {nproc}"
        else:
            self.chosen = "--threads" if threads else "torchrun's OMP_NUM_THREADS"
        if threads > 0:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        self.workers: LocalWorkers | None = None
        self.collector: SpreadCollector | None = None

    @property
    def worker(self) -> bool:
        return self.world.rank != 0

    def describe(self) -> str:
        where = "torchrun" if self.launched is not None else "this machine"
        return f"each round's cohort spread over {self.world.size} processes ({where}, {self.backend}, {self.threads} intra-op thread{'s' if self.threads != 1 else ''} each)"

    def serve(self) -> int:
        """A worker rank under torchrun: build the setup, join, train rounds until rank 0 stops; returns the rounds served."""

        setup, method = build_worker(self.config.changed(device=worker_device(self.config.device, self.world)))
        connect(self.world, self.backend)
        try:
            return serve(setup, method, Channel(self.world, channel_device(self.backend, self.world), lambda: None))
        finally:
            dist.destroy_process_group()

    def clients(self, setup: Setup, method: Method, *, self_reported: bool = False) -> InProcessCollector:
        """Rank 0: start the local workers (or join torchrun's) and return the collector that spreads each cohort over
        the ranks: how the simulation's environment reaches its clients (feast_edge.sim.environment); wrappers (secure
        sums, the virtual clock) go around it as around the in-process one."""
        try:
            if self.launched is None:
                self.workers = LocalWorkers(self.config, self.world.size, self.threads, self.backend, self.command)
                channel = self.workers.connect()
            else:
                connect(self.world, self.backend)
                channel = Channel(self.world, channel_device(self.backend, self.world), lambda: None)
        except BaseException:
            self.close(ok=False)
            raise
        self.collector = SpreadCollector(
            setup, method, channel, self.config.training.rounds, self_reported=self_reported
        )
        return self.collector

    def close(self, ok: bool = True) -> None:
        """Stop the other ranks (at once when rank 0 failed) and leave the process group."""
        try:
            if ok and self.collector is not None:
                self.collector.close()
        finally:
            if self.workers is not None:
                self.workers.stop(grace=30.0 if ok else 0.0)
            if dist.is_initialized():
                dist.destroy_process_group()


def _parent_alive(parent: int) -> Callable[[], None]:
    def alive() -> None:
        if os.getppid() != parent:
            raise DistributedError("rank 0 (the process that started this one) has gone; stopping")

    return alive


def serve_local() -> None:
    """A worker of a local ``--nproc`` run: its job (config JSON) on stdin, its rank in the environment."""
    parent = os.getppid()
    job = json.loads(sys.stdin.read())
    world = torchrun_world()
    if world is None:
        raise DistributedError("a simulation worker is started by feast-edge simulate --nproc N, not by hand")
    if job["threads"] > 0:
        torch.set_num_threads(job["threads"])
    config = SimulationConfig.of(**{**job["config"], "device": worker_device(job["config"]["device"], world)})
    setup, method = build_worker(config)
    store = dist.TCPStore("127.0.0.1", int(job["port"]), world.size, is_master=False, timeout=TIMEOUT)
    store.set(f"{_JOINED}{world.rank}", "1")
    connect(world, job["backend"], store)
    try:
        serve(setup, method, Channel(world, channel_device(job["backend"], world), _parent_alive(parent)))
    finally:
        dist.destroy_process_group()


def build_worker(config: SimulationConfig) -> tuple[Setup, Method]:
    """What a worker rank trains with: the same setup and method rank 0 builds from the same config."""
    setup = build_setup(config)
    return setup, method_class(config.method)(setup, config)
