"""What a run directory says for people: where validation and BN calibration ran, its exported models, the devices' personal models.

The dashboard (``feast-edge dashboard RUN_DIR``), the report (``feast-edge report RUN_DIR``) and ``feast-server
status`` read a run directory here and describe it in the same words:

* validation ran on the server's ``--data`` (the paper's protocol), or was *federated*: the cohort tested the probe
  variants on its held-out splits (``RoundRecord.validation`` says on which devices and how many examples);
* a device's model was BN-calibrated on the server's data (its manifest has a ``validation_accuracy``), or on the device
  itself (``"calibration": "device"``): then the accuracy is the one the device reported on its own held-out split
  (the registry's ``metrics`` of that device, for the exported round);
* beside it, the device's own held-out accuracy of its *personal* model (``feast_edge.personalize``) and how it was
  made, and over the devices (:func:`fleet_accuracy`) the mean served -> personal and the worst of each, with its device.

What a device reported came over the network: every value is checked here (an accuracy in [0, 1], a method this
toolkit knows, text cut and made printable) so that no reader has to trust it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from feast_edge.evaluate.served_round import weights_words
from feast_edge.personalize.fleet import FleetAccuracy, fleet_accuracy_of
from feast_edge.personalize.select import MAX_STRENGTH, METHODS, STRENGTH_NAME
from feast_edge.personalize.tuned import Tuned, TunedError
from feast_edge.report.run_files import DEVICE, DEVICES, FEDERATED, FEDERATION, SERVER
from feast_edge.util.text import printable


# ------------------------------------------------------------------ validation
def validated_on(val_accuracy: float | None, validation: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Where one round was validated: ``{"source": "devices", "devices": n, "samples": m}`` (federated) or
    ``{"source": "server"}``; None for a round not validated."""
    if val_accuracy is None:
        return None
    validation = validation or {}
    if validation.get("source") == DEVICES:
        devices = validation.get("devices")
        samples = validation.get("samples")
        return {
            "source": DEVICES,
            "devices": len(devices) if isinstance(devices, (list, tuple)) else 0,
            "samples": samples if isinstance(samples, int) else 0,
        }
    return {"source": SERVER}


def run_validated_on(fields: Mapping[str, Any]) -> dict[str, Any] | None:
    """Where a feast-server run (its checkpoint's fields) validates: as in its last validated round, else by its
    ``data`` (None: federated); None for another kind of run (a simulation validates on its own split)."""
    if fields.get("kind", FEDERATION) != FEDERATION:
        return None
    for record in reversed(list(fields.get("history") or ())):
        where = validated_on(record.get("val_accuracy"), record.get("validation"))
        if where is not None:
            return where
    if "data" not in fields:  # checkpoints from before a server could run without data
        return None
    return {"source": DEVICES if fields["data"] is None else SERVER}


def _devices(n: int) -> str:
    return "1 device's" if n == 1 else f"{n} devices'"


def validation_words(where: Mapping[str, Any] | None) -> str | None:
    """``validation: on the server's data`` or ``validation: federated, on 3 devices' held-out data (60 examples)``."""
    if where is None:
        return None
    if where.get("source") != DEVICES:
        return "validation: on the server's data"
    if "devices" not in where:
        return "validation: federated, on the devices' held-out data"
    return f"validation: federated, on {_devices(where['devices'])} held-out data ({where.get('samples', 0)} examples)"


# ------------------------------------------------------------------ BN calibration of the exported models
def device_calibrated(manifest: Mapping[str, Any]) -> bool:
    """Whether ``manifest``'s model is exported as ONNX on its device (its BN calibrated there, or federated) rather
    than calibrated and exported on the server."""
    return manifest.get("calibration") in (DEVICE, FEDERATED)


def served_precision(manifest: Mapping[str, Any], metrics: Mapping[str, Any] | None) -> str:
    """The precision of the file a device is served: the manifest's (exported on the server) or the one the device
    reported it kept (exported on the device); ``"fp32 (int8 refused)"`` when int8 was asked and refused, ``"int8
    asked"`` while the device has not reported this export."""
    asked = str(manifest.get("precision", "fp32"))
    if device_calibrated(manifest):
        metrics = metrics or {}
        if "model_precision" not in metrics or metrics.get("model_round") != manifest.get("rounds"):
            return f"{asked} asked"
        kept, refused = str(metrics["model_precision"]), metrics.get("int8_refused")
    else:
        kept, refused = asked, manifest.get("int8_refused")
    return f"{kept} (int8 refused)" if refused else kept


def _reported_fraction(value: Any) -> float | None:
    """``value`` if it is a number in [0, 1] (an accuracy a device reported), else None: a device may send anything."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value) if 0 <= value <= 1 else None


def _reported_count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def model_accuracy(manifest: Mapping[str, Any], metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """How one exported model is calibrated and how accurate it is: ``calibration`` (server/device), ``accuracy``,
    ``accuracy_note`` (in words), for a device-calibrated model what the device reported for the exported round, and
    its personal model (:func:`personal_model`; the ``personal_*`` keys)."""
    metrics = metrics or {}
    # metrics of an earlier export are not this model's
    current = metrics.get("model_round", manifest.get("rounds")) == manifest.get("rounds")
    if not device_calibrated(manifest):
        # Its accuracy is the server's validation, not the device's own: no own accuracy to set a personal one beside.
        return {
            "calibration": SERVER,
            "accuracy": manifest.get("validation_accuracy"),
            "accuracy_note": "validation, on the server's data",
            **personal_model(metrics if current else {}),
            "personal_accuracy": None,
        }
    where = manifest["calibration"]
    calibrated = "calibrated on the device" if where == DEVICE else "federated BN statistics"
    if "holdout_accuracy" not in metrics or not current:
        return {
            "calibration": where,
            "accuracy": None,
            "accuracy_note": f"{calibrated}; no report from it yet",
            **personal_model({}),
        }
    samples = _reported_count(metrics.get("holdout_samples"))
    accuracy = _reported_fraction(metrics.get("holdout_accuracy"))
    note = f"{calibrated}; held-out accuracy on its own data" + (
        f" ({samples} examples)" if samples is not None else ""
    )
    if accuracy is None and metrics.get("holdout_accuracy") is not None:
        note = f"{calibrated}; it reported an invalid held-out accuracy"
    return {
        "calibration": where,
        "accuracy": accuracy,
        "accuracy_note": note,
        "holdout_accuracy": accuracy,
        "holdout_samples": samples,
        "calibrated_on": metrics.get("calibrated_on"),
        "model_sha256": metrics.get("model_sha256"),
        **personal_model(metrics),
    }


# ------------------------------------------------------------------ class coverage and the serving rule
COVERAGE_PARTS = ("trained", "validated", "calibrated")


def coverage_words(manifest: Mapping[str, Any], part: str = "trained") -> str:
    """A served variant's class coverage (``trained``, ``validated`` or ``calibrated``) as its manifest records it:
    ``all 10``, ``7 of 10 (missing two, three, four)``, or ``-`` when the manifest does not say."""
    coverage = manifest.get("coverage")
    covered = coverage.get(part) if isinstance(coverage, Mapping) else None
    if not isinstance(covered, Mapping):
        return "-"
    have, missing = covered.get("classes"), covered.get("missing")
    if not isinstance(have, list) or not isinstance(missing, list):
        return "-"
    if not missing:
        return f"all {len(have)}"
    shown = ", ".join(str(m)[:40] for m in missing[:4]) + (f" +{len(missing) - 4}" if len(missing) > 4 else "")
    return f"{len(have)} of {len(have) + len(missing)} (missing {shown})"


def chosen_by(manifest: Mapping[str, Any]) -> str:
    """Which serving rule chose a device's variant: ``largest affordable``, or ``smaller: better on validation: …``."""
    rule = manifest.get("serving_rule")
    if not isinstance(rule, str) or not rule:
        return "-"
    rule = rule[:120]
    return "smaller: " + rule if rule.startswith("better") else rule


def served_words(manifests: Iterable[Mapping[str, Any]]) -> str:
    """``weights of round 8 of 20: <the serving rule's reason>`` from the manifests' ``served_round`` (``''`` where no
    manifest says, as in runs from before it)."""
    served = next((m["served_round"] for m in manifests if isinstance(m.get("served_round"), Mapping)), None)
    if not served or "of" not in served:
        return ""
    return f"{weights_words(served)}: {served.get('reason', '')}"


def served_so_far(validation: Mapping[str, Any]) -> str:
    """During a run validated by its devices: ``weights of round 8 so far: <the serving rule's reason>`` from a round
    record's validation (``''`` where the rule did not run)."""
    served = validation.get("served_round")
    if not isinstance(served, int) or isinstance(served, bool):
        return ""
    span = validation.get("served_average_of")
    if isinstance(span, list) and len(span) == 2 and all(isinstance(r, int) for r in span):
        return f"the mean of the weights of rounds {span[0]}-{span[1]} so far: {validation.get('served_reason') or ''}"
    return f"weights of round {served} so far: {validation.get('served_reason') or ''}"


def served_variants(manifests: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per served variant (by MACs): the devices it serves, the rules that chose it, its class coverage."""
    rows: dict[int, dict[str, Any]] = {}
    for m in manifests:
        macs = m.get("macs")
        if not isinstance(macs, int) or isinstance(macs, bool):
            continue
        row = rows.setdefault(
            macs, {"macs": macs, "devices": [], "chosen_by": [], **{p: coverage_words(m, p) for p in COVERAGE_PARTS}}
        )
        row["devices"].append(str(m.get("device")))
        if chosen_by(m) not in row["chosen_by"]:
            row["chosen_by"].append(chosen_by(m))
    return [rows[k] for k in sorted(rows)]


# ------------------------------------------------------------------ the devices' personal models
KEPT = "served model kept"  # a device without a personal model: it uses the served one
NOTE_REASON = 40  # characters of a device's reason a table cell shows (the whole, cut at 300, is ``personal_reason``)
_SYMBOLS = {"tau": "τ", "mu": "μ"}


def _strength_lies(method: str, value: Any) -> bool:
    """Whether a reported strength of ``method`` is neither None nor a number in [0, the method's maximum]."""
    if value is None:
        return False
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return True
    return not 0 <= value <= MAX_STRENGTH[method]


def _strength_words(method: str, strength: float) -> str:
    """``τ=1``, ``μ=0.1``, ``3 epochs``."""
    name = STRENGTH_NAME[method]
    if name == "epochs":
        return f"{strength:g} epoch" + ("" if strength == 1 else "s")
    return f"{_SYMBOLS.get(name, name)}={strength:g}"


def personal_model(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A device's report of its personal model, checked: ``personal_accuracy`` (its own held-out accuracy, in [0, 1],
    or None), ``personal_method`` (a known method, ``""`` when it kept the served model, None when it reported nothing
    usable), ``personal_strength``, ``personal_reason`` (printable, cut), ``personal_note`` (a few words for a table:
    ``prior τ=1``, ``served model kept: …``, ``no report``, ``invalid report (FIELD)``), the classes the personal model
    was tuned to (``personal_classes``, ``personal_task_classes``; None in a report from before them) and
    ``personal_tuned``, their words where those are fewer than all the task's (``tuned to 6 of 10 classes: …; serve the
    global model for the others``; "" otherwise).

    One value out of bounds voids the whole report: a device that lies about its method is not believed about its
    accuracy either."""
    nothing = {
        "personal_accuracy": None,
        "personal_method": None,
        "personal_strength": None,
        "personal_reason": None,
        "personal_classes": None,
        "personal_task_classes": None,
        "personal_tuned": "",
    }
    if "personal_method" not in metrics and "personal_accuracy" not in metrics:
        return {**nothing, "personal_note": "no report"}
    method, raw, strength = (metrics.get(f"personal_{k}") for k in ("method", "accuracy", "strength"))
    accuracy = _reported_fraction(raw)
    if not isinstance(method, str) or method not in ("", *METHODS):
        return {**nothing, "personal_note": "invalid report (personal_method)"}
    if accuracy is None and raw is not None:
        return {**nothing, "personal_note": "invalid report (personal_accuracy)"}
    if method and _strength_lies(method, strength):
        return {**nothing, "personal_note": "invalid report (personal_strength)"}
    try:
        tuned = Tuned.read(metrics) if method else None  # a device that kept the served model tuned nothing
    except TunedError:
        return {**nothing, "personal_note": "invalid report (personal_classes)"}
    strength = float(strength) if method and strength is not None else None
    reason = metrics.get("personal_reason")
    reason = printable(reason) if isinstance(reason, str) else None
    if method:
        words = method if strength is None else f"{method} {_strength_words(method, strength)}"
    else:
        words = KEPT + (f": {printable(reason, NOTE_REASON)}" if reason else "")
    return {
        "personal_accuracy": accuracy,
        "personal_method": method,
        "personal_strength": strength,
        "personal_reason": reason,
        "personal_note": words,
        "personal_classes": None if tuned is None else list(tuned.classes),
        "personal_task_classes": None if tuned is None else tuned.of,
        "personal_tuned": "" if tuned is None else tuned.words(),
    }


def fleet_accuracy(models: Iterable[tuple[str, Mapping[str, Any]]]) -> FleetAccuracy:
    """Summarize ``(device, model_accuracy(...))`` pairs (feast_edge.personalize.fleet.fleet_accuracy_of): a device
    without both own accuracies, or whose report was invalid, is left out of the means."""
    models = list(models)
    return fleet_accuracy_of(
        (str(device), _reported_fraction(model.get("accuracy")), _reported_fraction(model.get("personal_accuracy")))
        for device, model in models
    )
