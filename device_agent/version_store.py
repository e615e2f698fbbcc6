"""The versions a device holds: each served model it received in a folder of its own, the current one where every
reader finds it.

    {model_dir}/{device}.onnx .json .personal.onnx .personal.json   the current version, where fetch-model, evaluate,
                                                                    predict and the personal-model readers look
    {model_dir}/versions/{device}/{seq:04d}/                        one received version's files (the same names)
    {model_dir}/versions/{device}/state.json                        what the device holds (written atomically)

``seq`` numbers what this device received (1, 2, ...); the server's own version number, the round, the decision and
its figures are in the record (``held_versions``: the records and what a manifest says of its version). Files are kept for the current version and the previous installed one (what
``feast-agent rollback`` goes back to); a refused candidate's files and older versions' are deleted, their records kept
(the last KEEP_RECORDS).

Crash safety. Installing (and rolling back) writes state.json first, naming the new current version (the commit
point), then copies that version's files over the current ones, each atomically (``feast_edge.util.atomic``), and
only then deletes the folders no longer kept. Whenever the power goes, the files in ``model_dir`` are the old
version's, the new one's, or a mix; :meth:`VersionStore.recover` (on the agent's start, before every comparison and
every rollback) compares each with the SHA-256 the current version's record holds and copies back whatever differs
from that version's folder, so the device always runs one complete model. A model some other tool wrote there (a
``feast-agent fetch-model --out`` into the folder: its ONNX file matches its manifest but no version held) is adopted
as a version, not overwritten.

Two processes may touch one device's versions (``feast-agent run`` and ``feast-agent rollback``): every change is
made under an exclusive lock on ``versions/{device}/.lock``, and the agent reads the current version from disk each
time a new one arrives, so it compares with what a rollback left.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from feast_edge.agent.held_versions import (
    ADOPTED,
    Held,
    HeldVersion,
    Rollback,
    StoreError,
    describe,
    file_names,
    manifest_version,
    read_manifest,
    served_round,
    sha256_of,
    whole,
)
from feast_edge.transport.errors import TopicError
from feast_edge.transport.topics import validate_id
from feast_edge.util.atomic import atomic_write_bytes

log = logging.getLogger(__name__)

STATE = "state.json"
KEEP_RECORDS = 100  # records kept per device (the current and previous versions' always)
LOCK_WAIT = 60.0  # seconds a change waits for another process's (an install takes seconds, not minutes)


class VersionStore:
    """One device's versions under ``model_dir`` (see the module docstring)."""

    def __init__(self, model_dir: str | os.PathLike[str], device: str) -> None:
        try:
            validate_id(device, "device id")
        except TopicError as exc:
            raise StoreError(f"--device-id: {exc}") from None
        self.model_dir = Path(model_dir)
        self.device = device
        self.root = self.model_dir / "versions" / device
        self.names = file_names(device)

    @property
    def served(self) -> Path:
        """The current served ONNX file (what readers open)."""
        return self.model_dir / self.names[0]

    def folder(self, seq: int) -> Path:
        return self.root / f"{seq:04d}"

    def exists(self) -> bool:
        return (self.root / STATE).is_file()

    def read(self) -> Held:
        """What state.json says (an empty record of the device where there is none yet)."""
        path = self.root / STATE
        if not path.is_file():
            return Held(self.device)
        return Held.from_json(path.read_text(encoding="utf-8"), path)

    # ------------------------------------------------------------------ locking
    @contextmanager
    def locked(self, wait: float = LOCK_WAIT) -> Iterator[None]:
        """Hold the device's lock (another feast-agent run or rollback waits up to ``wait`` seconds for it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise StoreError(
                            f"another feast-agent is changing the versions of {self.device} in {self.model_dir} "
                            f"(its lock was held for {wait:g} s); try again when its install is done"
                        ) from None
                    time.sleep(0.1)
            yield
        finally:
            os.close(fd)  # releases the lock

    # ------------------------------------------------------------------ the files in place
    def _here(self) -> dict[str, str]:
        """SHA-256 of each current file that exists in ``model_dir``."""
        return {n: sha256_of(self.model_dir / n) for n in self.names if (self.model_dir / n).is_file()}

    def _intact(self, record: HeldVersion) -> bool:
        """Whether ``record``'s folder holds its served model and every file it lists, unchanged."""
        folder = self.folder(record.seq)
        return self.names[0] in record.files and all(
            (folder / n).is_file() and sha256_of(folder / n) == digest for n, digest in record.files.items()
        )

    def _place(self, record: HeldVersion) -> None:
        """Copy ``record``'s files over the current ones (each atomically), remove the current files it lacks."""
        here = self._here()
        for name in self.names:
            target = self.model_dir / name
            if name not in record.files:
                target.unlink(missing_ok=True)
                continue
            if here.get(name) == record.files[name]:
                continue
            blob = (self.folder(record.seq) / name).read_bytes()
            if hashlib.sha256(blob).hexdigest() != record.files[name]:
                raise StoreError(
                    f"{self.folder(record.seq) / name} changed on disk since it was recorded; it was not installed"
                )
            atomic_write_bytes(target, blob)

    def _consistent_here(self, here: Mapping[str, str]) -> dict[str, str]:
        """The current files that form a complete model by themselves (the ONNX file its manifest's SHA-256, a personal
        pair belonging to it), or {} when the served pair does not."""
        onnx, manifest, personal, personal_manifest = self.names
        if (
            onnx not in here
            or manifest not in here
            or read_manifest(self.model_dir / manifest).get("sha256") != here[onnx]
        ):
            return {}
        kept = {onnx: here[onnx], manifest: here[manifest]}
        about = read_manifest(self.model_dir / personal_manifest) if personal_manifest in here else {}
        if personal in here and about.get("sha256") == here[personal] and about.get("served_sha256") == here[onnx]:
            kept.update({personal: here[personal], personal_manifest: here[personal_manifest]})
        return kept

    # ------------------------------------------------------------------ recovery
    def recover(self, *, sweep: bool = False, now: float | None = None) -> list[str]:
        """Make the files in place the current version's (see the module docstring); what it did, in words.

        ``sweep`` (the agent's start, when no install of this device can be under way): also delete the folders no
        record keeps files in and the temporary files a power loss left behind."""
        held, done = self.read(), []
        if sweep:
            done += self._sweep(held)
        running = held.running
        here = self._here()
        if running is not None and here == running.files:
            return done
        consistent = self._consistent_here(here)
        known = {v.files.get(self.names[0]) for v in held.versions if v.files}
        foreign = bool(consistent) and consistent[self.names[0]] not in known
        if running is not None and not foreign and self._intact(running):
            self._place(running)
            said = (
                f"{self.device}: restored {describe(running)} from {self.folder(running.seq)}: the files in "
                f"{self.model_dir} were not all its own (a power loss during an install or rollback)"
            )
        elif consistent:
            adopted = self._adopt(held, consistent, time.time() if now is None else now)
            log.info("%s: adopted the model found in %s as %s", self.device, self.model_dir, describe(adopted))
            return [*done, f"{self.device}: adopted the model found in {self.model_dir} as {describe(adopted)}"]
        elif running is not None or here:
            said = (
                f"{self.device}: the model files in {self.model_dir} are incomplete and no held version restores "
                "them; the next served model is installed without a comparison"
            )
        else:
            return done
        log.warning("%s", said)
        return [*done, said]

    def _adopt(self, held: Held, files: Mapping[str, str], now: float) -> HeldVersion:
        """Take the complete model in place as a new current version (copied into a folder of its own)."""
        seq = self._next_seq(held)
        folder = self.folder(seq)
        folder.mkdir(parents=True, exist_ok=True)
        for name in files:
            atomic_write_bytes(folder / name, (self.model_dir / name).read_bytes())
        manifest = read_manifest(self.model_dir / self.names[1])
        accuracy = manifest.get("holdout_accuracy")
        record = HeldVersion(
            seq=seq,
            federation=str(manifest.get("federation", "")),
            version=manifest_version(manifest),
            round=served_round(manifest),
            rounds=whole(manifest.get("rounds")),
            decision=ADOPTED,
            at=now,
            reason="found in place (written by an agent before versions, or by feast-agent fetch-model)",
            holdout_accuracy=accuracy
            if isinstance(accuracy, (int, float)) and not isinstance(accuracy, bool)
            else None,
            holdout_examples=whole(manifest.get("holdout_samples")) or 0,
            files=dict(files),
        )
        self._commit(held, record, install=True)
        return record

    def _sweep(self, held: Held) -> list[str]:
        keep = {f"{v.seq:04d}" for v in held.versions if v.files}
        gone = []
        if self.root.is_dir():
            for path in sorted(self.root.iterdir()):
                if path.is_dir() and path.name.isdigit() and path.name not in keep:
                    shutil.rmtree(path, ignore_errors=True)
                    gone.append(path.name)
        for folder in (self.model_dir, self.root):
            for name in (*self.names, STATE):
                for stale in folder.glob(f".{name}.*.tmp"):
                    stale.unlink(missing_ok=True)
        if not gone:
            return []
        said = f"{self.device}: removed the unfinished version folder(s) {', '.join(gone)} of {self.root}"
        log.info("%s", said)
        return [said]

    # ------------------------------------------------------------------ changes (under the lock)
    def _next_seq(self, held: Held) -> int:
        on_disk = (
            [int(p.name) for p in self.root.iterdir() if p.is_dir() and p.name.isdigit()] if self.root.is_dir() else []
        )
        return 1 + max([0, *on_disk, *(v.seq for v in held.versions)])

    def begin(self) -> Path:
        """A new, empty folder for a candidate to be prepared in (before any decision)."""
        with self.locked():
            folder = self.folder(self._next_seq(self.read()))
            folder.mkdir(parents=True)
        return folder

    def discard(self, folder: Path) -> None:
        """Remove a candidate's folder that never became a version (it could not be prepared); a recorded one stays."""
        if self.read().record(int(folder.name)) is None:
            shutil.rmtree(folder, ignore_errors=True)

    def in_place(self) -> HeldVersion | None:
        """The current version, if the files in place are its own (None: none, or none complete)."""
        running = self.read().running
        return running if running is not None and self._here() == running.files else None

    def commit(self, folder: Path, record: HeldVersion, *, install: bool) -> HeldVersion:
        """Record the candidate prepared in ``folder``: installed (made current, its files put in place) or refused (its
        files deleted, its record kept). The caller holds the lock and has just recovered."""
        seq = int(folder.name)
        files = {n: sha256_of(folder / n) for n in self.names if (folder / n).is_file()} if install else {}
        if install and self.names[0] not in files:
            raise StoreError(f"{folder} holds no {self.names[0]}; nothing to install")
        record = replace(record, seq=seq, files=files)
        self._commit(self.read(), record, install=install)
        if not install:
            shutil.rmtree(folder, ignore_errors=True)
        return record

    def _commit(self, held: Held, record: HeldVersion, *, install: bool) -> None:
        versions = (*held.versions, record)
        after = replace(held, versions=versions, current=record.seq if install else held.current)
        self._write_and_place(after)

    def rollback(self, now: float | None = None) -> tuple[HeldVersion, HeldVersion]:
        """Make the previous installed version current again; (the version left, the one now current). The caller
        holds the lock and has just recovered."""
        held = self.read()
        left, back = held.running, held.previous
        if left is None:
            raise StoreError(f"device {self.device} runs no version in {self.model_dir}; there is nothing to roll back")
        if back is None or not self._intact(back):
            why = "no earlier installed version" if back is None else f"the files of {describe(back)} are gone"
            raise StoreError(
                f"nothing to roll back to: {self.device} runs {describe(left)} and {why} is kept in "
                f"{self.root}; a rollback goes back one installed version (the server's next version replaces this one)"
            )
        at = time.time() if now is None else now
        versions = tuple(replace(v, rolled_back=at) if v.seq == left.seq else v for v in held.versions)
        same = not left.federation or not back.federation or left.federation == back.federation
        note = Rollback(left.seq, left.version, back.version if same else None, left.federation or back.federation, at)
        self._write_and_place(replace(held, versions=versions, current=back.seq, rollback=note))
        return left, back

    def mark_told(self) -> None:
        """The server heard of the last rollback."""
        with self.locked():
            held = self.read()
            if held.rollback is not None:
                self._write(replace(held, rollback=replace(held.rollback, told=True)))

    def _write_and_place(self, held: Held) -> None:
        """Write ``held`` (the commit point), put its current version's files in place, then delete the folders no
        longer kept (the current and previous installed versions' stay; the last KEEP_RECORDS records)."""
        keep = {held.current, held.previous.seq if held.previous is not None else None}
        dropped = [v for v in held.versions if v.files and v.seq not in keep]
        versions = tuple(v if v.seq in keep or not v.files else replace(v, files={}) for v in held.versions)
        if len(versions) > KEEP_RECORDS:  # the oldest records go, never the current or previous version's
            rest = [v.seq for v in versions if v.seq not in keep]
            old = set(rest[: len(versions) - KEEP_RECORDS])
            versions = tuple(v for v in versions if v.seq not in old)
        held = replace(held, versions=versions)
        self._write(held)
        if held.running is not None:
            self._place(held.running)
        for v in dropped:
            shutil.rmtree(self.folder(v.seq), ignore_errors=True)

    def _write(self, held: Held) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.root / STATE, held.to_json())
