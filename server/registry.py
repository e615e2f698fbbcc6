"""The server's persistent device registry (SQLite): who registered, with what budget, data and profile, and when.

One row per device id. ``host`` is the agent process that hosts the device
(its presence topic is ``status/{host}``), ``instance`` the random id of that
process, so a reconnect of the same agent is told apart from a second agent
claiming the same id. ``precision`` is the one the device is served in, which
its budget is for (its profile's). The file survives server restarts; the
checkpoint keeps a snapshot of it per round.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from feast_edge.util.sqlite import open_database

SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (
    device_id   TEXT PRIMARY KEY,
    host        TEXT NOT NULL,
    instance    TEXT NOT NULL,
    budget_macs INTEGER NOT NULL,
    samples     INTEGER NOT NULL,
    preset      TEXT NOT NULL,
    profile     TEXT NOT NULL,
    first_seen  REAL NOT NULL,
    last_seen   REAL NOT NULL,
    status      TEXT NOT NULL,
    rounds      INTEGER NOT NULL DEFAULT 0,
    metrics     TEXT NOT NULL DEFAULT '{}',
    precision   TEXT NOT NULL DEFAULT 'fp32'
);
"""
SCHEMA_VERSION = "1"
# Columns added since: (name, definition). A registry written before gains them when opened for writing; read-only,
# a row without one reads as the definition's default (_device).
ADDED_COLUMNS = (("precision", "TEXT NOT NULL DEFAULT 'fp32'"),)


@dataclass(frozen=True)
class Device:
    """One registry row."""

    device_id: str
    host: str
    instance: str
    budget_macs: int
    samples: int
    preset: str
    profile: dict[str, Any]
    first_seen: float
    last_seen: float
    status: str  # online | offline
    rounds: int = 0  # rounds whose aggregate included this device
    metrics: dict[str, Any] | None = None  # last metrics the device reported
    precision: str = "fp32"  # the precision it is served in, which its budget is for (registered; older rows: fp32)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Registry:
    """Thread-safe access to ``devices.sqlite``."""

    def __init__(self, path: str | Path, readonly: bool = False) -> None:
        """Open (creating it if needed) the registry; ``readonly`` opens an existing one without writing anything."""
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = open_database(self.path, SCHEMA, SCHEMA_VERSION, readonly)
        if readonly:
            return
        with self._lock, self._db:
            present = {row["name"] for row in self._db.execute("PRAGMA table_info(devices)")}
            for name, definition in ADDED_COLUMNS:
                if name not in present:
                    self._db.execute(f"ALTER TABLE devices ADD COLUMN {name} {definition}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def get(self, device_id: str) -> Device | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM devices WHERE device_id = ?", (device_id,)).fetchone()
        return None if row is None else _device(row)

    def count(self) -> int:
        """How many devices are registered."""
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM devices").fetchone()[0])

    def devices(self) -> list[Device]:
        """Every registered device, sorted by id."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM devices ORDER BY device_id").fetchall()
        return [_device(r) for r in rows]

    def register(
        self,
        device_id: str,
        *,
        host: str,
        instance: str,
        budget_macs: int,
        samples: int,
        preset: str,
        profile: dict[str, Any],
        status: str,
        precision: str = "fp32",
    ) -> Device:
        """Insert or update a device's registration (first_seen is kept)."""
        now = time.time()
        with self._lock, self._db:
            self._db.execute(
                """INSERT INTO devices (device_id, host, instance, budget_macs, samples, preset, profile, first_seen, last_seen, status,
                       precision)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT(device_id) DO UPDATE SET host = excluded.host, instance = excluded.instance,
                       budget_macs = excluded.budget_macs, samples = excluded.samples, preset = excluded.preset,
                       profile = excluded.profile, last_seen = excluded.last_seen, status = excluded.status,
                       precision = excluded.precision""",
                (
                    device_id,
                    host,
                    instance,
                    int(budget_macs),
                    int(samples),
                    preset,
                    json.dumps(profile, sort_keys=True),
                    now,
                    now,
                    status,
                    precision,
                ),
            )
        device = self.get(device_id)
        assert device is not None
        return device

    def set_host_status(self, host: str, status: str) -> list[str]:
        """Mark every device hosted by ``host`` online/offline; returns their ids."""
        now = time.time()
        with self._lock, self._db:
            rows = self._db.execute("SELECT device_id FROM devices WHERE host = ?", (host,)).fetchall()
            self._db.execute("UPDATE devices SET status = ?, last_seen = ? WHERE host = ?", (status, now, host))
        return [r["device_id"] for r in rows]

    def mark_all_offline(self) -> None:
        """At server start nobody is known to be online until its retained presence says so."""
        with self._lock, self._db:
            self._db.execute("UPDATE devices SET status = 'offline'")

    def touch(self, device_id: str, *, participated: bool = False, metrics: dict[str, Any] | None = None) -> None:
        """Record that a device was heard from (and whether its update entered an aggregate, and its metrics)."""
        now = time.time()
        with self._lock, self._db:
            self._db.execute(
                "UPDATE devices SET last_seen = ?, rounds = rounds + ? WHERE device_id = ?",
                (now, 1 if participated else 0, device_id),
            )
            if metrics is not None:
                self._db.execute(
                    "UPDATE devices SET metrics = ? WHERE device_id = ?",
                    (json.dumps(metrics, sort_keys=True), device_id),
                )

    def snapshot(self) -> list[dict[str, Any]]:
        """The registry as JSON-ready rows (stored in every checkpoint)."""
        return [d.to_dict() for d in self.devices()]


def _device(row: sqlite3.Row) -> Device:
    return Device(
        device_id=row["device_id"],
        host=row["host"],
        instance=row["instance"],
        budget_macs=int(row["budget_macs"]),
        samples=int(row["samples"]),
        preset=row["preset"],
        profile=json.loads(row["profile"]),
        first_seen=float(row["first_seen"]),
        last_seen=float(row["last_seen"]),
        status=row["status"],
        rounds=int(row["rounds"]),
        metrics=json.loads(row["metrics"] or "{}"),
        precision=dict(row).get("precision", "fp32"),  # a registry from before the column: float32
    )
