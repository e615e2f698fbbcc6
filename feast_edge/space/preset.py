"""Presets: the constants of one elastic-ResNet family, stored as TOML data (method §1).

A preset is looked up by name among the built-in files in ``feast_edge/presets/``
and the directories listed in the ``FEAST_EDGE_PRESET_PATH`` environment
variable, or loaded directly from a ``.toml`` path. Adding a preset is adding a
file; no code changes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from feast_edge.data.task import RESIZE_POLICIES, Task, TaskError, default_class_names
from feast_edge.errors import PresetError
from feast_edge.util.lookup import named_files, read_text

BUILTIN_DIR = Path(__file__).parent.parent / "presets"
PATH_ENV = "FEAST_EDGE_PRESET_PATH"

# Search settings stored with a preset; they do not shape tensors or costs, so
# they stay out of Preset.digest (a cache or checkpoint stays valid when they change).
_NOT_SHAPE = (
    "name",
    "description",
    "cache_segments",
    "extraction_rho",
    "budget_min",
    "budget_max",
    "budget_cap",
    "train",
    "class_names",
    "resize",
)
# Keys of the optional [train] table: the preset's training recipe (feast_edge.local.recipe.TrainConfig fields,
# plus lr_schedule for the run loop); values are checked by TrainConfig when a run starts.
RECIPE_KEYS = (
    "lr",
    "lr_schedule",
    "batch_size",
    "epochs",
    "momentum",
    "weight_decay",
    "clip_norm",
    "augment",
    "randaugment",
    "mixup_alpha",
    "cutmix_alpha",
    "crop_padding",
    "kd_weight",
    "temperature",
    "absent_logit_scale",
)


@dataclass(frozen=True)
class CacheSegment:
    """``count`` cache targets evenly spaced from ``start`` to ``stop`` MACs, searched under ``rho0`` (method §3)."""

    name: str
    start: float
    stop: float
    count: int
    rho0: float

    @property
    def targets(self) -> tuple[float, ...]:
        """The MAC targets, ``numpy.linspace(start, stop, count)`` (method §3)."""
        if self.count == 1:
            return (float(self.start),)
        step = (self.stop - self.start) / (self.count - 1)
        return tuple(float(self.start + i * step) for i in range(self.count - 1)) + (float(self.stop),)


@dataclass(frozen=True)
class RhoStep:
    """Effectiveness ceiling ``rho0`` for extraction budgets from ``from_macs`` up (paper supplement F)."""

    from_macs: float
    rho0: float


def _records(value: Any, kind: type) -> tuple[Any, ...]:
    """Coerce a list of dicts (TOML/JSON form) or of records into a tuple of ``kind``."""
    return tuple(v if isinstance(v, kind) else kind(**v) for v in value)


@dataclass(frozen=True)
class Preset:
    """Constants of one supernet family: input geometry, stem, stages and choice sets."""

    name: str
    description: str
    in_channels: int
    input_size: int
    classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    stem_channels: int
    stem_stride: int
    stage_channels: tuple[int, ...]
    stage_strides: tuple[int, ...]
    max_extra_blocks: int
    expansion_ratios: tuple[float, ...]
    width_multipliers: tuple[float, ...]
    divisor: int = 8
    cache_segments: tuple[CacheSegment, ...] = ()
    extraction_rho: tuple[RhoStep, ...] = ()
    # Simulated client budgets in MACs (method §4): Zipf over [budget_min, budget_max], allocation cap budget_cap.
    budget_min: float = 25e6
    budget_max: float = 1500e6
    budget_cap: float = 600e6
    # Training recipe ([train] table): (key, value) pairs sorted by key; empty means method §7's defaults.
    train: tuple[tuple[str, Any], ...] = ()
    # The task contract's names and image policy (feast_edge.data.task); () names the classes "0", "1", ...
    class_names: tuple[str, ...] = ()
    resize: str = "stretch"

    def __post_init__(self) -> None:
        object.__setattr__(self, "train", _recipe_pairs(self.name, self.train))
        object.__setattr__(self, "class_names", tuple(self.class_names))
        try:
            object.__setattr__(self, "cache_segments", _records(self.cache_segments, CacheSegment))
            object.__setattr__(self, "extraction_rho", _records(self.extraction_rho, RhoStep))
        except TypeError as exc:
            raise PresetError(
                f"preset {self.name}: a [cache] record is malformed ({exc}); see feast_edge/presets/paper-cifar100.toml for the format"
            ) from None
        _check_preset(self)

    @property
    def num_stages(self) -> int:
        return len(self.stage_channels)

    @property
    def digest(self) -> str:
        """SHA-256 of the fields that shape tensors and costs (not name, description or [cache] settings)."""
        shape = {k: v for k, v in asdict(self).items() if k not in _NOT_SHAPE}
        blob = json.dumps(shape, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    @property
    def task(self) -> Task:
        """The task contract: input channels and size, resize policy, class names, normalization."""
        names = self.class_names or default_class_names(self.classes)
        return Task(self.in_channels, self.input_size, names, self.mean, self.std, self.resize)

    @property
    def recipe(self) -> dict[str, Any]:
        """The [train] table as a dict (what the preset overrides of method §7's training defaults)."""
        return dict(self.train)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (the same content as the TOML file, flattened)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Preset:
        """Inverse of :meth:`to_dict`; validates every field."""
        try:
            return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
        except TypeError as exc:
            raise PresetError(
                f"preset record is malformed ({exc}); re-create it with this version of feast-edge"
            ) from None


def _recipe_pairs(name: str, value: Any) -> tuple[tuple[str, Any], ...]:
    """Normalise a [train] table (dict or pairs, lists as tuples) and refuse unknown keys."""
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = {str(k): tuple(v) if isinstance(v, list) else v for k, v in items}
    except (TypeError, ValueError):
        raise PresetError(f"preset {name}: [train] must be a table of key = value") from None
    unknown = sorted(set(pairs) - set(RECIPE_KEYS))
    if unknown:
        raise PresetError(
            f"preset {name}: [train] has unknown key(s) {', '.join(unknown)}; allowed: {', '.join(RECIPE_KEYS)}"
        )
    return tuple(sorted(pairs.items()))


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise PresetError(f"preset {where}: {message}")


def _check_preset(p: Preset) -> None:
    name = p.name or "<unnamed>"
    _require(
        bool(p.name) and p.name.strip() == p.name, name, "'name' must be a non-empty string without surrounding spaces"
    )
    _require(p.in_channels >= 1, name, f"input.channels = {p.in_channels} must be >= 1")
    _require(p.input_size >= 1, name, f"input.size = {p.input_size} must be >= 1")
    _require(p.classes >= 1, name, f"input.classes = {p.classes} must be >= 1")
    _require(
        len(p.mean) == p.in_channels,
        name,
        f"input.mean has {len(p.mean)} values; it needs one per input channel ({p.in_channels})",
    )
    _require(
        len(p.std) == p.in_channels,
        name,
        f"input.std has {len(p.std)} values; it needs one per input channel ({p.in_channels})",
    )
    _require(all(s > 0 for s in p.std), name, "input.std values must all be > 0")
    _require(p.stem_channels >= 1, name, f"stem.channels = {p.stem_channels} must be >= 1")
    _require(p.stem_stride >= 1, name, f"stem.stride = {p.stem_stride} must be >= 1")
    _require(len(p.stage_channels) >= 1, name, "stages.channels must list at least one stage")
    _require(all(c >= 1 for c in p.stage_channels), name, "stages.channels must all be >= 1")
    _require(
        len(p.stage_strides) == len(p.stage_channels),
        name,
        f"stages.strides has {len(p.stage_strides)} entries but stages.channels has {len(p.stage_channels)}; give one stride per stage",
    )
    _require(all(s >= 1 for s in p.stage_strides), name, "stages.strides must all be >= 1")
    _require(p.max_extra_blocks >= 0, name, f"stages.max_extra_blocks = {p.max_extra_blocks} must be >= 0")
    _require(len(p.expansion_ratios) >= 1, name, "stages.expansion_ratios must not be empty")
    _require(
        list(p.expansion_ratios) == sorted(set(p.expansion_ratios)) and all(0 < e <= 4 for e in p.expansion_ratios),
        name,
        "stages.expansion_ratios must be strictly increasing values in (0, 4]",
    )
    _require(len(p.width_multipliers) >= 1, name, "stages.width_multipliers must not be empty")
    _require(
        list(p.width_multipliers) == sorted(set(p.width_multipliers)) and all(0 < w <= 1 for w in p.width_multipliers),
        name,
        "stages.width_multipliers must be strictly increasing values in (0, 1]",
    )
    _require(p.divisor >= 1, name, f"stages.divisor = {p.divisor} must be >= 1")
    resolution = math.ceil(p.input_size / p.stem_stride)
    for s in p.stage_strides:
        resolution = math.ceil(resolution / s)
    _require(resolution >= 1, name, "the strides reduce the input below 1x1")
    _check_cache_settings(p, name)
    _require(
        not p.class_names or len(p.class_names) == p.classes,
        name,
        f"input.class_names lists {len(p.class_names)} names; it needs one per class ({p.classes})",
    )
    _require(
        p.resize in RESIZE_POLICIES,
        name,
        f"input.resize {p.resize!r} is unknown; choose one of {', '.join(RESIZE_POLICIES)}",
    )
    try:
        p.task
    except TaskError as exc:
        raise PresetError(f"preset {name}: {exc}") from None
    _require(
        0 < p.budget_min <= p.budget_cap and p.budget_min < p.budget_max,
        name,
        f"population budgets need 0 < budget_min <= budget_cap and budget_min < budget_max "
        f"(got {p.budget_min:g}, {p.budget_cap:g}, {p.budget_max:g})",
    )


def _check_cache_settings(p: Preset, name: str) -> None:
    for seg in p.cache_segments:
        where = f"cache.segments {seg.name!r}"
        _require(bool(seg.name), name, "every cache.segments entry needs a non-empty 'name'")
        _require(seg.count >= 1, name, f"{where}: count = {seg.count} must be >= 1")
        _require(
            0 < seg.start <= seg.stop,
            name,
            f"{where}: needs 0 < start <= stop (got start = {seg.start:g}, stop = {seg.stop:g})",
        )
        _require(seg.count == 1 or seg.start < seg.stop, name, f"{where}: start == stop needs count = 1")
        _require(seg.rho0 > 0, name, f"{where}: rho0 = {seg.rho0} must be > 0")
    _require(
        len({seg.name for seg in p.cache_segments}) == len(p.cache_segments),
        name,
        "cache.segments names must be unique",
    )
    steps = [step.from_macs for step in p.extraction_rho]
    if steps:
        _require(
            steps[0] == 0,
            name,
            f"cache.extraction must start at from_macs = 0 (got {steps[0]:g}) so that every budget has a ceiling",
        )
        _require(steps == sorted(set(steps)), name, "cache.extraction from_macs values must be strictly increasing")
        _require(all(step.rho0 > 0 for step in p.extraction_rho), name, "cache.extraction rho0 values must all be > 0")


def _cache_from_toml(cache: dict[str, Any]) -> dict[str, Any]:
    """The optional ``[cache]`` table: target segments and extraction ceilings (method §3)."""
    segments = tuple(
        CacheSegment(
            name=str(seg["name"]),
            start=float(seg["start"]),
            stop=float(seg["stop"]),
            count=int(seg["count"]),
            rho0=float(seg["rho0"]),
        )
        for seg in cache.get("segments", [])
    )
    steps = tuple(
        RhoStep(from_macs=float(step["from_macs"]), rho0=float(step["rho0"])) for step in cache.get("extraction", [])
    )
    return {"cache_segments": segments, "extraction_rho": steps}


def _population_from_toml(table: dict[str, Any]) -> dict[str, float]:
    """The optional ``[population]`` table: simulated budget range and allocation cap (method §4)."""
    keys = {"budget_min": "budget_min", "budget_max": "budget_max", "budget_cap": "budget_cap"}
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise PresetError(f"[population] has unknown key(s) {', '.join(unknown)}; allowed: {', '.join(keys)}")
    return {keys[k]: float(v) for k, v in table.items()}


def _from_toml(data: dict[str, Any], source: str) -> Preset:
    try:
        inp, stem, stages = data["input"], data["stem"], data["stages"]
        return Preset(
            name=str(data["name"]),
            description=str(data.get("description", "")),
            in_channels=int(inp["channels"]),
            input_size=int(inp["size"]),
            classes=int(inp["classes"]),
            mean=tuple(float(v) for v in inp["mean"]),
            std=tuple(float(v) for v in inp["std"]),
            stem_channels=int(stem["channels"]),
            stem_stride=int(stem.get("stride", 1)),
            stage_channels=tuple(int(v) for v in stages["channels"]),
            stage_strides=tuple(int(v) for v in stages["strides"]),
            max_extra_blocks=int(stages["max_extra_blocks"]),
            expansion_ratios=tuple(float(v) for v in stages["expansion_ratios"]),
            width_multipliers=tuple(float(v) for v in stages["width_multipliers"]),
            divisor=int(stages.get("divisor", 8)),
            class_names=tuple(str(v) for v in inp.get("class_names", ())),
            resize=str(inp.get("resize", "stretch")),
            **_cache_from_toml(data.get("cache", {})),
            **_population_from_toml(data.get("population", {})),
            train=tuple(data.get("train", {}).items()),
        )
    except KeyError as exc:
        raise PresetError(
            f"preset file {source} lacks the field {exc.args[0]!r}; see feast_edge/presets/*.toml for the format"
        ) from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, PresetError):
            raise
        raise PresetError(
            f"preset file {source} has a field of the wrong type ({exc}); see feast_edge/presets/*.toml for the format"
        ) from None


def load_preset_file(path: str | os.PathLike[str]) -> Preset:
    """Load and validate one preset TOML file."""
    path = Path(path)
    text = read_text(path, "preset file", PresetError, "a preset name")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PresetError(f"preset file {path} is not valid TOML ({exc}); fix the syntax") from None
    preset = _from_toml(data, str(path))
    _SOURCES[preset] = path.resolve()
    return preset


# The file each preset was last loaded from: where its variant cache is looked for (feast_edge.cache.variants).
_SOURCES: dict[Preset, Path] = {}


def preset_file(preset: Preset) -> Path | None:
    """The file ``preset`` was loaded from (the last one holding exactly this preset); None for one built in code."""
    return _SOURCES.get(preset)


def available_presets() -> dict[str, Path]:
    """Map of preset name -> file, user directories first (they may shadow built-ins)."""
    return named_files(PATH_ENV, BUILTIN_DIR, "*.toml")


_CACHE: dict[tuple[str, float], Preset] = {}


def load_preset(name_or_path: str | os.PathLike[str] | Preset) -> Preset:
    """Resolve a preset by name (built-in or on FEAST_EDGE_PRESET_PATH) or by .toml path."""
    if isinstance(name_or_path, Preset):
        return name_or_path
    text = str(name_or_path)
    if text.endswith(".toml") or os.sep in text:
        return load_preset_file(text)
    presets = available_presets()
    if text not in presets:
        names = ", ".join(sorted(presets)) or "none"
        raise PresetError(
            f"unknown preset {text!r}; choose one of: {names} "
            f"(or pass a .toml file, or add a directory of presets to ${PATH_ENV})"
        )
    file = presets[text]
    key = (str(file), file.stat().st_mtime)
    if key not in _CACHE:
        preset = load_preset_file(file)
        if preset.name != text:
            raise PresetError(
                f"preset file {file} declares name {preset.name!r}; rename the file or the preset so they match"
            )
        _CACHE[key] = preset
    return _CACHE[key]
