"""One hosted client's incoming transfers: wait for one, keep any other that finishes meanwhile for its own wait."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from feast_edge.transport.chunks import Progress, Status
from feast_edge.transport.frames import TransferInfo
from feast_edge.transport.transfer import ChunkReceiver

log = logging.getLogger(__name__)

POLL = 0.2  # seconds between looks at the deadline and the abandon condition
PROGRESS_EVERY = 1.0  # seconds between progress reports


class Downloads:
    """The transfers the server sends one client (its ``ChunkReceiver``), each taken by the one wait for it."""

    def __init__(self, receiver: ChunkReceiver, keep: int = 16) -> None:
        self.receiver = receiver
        self._finished: OrderedDict[str, Progress] = OrderedDict()  # e.g. a model pushed while a round's payload came
        self._keep = keep
        self.failures: OrderedDict[str, str] = OrderedDict()  # transfer -> why it was rejected (the last few)

    def received(self, transfer: str) -> int:
        """Chunks of ``transfer`` held so far."""
        return self.receiver.reassembler.received(transfer) or 0

    def wait(
        self,
        info: TransferInfo,
        deadline: float,
        abandon: Callable[[], bool],
        progress: Callable[[int], None] | None = None,
    ) -> bytes | None:
        """The payload of announced transfer ``info`` once complete and verified (its chunks are nacked until then);
        None if it was rejected, or the monotonic ``deadline`` passed or ``abandon()`` came true first (asked every
        0.2 s). ``progress(chunks held)`` is called at once and then about once a second. Nothing else is handled
        here: the caller's other messages wait for it."""
        transfer = info.transfer
        self.receiver.expect(info)
        if progress is not None:
            progress(self.received(transfer))
        reported = time.monotonic()
        while (finished := self._finished.pop(transfer, None)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or abandon():
                return None
            got = self.receiver.get(timeout=min(remaining, POLL))  # also nacks missing chunks
            if got is not None:
                self._finished[got.info.transfer] = got
                while len(self._finished) > self._keep:
                    self._finished.popitem(last=False)
            elif progress is not None and time.monotonic() - reported >= PROGRESS_EVERY:
                reported = time.monotonic()
                progress(self.received(transfer))
        if finished.status is Status.COMPLETE and finished.payload is not None:
            return finished.payload
        reason = finished.reason or finished.status.value
        log.warning("transfer %s for %s failed: %s", transfer, finished.info.device, reason)
        self.failures[transfer] = reason
        while len(self.failures) > self._keep:
            self.failures.popitem(last=False)
        return None
