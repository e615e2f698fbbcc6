"""Device profiles: the record, where they are found, and the budget they imply (issue 4, items 2-3).

A profile answers one question for the federation: which cached variants may
this device be served and trained on? Two limits decide it:

* **latency**: inference of the served variant at batch 1 must meet a target,
  ``a + b·MACs ≤ latency_target_ms``, where ``a`` (ms) and ``b`` (ms per
  million MACs) are fitted by least squares (:func:`fit_latency`) to timed
  cached variants;
* **memory**: local co-training (method §7) of the envelope routed at the
  budget (method §5) must fit in ``memory_limit_bytes``
  (:func:`training_memory_bytes` gives the estimate and its formula).

The budget is the largest cached variant's MACs meeting both
(:func:`derive_budget`), so a profile's budget is always an operating point of
the cache. Profiles are JSON files in the format of :meth:`DeviceProfile.to_dict`;
the built-in ones ship as package data (``feast_edge.profiles``, the
repository's ``profiles/`` folder) and are found by name (:func:`load_profile`).
Measuring a device is the agent's job (``feast_edge.agent.profiling``).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

# The budget a profile implies is derived in feast_edge.budget.derive; its names stay importable from here.
from feast_edge.budget.derive import (  # noqa: F401
    TRAIN_BATCH_SIZE,
    activation_elements,
    derive_budget,
    fit_latency,
    training_memory_bytes,
)
from feast_edge.errors import ProfileError
from feast_edge.evaluate.precisions import PRECISIONS
from feast_edge.space.preset import Preset
from feast_edge.util.atomic import atomic_write_bytes, check_writable
from feast_edge.util.lookup import named_files, read_text

FORMAT = "feast-edge-device-profile"
VERSION = 1
PATH_ENV = "FEAST_EDGE_PROFILE_PATH"
DEVICES = ("cpu", "cuda")
DEFAULT_LATENCY_TARGET_MS = 50.0
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def builtin_dir() -> Path:
    """The directory of the built-in profiles (package data of ``feast_edge.profiles``)."""
    return Path(str(resources.files("feast_edge.profiles")))


# ------------------------------------------------------------------ the profile
Pairs = tuple[tuple[float, float], ...]  # (MACs, median ms) pairs


def _pairs(pairs: Pairs) -> list[list[float]]:
    return [[m, ms] for m, ms in pairs]


@dataclass(frozen=True)
class Alternative:
    """Another serving precision timed alongside the profile's own (``--precision auto``): its fit and budget."""

    latency_a_ms: float
    latency_b_ms_per_mmac: float
    budget_macs: float
    measurements: Pairs = ()
    holdout: Pairs = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "latency_a_ms": self.latency_a_ms,
            "latency_b_ms_per_mmac": self.latency_b_ms_per_mmac,
            "budget_macs": self.budget_macs,
            "measurements": _pairs(self.measurements),
            **({"holdout": _pairs(self.holdout)} if self.holdout else {}),
        }


@dataclass(frozen=True)
class DeviceProfile:
    """A device's measured (or documented) latency fit, memory limit and the MAC budget derived from them."""

    name: str
    description: str
    device: str  # "cpu" or "cuda": where inference and training run
    hardware: dict[str, Any] = field(hash=False)  # what was read (read_hardware) or documented
    preset: str  # the preset whose cache was timed and whose MACs the budget counts
    latency_a_ms: float  # intercept a of latency ≈ a + b·MACs at batch 1 (per-inference overhead)
    latency_b_ms_per_mmac: float  # slope b, ms per million MACs
    latency_target_ms: float
    memory_limit_bytes: int  # memory available to train the routed envelope
    budget_macs: float  # derive_budget(...) of the fields above
    source: str  # "measured on <host> <date> ..." or the documented sources of the figures
    measurements: tuple[tuple[float, float], ...] = ()  # (MACs, median ms) pairs that were timed (and fitted)
    runtime: str = (
        ""  # what the timings ran on, e.g. "onnxruntime 1.32.0, CPUExecutionProvider" ("": documented figures)
    )
    holdout: tuple[
        tuple[float, float], ...
    ] = ()  # (MACs, median ms) of timed variants the fit did not see: its error check
    precision: str = "fp32"  # the serving precision (quantize.PRECISIONS) the fit and budget are for
    # The other precisions timed alongside (--precision auto): precision -> its fit and budget.
    alternatives: dict[str, Alternative] = field(default_factory=dict, hash=False)

    def latency_ms(self, macs: float) -> float:
        """Predicted batch-1 latency ``a + b·MACs`` of a variant with ``macs`` MACs."""
        return self.latency_a_ms + self.latency_b_ms_per_mmac * macs / 1e6

    def holdout_errors(self) -> list[float]:
        """Relative error |predicted − measured| / measured of the fit on each held-out variant."""
        return [abs(self.latency_ms(macs) - ms) / ms for macs, ms in self.holdout]

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form; the format of the files in ``profiles/``."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "name": self.name,
            "description": self.description,
            "device": self.device,
            "preset": self.preset,
            "latency_a_ms": self.latency_a_ms,
            "latency_b_ms_per_mmac": self.latency_b_ms_per_mmac,
            "latency_target_ms": self.latency_target_ms,
            "memory_limit_bytes": self.memory_limit_bytes,
            "budget_macs": self.budget_macs,
            "source": self.source,
            "hardware": self.hardware,
            "measurements": _pairs(self.measurements),
            **({"runtime": self.runtime} if self.runtime else {}),
            **({"holdout": _pairs(self.holdout)} if self.holdout else {}),
            # Written only when not float32, so the files of float32 profiles stay as they were.
            **({"precision": self.precision} if self.precision != "fp32" else {}),
            **({"alternatives": {p: a.to_dict() for p, a in self.alternatives.items()}} if self.alternatives else {}),
        }

    @classmethod
    def from_dict(cls, d: Any, source: str = "<profile>") -> DeviceProfile:
        """Validate a JSON record and build the profile; errors name the offending field."""
        return _profile_from_dict(d, source)


_FIELDS = {
    "name",
    "description",
    "device",
    "preset",
    "latency_a_ms",
    "latency_b_ms_per_mmac",
    "latency_target_ms",
    "memory_limit_bytes",
    "budget_macs",
    "source",
    "hardware",
}
_OPTIONAL = {"measurements", "runtime", "holdout", "precision", "alternatives"}
_ALTERNATIVE = {"latency_a_ms", "latency_b_ms_per_mmac", "budget_macs"}
_HEADER = {"format", "version"}


def _bad(
    source: str, problem: str, fix: str = "re-create it with 'feast-agent profile' or fix the field"
) -> ProfileError:
    return ProfileError(f"device profile {source}: {problem}; {fix}")


def _number(data: dict[str, Any], key: str, source: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(source, f"field {key!r} must be a finite number, got {value!r}")
    return float(value)


def _text(data: dict[str, Any], key: str, source: str) -> str:
    value = data[key]
    if not isinstance(value, str):
        raise _bad(source, f"field {key!r} must be a string, got {type(value).__name__}")
    return value


def _measurements(value: Any, source: str, key: str = "measurements") -> tuple[tuple[float, float], ...]:
    if not isinstance(value, list):
        raise _bad(source, f"field '{key}' must be a list of [MACs, ms] pairs, got {type(value).__name__}")
    pairs = []
    for i, pair in enumerate(value):
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2
        ok = ok and all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in pair
        )
        if not ok:
            raise _bad(source, f"field '{key}' entry {i} must be a [MACs, ms] pair of positive numbers, got {pair!r}")
        pairs.append((float(pair[0]), float(pair[1])))
    return tuple(pairs)


def _precision(data: dict[str, Any], source: str) -> str:
    precision = _text(data, "precision", source) if "precision" in data else "fp32"  # older files: float32
    if precision not in PRECISIONS:
        raise _bad(
            source,
            f"field 'precision' is {precision!r}, expected one of {', '.join(PRECISIONS)} (the precision it is served in)",
        )
    return precision


def _alternatives(value: Any, precision: str, source: str) -> dict[str, Alternative]:
    """The ``alternatives`` field: other precisions, each with a valid fit and budget."""
    if not isinstance(value, dict):
        raise _bad(source, f"field 'alternatives' must be an object of precision -> fit, got {type(value).__name__}")
    alternatives = {}
    for other, fit in value.items():
        where = f"alternatives.{other}"
        if other not in PRECISIONS or other == precision:
            raise _bad(
                source,
                f"field 'alternatives' names {other!r}; expected another precision than {precision!r} "
                f"({', '.join(PRECISIONS)})",
            )
        if (
            not isinstance(fit, dict)
            or not _ALTERNATIVE <= set(fit)
            or set(fit) - _ALTERNATIVE - {"measurements", "holdout"}
        ):
            raise _bad(
                source,
                f"field '{where}' must be an object of {', '.join(sorted(_ALTERNATIVE))}, measurements and holdout",
            )
        named = {f"{where}.{key}": fit[key] for key in ("latency_a_ms", "latency_b_ms_per_mmac", "budget_macs")}
        a, b, budget = (_number(named, key, source) for key in named)
        if not (a >= 0 and b > 0 and budget > 0):
            raise _bad(
                source, f"field '{where}' needs latency_a_ms >= 0, latency_b_ms_per_mmac > 0 and budget_macs > 0"
            )
        alternatives[other] = Alternative(
            latency_a_ms=a,
            latency_b_ms_per_mmac=b,
            budget_macs=budget,
            measurements=_measurements(fit.get("measurements", []), source, f"{where}.measurements"),
            holdout=_measurements(fit.get("holdout", []), source, f"{where}.holdout"),
        )
    return alternatives


def _profile_from_dict(data: Any, source: str) -> DeviceProfile:
    if not isinstance(data, dict):
        raise _bad(
            source,
            f"is a JSON {type(data).__name__}, expected an object",
            "pass a file written by 'feast-agent profile'",
        )
    if data.get("format") != FORMAT:
        raise _bad(
            source,
            f"field 'format' is {data.get('format')!r}, expected {FORMAT!r}",
            "pass a file written by 'feast-agent profile'",
        )
    if data.get("version") != VERSION:
        raise _bad(source, f"field 'version' is {data.get('version')!r}, this feast-edge reads version {VERSION}")
    unknown = sorted(set(data) - _FIELDS - _OPTIONAL - _HEADER)
    if unknown:
        raise _bad(
            source,
            f"has unknown field(s) {', '.join(map(repr, unknown))}",
            f"remove them (allowed: {', '.join(sorted(_FIELDS | _OPTIONAL))})",
        )
    missing = sorted(_FIELDS - set(data))
    if missing:
        raise _bad(source, f"lacks the field(s) {', '.join(map(repr, missing))}")

    name = _text(data, "name", source)
    if not NAME_PATTERN.match(name):
        raise _bad(source, f"field 'name' {name!r} must be letters, digits, '.', '_' or '-' (it names the file)")
    device = _text(data, "device", source)
    if device not in DEVICES:
        raise _bad(source, f"field 'device' is {device!r}, expected one of {', '.join(DEVICES)}")
    preset = _text(data, "preset", source)
    if not preset:
        raise _bad(source, "field 'preset' must name the preset whose cache was timed")
    hardware = data["hardware"]
    if not isinstance(hardware, dict):
        raise _bad(source, f"field 'hardware' must be an object, got {type(hardware).__name__}")

    a = _number(data, "latency_a_ms", source)
    b = _number(data, "latency_b_ms_per_mmac", source)
    target = _number(data, "latency_target_ms", source)
    budget = _number(data, "budget_macs", source)
    memory = data["memory_limit_bytes"]
    checks = [
        (a >= 0, f"field 'latency_a_ms' = {a} must be >= 0 (an inference cannot take negative time)"),
        (b > 0, f"field 'latency_b_ms_per_mmac' = {b} must be > 0 (latency must grow with MACs)"),
        (target > 0, f"field 'latency_target_ms' = {target} must be > 0"),
        (budget > 0, f"field 'budget_macs' = {budget} must be > 0"),
        (
            not isinstance(memory, bool) and isinstance(memory, int) and memory > 0,
            f"field 'memory_limit_bytes' must be a positive integer, got {memory!r}",
        ),
    ]
    for ok, problem in checks:
        if not ok:
            raise _bad(source, problem)
    precision = _precision(data, source)
    return DeviceProfile(
        name=name,
        description=_text(data, "description", source),
        device=device,
        hardware=hardware,
        preset=preset,
        latency_a_ms=a,
        latency_b_ms_per_mmac=b,
        latency_target_ms=target,
        memory_limit_bytes=memory,
        budget_macs=budget,
        source=_text(data, "source", source),
        measurements=_measurements(data.get("measurements", []), source),
        runtime=_text(data, "runtime", source) if "runtime" in data else "",
        holdout=_measurements(data.get("holdout", []), source, "holdout"),
        precision=precision,
        alternatives=_alternatives(data.get("alternatives", {}), precision, source),
    )


# ------------------------------------------------------------------ files
def save_profile(profile: DeviceProfile, path: str | os.PathLike[str]) -> Path:
    """Atomically write ``profile`` as pretty JSON."""
    path = check_writable(path, "device profile")
    return atomic_write_bytes(path, (json.dumps(profile.to_dict(), indent=2) + "\n").encode())


def available_profiles() -> dict[str, Path]:
    """Map of profile name -> file: directories on $FEAST_EDGE_PROFILE_PATH first (they shadow), then the built-in profiles."""
    return named_files(PATH_ENV, builtin_dir(), "*.json")


def _read_profile_file(path: Path) -> DeviceProfile:
    text = read_text(path, "device profile", ProfileError, "a profile name")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(
            f"device profile {path} is not valid JSON ({exc.msg} at line {exc.lineno}); fix it or re-create it with 'feast-agent profile'"
        ) from None
    return DeviceProfile.from_dict(data, source=str(path))


def load_profile(name_or_path: str | os.PathLike[str]) -> DeviceProfile:
    """Load a profile from a ``.json`` path, or by name from $FEAST_EDGE_PROFILE_PATH and the built-in profiles."""
    text = str(name_or_path)
    if text.endswith(".json") or os.sep in text or (os.altsep and os.altsep in text):
        return _read_profile_file(Path(text))
    profiles = available_profiles()
    if text not in profiles:
        names = ", ".join(sorted(profiles)) or "none"
        raise ProfileError(
            f"unknown device profile {text!r}; choose one of: {names} "
            f"(or pass a .json file, or add a directory of profiles to ${PATH_ENV})"
        )
    return _read_profile_file(profiles[text])


def budgets_from_profiles(names_or_paths: Sequence[str], clients: int, preset: Preset | str) -> tuple[float, ...]:
    """Budgets of ``clients`` simulated clients, cycling through the given profiles in order (issue 4, item 3)."""
    if not names_or_paths:
        raise ProfileError("--profiles needs at least one profile name or .json file")
    if clients < 1:
        raise ProfileError(f"--clients {clients} must be at least 1")
    preset_name = preset.name if isinstance(preset, Preset) else str(preset)
    profiles = [load_profile(p) for p in names_or_paths]
    for p in profiles:
        if p.preset != preset_name:
            raise ProfileError(
                f"profile {p.name} was derived for preset {p.preset}, not {preset_name}: its budget counts MACs of another cache; "
                f"pass --preset {p.preset} or re-profile the device with 'feast-agent profile --preset {preset_name}'"
            )
    return tuple(profiles[i % len(profiles)].budget_macs for i in range(clients))


def profile_summary(profile: DeviceProfile) -> dict[str, Any]:
    """The part of a profile an agent sends with its registration (no raw measurements)."""
    data = profile.to_dict()
    for key in ("measurements", "format", "version"):
        data.pop(key, None)
    for fit in data.get("alternatives", {}).values():
        fit.pop("measurements", None)
    return data
