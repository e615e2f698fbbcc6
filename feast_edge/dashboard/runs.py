"""Finished runs as a dashboard: ``feast-edge dashboard RUN_DIR...`` reads what ``simulate`` and ``feast-server run`` leave in ``--out``.

* a ``feast-edge simulate`` run: its ``results.json`` (read by
  :func:`feast_edge.report.runs.load_run`, the report's reader): variants tested,
  population accuracy, the rounds; its clients become the fleet;
* a ``feast-server run`` (or an unfinished simulation): the record of
  ``checkpoint.safetensors`` (config, round history), the device registry
  ``devices.sqlite`` (read-only) and the exported ``models/``.

One run fills the page's sections; several are added side by side for comparison.
Traffic is recorded in parameters; the page shows bytes at 4 per parameter
(payload tensors are float32, :mod:`feast_edge.route.payload`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from feast_edge.dashboard.app import DashboardError
from feast_edge.dashboard.state import DashboardState, arch_label
from feast_edge.errors import FeastError
from feast_edge.privacy.private_rounds import privacy_entry
from feast_edge.report.model_words import (
    device_calibrated,
    model_accuracy,
    run_validated_on,
    served_words,
    validated_on,
    validation_words,
)
from feast_edge.report.run_files import DEVICES, MODELS, read_manifests, read_registry
from feast_edge.report.runs import load_run
from feast_edge.run.checkpoint import read_record
from feast_edge.run.clock import clock_entry
from feast_edge.run.loop import CHECKPOINT, HISTORY_FORMAT

RESULTS = "results.json"
BYTES_PER_PARAM = 4
WHAT_A_RUN_IS = (
    "a run directory holds results.json (feast-edge simulate --out) or checkpoint.safetensors (feast-server run --out)"
)


@dataclass
class RunData:
    """What one run directory shows on the dashboard."""

    name: str
    title: str
    run: dict[str, Any]
    history: list[dict[str, Any]]
    variants: list[dict[str, Any]] = field(default_factory=list)
    population_accuracy: float | None = None
    devices: dict[str, dict[str, Any]] = field(default_factory=dict)
    manifests: list[dict[str, Any]] = field(default_factory=list)
    model_dir: Path | None = None
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)  # device -> what it reported (registry metrics)
    served: str = (
        ""  # a simulation's served round: "weights of round 8 of 20: <reason>" (a federation's: its manifests)
    )

    def fill(self, state: DashboardState) -> None:
        """Show this run in the page's main sections."""
        state.set_run(**self.run)
        for device, fields in self.devices.items():
            state.set_device(device, **fields)
        for entry in self.history:
            state.end_round(entry)
        state.set_variants(self.variants)
        state.set_population(self.population_accuracy)
        if self.model_dir is not None:
            state.set_models(self.manifests, self.model_dir, self.metrics)
        state.set_served(self.served)

    def summary(self) -> dict[str, Any]:
        """This run as one of several compared: name, method, seed, history, variants, population accuracy."""
        return {
            "name": self.name,
            "method": self.run.get("method"),
            "seed": self.run.get("seed"),
            "preset": self.run.get("preset"),
            "validation": self.run.get("validation"),
            "history": self.history,
            "variants": self.variants,
            "population_accuracy": self.population_accuracy,
        }


def load_runs(paths: Sequence[Path]) -> DashboardState:
    """A dashboard state (kind ``runs``) of finished run directories: one fills the page, several are compared."""
    if not paths:
        raise DashboardError(f"give at least one run directory; {WHAT_A_RUN_IS}")
    runs = [read_run(Path(p)) for p in paths]
    names = [r.name for r in runs]
    for run, path in zip(runs, paths):
        if names.count(run.name) > 1:
            run.name = str(path)  # two runs/seed0 folders: tell them apart by their whole path
    if len(runs) == 1:
        state = DashboardState("runs", runs[0].title)
        runs[0].fill(state)
        return state
    state = DashboardState("runs", f"{len(runs)} runs: {', '.join(r.name for r in runs)}")
    longest = max(runs, key=lambda r: r.run.get("rounds_done") or 0)
    state.set_run(
        status="finished",
        message=f"comparing {len(runs)} runs",
        rounds_done=longest.run.get("rounds_done"),
        rounds_total=longest.run.get("rounds_total"),
    )
    for run in runs:
        state.add_run(run.summary())
    return state


def read_run(path: Path) -> RunData:
    """One run directory, of a simulation (results.json) or of a federation (its checkpoint)."""
    if not path.is_dir():
        raise DashboardError(f"run directory {path} does not exist; {WHAT_A_RUN_IS}")
    try:
        if (path / RESULTS).is_file():
            return _simulation(path)
        if (path / CHECKPOINT).is_file():
            return _checkpointed(path)
    except DashboardError:
        raise
    except FeastError as exc:
        raise DashboardError(str(exc)) from None
    raise DashboardError(f"{path} is not a run directory: it holds neither {RESULTS} nor {CHECKPOINT}; {WHAT_A_RUN_IS}")


def history_entry(record: dict[str, Any], shift: int = 0) -> dict[str, Any]:
    """A stored round record (:class:`feast_edge.run.loop.RoundRecord` as a dict) as a dashboard history entry;
    ``validated_on`` says where it was validated (:func:`feast_edge.report.model_words.validated_on`)."""
    routed, full = record.get("routed_params"), record.get("full_params")
    return {
        "round": int(record.get("round", 0)) + shift,
        "loss": record.get("loss"),
        "val_accuracy": record.get("val_accuracy"),
        "bytes_down": None if routed is None else BYTES_PER_PARAM * routed,
        "bytes_up": None if routed is None else BYTES_PER_PARAM * routed,  # each member returns the slice it was routed
        "broadcast_bytes": None if full is None else BYTES_PER_PARAM * full,
        "train_macs": record.get("train_macs"),
        "seconds": record.get("seconds"),
        "validated_on": validated_on(record.get("val_accuracy"), record.get("validation")),
        **privacy_entry(record.get("dp") or {}),
        **clock_entry(record.get("clock"), record.get("staleness") or {}),
    }


def _upload(record: dict[str, Any], device: str) -> dict[str, Any] | None:
    """What became of ``device``'s upload in one round record, if it was in the cohort."""
    if device in record.get("updated", ()):
        return {"round": record.get("round"), "status": "accepted", "reason": None}
    for status in ("rejected", "declined", "incomplete"):
        reasons = record.get(status, {})
        if isinstance(reasons, dict) and device in reasons:
            return {"round": record.get("round"), "status": status, "reason": reasons[device]}
    for status in ("missing", "dropped"):
        if device in record.get(status, ()):
            return {"round": record.get("round"), "status": status, "reason": None}
    return None


def _participation(rounds: list[dict[str, Any]], device: str) -> dict[str, Any]:
    """Rounds whose aggregate took ``device``'s update, and its last upload."""
    uploads = [u for u in (_upload(r, device) for r in rounds) if u is not None]
    return {"rounds": sum(u["status"] == "accepted" for u in uploads), "last_upload": uploads[-1] if uploads else None}


def _simulation(path: Path) -> RunData:
    run = load_run(path)  # validates results.json with the report's messages
    record = json.loads((path / RESULTS).read_text(encoding="utf-8"))
    rounds = list(record.get("rounds", []))
    variants = [
        {
            "label": str(v.get("label", f"#{i}")),
            "macs": v.get("macs"),
            "params": v.get("params"),
            "test_accuracy": v.get("test_accuracy"),
        }
        for i, v in enumerate(record["variants"])
    ]
    devices = {}
    served = record.get("served") or []
    for i, budget in enumerate(run.budgets):
        name = f"client-{i:03d}"  # simulate's client ids (feast_edge.sim.simulate.build_setup)
        variant = variants[served[i]] if i < len(served) and 0 <= served[i] < len(variants) else None
        devices[name] = {
            "budget_macs": budget,
            "variant": None if variant is None else {k: variant[k] for k in ("label", "macs", "params")},
            **_participation(rounds, name),
        }
    config = record.get("config", {})
    return RunData(
        name=path.name,
        title=f"{path.name}: {run.group}, seed {run.seed}, {run.preset}",
        run={
            "method": run.group,
            "preset": run.preset,
            "seed": run.seed,
            "rounds_total": config.get("rounds", run.rounds),
            "rounds_done": run.rounds,
            "status": "finished",
        },
        history=[history_entry(r) for r in rounds],
        variants=variants,
        population_accuracy=run.population_accuracy,
        devices=devices,
        served=served_words([{"served_round": record.get("served_round")}]),
    )


def _checkpointed(path: Path) -> RunData:
    fields = read_record(path / CHECKPOINT, format=None).get("fields", {})
    config = fields.get("config", {})
    shift = 1 if fields.get("history_format", 1) < HISTORY_FORMAT else 0  # older checkpoints counted rounds from 0
    rounds = [{**r, "round": int(r.get("round", 0)) + shift} for r in fields.get("history", [])]
    manifests = read_manifests(path)
    by_device = {m.get("device"): m for m in manifests}
    devices, metrics = {}, {}
    for d in read_registry(path, fields):
        name = str(d.get("device_id", ""))
        profile = d.get("profile") or {}
        hardware = profile.get("hardware") or {}
        manifest = by_device.get(name)
        if isinstance(d.get("metrics"), dict) and d["metrics"]:
            metrics[name] = d["metrics"]
        devices[name] = {
            "profile": profile.get("name"),
            "hardware": hardware.get("cuda_name") or hardware.get("cpu"),
            "budget_macs": d.get("budget_macs"),
            "precision": d.get("precision") or "fp32",  # a registry from before the column: float32
            "online": None,  # a finished run: the registry's last status is history, not presence
            "last_seen": d.get("last_seen"),
            "variant": None
            if manifest is None
            else {
                "label": arch_label(manifest.get("arch")),
                "macs": manifest.get("macs"),
                "params": manifest.get("params"),
            },
            **_participation(rounds, name),
        }
    variants = {}
    for m in manifests:  # what the server-calibrated models scored on its data, as the accuracy-vs-MACs points
        if device_calibrated(m):
            continue  # each device measured its own model on data of its own: not one curve
        variants.setdefault(
            m.get("macs"),
            {
                "label": arch_label(m.get("arch")),
                "macs": m.get("macs"),
                "params": m.get("params"),
                "val_accuracy": m.get("validation_accuracy"),
            },
        )
    accuracies = [model_accuracy(m, metrics.get(str(m.get("device", ""))))["accuracy"] for m in manifests]
    # The population accuracy of a deployment: the mean over devices of the exported model's accuracy (validation on
    # the server's data, or the device's own held-out accuracy where it calibrated the model).
    population = (
        sum(accuracies) / len(accuracies)
        if accuracies and all(isinstance(a, (int, float)) for a in accuracies)
        else None
    )
    kind = fields.get("kind", "federation")
    done, total = int(fields.get("round", len(rounds))), config.get("rounds")
    finished = total is not None and done >= int(total)
    described = f"federation {config['federation']!r}" if config.get("federation") else kind
    where = run_validated_on(fields)
    return RunData(
        name=path.name,
        title=f"{path.name}: {described}, {config.get('preset', '?')}",
        run={
            "federation": config.get("federation"),
            "preset": config.get("preset"),
            "method": config.get("method", "feast"),
            "seed": config.get("seed", fields.get("seed")),
            "rounds_total": total,
            "rounds_done": done,
            "status": "finished" if finished else "waiting",
            "message": None if finished else f"stopped after round {done} of {total or '?'} (or still running)",
            "validation": validation_words(where),
            # Without data of its own the server tests no variant: the page says so where the points would be.
            "server_data": None if where is None else where["source"] != DEVICES,
        },
        history=[history_entry(r) for r in rounds],
        variants=sorted(variants.values(), key=lambda v: (v["macs"] is None, v["macs"] or 0)),
        devices=devices,
        manifests=manifests,
        model_dir=path / MODELS if manifests else None,
        metrics=metrics,
        population_accuracy=population,
    )
