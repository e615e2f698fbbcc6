"""A device agent made slower than its machine: what a Raspberry Pi beside a workstation looks like to the server.

``slow_down(agent, 5)`` makes an in-process :class:`feast_edge.agent.agent.Agent` take five times as long over each
round it is sent: before it uploads, it sleeps four times what the round took so far (download and training). Used
by tests/federation/test_async_federation.py and bench/bench_async_mqtt.py.
"""

from __future__ import annotations

import time
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
