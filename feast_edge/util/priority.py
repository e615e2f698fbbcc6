"""A lower CPU priority (OS niceness) for work that must not slow down a device's own application.

A board federating is never idle: a Jetson runs its camera pipeline, a laptop
is in use, a Pi serves its own model. ``feast-agent run`` lowers its own
priority (``--nice 10`` by default), so the scheduler gives the device's own
work the cores first and training takes what is left (docs/benchmarks.md,
"Threads on a shared machine", measures a foreground process beside it).

On Linux niceness belongs to each thread and a new thread inherits its
creator's, so :func:`lower_priority` sets every thread the process has now;
threads started later (PyTorch's pool, paho's network thread) inherit it.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_NICE = 19


def _threads() -> list[int]:
    """The ids of this process's threads (Linux), else the process alone (0)."""
    try:
        return [int(t.name) for t in Path("/proc/self/task").iterdir() if t.name.isdigit()]
    except OSError:
        return [0]


def current_nice() -> int:
    """This thread's niceness (0 where the platform has none)."""
    return os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0


def lower_priority(nice: int) -> str:
    """Run this process at niceness ``nice`` (0..19) or lower priority if it already is; what was done, in words."""
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"--nice {nice} must be between 0 (normal priority) and {MAX_NICE} (lowest)")
    before = current_nice()
    if nice <= before:
        return f"at niceness {before}" + (" (normal priority)" if before == 0 else "")
    if not hasattr(os, "setpriority"):
        return f"at normal priority: this platform has no niceness to lower (--nice {nice} ignored)"
    for tid in _threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # a thread that ended meanwhile
            pass
    return f"at niceness {current_nice()} (the device's own work comes first; --nice 0 keeps normal priority)"
