"""In-process device agents, one of them slower than its machine: a Raspberry Pi beside a workstation, as the
server sees it.

``slow_down(agent, 5)`` makes an in-process :class:`feast_edge.agent.agent.Agent` take five times as long over each
round it is sent: before it uploads, it sleeps four times what the round took so far (download and training).
``agents_running(agents)`` starts, registers and runs each agent in a thread, and stops them after. Used by
tests/federation/test_async_federation.py, test_lying_device.py and bench/bench_async_mqtt.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


def slow_down(agent: Any, factor: float) -> None:
    """Make ``agent``'s rounds take ``factor`` times as long (see the module docstring)."""
    began = [time.monotonic()]
    run, upload = agent.rounds.run, agent.rounds._upload

    def timed(client: Any, incoming: Any) -> bool:
        began[0] = time.monotonic()
        return run(client, incoming)

    def late_upload(*args: Any) -> bool:
        time.sleep((factor - 1) * (time.monotonic() - began[0]))
        return upload(*args)

    agent.rounds.run, agent.rounds._upload = timed, late_upload


@contextmanager
def agents_running(agents: Sequence[Any]) -> Iterator[None]:
    """Each of ``agents`` connected, registered and serving rounds in a thread of its own; stopped and closed after."""
    threads = []
    try:
        for agent in agents:
            agent.start(timeout=10)
            threads.append(threading.Thread(target=lambda a=agent: (a.register(), a.run()), daemon=True))
            threads[-1].start()
        yield
    finally:
        for agent in agents:
            agent.stop.set()
        for thread in threads:
            thread.join(30)
        for agent in agents:
            agent.close()
