"""How many threads to compute with: the cores this process may use, less those other work keeps busy now.

A thread pool wider than the free cores collapses. PyTorch's intra-op threads
meet at every parallel region, so one thread that the scheduler parks behind
another process stalls the rest: on 2 cores beside one busy process at normal
priority, a co-training step on 2 threads costs 1.8 times what it costs on one
(docs/benchmarks.md, "Threads on a shared machine"). Devices are shared (a
Jetson's camera pipeline, a laptop in use), so the long-lived commands choose
their threads from the cores free *now* and choose again before each piece of
work:

* the ceiling: the CPUs of the process's affinity mask, and below that the
  cgroup CPU quota rounded down (a container given 1.5 CPUs is throttled by a
  second thread) and ``OMP_NUM_THREADS`` where the environment sets it (the
  limit PyTorch itself would take);
* the deduction: the CPU time other processes used on those CPUs over the last
  few seconds (``/proc/stat`` through psutil, less this process's own time),
  rounded to whole cores, half a core counting as free.

:func:`choose_threads` is that rule as a pure function; :class:`CoreMonitor`
measures its inputs; :class:`Threads` applies a choice to PyTorch before each
step and says when it changes.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

WINDOW_S = 3.0  # other processes' busy time is averaged over this many seconds
SAMPLE_EVERY_S = 0.5
FIRST_WINDOW_S = 1.0  # a choice made before the monitor has this much history waits for it
REFRESH_S = 2.0  # within a long step (a round's local training), the choice is made again this often


@dataclass(frozen=True)
class CoreState:
    """The inputs of a thread choice: the CPUs this process may use, its CPU quota, other work's load on them."""

    cores: int  # CPUs in the affinity mask
    quota: float | None = None  # cgroup CPU quota in CPUs (None: no quota)
    others_busy: float = 0.0  # CPUs' worth of time other processes used on those CPUs lately
    declared: int | None = None  # OMP_NUM_THREADS (None: not set)


@dataclass(frozen=True)
class ThreadChoice:
    """A thread count and why, in words for a log line (``1 of 2 cores busy with other work``)."""

    threads: int
    reason: str


def choose_threads(state: CoreState, fixed: int = 0) -> ThreadChoice:
    """The intra-op threads for ``state``: ``fixed`` when given (``--threads N``), else the free cores, at least one."""
    if fixed > 0:
        return ThreadChoice(fixed, f"--threads {fixed}")
    cores = max(1, state.cores)
    of = f"of {cores} core{'s' * (cores != 1)}"
    ceiling, limit = cores, ""
    if state.quota is not None and state.quota < cores:
        ceiling = max(1, math.floor(state.quota))
        limit = f"a CPU quota of {state.quota:g} {of}"
    if state.declared is not None and 0 < state.declared < ceiling:
        ceiling, limit = state.declared, f"OMP_NUM_THREADS={state.declared} ({cores} cores)"
    busy = min(cores, math.ceil(max(0.0, state.others_busy) - 0.5))  # half a core busy counts as free
    free = cores - busy
    threads = max(1, min(ceiling, free))
    if busy and free <= ceiling:
        reason = f"{busy} {of} busy with other work"
    elif ceiling < cores:
        reason = limit
    else:
        reason = f"{cores} {of} free"
    return ThreadChoice(threads, reason)


# ----------------------------------------------------------------------------- measuring the inputs
def declared_threads(environ: dict[str, str] | None = None) -> int | None:
    """``OMP_NUM_THREADS`` as a positive count; None when unset or not one."""
    text = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def affinity_cpus() -> list[int]:
    """The CPUs this process may run on (all of them where the platform has no affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and its v1 ``cpu`` controller path, from ``/proc/self/cgroup``."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "cpu" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _quota_v2(root: Path, path: str) -> float | None:
    """The tightest ``cpu.max`` from the process's cgroup up to the root (``max PERIOD`` is no limit)."""
    tightest: float | None = None
    here = root / path.lstrip("/")
    while True:
        text = _read(here / "cpu.max")
        if text:
            quota, _, period = text.partition(" ")
            if quota != "max" and period:
                try:
                    cpus = int(quota) / int(period)
                except (ValueError, ZeroDivisionError):
                    cpus = None
                if cpus is not None and cpus > 0:
                    tightest = cpus if tightest is None else min(tightest, cpus)
        if here == root or root not in here.parents:
            return tightest
        here = here.parent


def _quota_v1(root: Path, path: str) -> float | None:
    """``cpu.cfs_quota_us / cpu.cfs_period_us`` of the v1 ``cpu`` controller (-1: no limit)."""
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        base = root / mount
        if not base.is_dir():
            continue
        here = base / path.lstrip("/")
        for folder in (here, base):
            quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
            try:
                q, p = int(quota or "-1"), int(period or "0")
            except ValueError:
                continue
            if q > 0 and p > 0:
                return q / p
        return None
    return None


def cpu_quota(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The cgroup CPU quota of this process in CPUs (cgroup v2 ``cpu.max``, else v1 CFS quota); None without one."""
    v2, v1 = _cgroup_paths(proc_cgroup)
    if v2 is not None and (root / "cgroup.controllers").is_file():
        return _quota_v2(root, v2)
    if v1 is not None:
        return _quota_v1(root, v1)
    if v2 is not None and (root / "unified").is_dir():  # hybrid: v2 mounted beside v1
        return _quota_v2(root / "unified", v2)
    return None


@dataclass(frozen=True)
class _Sample:
    at: float
    busy: float  # seconds of busy CPU time on the watched CPUs, since boot
    own: float  # seconds of this process's CPU time


def _sample(cpus: list[int]) -> _Sample | None:
    """Busy time of ``cpus`` and of this process, now; None where psutil cannot read per-CPU times."""
    import psutil

    try:
        per_cpu = psutil.cpu_times(percpu=True)
        own = psutil.Process().cpu_times()
    except (psutil.Error, OSError, NotImplementedError):
        return None
    busy = 0.0
    for i in cpus:
        if i < len(per_cpu):
            times = per_cpu[i]
            idle = times.idle + getattr(times, "iowait", 0.0)
            # guest time is counted in user already (Linux); everything but idle and iowait is work done.
            total = sum(getattr(times, f) for f in times._fields if f not in ("guest", "guest_nice"))
            busy += total - idle
    return _Sample(time.monotonic(), busy, own.user + own.system)


class CoreMonitor:
    """Other processes' load on this process's CPUs over the last ``window`` seconds, sampled by a daemon thread."""

    def __init__(
        self,
        window: float = WINDOW_S,
        every: float = SAMPLE_EVERY_S,
        sample: Callable[[list[int]], _Sample | None] = _sample,
        first_window: float = FIRST_WINDOW_S,
    ) -> None:
        """``first_window``: the shortest window a choice is made on (the first waits for it)."""
        self.window, self.every, self._sample, self.first_window = window, every, sample, first_window
        self.cpus = affinity_cpus()
        self.quota = cpu_quota()
        self.declared = declared_threads()
        self._samples: deque[_Sample] = deque(maxlen=max(2, int(window / every) + 2))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> CoreMonitor:
        """Sample in the background from now on (idempotent)."""
        if self._thread is None:
            self._take()
            self._thread = threading.Thread(target=self._run, name="core-monitor", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._take()

    def _take(self) -> _Sample | None:
        sample = self._sample(self.cpus)
        if sample is not None:
            with self._lock:
                self._samples.append(sample)
        return sample

    def state(self) -> CoreState:
        """The CPUs, the quota and other processes' busy CPUs over the window ending now (0 where unmeasurable)."""
        if choose_threads(CoreState(len(self.cpus), self.quota, 0.0, self.declared)).threads <= 1:
            return CoreState(len(self.cpus), self.quota, 0.0, self.declared)  # one thread whatever the load
        with self._lock:
            first = self._samples[0] if self._samples else None
        if first is None:
            first = self._take()
        if first is not None and time.monotonic() - first.at < self.first_window:
            time.sleep(self.first_window - (time.monotonic() - first.at))  # too short a window says little
        now = self._take()
        if first is None or now is None:
            return CoreState(len(self.cpus), self.quota, 0.0, self.declared)
        with self._lock:
            start = next((s for s in self._samples if now.at - s.at <= self.window), first)
        elapsed = now.at - start.at
        if elapsed <= 0:
            return CoreState(len(self.cpus), self.quota, 0.0, self.declared)
        others = ((now.busy - start.busy) - (now.own - start.own)) / elapsed
        return CoreState(len(self.cpus), self.quota, min(float(len(self.cpus)), max(0.0, others)), self.declared)


def threads_now(fixed: int = 0, window: float = 0.5) -> ThreadChoice:
    """One choice for a whole run (``feast-edge simulate``): ``fixed``, else the free cores measured over ``window`` s."""
    if fixed > 0:
        return choose_threads(CoreState(len(affinity_cpus())), fixed)
    return choose_threads(CoreMonitor(first_window=window).state())


class Threads:
    """The intra-op threads of a long-lived command: ``--threads N`` (``fixed`` N), chosen from the free cores before
    each step (``fixed`` 0: ``use("training")``), or left as the process has them (``fixed`` None: a library caller's
    own setting); set in PyTorch and logged when the choice changes."""

    def __init__(self, fixed: int | None = 0, monitor: CoreMonitor | None = None, logger: logging.Logger = log) -> None:
        self.fixed = fixed
        self.monitor = None if fixed is None or fixed > 0 else (monitor or CoreMonitor()).start()
        self.log = logger
        self.current: ThreadChoice | None = None
        self._chosen_at = 0.0

    @property
    def adaptive(self) -> bool:
        return self.monitor is not None

    def choose(self) -> ThreadChoice:
        """The choice for a step starting now (nothing is set)."""
        if self.monitor is not None:
            return choose_threads(self.monitor.state())
        if self.fixed:
            return choose_threads(CoreState(len(affinity_cpus())), self.fixed)
        import torch

        return ThreadChoice(torch.get_num_threads(), "the process's own setting")

    def use(self, step: str) -> int:
        """Choose the threads for ``step`` (e.g. "training"), set PyTorch's; the count, for onnxruntime sessions."""
        import torch

        if self.fixed is None:
            return torch.get_num_threads()
        choice = self.choose()
        if torch.get_num_threads() != choice.threads:
            torch.set_num_threads(choice.threads)
        if self.current is None or choice.threads != self.current.threads:
            threads = torch.get_num_threads()
            self.log.info("%s with %d thread%s: %s", step, threads, "s" * (threads != 1), choice.reason)
        self.current, self._chosen_at = choice, time.monotonic()
        return choice.threads

    def refresh(self, step: str) -> None:
        """Within a long step: choose again when the last choice is ``REFRESH_S`` old (adaptive threads only), so an
        application that starts on the device mid-round gets its core back within seconds, not at the next round."""
        if self.monitor is not None and time.monotonic() - self._chosen_at >= REFRESH_S:
            self.use(step)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
