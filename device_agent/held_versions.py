"""What a device records of the model versions it received (``state.json`` of ``version_store``): value types that
convert themselves to and from JSON, and what a served model's manifest says of its version.

    HeldVersion   one version: the server's version number, federation and round, the decision and its figures, when,
                  its held-out and test accuracy, the SHA-256 of the files its folder holds
    Held          one device's state: its versions, which is current, the last rollback
    Rollback      the last rollback: the version left, the one run since, whether the server was told
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from feast_edge.errors import FeastError
from feast_edge.versions.gate import FIRST, INSTALLED, UNGATED

FORMAT = "feast-edge/device-versions"
# Local decisions besides the gate's: a model found in place (installed by an agent before versions, or by
# fetch-model) and one from a server whose manifest carries no version (installed as before, not compared).
ADOPTED, UNVERSIONED = "adopted", "unversioned"
INSTALLS = (INSTALLED, FIRST, UNGATED, ADOPTED, UNVERSIONED)  # decisions after which a version ran


class StoreError(FeastError):
    """A device's versions cannot be read or changed as asked."""


def file_names(device: str) -> tuple[str, str, str, str]:
    """The current model's files: served ONNX, its manifest, the personal ONNX, its manifest (personal_model.py)."""
    return f"{device}.onnx", f"{device}.json", f"{device}.personal.onnx", f"{device}.personal.json"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class HeldVersion:
    """One version the device received: where it came from, what the device decided and measured, its files."""

    seq: int  # this device's number for it (its folder's name)
    federation: str
    version: int | None  # the server's version number (None: its manifest carried none)
    round: int | None  # the round it was served from (manifest served_round.round, else its rounds)
    rounds: int | None  # the rounds the federation had run when it was exported (manifest rounds)
    decision: str  # the gate's (installed, refused, first) or ADOPTED / UNVERSIONED
    at: float  # when it was decided (Unix s)
    figures: dict[str, Any] = field(default_factory=dict)  # the gate's paired counts (Verdict.figures)
    reason: str = ""
    holdout_accuracy: float | None = None  # on the device's held-out split, in onnxruntime (None: not measured)
    holdout_examples: int = 0
    test_accuracy: float | None = None  # on its test split (--test-split; None: none), never used to decide
    test_examples: int = 0
    files: dict[str, str] = field(default_factory=dict)  # file name -> SHA-256, of the files its folder holds
    rolled_back: float | None = None  # when the device went back from it (None: never)

    @property
    def installed(self) -> bool:
        """Whether the device ran it (installed, whatever came after)."""
        return self.decision in INSTALLS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HeldVersion:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class Rollback:
    """The last rollback: the version it left, the one the device runs since, and whether the server heard of it."""

    left: int  # seq
    version: int | None  # the server version it left
    running: int | None  # the server version it runs now
    federation: str
    at: float
    told: bool = False


@dataclass(frozen=True)
class Held:
    """What state.json holds for one device."""

    device: str
    current: int | None = None  # seq of the version whose files are in place (None: none yet)
    versions: tuple[HeldVersion, ...] = ()
    rollback: Rollback | None = None

    def record(self, seq: int | None) -> HeldVersion | None:
        return next((v for v in self.versions if v.seq == seq), None)

    @property
    def running(self) -> HeldVersion | None:
        return self.record(self.current)

    @property
    def previous(self) -> HeldVersion | None:
        """The version a rollback goes back to: the newest installed one before the current, not rolled back from."""
        now = self.running
        if now is None:
            return None
        earlier = [v for v in self.versions if v.seq < now.seq and v.installed and v.rolled_back is None]
        return max(earlier, key=lambda v: v.seq, default=None)

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT,
            "device": self.device,
            "current": self.current,
            "versions": [v.to_dict() for v in self.versions],
            "rollback": None if self.rollback is None else asdict(self.rollback),
        }
        return (json.dumps(body, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, text: str, where: Path) -> Held:
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r} is not {FORMAT!r}")
            back = data.get("rollback")
            return cls(
                device=str(data["device"]),
                current=data.get("current"),
                versions=tuple(HeldVersion.from_dict(v) for v in data.get("versions", [])),
                rollback=None if back is None else Rollback(**back),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StoreError(
                f"{where} cannot be read ({exc}); move it away to start the device's versions afresh (its current "
                "model stays where it is and is adopted as a version)"
            ) from None


# ---------------------------------------------------------------------- what manifests say
def read_manifest(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` ({} where there is none, or it cannot be read)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def whole(value: Any) -> int | None:
    """``value`` if it is an integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


VERSION_KEY = "model_version"  # the manifest's ``version`` is its format's (1), not the served version's


def manifest_version(manifest: Mapping[str, Any]) -> int | None:
    """The server's version number a manifest carries (``model_version``, an integer of 1 or more), else None."""
    value = whole(manifest.get(VERSION_KEY))
    return value if value is not None and value >= 1 else None


def served_round(manifest: Mapping[str, Any]) -> int | None:
    """The round a served model's weights come from: ``served_round.round``, else ``rounds``."""
    served = manifest.get("served_round")
    if isinstance(served, dict) and whole(served.get("round")) is not None:
        return served["round"]
    return whole(manifest.get("rounds"))


def describe(record: HeldVersion) -> str:
    """``version 4 (round 12, seq 0005)`` / ``seq 0001 (no server version)``."""
    where = f"seq {record.seq:04d}" if record.round is None else f"round {record.round}, seq {record.seq:04d}"
    return f"version {record.version} ({where})" if record.version is not None else f"{where} (no server version)"
