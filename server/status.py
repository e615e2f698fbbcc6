"""``feast-server status``: where a run stands, read from its run directory (like ``flwr ls``).

Only reads what ``feast-server run`` keeps in ``--out``: the device registry
(``devices.sqlite``: who registered, online or not, last seen, rounds taken
part in, what each reported of its model), the record of the latest checkpoint
(completed rounds, the round history, the best validation accuracy) and the
exported models' index (the models their devices calibrated: their own
held-out accuracy, served model -> personal model, the mean and the worst
device). A running server is not disturbed: the registry is SQLite in WAL
mode, which serves readers beside the writer, and checkpoints are replaced
atomically.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.table import Table

from feast_edge.errors import FeastError
from feast_edge.evaluate.served_round import served_record, weights_words
from feast_edge.privacy.private_rounds import privacy_line, stored_privacy
from feast_edge.report.model_words import (
    FleetAccuracy,
    device_calibrated,
    fleet_accuracy,
    model_accuracy,
    run_validated_on,
    served_variants,
    validation_words,
)
from feast_edge.report.run_files import read_manifests
from feast_edge.run.checkpoint import read_record
from feast_edge.run.collect import STALE
from feast_edge.run.loop import CHECKPOINT, HISTORY_FORMAT
from feast_edge.run.round_record import refusal_kinds
from feast_edge.server.app import REGISTRY
from feast_edge.server.coverage import holders
from feast_edge.server.jobs import read_jobs
from feast_edge.server.output import OWN_CAPTION, add_fleet_rows, personal_cell, served_cell
from feast_edge.server.registry import Device, Registry
from feast_edge.server.secure import read_stage, stage_line
from feast_edge.util.text import duration
from feast_edge.versions.book import FILENAME as VERSIONS
from feast_edge.versions.book import VersionBook
from feast_edge.versions.gate import FIRST, INSTALLED, REFUSED, ROLLED_BACK, UNGATED


class StatusError(FeastError):
    """``--out`` is not the run directory of a feast-server run."""


def read_status(out: str | Path, now: float | None = None) -> dict[str, Any]:
    """The state of the run in ``out`` as one JSON-ready dict: rounds, last and best round, devices."""
    out = Path(out)
    if not out.is_dir():
        raise StatusError(f"run directory {out} does not exist; point --out at the directory of a feast-server run")
    registry_path = out / REGISTRY
    if not registry_path.is_file():
        raise StatusError(
            f"{out} has no device registry ({REGISTRY}); point --out at the directory of a feast-server run (not a simulation's)"
        )
    registry = Registry(registry_path, readonly=True)
    try:
        devices = registry.devices()
    finally:
        registry.close()
    now = time.time() if now is None else now
    versions = read_versions(out)
    fields = read_record(out / CHECKPOINT).get("fields", {}) if (out / CHECKPOINT).is_file() else {}
    config = fields.get("config", {})
    shift = 1 if fields.get("history_format", 1) < HISTORY_FORMAT else 0  # older checkpoints counted rounds from 0
    history = fields.get("history", [])
    last = history[-1] if history else None
    best = fields.get("best") or None
    chosen = None if best is None or "round" not in best else {**best, "round": best["round"] + shift}
    # Where the validation figures come from: the server's --data, or the devices' held-out splits (federated).
    where = run_validated_on({"kind": "federation", **fields})
    validation = next((h.get("validation") or {} for h in reversed(history) if h.get("val_accuracy") is not None), {})
    federated = where is not None and where["source"] == "devices"
    words = validation_words(where)
    if federated and "devices" in where:
        words = f"{words} in the last validated round"
    # The models their devices calibrated: their own held-out accuracy, served -> personal, as each reported it.
    metrics = {d.device_id: d.metrics for d in devices}
    manifests = read_manifests(out)
    models = {
        str(m.get("device")): model_accuracy(m, metrics.get(str(m.get("device"))))
        for m in manifests
        if device_calibrated(m)
    }
    return {
        "out": str(out),
        # Per served variant: whom it serves, the rule that chose it, the classes it was trained, validated and
        # BN-calibrated on (from the exported manifests); and the fleet's coverage problems (from the registry).
        "coverage": served_variants(manifests),
        "coverage_warnings": _coverage_warnings(devices, manifests, fields.get("classes"), config.get("preset")),
        "validation": {
            "source": None if where is None else where["source"],
            "devices": validation.get("devices", []) if federated else [],
            "samples": validation.get("samples") if federated else None,
            "words": words,
        },
        "federation": config.get("federation"),
        "preset": config.get("preset"),
        "privacy": stored_privacy(
            config, history
        ),  # None: no DP; else ε at δ after the last round (feast_edge.privacy)
        "rounds": {
            "completed": int(fields.get("round", 0)),
            "total": config.get("rounds"),  # None without an end
            "continuous": bool(config.get("continuous", False)),
        },
        "last_round": None
        if last is None
        else {
            "round": last["round"] + shift,
            "applied": last.get("applied"),
            "loss": last.get("loss"),
            "val_accuracy": last.get("val_accuracy"),
        },
        "best": chosen,
        # The weights a device would be served now: their round and why (feast_edge.evaluate.served_round).
        "served": served_record(int(fields["round"]), chosen or {}) if fields.get("round") else None,
        "own_accuracy": fleet_accuracy(models.items()).to_dict() if models else None,
        "asynchronous": asynchronous_status(out, config, history, now),
        "secure": read_stage(out) if config.get("secure_agg") else None,  # the stage of the last secure round
        "online": sum(d.status == "online" for d in devices),
        "devices": [
            {
                "device": d.device_id,
                "host": d.host,
                "status": d.status,
                "last_seen": d.last_seen,
                "seconds_since_seen": max(0.0, now - d.last_seen),
                "budget_macs": d.budget_macs,
                "precision": d.precision,
                "samples": d.samples,
                "rounds": d.rounds,
                "profile": d.profile.get("name"),
                "model": models.get(d.device_id),  # None: no model it calibrated itself
                # The served version it runs, since when, and its own held-out accuracy on it (None: none yet).
                "version": _running((versions or {}).get("running", {}).get(d.device_id), now),
            }
            for d in devices
        ],
        "versions": None if versions is None else {k: v for k, v in versions.items() if k != "running"},
    }


def read_versions(out: Path) -> dict[str, Any] | None:
    """The versions registry of the run in ``out`` (feast_edge.versions.book): its versions, how many installs,
    refusals and rollbacks, and what each device runs (None: a run from before versions)."""
    path = out / VERSIONS
    if not path.is_file():
        return None
    book = VersionBook(path, readonly=True)
    try:
        versions, counts, running = book.versions(), book.counts(), book.running()
    finally:
        book.close()
    return {
        "versions": [v.to_dict() for v in versions],
        "installs": sum(counts.get(k, 0) for k in (INSTALLED, FIRST, UNGATED)),
        "refusals": counts.get(REFUSED, 0),
        "rollbacks": counts.get(ROLLED_BACK, 0),
        "held": sum(v.state == "held" for v in versions),
        "running": {d: r.to_dict() for d, r in running.items()},
    }


def _running(version: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
    return None if version is None else {**version, "seconds_since": max(0.0, now - version["since"])}


def versions_line(state: dict[str, Any]) -> str:
    """``versions: 3; the newest, 3 (round 12): promoted: ...; 10 installs, 2 refusals, 1 rollback, 0 held back``."""
    newest = state["versions"][-1] if state["versions"] else None
    about = (
        ""
        if newest is None
        else f"; the newest, {newest['number']} (round {newest['round']}): {newest['state']}"
        + (f" ({newest['state_reason']})" if newest["state_reason"] else "")
    )
    return (
        f"versions: {len(state['versions'])}{about}; {state['installs']} installs, {state['refusals']} refusals, "
        f"{state['rollbacks']} rollbacks, {state['held']} held back"
    )


def _version_cell(version: dict[str, Any] | None) -> str:
    if version is None:
        return "-"
    accuracy = "" if version.get("accuracy") is None else f", own {100 * version['accuracy']:.1f}%"
    return f"{version['version']} (since {ago(version['seconds_since'])}{accuracy})"


def asynchronous_status(
    out: Path, config: dict[str, Any], history: list[dict[str, Any]], now: float
) -> dict[str, Any] | None:
    """An asynchronous run's K, M, S, its buffer and jobs in flight (JOBS, as the server last wrote it), and each
    device's released updates and the staleness of its last one (None: synchronous rounds)."""
    if config.get("mode") != "async":
        return None
    jobs = read_jobs(out) or {}
    devices: dict[str, dict[str, Any]] = {}
    for h in history:
        for device, tau in (h.get("staleness") or {}).items():
            entry = devices.setdefault(device, {"released": 0, "staleness": None})
            entry["released"] += 1
            entry["staleness"] = tau
    in_flight = jobs.get("in_flight") if isinstance(jobs.get("in_flight"), dict) else {}
    return {
        "buffer": config.get("buffer"),
        "concurrency": config.get("concurrency"),
        "max_staleness": config.get("max_staleness"),
        "discount": config.get("staleness"),
        "held": (jobs.get("buffer") or {}).get("held"),
        "in_flight": {
            d: {"version": j.get("version"), "seconds": max(0.0, now - float(j.get("since", now)))}
            for d, j in sorted(in_flight.items())
            if isinstance(j, dict)
        },
        "refused_stale": sum(kind == STALE for h in history for kind in refusal_kinds(h).values()),
        "devices": devices,
    }


def asynchronous_line(state: dict[str, Any]) -> str:
    """The buffer and the jobs in flight of an asynchronous run, in one line."""
    held = "?" if state["held"] is None else state["held"]
    jobs = ", ".join(f"{d} (version {j['version']}, {duration(j['seconds'])})" for d, j in state["in_flight"].items())
    return (
        f"asynchronous: {state['buffer']} updates per release, {state['concurrency']} devices training at once, "
        f"staleness at most {state['max_staleness']} ({state['discount']}); buffer {held}/{state['buffer']}; "
        f"in flight: {jobs or 'none'}; refused as stale: {state['refused_stale']}"
    )


def _coverage_warnings(devices: list[Device], manifests: list[dict[str, Any]], classes: Any, preset: Any) -> list[str]:
    """The coverage problems of the registered fleet, with the task's class names as the run recorded them
    (``classes``), else from the run's preset ([] when neither is there: a run written before the names were recorded,
    whose user preset file does not load here)."""
    from feast_edge.evaluate.coverage import coverage_warnings
    from feast_edge.space.preset import load_preset

    if isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes):
        names = tuple(classes)
    else:
        try:
            names = load_preset(str(preset)).task.classes
        except (FeastError, OSError, ValueError):
            return []
    served = [m["macs"] for m in manifests if isinstance(m.get("macs"), int)]
    return coverage_warnings(holders(devices), served, names)


def ago(seconds: float) -> str:
    """``12 s ago``, ``3 min ago``, ``5 h ago``, ``2 d ago``."""
    return f"{duration(seconds)} ago"


def _staleness_cell(jobs: dict[str, Any], device: str) -> str:
    """An asynchronous run's device: the staleness of its last released update, and the version it trains now."""
    last = (jobs["devices"].get(device) or {}).get("staleness")
    job = jobs["in_flight"].get(device)
    words = "-" if last is None else f"last {last}"
    return words + ("" if job is None else f"; training from {job['version']}")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def status_lines(status: dict[str, Any]) -> list[str]:
    """The run, its rounds and its best validation accuracy, in a few lines for people."""
    run = f"run {status['out']}"
    if status["federation"] is not None:
        run += f": federation {status['federation']!r}, preset {status['preset']}"
    rounds, last, best = status["rounds"], status["last_round"], status["best"]
    if last is None:
        progress = f"rounds: none completed yet (of {rounds['total'] or '?'})"
    else:
        state = "aggregated" if last["applied"] else "unchanged"
        done = f"{rounds['completed']}/{rounds['total']}" if rounds["total"] else f"{rounds['completed']}"
        endless = " (no end: --continuous)" if rounds.get("continuous") else ""
        progress = (
            f"rounds: {done} completed{endless}; last, round {last['round']}: {state}, val {_pct(last['val_accuracy'])}"
        )
    served = status.get("served")
    best_line = (
        "served: no round completed yet"
        if served is None
        else f"served: {weights_words(served)}"
        + ("" if best is None else f", validation {_pct(best['val_accuracy'])}")
        + f" ({served['reason']})"
    )
    words = (status.get("validation") or {}).get("words")
    own = status.get("own_accuracy")
    return [
        run,
        progress,
        best_line,
        *([words] if words else []),
        *([asynchronous_line(status["asynchronous"])] if status.get("asynchronous") else []),
        *([stage_line(status["secure"])] if status.get("secure") else []),
        f"devices: {status['online']} of {len(status['devices'])} online",
        *([FleetAccuracy(**own).words()] if own else []),
        *([privacy_line(status["privacy"])] if status.get("privacy") else []),
        *([versions_line(status["versions"])] if status.get("versions") else []),
        *(f"class coverage: {line}" for line in status.get("coverage_warnings", [])),
    ]


def status_table(status: dict[str, Any]) -> Table:
    """One row per registered device; where devices calibrated their models, their own held-out accuracy (served ->
    personal) and, below, the means and the worst of each column."""
    own = any(d.get("model") is not None for d in status["devices"])
    table = Table(title=f"devices registered in {status['out']}", caption=OWN_CAPTION if own else None)
    columns = ["device", "host", "status", "last seen", "budget", "precision", "samples", "rounds", "profile"]
    jobs = status.get("asynchronous")
    columns += ["staleness"] if jobs else []
    versions = status.get("versions") is not None
    columns += ["version"] if versions else []
    for col in columns + (["own acc, served", "own acc, personal"] if own else []):
        table.add_column(
            col,
            justify="right" if col in ("budget", "samples", "rounds", "own acc, served") else "left",
            overflow="fold",
        )
    for i, d in enumerate(status["devices"]):
        model = d.get("model")
        table.add_row(
            d["device"],
            d["host"],
            d["status"],
            ago(d["seconds_since_seen"]),
            f"{d['budget_macs'] / 1e6:.2f}M",
            d["precision"],
            str(d["samples"]),
            str(d["rounds"]),
            d["profile"] or "-",
            *([] if not jobs else [_staleness_cell(jobs, d["device"])]),
            *([] if not versions else [_version_cell(d.get("version"))]),
            *([] if not own else ["-", "-"] if model is None else [served_cell(model), personal_cell(model)]),
            end_section=own and i == len(status["devices"]) - 1,
        )
    if own:
        add_fleet_rows(table, FleetAccuracy(**status["own_accuracy"]), len(columns))
    return table
