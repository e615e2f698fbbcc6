"""What the dashboard shows, held in one place: the run, the fleet, the round in flight, what was learned, the models.

Writers (the server's or the simulation's thread) call the setters; readers
(the web thread) take :meth:`DashboardState.snapshot`, a JSON-ready deep copy,
or block in :meth:`DashboardState.wait` until the next change. One condition
variable guards everything; every change bumps :attr:`DashboardState.version`.

Device names, reasons and labels may come from the network, so everything
stored is bounded (strings, devices, history, round members) and made
JSON-safe (no NaN, no foreign types), and keys that name a secret are dropped:
the page never shows a password, token or key.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from feast_edge.errors import ArchError
from feast_edge.report.model_words import (
    chosen_by,
    coverage_words,
    device_calibrated,
    fleet_accuracy,
    model_accuracy,
    served_precision,
    served_words,
)
from feast_edge.space.arch import Arch
from feast_edge.util.text import shortened

KINDS = ("federation", "simulation", "runs")
# What the page knows how to show. Other values are shown as given, never refused: the dashboard watches a run
# and must not stop it over a word.
RUN_STATUSES = ("waiting", "running", "exporting", "finished", "failed", "stopped")
MEMBER_STATES = (
    "routed",
    "downloading",
    "training",
    "masking",
    "uploading",
    "aggregated",
    "late",
    "rejected",
    "declined",
    "incomplete",
    "dropped",
)
MAX_STRING = 200
MAX_TEXT = 4000  # a sentence the page shows whole (the served round's reason names devices and their accuracies)
MAX_DEVICES = 10_000
MAX_HISTORY = 100_000
MAX_MEMBERS = 10_000
MAX_ITEMS = 10_000  # any other list or mapping taken from a caller
MAX_DEPTH = 8
_SECRET = re.compile(r"pass(word|wd)?|token|key|secret|credential", re.IGNORECASE)


def is_secret(name: str) -> bool:
    """A field name that may hold a secret (password, token, key, secret, credential); its value is never stored."""
    return bool(_SECRET.search(name))


def clean(value: Any, depth: int = 0) -> Any:
    """``value`` as bounded, JSON-ready data: strings capped, NaN/∞ as None, secret-named keys dropped, other types as text."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value[:MAX_STRING]
    if isinstance(value, Path):
        return str(value)[:MAX_STRING]
    if depth >= MAX_DEPTH:
        return None
    if isinstance(value, dict):
        items = ((str(k)[:MAX_STRING], v) for k, v in list(value.items())[:MAX_ITEMS])
        return {k: clean(v, depth + 1) for k, v in items if not is_secret(k)}
    if isinstance(value, (list, tuple, deque)):
        return [clean(v, depth + 1) for v in list(value)[:MAX_ITEMS]]
    if hasattr(value, "item"):  # numpy and torch scalars
        try:
            return clean(value.item(), depth)
        except (TypeError, ValueError):
            pass
    return str(value)[:MAX_STRING]


def _copy(value: Any) -> Any:
    """A deep copy of cleaned data (dicts, lists and immutable scalars only), faster than ``copy.deepcopy``."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _count(value: int | None) -> int | None:
    return None if value is None else max(0, int(value))


def arch_label(arch: Any) -> str | None:
    """An architecture (its dict form) as its canonical text, ``d=[..] e=[..] w=[..]``; None if it is not one."""
    try:
        return Arch.from_dict(arch).text
    except (ArchError, TypeError, ValueError):
        return None


def model_url(device: str) -> str:
    """The page's relative download link of a device's ONNX model."""
    return f"models/{quote(device, safe='')}.onnx"


class DashboardState:
    """The dashboard's data, shared between the thread that runs the federation and the web server's thread."""

    def __init__(self, kind: str, title: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"dashboard kind {kind!r} is not one of {', '.join(KINDS)}")
        self.kind = kind
        self._changed = threading.Condition()
        self._version = 0
        self._title = clean(str(title))
        self._run: dict[str, Any] = {}
        self._devices: dict[str, dict[str, Any]] = {}
        self._round: dict[str, Any] | None = None
        self._members: dict[str, dict[str, Any]] = {}
        self._history: deque[dict[str, Any]] = deque(maxlen=MAX_HISTORY)
        self._variants: list[dict[str, Any]] = []
        self._population: float | None = None
        self._models: list[dict[str, Any]] = []
        self._own_accuracy: dict[str, Any] | None = None  # over the device-calibrated models: fleet_accuracy
        self._served = (
            ""  # the weights the models were made of: "weights of round 8 of 20: <the serving rule's reason>"
        )
        self._model_paths: dict[str, Path] = {}
        self._runs: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ reading
    @property
    def version(self) -> int:
        """Bumps on every change."""
        with self._changed:
            return self._version

    def snapshot(self) -> dict[str, Any]:
        """Everything the page shows, as a JSON-ready deep copy."""
        with self._changed:
            current = None
            if self._round is not None:
                current = {**_copy(self._round), "members": [_copy(m) for m in self._members.values()]}
            return {
                "version": self._version,
                "kind": self.kind,
                "title": self._title,
                "now": time.time(),
                "run": _copy(self._run),
                "devices": [_copy(self._devices[name]) for name in sorted(self._devices)],
                "round": current,
                "history": [_copy(h) for h in self._history],
                "variants": _copy(self._variants),
                "population_accuracy": self._population,
                "models": _copy(self._models),
                "own_accuracy": _copy(self._own_accuracy),
                "served": self._served,
                "runs": _copy(self._runs),
            }

    def wait(self, version: int, timeout: float) -> int:
        """Block until the version passes ``version`` or ``timeout`` seconds pass; the current version."""
        with self._changed:
            self._changed.wait_for(lambda: self._version > version, timeout)
            return self._version

    def model_path(self, device: str) -> Path | None:
        """Where the exported model of ``device`` lies on this machine (never shown on the page)."""
        with self._changed:
            return self._model_paths.get(device)

    # ------------------------------------------------------------------ writing
    def _bump(self) -> None:
        self._version += 1
        self._changed.notify_all()

    def set_run(self, **fields: Any) -> None:
        """Merge ``fields`` (federation, preset, method, rounds_total, rounds_done, status, started, message, validation,
        server_data: whether the server holds data to test variants on, False where the devices validate) into the run."""
        fields = clean(fields)
        with self._changed:
            self._run.update(fields)
            self._bump()

    def set_device(self, device: str, **fields: Any) -> None:
        """Create or update one device: profile, hardware, budget_macs, precision, variant, envelope, online, last_seen,
        rounds, last_upload."""
        name, fields = clean(str(device)), clean(fields)
        with self._changed:
            entry = self._devices.get(name)
            if entry is None:
                if len(self._devices) >= MAX_DEVICES:
                    return
                entry = self._devices[name] = {"name": name}
            entry.update(fields)
            entry["name"] = name
            self._bump()

    def start_round(self, round: int, members: list[str], deadline: float | None) -> None:
        """A round begins: each cohort member is ``routed``; ``deadline`` in epoch seconds."""
        with self._changed:
            self._round = {"round": int(round), "deadline": clean(deadline), "started": time.time(), "finished": False}
            self._members = {}
            for device in members:
                name = clean(str(device))
                if len(self._members) >= MAX_MEMBERS:
                    break
                self._members[name] = {"device": name, "state": "routed", "done": None, "total": None, "reason": None}
            self._bump()

    def member(
        self, device: str, state: str, done: int | None = None, total: int | None = None, reason: str | None = None
    ) -> None:
        """A cohort member's progress (``done``/``total`` chunks while down- or uploading); a device not in the round is ignored."""
        name = str(device)[:MAX_STRING]
        with self._changed:
            entry = self._members.get(name)
            if entry is None:
                return
            entry.update(state=clean(str(state)), done=_count(done), total=_count(total), reason=clean(reason))
            self._bump()

    def end_round(self, entry: dict[str, Any]) -> None:
        """A round is over: its record joins the history; the round stays shown, finished, until the next starts."""
        record = clean(dict(entry))
        with self._changed:
            self._history.append(record)
            if self._round is not None:
                self._round["finished"] = True
            self._bump()

    def set_variants(self, variants: list[dict[str, Any]]) -> None:
        """The latest evaluation of the cached variants: label, macs, params, val_accuracy, test_accuracy."""
        variants = clean(list(variants))
        with self._changed:
            self._variants = variants
            self._bump()

    def set_population(self, accuracy: float | None) -> None:
        """Population accuracy: the mean accuracy of the variant each client is served."""
        with self._changed:
            self._population = clean(None if accuracy is None else float(accuracy))
            self._bump()

    def set_models(
        self,
        manifests: list[dict[str, Any]],
        model_dir: Path,
        metrics: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """The exported models: one manifest per device; the files stay in ``model_dir`` and the page gets a link.

        A model calibrated on its device (``"calibration": "device"``) shows the held-out accuracy the device reported
        (``metrics``: device -> its registry metrics), served model -> its personal model, and no link: its ONNX file is
        on the device, and the weights the server sent it never reach the page. Over those models, ``own_accuracy``:
        the means and the worst of each column (``feast_edge.report.model_words.fleet_accuracy``). Manifests that name the served round
        set ``served`` (:meth:`set_served`)."""
        models, paths, own = [], {}, []
        for manifest in list(manifests)[:MAX_DEVICES]:
            device = clean(str(manifest.get("device", "")))
            file = str(manifest.get("file", ""))
            if not device or not file or Path(file).name != file or file in (".", ".."):
                continue  # a file name with a folder in it could point outside model_dir
            on_device = device_calibrated(manifest)
            if not on_device:
                paths[device] = Path(model_dir) / file
            accuracy = model_accuracy(manifest, (metrics or {}).get(str(manifest.get("device", ""))))
            if on_device:
                own.append((device, accuracy))
            models.append(
                clean(
                    {
                        "device": device,
                        "variant": manifest.get("label") or manifest.get("variant") or arch_label(manifest.get("arch")),
                        "macs": manifest.get("macs"),
                        "params": manifest.get("params"),
                        "validation_accuracy": manifest.get("validation_accuracy"),
                        "precision": served_precision(manifest, (metrics or {}).get(device)),
                        # Which rule chose the variant, and the classes it was trained and validated on (issue 37).
                        "chosen_by": chosen_by(manifest),
                        "classes_trained": coverage_words(manifest, "trained"),
                        "classes_validated": coverage_words(manifest, "validated"),
                        **accuracy,
                        "sha256": accuracy.get("model_sha256") if on_device else manifest.get("sha256"),
                        "size": None if on_device else manifest.get("size"),
                        "url": None if on_device else model_url(device),
                    }
                )
            )
        summary = clean(fleet_accuracy(own).to_dict()) if own else None
        with self._changed:
            self._models, self._model_paths, self._own_accuracy = models, paths, summary
            self._bump()
        self.set_served(served_words(manifests))

    def set_served(self, words: str) -> None:
        """The round whose weights are served and why the rule chose it: ``weights of round 8 of 20: <reason>``
        (:func:`feast_edge.report.model_words.served_words`), whole up to ``MAX_TEXT`` characters, else cut between
        words; ``''`` keeps what the page shows."""
        if not words:
            return
        with self._changed:
            self._served = shortened(str(words), MAX_TEXT)
            self._bump()

    def add_run(self, run: dict[str, Any]) -> None:
        """A finished run to compare: name, method, seed, history, variants, population_accuracy."""
        history = [clean(h) for h in list(run.get("history") or ())[-MAX_HISTORY:]]
        record = {**clean({k: v for k, v in run.items() if k != "history"}), "history": history}
        with self._changed:
            if len(self._runs) < MAX_ITEMS:
                self._runs.append(record)
            self._bump()
