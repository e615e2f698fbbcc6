"""The registry of versions (SQLite, ``versions.sqlite`` in the run directory): every served model a version, every
offer, install, refusal and rollback a row with its figures.

    versions   number (1, 2, ...), the round it came from (and the rounds it is the mean of), why it was served, its
               weights' SHA-256, its epsilon where DP is on, its validation figure; its state: ``canary`` (offered to
               its canaries), ``promoted`` (offered to every device), ``held`` (held back, with the reason),
               ``direct`` (offered to everyone without canaries)
    events     (device, version, what, when, figures, reason, the version the device runs after it): ``offered``,
               ``installed``, ``refused``, ``first`` (installed by a device that ran none), ``ungated`` (installed
               by an agent that cannot refuse one), ``rolled-back`` (the device went back to ``running``)

A device's running version, since when, and its own held-out accuracy on it are read from its last event that
changed what it runs. The file survives restarts; nothing in it is ever rewritten but a version's state.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from feast_edge.util.sqlite import open_database
from feast_edge.versions.gate import DECISIONS, FIRST, INSTALLED, ROLLED_BACK, UNGATED, Verdict, from_counts

FILENAME = "versions.sqlite"
OFFERED = "offered"
EVENTS = (OFFERED, *DECISIONS)
CHANGES = (INSTALLED, FIRST, UNGATED, ROLLED_BACK)  # events after which a device runs another version
STATES = ("canary", "promoted", "held", "direct")

SCHEMA = """
CREATE TABLE IF NOT EXISTS versions (
    number         INTEGER PRIMARY KEY,
    round          INTEGER NOT NULL,
    average_of     TEXT NOT NULL DEFAULT '',
    reason         TEXT NOT NULL,
    weights_sha256 TEXT NOT NULL,
    epsilon        REAL,
    val_accuracy   REAL,
    created        REAL NOT NULL,
    state          TEXT NOT NULL,
    state_reason   TEXT NOT NULL DEFAULT '',
    canaries       TEXT NOT NULL DEFAULT '[]',
    decided        REAL
);
CREATE TABLE IF NOT EXISTS events (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    device   TEXT NOT NULL,
    version  INTEGER NOT NULL,
    event    TEXT NOT NULL,
    at       REAL NOT NULL,
    figures  TEXT NOT NULL DEFAULT '{}',
    reason   TEXT NOT NULL DEFAULT '',
    running  INTEGER
);
CREATE INDEX IF NOT EXISTS events_device ON events (device, id);
CREATE INDEX IF NOT EXISTS events_version ON events (version, id);
"""
SCHEMA_VERSION = "1"


@dataclass(frozen=True)
class Version:
    number: int
    round: int
    average_of: tuple[int, int] | None
    reason: str
    weights_sha256: str
    epsilon: float | None
    val_accuracy: float | None
    created: float
    state: str
    state_reason: str
    canaries: tuple[str, ...]
    decided: float | None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "average_of": list(self.average_of) if self.average_of else None}


@dataclass(frozen=True)
class Event:
    device: str
    version: int
    event: str
    at: float
    figures: dict[str, Any]
    reason: str
    running: int | None

    def verdict(self) -> Verdict:
        """The decision this event records, with its figures."""
        f = {
            k: int(self.figures.get(k) or 0) for k in ("examples", "new_correct", "old_correct", "new_only", "old_only")
        }
        if not f["examples"]:
            return Verdict(self.event in CHANGES, self.event)
        return from_counts(f["examples"], f["new_correct"], f["old_correct"], f["new_only"], f["old_only"])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Running:
    """What a device runs: its version, since when, and its own held-out accuracy on it (None: not measured)."""

    version: int
    since: float
    accuracy: float | None
    examples: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class VersionBook:
    """Thread-safe access to the versions registry; ``readonly`` opens an existing one without writing anything."""

    def __init__(self, path: str | Path, readonly: bool = False) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = open_database(path, SCHEMA, SCHEMA_VERSION, readonly)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ versions
    def add(
        self,
        *,
        round: int,
        reason: str,
        weights_sha256: str,
        state: str,
        canaries: tuple[str, ...] = (),
        average_of: tuple[int, int] | None = None,
        epsilon: float | None = None,
        val_accuracy: float | None = None,
        state_reason: str = "",
        at: float | None = None,
    ) -> Version:
        """A new version, numbered one past the newest."""
        if state not in STATES:
            raise ValueError(f"unknown version state {state!r}")
        now = time.time() if at is None else at
        with self._lock, self._db:
            number = int(self._db.execute("SELECT COALESCE(MAX(number), 0) + 1 FROM versions").fetchone()[0])
            self._db.execute(
                """INSERT INTO versions (number, round, average_of, reason, weights_sha256, epsilon, val_accuracy,
                       created, state, state_reason, canaries, decided)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                (
                    number,
                    int(round),
                    json.dumps(list(average_of)) if average_of else "",
                    reason,
                    weights_sha256,
                    epsilon,
                    val_accuracy,
                    now,
                    state,
                    state_reason,
                    json.dumps(sorted(canaries)),
                    None if state == "canary" else now,
                ),
            )
        found = self.version(number)
        assert found is not None
        return found

    def decide(self, number: int, state: str, reason: str, at: float | None = None) -> None:
        """Set a canary version's outcome: ``promoted`` or ``held``, with the reason."""
        if state not in STATES:
            raise ValueError(f"unknown version state {state!r}")
        with self._lock, self._db:
            self._db.execute(
                "UPDATE versions SET state = ?, state_reason = ?, decided = ? WHERE number = ?",
                (state, reason, time.time() if at is None else at, number),
            )

    def version(self, number: int) -> Version | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM versions WHERE number = ?", (number,)).fetchone()
        return None if row is None else _version(row)

    def versions(self, state: str | None = None) -> list[Version]:
        """Every version, or those in ``state``, oldest first."""
        where, args = ("WHERE state = ?", (state,)) if state is not None else ("", ())
        with self._lock:
            rows = self._db.execute(f"SELECT * FROM versions {where} ORDER BY number", args).fetchall()
        return [_version(r) for r in rows]

    def latest(self) -> Version | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM versions ORDER BY number DESC LIMIT 1").fetchone()
        return None if row is None else _version(row)

    # ------------------------------------------------------------------ events
    def record(
        self,
        device: str,
        version: int,
        event: str,
        *,
        figures: Mapping[str, Any] | None = None,
        reason: str = "",
        running: int | None = None,
        at: float | None = None,
    ) -> Event:
        """Append one event (see the module docstring)."""
        if event not in EVENTS:
            raise ValueError(f"unknown version event {event!r}")
        now = time.time() if at is None else at
        figures = dict(figures or {})
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO events (device, version, event, at, figures, reason, running) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (device, int(version), event, now, json.dumps(figures, sort_keys=True), reason, running),
            )
        return Event(device, int(version), event, now, figures, reason, running)

    def events(self, *, device: str | None = None, version: int | None = None) -> list[Event]:
        """Events in the order they were recorded, of one device and/or one version."""
        where, args = [], []
        if device is not None:
            where.append("device = ?")
            args.append(device)
        if version is not None:
            where.append("version = ?")
            args.append(version)
        sql = "SELECT * FROM events" + (f" WHERE {' AND '.join(where)}" if where else "") + " ORDER BY id"
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [_event(r) for r in rows]

    def offered(self, version: int) -> set[str]:
        """The devices ``version`` was offered to."""
        return {e.device for e in self.events(version=version) if e.event == OFFERED}

    def answers(self, version: int) -> dict[str, Event]:
        """Each device's answer to ``version`` (its latest decision event about it)."""
        return {e.device: e for e in self.events(version=version) if e.event != OFFERED}

    def running(self) -> dict[str, Running]:
        """Each device's running version (see the module docstring)."""
        out: dict[str, Running] = {}
        installed: dict[tuple[str, int], Event] = {}
        for e in self.events():
            if e.event not in CHANGES:
                continue
            if e.event != ROLLED_BACK:
                installed[(e.device, e.version)] = e
            elif e.running is None:  # back to a model from before this run's versions
                out.pop(e.device, None)
                continue
            now = e.running if e.running is not None else e.version
            source = installed.get((e.device, now))
            figures = source.figures if source is not None else {}
            examples = int(figures.get("examples") or 0)
            accuracy = figures.get("new_correct", 0) / examples if examples else figures.get("accuracy")
            out[e.device] = Running(now, e.at, accuracy, examples)
        return out

    def counts(self) -> dict[str, int]:
        """How many events of each kind (for summaries)."""
        with self._lock:
            rows = self._db.execute("SELECT event, COUNT(*) AS n FROM events GROUP BY event").fetchall()
        return {r["event"]: int(r["n"]) for r in rows}


def weights_digest(state: Mapping[str, Any]) -> str:
    """The SHA-256 of a state dict's tensors as safetensors writes them (names sorted): a version's weights."""
    from safetensors.torch import save

    return hashlib.sha256(save({k: v.detach().contiguous() for k, v in state.items()})).hexdigest()


def _version(row: sqlite3.Row) -> Version:
    span = json.loads(row["average_of"]) if row["average_of"] else None
    return Version(
        number=int(row["number"]),
        round=int(row["round"]),
        average_of=(int(span[0]), int(span[1])) if span else None,
        reason=row["reason"],
        weights_sha256=row["weights_sha256"],
        epsilon=row["epsilon"],
        val_accuracy=row["val_accuracy"],
        created=float(row["created"]),
        state=row["state"],
        state_reason=row["state_reason"],
        canaries=tuple(json.loads(row["canaries"] or "[]")),
        decided=row["decided"],
    )


def _event(row: sqlite3.Row) -> Event:
    return Event(
        device=row["device"],
        version=int(row["version"]),
        event=row["event"],
        at=float(row["at"]),
        figures=json.loads(row["figures"] or "{}"),
        reason=row["reason"],
        running=None if row["running"] is None else int(row["running"]),
    )
