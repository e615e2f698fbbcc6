"""A pushed model as a version the device may refuse (method §10.2): prepared in a folder of its own, compared with the
model the device runs on its own held-out split, installed only if not worse.

    prepare      as before (``model_files.prepare_pushed_model``: kept as sent, or calibrated, exported and
                 personalized here), but in the candidate's folder (``version_store``): nothing in place changes yet
    compare      the candidate's served ONNX file and the current one in onnxruntime on the same held-out examples
                 (``feast_edge.evaluate.predict``: each file's own task turns the pixels into its input); per example,
                 right or wrong -> ``feast_edge.versions.gate.judge(new, old)``
    decide       installed (its files copied over the current ones), refused (the current model stays; one line with
                 the figures), first (the device runs no model it can compare with), or installed without a
                 comparison (no held-out split)
    test split   each candidate's accuracy on the ``--test-split`` examples, measured after the decision and never
                 used by it
    tell         a ``version_report`` with the figures, then the metrics of what the device runs (the agent sends both)

A manifest without ``model_version`` (a server before versions) is installed as before: no comparison, no report.
A manifest whose ``version_report`` is ``"decision"`` (a server under differential privacy: held-out counts would
leave the device unnoised) gets the decision alone: the report's counts are 0 and its reason names no figure, and the
metrics add no accuracy the preparation did not already report. The device decides on its figures all the same.
The int8 file and a server-exported ONNX file pass the same gate: both are ONNX files by then.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from feast_edge.agent.held_versions import UNVERSIONED, HeldVersion, describe, manifest_version, served_round
from feast_edge.agent.local_data import LocalClient
from feast_edge.agent.model_files import prepare_pushed_model
from feast_edge.agent.version_store import VersionStore
from feast_edge.errors import FeastError
from feast_edge.evaluate.onnx_export import OnnxModelError
from feast_edge.evaluate.predict import load_model, predicted_classes
from feast_edge.personalize.select import Choice
from feast_edge.protocol import ModelReady, VersionReport
from feast_edge.protocol.limits import MAX_REASON
from feast_edge.space.preset import Preset
from feast_edge.versions.gate import FIRST, INSTALLED, REFUSED, Verdict, judge

log = logging.getLogger(__name__)

COUNTS = ("examples", "new_correct", "old_correct", "new_only", "old_only")  # the paired figures a report carries
NO_VERSION = (
    "the server's manifest carries no model_version (a server before versions): installed as before, not compared"
)
DECISION_ONLY = "decision"  # manifest version_report: the server asks for the decision without its figures (DP)
WITHHELD = {
    INSTALLED: "installed: not worse than the running model on its held-out split",
    REFUSED: "refused: worse than the running model on its held-out split",
}


@dataclass(frozen=True)
class Outcome:
    """What became of one pushed model: its record, the gate's verdict (None: no version to judge), the server version
    the device runs after it (0: none of this federation), the metrics to send, and the served file in place."""

    record: HeldVersion
    verdict: Verdict | None
    running: int
    metrics: dict[str, Any]
    served: Path | None
    figures: bool = True  # whether the paired counts go to the server (False: the decision alone, under DP)

    def report(self, federation: str, round: int, device: str) -> VersionReport | None:
        """The ``version_report`` the server reads (None for a model without a version)."""
        if self.verdict is None or self.record.version is None:
            return None
        return VersionReport(
            federation=federation,
            round=round,
            device=device,
            version=self.record.version,
            decision=self.verdict.decision,
            running=self.running,
            reason=told_reason(self.record.reason, self.verdict, self.figures)[:MAX_REASON],
            **{k: int(getattr(self.verdict, k)) if self.figures else 0 for k in COUNTS},
        )


def told_reason(reason: str, verdict: Verdict | None, figures: bool) -> str:
    """What the server is told of a decision's reason: what the figures it receives do not say already ('' when they
    say it all: it words them itself), and never a figure under ``figures=False``."""
    if verdict is None or not verdict.examples:  # nothing compared: the reason holds no figure
        return reason
    if figures:
        return "" if reason == verdict.words() else reason
    return f"{WITHHELD[verdict.decision]} (figures withheld: the server asks for the decision alone)"


def correctness(
    path: str | os.PathLike[str], images: torch.Tensor, labels: torch.Tensor, threads: int | None = None
) -> np.ndarray:
    """Per example, whether the ONNX file at ``path`` classifies it right (bool vector, the examples' order)."""
    model = load_model(path, threads=threads)
    if tuple(images.shape[1:]) != tuple(model.task.shape):
        raise OnnxModelError(
            f"model {path} takes {model.task.describe()}, the device's examples are {tuple(images.shape[1:])}"
        )
    return (predicted_classes(model, images) == labels).numpy()


def running_version(record: HeldVersion | None, federation: str) -> int:
    """The server version ``record`` is, as ``federation``'s server knows it (0: none, or another federation's)."""
    if record is None or record.version is None or (record.federation and record.federation != federation):
        return 0
    return record.version


def receive_version(
    blob: bytes,
    message: ModelReady,
    model_dir: str | os.PathLike[str],
    *,
    data: LocalClient,
    preset: Preset,
    federation: str,
    personalize: Choice | None = None,
    torch_device: str = "cpu",
    threads: int = 0,
) -> Outcome | None:
    """Prepare the pushed model in a version folder, judge it against the current one, install or refuse it (see the
    module docstring); None (logged) if it could not be prepared."""
    store = VersionStore(model_dir, message.device)
    folder = store.begin()
    try:
        kept = prepare_pushed_model(
            blob,
            message,
            folder,
            data=data,
            preset=preset,
            personalize=personalize,
            torch_device=torch_device,
            threads=threads,
        )
        if kept is None:
            store.discard(folder)
            return None
        candidate, metrics = kept
        with store.locked():
            store.recover()  # a rollback, or a power loss, since the last version: compare with what runs now
            return _decide(store, folder, candidate, metrics, message, data, federation, threads or None)
    except BaseException:
        store.discard(folder)  # never a version: its folder goes (a recorded one stays)
        raise


def _decide(
    store: VersionStore,
    folder: Path,
    candidate: Path,
    metrics: dict[str, Any],
    message: ModelReady,
    data: LocalClient,
    federation: str,
    threads: int | None,
) -> Outcome:
    manifest, device = message.manifest, message.device
    version = manifest_version(manifest)
    current = store.in_place()
    new, unusable = _measured(candidate, data.holdout_images, data.holdout_labels, threads)
    verdict, reason = _verdict(version, current, store.served, new, unusable, data, threads)
    tested, _ = _measured(candidate, data.test_images, data.test_labels, threads)  # after the decision, apart
    install = verdict is None or verdict.install
    figures = manifest.get("version_report") != DECISION_ONLY
    record = store.commit(
        folder,
        HeldVersion(
            seq=0,
            federation=str(manifest.get("federation") or federation),
            version=version,
            round=served_round(manifest),
            rounds=manifest.get("rounds") if isinstance(manifest.get("rounds"), int) else None,
            decision=UNVERSIONED if verdict is None else verdict.decision,
            at=time.time(),
            figures={} if verdict is None else verdict.figures(),
            reason=reason,
            holdout_accuracy=None if new is None else float(new.mean()),
            holdout_examples=0 if new is None else int(new.size),
            test_accuracy=None if tested is None else float(tested.mean()),
            test_examples=0 if tested is None else int(tested.size),
        ),
        install=install,
    )
    now = store.in_place()
    running = running_version(now, federation)
    test_words = (
        ""
        if tested is None
        else f"; test split {100 * tested.mean():.1f}% on {tested.size} examples (measured, not used to decide)"
    )
    if install:
        log.info("%s installed %s: %s%s", device, describe(record), reason, test_words)
        values = _installed_metrics(metrics, record, manifest, figures)
    else:
        keeps = describe(now) if now is not None else "the model it runs"
        log.info("%s refused %s: %s; it keeps %s%s", device, describe(record), reason, keeps, test_words)
        values = {
            "model_kept": False,  # the server's wait for this device's model report ends: it keeps the one it runs
            "model_round": manifest.get("rounds", 0),
            "model_version": version,
            "model_decision": record.decision,
            "model_refused": (reason if figures else told_reason(reason, verdict, figures))[:300],
            "model_running_version": running,
        }
    return Outcome(record, verdict, running, values, store.served if now is not None else None, figures)


def _measured(
    path: Path, images: torch.Tensor, labels: torch.Tensor, threads: int | None
) -> tuple[np.ndarray | None, str]:
    """The candidate's per-example correctness on ``images`` (None: no examples), or why it cannot run on them."""
    if not len(labels):
        return None, ""
    try:
        return correctness(path, images, labels, threads), ""
    except FeastError as exc:
        return None, str(exc)


def _verdict(
    version: int | None,
    current: HeldVersion | None,
    served: Path,
    new: np.ndarray | None,
    unusable: str,
    data: LocalClient,
    threads: int | None,
) -> tuple[Verdict | None, str]:
    """The gate's verdict on the candidate (None: a model without a version, installed as before) and its reason."""
    if version is None:
        return None, NO_VERSION
    if unusable:  # a model that cannot classify this device's examples is no version it can run
        return Verdict(False, REFUSED), f"refused: it cannot run on this device's held-out examples ({unusable})"
    if current is None:  # nothing to compare with: its held-out accuracy alone (what the device runs from now)
        right = 0 if new is None else int(new.sum())
        verdict = Verdict(True, FIRST, 0 if new is None else int(new.size), right, 0, right, 0)
        return verdict, verdict.words()
    if new is None:
        return Verdict(True, INSTALLED), "installed: not compared, this device has no held-out split (--holdout)"
    try:
        old = correctness(served, data.holdout_images, data.holdout_labels, threads)
    except FeastError as exc:
        return Verdict(True, FIRST), f"installed: the model it ran cannot be compared with it ({exc})"
    verdict = judge(new, old)
    return verdict, verdict.words()


def _installed_metrics(
    metrics: dict[str, Any], record: HeldVersion, manifest: dict[str, Any], figures: bool
) -> dict[str, Any]:
    """What the server learns of an installed version: the prepared model's metrics as before, with its version and
    decision, and (unless the server asks for the decision alone) its held-out accuracy where the preparation measured
    none (a server-exported file) and its test accuracy."""
    values = dict(metrics)
    values.setdefault("model_round", manifest.get("rounds", 0))
    values["model_decision"] = record.decision
    if record.version is not None:
        values["model_version"] = record.version
    if not figures:
        return values
    if "holdout_accuracy" not in values and record.holdout_accuracy is not None:
        values.update(holdout_accuracy=record.holdout_accuracy, holdout_samples=record.holdout_examples)
    if record.test_accuracy is not None:
        values.update(test_accuracy=record.test_accuracy, test_samples=record.test_examples)
    return values
