"""The run directory's SQLite files (the device registry, the versions registry): opened one way everywhere."""

from __future__ import annotations

import sqlite3
from pathlib import Path

MEMORY = ":memory:"


def open_database(path: str | Path, schema: str, version: str, readonly: bool = False) -> sqlite3.Connection:
    """A connection to the database at ``path`` (rows by name; usable from the caller's threads under its own lock).

    ``readonly`` opens an existing file without writing anything (a reader beside a running server: WAL mode serves
    it); else the file (and its folder) is created if needed, put in WAL mode, and ``schema`` (idempotent ``CREATE
    ... IF NOT EXISTS``) applied, with ``version`` recorded as the schema's in a ``meta`` table. ``":memory:"``: a
    database that lives as long as the connection."""
    if readonly:
        db = sqlite3.connect(
            f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False, timeout=10.0
        )
        db.row_factory = sqlite3.Row
        return db
    if str(path) != MEMORY:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path), check_same_thread=False, timeout=10.0)
    db.row_factory = sqlite3.Row
    with db:
        if str(path) != MEMORY:
            db.execute("PRAGMA journal_mode=WAL")
        db.executescript(schema + "\nCREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);")
        db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('schema', ?)", (version,))
    return db
