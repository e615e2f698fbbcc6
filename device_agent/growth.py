"""Folders that grow: the agent picks up the images added to a client's own image folder or manifest between rounds.

While it waits between rounds, the agent lists the folder again (names, sizes, mtimes, modes: one ``stat`` per file,
nothing decoded) at most every ``--rescan`` seconds. When the listing changed, it reads the folder through the
decoded cache, which decodes only the new and changed files (``feast_edge.data.decoded_cache``); removed files drop
out. Each image keeps its side of the held-out split (``feast_edge.data.holdout.content_split``).

A class folder (or manifest label) the preset's task does not have is refused: its images are ignored, and the agent
says so once, naming the folder and the task's classes, and goes on. A listing that cannot be read (the folder gone,
a manifest row naming a missing file) is a warning: the client keeps the images it has.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

from feast_edge.agent.hosted import Hosted
from feast_edge.agent.local_data import LocalClient, own_client
from feast_edge.data.sources import Listing, load_listing, scan_source
from feast_edge.errors import FeastError

log = logging.getLogger(__name__)
SAID = 1000  # distinct warnings remembered (said once each)


@dataclasses.dataclass(frozen=True)
class Grown:
    """A client's data read again: what it held before and what it holds now."""

    device_id: str
    before: LocalClient
    after: LocalClient

    def describe(self) -> str:
        b, a = self.before, self.after
        tests = f" + {a.test_samples} test" if a.test_samples or b.test_samples else ""
        was = f" + {b.test_samples}" if tests else ""
        return (
            f"{self.device_id}: {a.samples} training + {a.holdout} held-out{tests} images "
            f"(was {b.samples} + {b.holdout}{was}; {len(a.classes_present)} classes)"
        )


class FolderWatch:
    """Rescans the growing clients' folders at most every ``every`` seconds (0: never)."""

    def __init__(self, clients: Mapping[str, Hosted], every: float) -> None:
        self.clients, self.every = clients, every
        self.last = time.monotonic()
        self._said: set[str] = set()  # warnings said once (refused folders, unreadable listings)

    @property
    def watching(self) -> list[str]:
        return [d for d, c in self.clients.items() if c.current.growing is not None]

    def due(self, now: float) -> bool:
        return self.every > 0 and now - self.last >= self.every and bool(self.watching)

    def poll(self, now: float) -> list[Grown]:
        """The clients whose folder changed since it was last read (read again), if a rescan is due; else []."""
        if not self.due(now):
            return []
        try:
            return [g for d in self.watching if (g := self.rescan(d)) is not None]
        finally:
            self.last = time.monotonic()  # from the rescan's end (one that failed too: not again at once)

    def rescan(self, device_id: str) -> Grown | None:
        """List ``device_id``'s folder; read it again if the listing changed (None if it did not, or cannot be read)."""
        before = self.clients[device_id].current
        growing = before.growing
        assert growing is not None
        try:
            listing = scan_source(growing.path, growing.task, unknown="skip")
            self._refused(listing, growing.task.classes)
            key = listing.key(growing.task)
            if key == growing.key:
                return None
            data = load_listing(listing, growing.task)
        except (FeastError, OSError) as exc:
            self._once(f"{device_id}: could not read {growing.path} again ({exc}); it keeps the images it has")
            return None
        after = own_client(device_id, data, dataclasses.replace(growing, key=data.key))
        if after.samples == 0:  # every image it holds now is held out: nothing to train on, nothing to register
            self._once(
                f"{device_id}: {growing.path} holds no training images now (all held out); it keeps the images it has"
            )
            return None
        return Grown(device_id, before, after)

    def _refused(self, listing: Listing, classes: tuple[str, ...]) -> None:
        folder = listing.files.kind == "image folder"
        for name in listing.files.unknown:
            what, fix = (
                ("class folder " + name + "/", "rename the folder") if folder else (f"label {name!r}", "relabel")
            )
            self._once(
                f"{listing.label}: refused {what}: the preset's task has no class {name!r} (its classes: "
                f"{', '.join(classes)}); its images are ignored ({fix} to one of the task's classes)"
            )

    def _once(self, line: str) -> None:
        if line not in self._said:
            if len(self._said) >= SAID:
                self._said.clear()  # bounded: a line said long ago may be said again
            self._said.add(line)
            log.warning("%s", line)
