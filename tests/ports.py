"""Loopback ports for the brokers, SuperLinks and SuperNodes a test starts, safe under pytest-xdist.

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, the same range every outgoing
connection's source port comes from, and another worker's pick too: between the moment a test chooses it and the
moment its broker binds it, a neighbour can take it ("address already in use"). Here each pytest-xdist worker takes
ports from a block of its own below the ephemeral range, checked free by binding them.
"""

from __future__ import annotations

import itertools
import os
import random
import socket

FIRST, LAST = 20_000, 32_000  # below Linux's ephemeral range (32768-60999 by default), above the well-known services
BLOCK = 1_000  # ports per worker: 12 workers before blocks are shared (they are still checked free)


def _block_start() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw3" under pytest-xdist
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    return FIRST + (index * BLOCK) % (LAST - FIRST)


_START = _block_start()
_OFFSETS = itertools.count(random.Random(os.getpid()).randrange(BLOCK))  # another start in each run of the suite


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports of this worker's block that nothing is bound to."""
    ports: list[int] = []
    for _ in range(BLOCK):
        port = _START + next(_OFFSETS) % BLOCK
        if port not in ports and _bindable(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free loopback ports in {_START}-{_START + BLOCK - 1}")


def free_port() -> int:
    """A loopback port of this worker's block that nothing is bound to."""
    return free_ports(1)[0]
