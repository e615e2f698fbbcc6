"""The fixed, MAC-sorted variant cache A (method §3) and its affordable sets (method §4).

A cache is built offline, once per preset, by one GA search per MAC target
(:mod:`feast_edge.cache.search`, assembled by :mod:`feast_edge.cache.build`), and shipped as JSON in
``feast_edge/caches/``.

Duplicates: when two targets return the same network the cache keeps one
entry and records every search job that found it (``CacheEntry.jobs``, sorted
by target). The cache is a *set* of variants: a duplicate would add no
operating point but would double that variant's chance of being drawn as the
random intermediate variant in local co-training (method §7). (The published
paper cache lists its 369.57M variant twice; loaded here it has 55 entries.)
One network can have several encodings: channel counts are rounded to the
preset's divisor, so two width indices (or expansion ratios) can give the same
width, and archs with equal :func:`~feast_edge.space.geometry.arch_layout` are
the same tensors of the supernet. Such entries are merged too, when a cache is
built and when one is loaded; the entry keeps the encoding that its earliest
job (smallest target, then seed) returned, so it is what that recorded search
reproduces.

MACs and params of every entry are counted with the head of ``classes``
classes, recorded in the file (default: the preset's own class count).

Where a cache is found (:func:`default_cache_path`): a preset loaded from a
file of its own (``my-task.toml``, by path or through ``$FEAST_EDGE_PRESET_PATH``)
has its cache beside it, ``my-task.cache.json`` (what ``feast-edge cache build``
writes by default); a built-in preset has its cache in ``feast_edge/caches/``;
every command that loads one also takes ``--cache FILE``.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from feast_edge.cache.fitness import evaluate
from feast_edge.cache.search import (
    SearchResult,
)
from feast_edge.errors import ArchError, FeastError
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost
from feast_edge.space.geometry import Layout, arch_layout
from feast_edge.space.preset import BUILTIN_DIR, Preset, preset_file
from feast_edge.util.atomic import atomic_write_bytes, check_writable

CACHE_DIR = Path(__file__).parent.parent / "caches"
CACHE_SUFFIX = ".cache.json"  # a user preset's cache beside its file: my-task.toml -> my-task.cache.json
FORMAT = "feast-edge-variant-cache"
VERSION = 1
DEFAULT_SEED = 42  # the seed of the paper's cache jobs (reference/feast-cifar100-cache.csv)
_REL_TOL = 1e-9


class CacheError(FeastError, ValueError):
    """A variant cache is missing, malformed, stale or belongs to another preset."""


@dataclass(frozen=True)
class SearchJob:
    """One GA run of the cache build: MAC target, effectiveness ceiling, seed (method §3)."""

    target: float
    rho0: float
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "rho0": self.rho0, "seed": self.seed}


@dataclass(frozen=True)
class CacheEntry:
    """One cached variant: its architecture, cost, fitness terms and the jobs that found it."""

    arch: Arch
    macs: int
    params: int
    fitness: float
    rho: float
    entropy: float
    jobs: tuple[SearchJob, ...]

    @property
    def target(self) -> float:
        """The smallest MAC target whose search returned this variant."""
        return self.jobs[0].target

    @property
    def seed(self) -> int:
        """Seed of the job behind :attr:`target`."""
        return self.jobs[0].seed

    def to_dict(self) -> dict[str, Any]:
        return {
            "arch": self.arch.to_dict(),
            "macs": self.macs,
            "params": self.params,
            "fitness": self.fitness,
            "rho": self.rho,
            "entropy": self.entropy,
            "jobs": [job.to_dict() for job in self.jobs],
        }


@dataclass(frozen=True)
class VariantCache:
    """The fixed cache A of one preset: entries sorted by MACs, affordability queries (method §3, §4)."""

    preset_name: str
    preset_digest: str
    classes: int
    entries: tuple[CacheEntry, ...]
    search: dict[str, Any] = field(hash=False)  # settings of the build: seed, population, generations, GA constants

    def __post_init__(self) -> None:
        if not self.entries:
            raise CacheError(
                f"variant cache of preset {self.preset_name} has no entries; build it with feast_edge.cache.build.build_cache"
            )
        macs = [e.macs for e in self.entries]
        if macs != sorted(macs):
            raise CacheError(
                f"variant cache of preset {self.preset_name} is not sorted by MACs; rebuild it with feast_edge.cache.build.build_cache"
            )
        if len({e.arch for e in self.entries}) != len(self.entries):
            raise CacheError(
                f"variant cache of preset {self.preset_name} lists an architecture twice; merge the duplicates (see CacheEntry.jobs)"
            )

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[CacheEntry]:
        return iter(self.entries)

    @property
    def archs(self) -> tuple[Arch, ...]:
        return tuple(e.arch for e in self.entries)

    @property
    def smallest(self) -> CacheEntry:
        """The globally smallest variant, affordable to every client (method §7 ``a_min``)."""
        return self.entries[0]

    @property
    def largest(self) -> CacheEntry:
        return self.entries[-1]

    def affordable(self, budget: float) -> tuple[CacheEntry, ...]:
        """``A_i = {a ∈ A : MAC(a) ≤ budget}``, sorted by MACs, possibly empty (method §4)."""
        return self.entries[: bisect.bisect_right([e.macs for e in self.entries], budget)]

    def largest_affordable(self, budget: float) -> CacheEntry:
        """The largest cached variant with MAC ≤ budget (method §8 serving)."""
        affordable = self.affordable(budget)
        if not affordable:
            raise CacheError(self.below_smallest(budget))
        return affordable[-1]

    def servable(self, budget: float, trained: Collection[int] | None = None) -> tuple[CacheEntry, ...]:
        """The variants a device of ``budget`` may be served, sorted by MACs: its affordable ones (method §8), or, given
        ``trained`` (the cache indices of the variants whose every slice some release moved: secure aggregation
        withholds slices, docs/security.md §10), those of them that trained; possibly none. CacheError below the
        smallest variant."""
        affordable = self.affordable(budget)
        if not affordable:
            raise CacheError(self.below_smallest(budget))
        return affordable if trained is None else tuple(e for i, e in enumerate(affordable) if i in trained)

    def largest_servable(self, budget: float, trained: Collection[int] | None = None) -> CacheEntry:
        """The largest of :meth:`servable`; a CacheError naming the fix when no variant is."""
        servable = self.servable(budget, trained)
        if not servable:
            raise CacheError(
                f"no variant a budget of {budget / 1e6:.2f}M MACs affords has been trained by a release yet (under "
                "--secure-agg a slice moves only once at least --colluders + 2 devices trained it in one round); run "
                "more rounds before serving"
            )
        return servable[-1]

    def below_smallest(self, budget: float, fix: str = "raise the budget or use a smaller preset") -> str:
        """The message for a budget that affords no cached variant, ending in ``fix``."""
        return f"budget {budget / 1e6:.2f}M MACs is below the smallest cached variant ({self.smallest.macs / 1e6:.2f}M MACs) of preset {self.preset_name}; {fix}"

    # -------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "preset": self.preset_name,
            "preset_digest": self.preset_digest,
            "classes": self.classes,
            "search": self.search,
            "entries": [e.to_dict() for e in self.entries],
        }

    def to_json(self) -> str:
        """JSON text: the header indented, one entry per line (readable diffs)."""
        record = self.to_dict()
        entries = record.pop("entries")
        head = json.dumps(record, indent=1)[:-2]
        body = ",\n".join("  " + json.dumps(e, separators=(", ", ": ")) for e in entries)
        return f'{head},\n "entries": [\n{body}\n ]\n}}\n'

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Atomically write the cache as JSON."""
        path = check_writable(path, "variant cache")
        return atomic_write_bytes(path, self.to_json().encode())


# ------------------------------------------------------------------ loading
def cache_path(preset: Preset) -> Path:
    """Where the cache shipped with the package for ``preset`` lives."""
    return CACHE_DIR / f"{preset.name}.json"


def user_cache_path(preset: Preset) -> Path | None:
    """``<dir>/<stem>.cache.json`` beside the file ``preset`` was loaded from; None for a built-in preset."""
    file = preset_file(preset)
    if file is None or file.parent == BUILTIN_DIR.resolve():
        return None
    return file.with_name(file.stem + CACHE_SUFFIX)


def default_cache_path(preset: Preset) -> Path:
    """The cache used without ``--cache``: the one beside the preset's own file if it exists, else the shipped one.

    A user preset with neither gets the path beside its file, so that the
    error says where ``feast-edge cache build`` puts it.
    """
    user = user_cache_path(preset)
    if user is not None and (user.exists() or not cache_path(preset).exists()):
        return user
    return cache_path(preset)


def _build_command(preset: Preset) -> str:
    """The command that builds ``preset``'s cache: by its file when it was loaded from one, else by name."""
    source = preset_file(preset)
    return f"feast-edge cache build --preset {source if source is not None else preset.name}"


def _fail(path: Any, problem: str, fix: str = "rebuild it with feast_edge.cache.build.build_cache") -> CacheError:
    return CacheError(f"variant cache {path}: {problem}; {fix}")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=1e-9)


def _entry_from_dict(data: Any, preset: Preset, classes: int, where: str) -> CacheEntry:
    if not isinstance(data, dict):
        raise _fail(where, f"entry is a {type(data).__name__}, expected an object")
    try:
        arch = Arch.from_dict(data["arch"]).validated(preset)
        jobs = tuple(SearchJob(float(j["target"]), float(j["rho0"]), int(j["seed"])) for j in data["jobs"])
        entry = CacheEntry(
            arch,
            int(data["macs"]),
            int(data["params"]),
            float(data["fitness"]),
            float(data["rho"]),
            float(data["entropy"]),
            jobs,
        )
    except ArchError as exc:
        raise _fail(where, f"holds an architecture that does not fit preset {preset.name} ({exc})") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise _fail(where, f"entry is malformed ({type(exc).__name__}: {exc})") from None
    if not jobs:
        raise _fail(where, "entry lists no search job")
    # Recompute everything derived from the arch: a stale cost model or fitness is caught here.
    if (entry.macs, entry.params) != arch_cost(preset, arch, classes):
        raise _fail(
            where,
            f"entry {arch} records {entry.macs} MACs / {entry.params} params, the cost model gives {arch_cost(preset, arch, classes)}",
        )
    fit = evaluate(preset, arch, classes=classes)
    if not (_close(entry.rho, fit.rho) and _close(entry.entropy, fit.entropy) and _close(entry.fitness, fit.fitness)):
        raise _fail(where, f"entry {arch} records fitness terms that differ from the current fitness (method §3)")
    return entry


def cache_from_dict(data: Any, preset: Preset, source: str = "<cache>") -> VariantCache:
    """Validate a JSON record against ``preset`` and build the cache."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _fail(
            source,
            f"is not a feast-edge variant cache (format {data.get('format') if isinstance(data, dict) else None!r})",
            "pass a file written by VariantCache.save",
        )
    if data.get("version") != VERSION:
        raise _fail(source, f"has version {data.get('version')!r}, this feast-edge reads version {VERSION}")
    name, digest = data.get("preset"), data.get("preset_digest")
    user = user_cache_path(preset)  # a user preset has no shipped cache: its fix is to build one
    if name != preset.name:
        raise _fail(
            source,
            f"was built for preset {name!r}, not {preset.name!r}",
            f"build the cache of preset {preset.name} with '{_build_command(preset)}' (it writes {user}) or pass --preset {name}"
            if user is not None
            else f"load the cache of preset {preset.name} (feast_edge/caches/{preset.name}.json) or pass --preset {name}",
        )
    if digest != preset.digest:
        raise _fail(
            source,
            f"was built for another definition of preset {name!r} (its shape digest differs)",
            f"rebuild it with '{_build_command(preset)}' (it writes {user}), or pass --cache FILE"
            if user is not None
            else f"rebuild it for the current preset {name}",
        )
    classes = data.get("classes")
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 1:
        raise _fail(source, f"has an invalid class count {classes!r}")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise _fail(source, "has no 'entries' list")
    search = data.get("search", {})
    if not isinstance(search, dict):
        raise _fail(source, "has a malformed 'search' record")
    parsed = tuple(_entry_from_dict(e, preset, classes, f"{source} entry {i}") for i, e in enumerate(entries))
    try:
        # A cache built before encodings of one network were merged may list one twice (see the module's docstring).
        return VariantCache(preset.name, preset.digest, classes, one_per_network(preset, parsed, classes), search)
    except CacheError as exc:
        raise _fail(source, str(exc)) from None


def load_cache(preset: Preset, path: str | os.PathLike[str] | None = None) -> VariantCache:
    """Load and validate a cache for ``preset``; default: :func:`default_cache_path` (beside its file, or shipped)."""
    given = path is not None
    path = default_cache_path(preset) if path is None else Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        build = _build_command(preset)
        raise _fail(
            path,
            "does not exist",
            f"pass the cache file you built ('{build} --out FILE' writes one)"
            if given
            else f"build it with '{build}' (it writes {path}), or pass --cache FILE",
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(path, f"cannot be read ({exc})", "check the path and its permissions") from None
    except json.JSONDecodeError as exc:
        raise _fail(path, f"is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return cache_from_dict(data, preset, str(path))


# ------------------------------------------------------------------ building
ProgressFn = Callable[[int, int, SearchResult], None]


def _job_order(job: SearchJob) -> tuple[float, int]:
    return job.target, job.seed


def one_per_network(preset: Preset, entries: Sequence[CacheEntry], classes: int) -> tuple[CacheEntry, ...]:
    """``entries`` with the encodings of one network (equal layouts) merged into one entry, order kept.

    The merged entry lists every job of the group and keeps the encoding of the
    earliest job (smallest target, then seed): the result does not depend on
    the order of ``entries``. One encoding listed twice is an error.
    """
    groups: dict[Layout, list[CacheEntry]] = {}
    for entry in entries:
        groups.setdefault(arch_layout(preset, entry.arch, classes), []).append(entry)
    merged = []
    for group in groups.values():
        if len({e.arch for e in group}) != len(group):
            raise CacheError(
                f"variant cache of preset {preset.name} lists an architecture twice; merge the duplicates (see CacheEntry.jobs)"
            )
        first = min(group, key=lambda e: (_job_order(e.jobs[0]), e.arch.text))
        jobs = tuple(sorted((j for e in group for j in e.jobs), key=_job_order))
        merged.append(replace(first, jobs=jobs))
    return tuple(merged)
