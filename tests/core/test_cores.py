"""Threads that follow the free cores (feast_edge.util.cores) and a lower priority (feast_edge.util.priority).

The chooser is a pure function of the CPUs a process may use, its CPU quota and the load of other processes; the
monitor measures those inputs (here from fake samples and fake cgroup folders); ``Threads`` applies a choice to
PyTorch and says when it changes. Timings live in bench/bench_threads.py, never here.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from feast_edge.util.cores import (
    CoreMonitor,
    CoreState,
    Threads,
    _Sample,
    choose_threads,
    cpu_quota,
    declared_threads,
)


# --- the rule --------------------------------------------------------------------------------------------------------
def test_idle_cores_are_all_used():
    choice = choose_threads(CoreState(cores=2, others_busy=0.05))
    assert (choice.threads, choice.reason) == (2, "2 of 2 cores free")


def test_one_busy_core_of_two_leaves_one_thread():
    choice = choose_threads(CoreState(cores=2, others_busy=1.0))
    assert (choice.threads, choice.reason) == (1, "1 of 2 cores busy with other work")


def test_a_quota_of_one_and_a_half_cpus_on_four_cores_gives_one_thread():
    choice = choose_threads(CoreState(cores=4, quota=1.5))
    assert (choice.threads, choice.reason) == (1, "a CPU quota of 1.5 of 4 cores")


def test_fixed_threads_win_over_everything():
    assert choose_threads(CoreState(cores=2, quota=1.0, others_busy=2.0), fixed=3).threads == 3
    assert choose_threads(CoreState(cores=2, quota=1.0, others_busy=2.0), fixed=3).reason == "--threads 3"


@pytest.mark.parametrize(
    ("state", "threads"),
    [
        (CoreState(cores=2, others_busy=0.5), 2),  # half a core busy counts as free
        (CoreState(cores=2, others_busy=0.6), 1),
        (CoreState(cores=2, others_busy=2.0), 1),  # never fewer than one
        (CoreState(cores=8, others_busy=2.7), 5),
        (CoreState(cores=4, quota=2.0, others_busy=1.0), 2),  # the quota binds before the load does
        (CoreState(cores=4, quota=2.0, others_busy=3.0), 1),
        (CoreState(cores=4, quota=8.0), 4),  # a quota above the cores is no limit
        (CoreState(cores=4, declared=1), 1),  # OMP_NUM_THREADS
        (CoreState(cores=4, others_busy=-0.2), 4),  # a negative measurement (clock skew) is no load
    ],
)
def test_the_rule(state: CoreState, threads: int):
    assert choose_threads(state).threads == threads


def test_omp_num_threads_is_read_as_a_positive_count():
    assert declared_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert declared_threads({"OMP_NUM_THREADS": "0"}) is None
    assert declared_threads({"OMP_NUM_THREADS": "two"}) is None
    assert declared_threads({}) is None


# --- the cgroup quota ------------------------------------------------------------------------------------------------
def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_tightest_on_the_way_to_the_root(tmp_path: Path):
    root = tmp_path / "cgroup"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "lab" / "cpu.max", "300000 100000\n")
    _write(root / "lab" / "agent" / "cpu.max", "150000 100000\n")
    _write(tmp_path / "self-cgroup", "0::/lab/agent\n")
    assert cpu_quota(tmp_path / "self-cgroup", root) == 1.5
    _write(root / "lab" / "agent" / "cpu.max", "max 100000\n")
    assert cpu_quota(tmp_path / "self-cgroup", root) == 3.0
    _write(root / "lab" / "cpu.max", "max 100000\n")
    assert cpu_quota(tmp_path / "self-cgroup", root) is None


def test_cgroup_v1_quota(tmp_path: Path):
    root = tmp_path / "cgroup"
    _write(root / "cpu,cpuacct" / "docker" / "c1" / "cpu.cfs_quota_us", "50000\n")
    _write(root / "cpu,cpuacct" / "docker" / "c1" / "cpu.cfs_period_us", "100000\n")
    _write(tmp_path / "self-cgroup", "4:memory:/docker/c1\n2:cpu,cpuacct:/docker/c1\n0::/\n")
    assert cpu_quota(tmp_path / "self-cgroup", root) == 0.5
    _write(root / "cpu,cpuacct" / "docker" / "c1" / "cpu.cfs_quota_us", "-1\n")
    assert cpu_quota(tmp_path / "self-cgroup", root) is None


def test_no_cgroup_information_is_no_quota(tmp_path: Path):
    assert cpu_quota(tmp_path / "missing", tmp_path) is None


# --- the monitor -----------------------------------------------------------------------------------------------------
class FakeClock:
    """Busy CPU time that grows as scripted: ``others`` and ``own`` CPUs' worth per second of (fake) time."""

    def __init__(self, others: float, own: float) -> None:
        self.others, self.own = others, own

    def sample(self, cpus: list[int]) -> _Sample:
        import time

        now = time.monotonic()
        return _Sample(now, busy=(self.others + self.own) * now, own=self.own * now)


def test_the_monitor_takes_this_process_out_of_the_busy_time():
    clock = FakeClock(others=1.0, own=1.0)  # this process keeps one core busy, another process the other
    monitor = CoreMonitor(sample=clock.sample, first_window=0.05)
    monitor.cpus, monitor.quota, monitor.declared = [0, 1], None, None
    state = monitor.state()
    assert state.cores == 2 and state.others_busy == pytest.approx(1.0, abs=1e-6)
    assert choose_threads(state).threads == 1


def test_without_per_cpu_times_the_monitor_sees_no_load():
    monitor = CoreMonitor(sample=lambda cpus: None, first_window=0.0)
    assert monitor.state().others_busy == 0.0


def test_the_real_monitor_measures_a_load_between_zero_and_its_cores():
    state = CoreMonitor(first_window=0.2).state()
    assert state.cores >= 1 and 0.0 <= state.others_busy <= state.cores


# --- applying a choice -----------------------------------------------------------------------------------------------
def test_threads_set_pytorch_and_log_only_when_the_choice_changes(caplog: pytest.LogCaptureFixture):
    before = torch.get_num_threads()
    busy = {"others": 1.0}
    monitor = CoreMonitor(sample=lambda cpus: None)
    monitor.cpus = [0, 1]
    monitor.state = lambda: CoreState(2, None, busy["others"])  # type: ignore[method-assign]
    threads = Threads(0, monitor=monitor, logger=logging.getLogger("test.cores"))
    try:
        with caplog.at_level(logging.INFO, logger="test.cores"):
            assert threads.use("training") == 1 and torch.get_num_threads() == 1
            assert threads.use("validating") == 1
            busy["others"] = 0.0
            assert threads.use("training") == 2 and torch.get_num_threads() == 2
        assert [r.getMessage() for r in caplog.records] == [
            "training with 1 thread: 1 of 2 cores busy with other work",
            "training with 2 threads: 2 of 2 cores free",
        ]
    finally:
        threads.close()
        torch.set_num_threads(before)


def test_fixed_threads_are_set_and_said_once(caplog: pytest.LogCaptureFixture):
    before = torch.get_num_threads()
    threads = Threads(before + 1, logger=logging.getLogger("test.cores"))
    try:
        with caplog.at_level(logging.INFO, logger="test.cores"):
            assert threads.use("training") == before + 1 == torch.get_num_threads()
            threads.use("exporting")
        assert [r.getMessage() for r in caplog.records] == [
            f"training with {before + 1} threads: --threads {before + 1}"
        ]
        assert threads.monitor is None
    finally:
        torch.set_num_threads(before)


def test_none_leaves_the_process_threads_alone():
    before = torch.get_num_threads()
    assert Threads(None).use("training") == before == torch.get_num_threads()


# --- a lower priority ------------------------------------------------------------------------------------------------
_NICE_CHILD = """
import os, threading, sys
from feast_edge.util.priority import lower_priority
seen = []
early = threading.Thread(target=lambda: (threading.Event().wait(0.5), seen.append(os.getpriority(os.PRIO_PROCESS, 0))))
early.start()  # a thread that exists before the priority is lowered
print(lower_priority(int(sys.argv[1])))
late = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0)))
late.start(); late.join(); early.join()
print(os.getpriority(os.PRIO_PROCESS, 0), *seen)
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "setpriority"), reason="this platform has no niceness")
def test_lower_priority_reaches_every_thread_of_the_process():
    result = subprocess.run([sys.executable, "-c", _NICE_CHILD, "10"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    said, nice = result.stdout.splitlines()
    assert said.startswith("at niceness 10")
    assert nice.split() == ["10", "10", "10"]  # the main thread, a later one, one that was already running


def test_lower_priority_never_raises_it_and_refuses_a_bad_value():
    from feast_edge.util.priority import current_nice, lower_priority

    assert lower_priority(0).startswith(f"at niceness {current_nice()}")
    with pytest.raises(ValueError, match="between 0"):
        lower_priority(20)


def test_within_a_long_step_the_choice_is_made_again_every_few_seconds(monkeypatch: pytest.MonkeyPatch):
    import feast_edge.util.cores as cores

    before = torch.get_num_threads()
    busy = {"others": 0.0}
    monitor = CoreMonitor(sample=lambda cpus: None)
    monitor.state = lambda: CoreState(2, None, busy["others"])  # type: ignore[method-assign]
    threads = Threads(0, monitor=monitor, logger=logging.getLogger("test.cores"))
    clock = {"now": 100.0}
    monkeypatch.setattr(cores.time, "monotonic", lambda: clock["now"])
    try:
        assert threads.use("training") == 2
        busy["others"] = 1.0  # an application starts on the device mid-round
        threads.refresh("training")
        assert torch.get_num_threads() == 2  # too soon: the last choice is fresh
        clock["now"] += cores.REFRESH_S
        threads.refresh("training")
        assert torch.get_num_threads() == 1 and threads.current.reason == "1 of 2 cores busy with other work"
        Threads(3).refresh("training")  # fixed threads are never chosen again
        assert torch.get_num_threads() == 1
    finally:
        threads.close()
        torch.set_num_threads(before)
