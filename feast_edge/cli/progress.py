"""Progress shown to people: a live bar in a terminal; in logs and pipes, plain lines and a heartbeat."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console


class Stage:
    """A long step shown to people: a live bar in a terminal; in logs and pipes, plain lines and a heartbeat.

    Outside a terminal a line says where the step stands when it starts, on
    ``update(..., line=True)``, after every ``heartbeat`` seconds without one,
    and when it ends (unless the last line said it already).
    """

    def __init__(self, console: Console, label: str, total: int, *, done: int = 0, heartbeat: float = 10.0) -> None:
        self.console, self.label, self.total, self.done, self.heartbeat = console, label, total, done, heartbeat
        self.note = ""
        self._bar: Any = None
        self._beat: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._began = self._said = time.monotonic()
        self._said_done: int | None = None

    def start(self) -> Stage:
        """Show the step: a bar in a terminal, else its first line and a heartbeat thread."""
        self._began = time.monotonic()
        if self.console.is_terminal:
            from rich.markup import escape
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            columns = (
                TextColumn(f"[bold]{escape(self.label)}"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[note]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
            )
            self._bar = Progress(*columns, console=self.console)
            self._task = self._bar.add_task(self.label, total=self.total, completed=self.done, note="")
            self._bar.start()
        else:
            self._say(with_note=False)
            self._beat = threading.Thread(target=self._heartbeat, name=f"stage {self.label}", daemon=True)
            self._beat.start()
        return self

    def update(self, done: int, note: str = "", *, line: bool = False) -> None:
        """``done`` of ``total`` finished; ``note`` is shown beside the count; ``line``: a line of its own outside a terminal too."""
        self.done, self.note = done, note
        if self._bar is not None:
            self._bar.update(self._task, completed=done, note=note)
        elif line:
            self._say()

    def finish(self, ok: bool = True) -> None:
        """Leave the bar (or a last line) showing where the step ended."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._beat is not None:
            self._stop.set()
            self._beat.join()
            self._beat = None
            if ok and self._said_done != self.done:
                self._say()

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(1.0, self.heartbeat)):
            if time.monotonic() - self._said >= self.heartbeat:
                self._say(with_note=False)  # the note describes the last update, not the time since

    def _say(self, with_note: bool = True) -> None:
        with self._lock:
            note = f"  {self.note}" if self.note and with_note else ""
            self.console.print(
                f"{self.label} {self.done}/{self.total}{note}  ({time.monotonic() - self._began:.0f} s)",
                soft_wrap=True,
                highlight=False,
            )
            self._said, self._said_done = time.monotonic(), self.done

    def __enter__(self) -> Stage:
        return self.start()

    def __exit__(self, kind: object, *exc: object) -> None:
        self.finish(ok=kind is None)


@contextmanager
def lazy_stage(console: Console, label: str) -> Iterator[Callable[[int, int], None]]:
    """A ``progress(done, total)`` callback that shows a :class:`Stage` from its first call (never, if nothing is called)."""
    shown: list[Stage] = []

    def update(done: int, total: int) -> None:
        if not shown:
            shown.append(Stage(console, label, total, done=done).start())
        shown[0].total = total
        shown[0].update(done)

    ok = False
    try:
        yield update
        ok = True
    finally:
        if shown:
            shown[0].finish(ok=ok)
