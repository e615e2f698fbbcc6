"""Finished ``feast-edge simulate`` runs as records: read from ``results.json``, grouped by method across seeds, summarised.

Runs of one method (same FEAST ``variants`` switch and method options) with
different seeds form a :class:`Group`, reported as mean ± sample standard
deviation; a run of method ``centralized`` is the reference (method §8). The
report (:mod:`feast_edge.report.summary`), its plots and the dashboard read
runs through here.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feast_edge.errors import FeastError
from feast_edge.settings.buffered import SERVER_LR

METHOD_ORDER = ("feast", "centralized", "heterofl", "scalefl", "fiarse", "sfn", "dfn")
REFERENCE = "centralized"
SAME_LABELS = "the centralized accuracy of the same variant (same label)"
BY_MACS = "the centralized accuracy of its largest point with MACs ≤ this point's MACs (the variants differ; — where none is that small)"


@dataclass(frozen=True)
class Point:
    """One operating point of a run: label, inference MACs, parameters and test accuracy (a fraction)."""

    label: str
    macs: int
    params: int
    accuracy: float


@dataclass(frozen=True)
class Run:
    """What the report reads from one run directory's ``results.json``."""

    directory: Path
    method: str
    variants: str
    options: tuple[tuple[str, str], ...]
    seed: int
    preset: str
    budgets: tuple[float, ...]
    population_accuracy: float
    best_val: float | None
    points: tuple[Point, ...]  # MAC-sorted
    params_sent: int  # both directions, all rounds
    train_macs: int
    seconds: float
    rounds: int
    validation: tuple[tuple[int, float], ...]  # (round, val accuracy) where validated
    gamma: float = 1.0  # the population's γ-allocation (method §4)
    server_opt: str = ""  # "adam lr=0.01" for a server optimizer other than plain averaging
    matched: dict[str, Any] | None = None  # how its rounds were matched to another run's training compute
    extraction: dict[str, Any] | None = None  # extraction.json: post-hoc extraction of uncached variants
    personalization: dict[str, Any] | None = None  # simulate --personalize: the summary of its "personalization" block
    privacy: dict[str, Any] | None = None  # simulate --dp-*: its "privacy" block (ε at δ, the settings)
    schedule: str = ""  # "async K=5 M=10 S=10 sqrt" for buffered asynchronous rounds (--mode async)
    virtual_seconds: float | None = None  # the virtual clock at the end (results.json's timeline)
    validation_in_time: tuple[tuple[float, float], ...] = ()  # (virtual seconds, val accuracy) where validated

    @property
    def group(self) -> str:
        """The name runs are grouped under: the method, FEAST's ablation switch, the options, a server optimizer,
        matched compute and a γ other than 1, not the seed."""
        parts = [f"variants={self.variants}"] if self.method == "feast" and self.variants != "full" else []
        parts += [f"{k}={v}" for k, v in self.options]
        parts += [f"server {self.server_opt}"] if self.server_opt else []
        parts += ["matched compute"] if self.matched is not None else []
        parts += [f"γ={self.gamma:g}"] if self.gamma != 1 else []
        parts += [dp_words(self.privacy)] if self.privacy else []
        parts += [self.schedule] if self.schedule else []
        return f"{self.method} ({', '.join(parts)})" if parts else self.method

    @property
    def kind(self) -> str:
        """:attr:`group` without γ: the runs a γ comparison pairs up."""
        return self.group.replace(f", γ={self.gamma:g}", "").replace(f" (γ={self.gamma:g})", "")


class _Malformed(Exception):
    """A results.json entry is missing or of the wrong kind."""


def _at(record: Any, *keys: str) -> Any:
    """``record[k0][k1]...``; a missing step names the dotted key."""
    value = record
    for i, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            raise _Malformed(f"lacks {'.'.join(keys[: i + 1])}")
        value = value[key]
    return value


def load_run(directory: Path) -> Run:
    """Read a run directory's ``results.json``; a missing or malformed file is a one-line :class:`FeastError`."""
    directory = Path(directory)
    fix = f"run feast-edge simulate --out {directory} to completion first"
    path = directory / "results.json"
    if not directory.is_dir():
        raise FeastError(f"run directory {directory} does not exist; {fix}")
    if not path.is_file():
        raise FeastError(f"run directory {directory} holds no results.json; {fix}")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FeastError(f"cannot read {path} ({exc}); {fix}") from None
    try:
        return _parse(directory, record)
    except _Malformed as exc:
        raise FeastError(f"{path} {exc}; {fix}") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise FeastError(f"{path} has a malformed entry ({exc}); {fix}") from None


def _parse(directory: Path, record: Any) -> Run:
    config = _at(record, "config")
    rounds = _at(record, "rounds")
    points = [
        Point(
            str(v.get("label", f"#{v.get('index', i)}")),
            int(_at(v, "macs")),
            int(_at(v, "params")),
            float(_at(v, "test_accuracy")),
        )
        for i, v in enumerate(_at(record, "variants"))
    ]
    if not points:
        raise _Malformed("lists no variants")
    best = _at(record, "best").get("val_accuracy")
    seconds = record.get("seconds_total")
    return Run(
        directory=directory,
        method=str(
            record.get("method", config.get("method", "feast"))
        ),  # results.json from before the method harness: FEAST
        variants=str(config.get("variants", "full")),
        options=tuple((str(k), str(v)) for k, v in config.get("method_options", ())),
        seed=int(_at(config, "seed")),
        preset=str(_at(record, "preset")),
        budgets=tuple(float(b) for b in _at(record, "population", "budgets")),
        population_accuracy=float(_at(record, "population_accuracy")),
        best_val=None if best is None else float(best),
        points=tuple(sorted(points, key=lambda p: p.macs)),
        params_sent=int(_at(record, "communication", "routed_params_total")),
        train_macs=int(_at(record, "compute", "train_macs_total")),
        seconds=float(seconds) if seconds is not None else sum(float(_at(r, "seconds")) for r in rounds),
        rounds=len(rounds),
        validation=tuple(
            (int(_at(r, "round")), float(r["val_accuracy"])) for r in rounds if r.get("val_accuracy") is not None
        ),
        gamma=float(record.get("population", {}).get("gamma", config.get("gamma", 1.0))),
        server_opt=_server_opt(config),
        matched=record.get("matched_compute"),
        extraction=_extraction(directory),
        personalization=_personalization(record),
        privacy=record.get("privacy") if isinstance(record.get("privacy"), dict) else None,
        schedule=_schedule(config),
        virtual_seconds=_virtual_seconds(record),
        validation_in_time=tuple(
            (float(r["clock"]), float(r["val_accuracy"]))
            for r in rounds
            if r.get("val_accuracy") is not None and isinstance(r.get("clock"), (int, float))
        ),
    )


def _schedule(config: dict[str, Any]) -> str:
    """``async K=5 M=10 S=10 sqrt η=0.25`` for buffered asynchronous rounds (η: the step of plain averaging without
    --server-lr, feast_edge.settings.buffered.SERVER_LR); '' for synchronous ones."""
    if config.get("mode") != "async":
        return ""
    step = config.get("server_opt", "avg") == "avg" and config.get("server_lr") is None
    return (
        f"async K={config.get('buffer')} M={config.get('concurrency')} S={config.get('max_staleness')} "
        f"{config.get('staleness')}" + (f" η={SERVER_LR:g}" if step else "")
    )


def _virtual_seconds(record: dict[str, Any]) -> float | None:
    timeline = record.get("timeline")
    value = timeline.get("virtual_seconds") if isinstance(timeline, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def dp_words(privacy: dict[str, Any]) -> str:
    """``dp z=1 C=0.5`` (``local dp ...`` for local DP; ``C=0.5 q=0.5`` adaptive): how a run's group names its
    privacy settings."""
    mode = "local dp" if privacy.get("mode") == "local" else "dp"
    adaptive = privacy.get("adaptive_clip")
    quantile = f" q={adaptive['quantile']:g}" if isinstance(adaptive, dict) else ""
    return f"{mode} z={privacy['noise']:g} C={privacy['clip']:g}{quantile}"


def _server_opt(config: dict[str, Any]) -> str:
    """``"adam lr=0.01"``, or "" for plain averaging (and runs from before server optimizers)."""
    name, lr = config.get("server_opt", "avg"), config.get("server_lr")
    if name == "avg" and lr in (None, 1, 1.0):
        return ""
    return name if lr is None else f"{name} lr={lr:g}"


def _extraction(directory: Path) -> dict[str, Any] | None:
    """The run's extraction.json (feast-edge extraction-gap), when there is a readable one."""
    try:
        record = json.loads((directory / "extraction.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("points"), list) else None


def _personalization(record: dict[str, Any]) -> dict[str, Any] | None:
    """The summary of ``simulate --personalize`` (own held-out accuracy, served and personal), when the run has one."""
    block = record.get("personalization")
    summary = block.get("summary") if isinstance(block, dict) else None
    if summary is None:
        return None
    if not isinstance(summary, dict) or not isinstance(summary.get("choice"), str):
        raise _Malformed("has a personalization block without its summary")
    return summary


# ------------------------------------------------------------------ groups and statistics
@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation (n − 1) of a quantity over the seeds of a group; no deviation for one seed."""

    mean: float
    std: float | None

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Stat | None:
        known = [v for v in values if v is not None]
        if not known:
            return None
        return cls(statistics.fmean(known), statistics.stdev(known) if len(known) > 1 else None)

    def percent(self) -> str:
        """``61.00 ± 1.41`` (a fraction shown in percent)."""
        return f"{100 * self.mean:.2f}" + (f" ± {100 * self.std:.2f}" if self.std is not None else "")


@dataclass(frozen=True)
class Group:
    """The runs of one method (same variants switch and options), one per seed."""

    name: str
    method: str
    runs: tuple[Run, ...]

    def stat(self, value: Callable[[Run], float | None]) -> Stat | None:
        return Stat.of(value(r) for r in self.runs)

    def points(self) -> list[tuple[Point, Stat]]:
        """Each operating point (by label, MAC-sorted) with its test accuracy over the seeds."""
        first: dict[str, Point] = {}
        accuracies: dict[str, list[float]] = {}
        for run in self.runs:
            for p in run.points:
                first.setdefault(p.label, p)
                accuracies.setdefault(p.label, []).append(p.accuracy)
        return sorted(
            ((first[k], Stat.of(v)) for k, v in accuracies.items()), key=lambda item: (item[0].macs, item[0].label)
        )


def group_runs(runs: Sequence[Run]) -> list[Group]:
    """Runs grouped by :attr:`Run.group`, in the order feast, centralized, the baselines, then anything else."""
    named: dict[str, list[Run]] = {}
    for run in runs:
        named.setdefault(run.group, []).append(run)
    groups = [
        Group(name, members[0].method, tuple(sorted(members, key=lambda r: r.seed))) for name, members in named.items()
    ]
    rank = {m: i for i, m in enumerate(METHOD_ORDER)}
    return sorted(groups, key=lambda g: (rank.get(g.method, len(METHOD_ORDER)), g.name))


def reference_group(groups: Sequence[Group]) -> Group | None:
    """The centralized reference (the first centralized group), if a run has method ``centralized``."""
    return next((g for g in groups if g.method == REFERENCE), None)


def variant_gaps(group: Group, reference: Group) -> tuple[str, list[float | None]]:
    """How each point is compared with the reference, and its gap (reference − point, in accuracy points)."""
    mine = group.points()
    ref = [(p, acc.mean) for p, acc in reference.points()]
    by_label = {p.label: acc for p, acc in ref}
    if all(p.label in by_label for p, _ in mine):
        return SAME_LABELS, [100 * (by_label[p.label] - acc.mean) for p, acc in mine]
    gaps: list[float | None] = []
    for p, acc in mine:
        below = [a for q, a in ref if q.macs <= p.macs]
        gaps.append(100 * (below[-1] - acc.mean) if below else None)
    return BY_MACS, gaps


def comparability_warnings(runs: Sequence[Run]) -> list[str]:
    """One line per reason the runs' numbers are not directly comparable (presets, populations, repeated seeds)."""
    warnings = []
    presets = sorted({r.preset for r in runs})
    if len(presets) > 1:
        warnings.append(
            f"warning: the runs use different presets ({', '.join(presets)}); their accuracies are not directly comparable"
        )
    first = runs[0]
    differ = [str(r.directory) for r in runs if r.budgets != first.budgets]
    if differ:
        warnings.append(
            f"warning: the runs do not share one client population (the budgets of {', '.join(differ)} differ from those of {first.directory}); "
            "population accuracies are not directly comparable"
        )
    for group in group_runs(runs):
        seeds = [r.seed for r in group.runs]
        for seed in sorted({s for s in seeds if seeds.count(s) > 1}):
            warnings.append(
                f"warning: {group.name} has {seeds.count(seed)} runs with seed {seed}; each counts as a seed of its own"
            )
    return warnings
