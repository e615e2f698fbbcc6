"""Settings nested by concern, and their flat form: the command line's options, stored configs and fingerprints.

A run's configuration (``SimulationConfig``, ``ServerConfig``) holds a few plain fields and one frozen dataclass per
concern (population, training, aggregation, privacy, validation, serving), each a :class:`Concern`. Every setting of
every concern has one *key*, unique across the configuration: its option is ``--key`` with dashes (``dp_clip`` is
``--dp-clip``) and its name in a run's stored config and fingerprint, as before settings were nested. So the flat form
is the contract the command line, run directories and Flower's run config keep, and the nested form is what code reads:
``config.privacy.dp_clip``, ``config.training.lr``.

    flat(config)               -> {"preset": ..., "per_round": 5, "lr": None, "dp_clip": None, ...}
    of(SimulationConfig, **kw) -> the configuration with the keys in ``kw`` changed from its defaults
    changed(config, **kw)      -> ``config`` with the keys in ``kw`` changed

Each setting is declared once, as its field: key, type and default, and with :func:`setting` its help (one sentence
for every app, plus an app's own words where the setting means more there: :class:`Help`), its bounds and the apps
that take it. The commands' options and ``--help`` (feast_edge.cli.panels) and Flower's run config
(feast_edge.flower.serverapp.run_config) are derived from these declarations.

    help_of(SimulationConfig, "simulation") -> {"per_round": "Clients sampled per round (m).", ...}
    bounds_of(ServerConfig)                 -> {"per_round": {"min": 1}, ...}
    accepted_by(ServerConfig, "flower")     -> the keys a Flower run config takes
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from feast_edge.errors import FeastError

C = TypeVar("C")
# Where a run is configured: feast-edge simulate, feast-server run, and a Flower run config (feast-server's settings).
APPS = ("simulation", "server", "flower")


class SettingsError(FeastError, ValueError):
    """A setting's value does not fit (the message names its option and what to give)."""


def check(checks: list[tuple[bool, str]]) -> None:
    """A SettingsError with the message of the first check that fails (a concern's ``__post_init__``)."""
    for ok, message in checks:
        if not ok:
            raise SettingsError(message)


@dataclass(frozen=True)
class Concern:
    """One concern's settings (frozen; each setting's key unique across a configuration)."""

    # The apps that take this concern's settings (a setting's own ``apps`` decides for it).
    apps: ClassVar[tuple[str, ...]] = APPS


@dataclass(frozen=True)
class Help:
    """A setting's help: one sentence every app shows, then the words an app adds where the setting means more there
    (``simulation``: feast-edge simulate and partition, ``server``: feast-server)."""

    core: str
    simulation: str = ""
    server: str = ""

    def text(self, app: str) -> str:
        """What ``app`` shows: the core sentence, then its own words."""
        words = getattr(self, app, "")
        return f"{self.core} {words}" if words else self.core


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str | Help | None = None,
    key: str | None = None,
    min: float | None = None,
    max: float | None = None,
    apps: tuple[str, ...] | None = None,
    **factory: Any,
) -> Any:
    """A setting's field, declared once: ``per_round: int = setting(5, min=1, help="Clients sampled per round.")``.

    ``help``: its help (a :class:`Help` where an app adds words; without one, no command builds an option from it);
    ``key``: its option and stored name where they differ from the field's name (``rule = setting("mean",
    key="aggregation")`` is ``--aggregation``); ``min``, ``max``: its option's bounds; ``apps``: the apps that take
    it, where they are fewer than its concern's."""
    unknown = set(apps or ()) - set(APPS)
    if unknown:
        raise ValueError(f"apps {sorted(unknown)} are none of {APPS}")
    metadata = {
        "key": key,
        "help": Help(help) if isinstance(help, str) else help,
        "bounds": {name: value for name, value in (("min", min), ("max", max)) if value is not None},
        "apps": apps,
    }
    given = {name: value for name, value in metadata.items() if value is not None and value != {}}
    return dataclasses.field(default=default, metadata=given, **factory)


def key_of(field: dataclasses.Field) -> str:
    """A concern field's key: its option without the dashes and its stored name."""
    return field.metadata.get("key", field.name)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def concern_fields(cls: type) -> dict[str, type]:
    """The fields of configuration class ``cls`` that are concerns, with their classes."""
    hints = _hints(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if isinstance(hints[f.name], type) and issubclass(hints[f.name], Concern)
    }


def _settings(cls: type) -> Iterator[tuple[str | None, dataclasses.Field, Any]]:
    """Every setting of ``cls``: (its concern's field name or None for a plain field, its field, its type)."""
    concerns = concern_fields(cls)
    for f in dataclasses.fields(cls):
        if f.name in concerns:
            hints = _hints(concerns[f.name])
            yield from ((f.name, g, hints[g.name]) for g in dataclasses.fields(concerns[f.name]))
        else:
            yield None, f, _hints(cls)[f.name]


def _declared(cls: type) -> Iterator[tuple[str, dataclasses.Field, tuple[str, ...]]]:
    """Every setting of ``cls``: (its key, its field, the apps that take it)."""
    concerns = concern_fields(cls)
    for concern, f, _ in _settings(cls):
        owner = concerns[concern] if concern is not None else Concern
        yield key_of(f), f, f.metadata.get("apps", owner.apps)


def declared_help(cls: type) -> dict[str, Help]:
    """Every key of configuration class ``cls`` that declares its help -> that declaration, in declaration order."""
    return {key: f.metadata["help"] for key, f, _ in _declared(cls) if "help" in f.metadata}


def help_of(cls: type, app: str) -> dict[str, str]:
    """Every key of configuration class ``cls`` that declares its help -> that help as ``app`` shows it, in declaration
    order."""
    return {key: declared.text(app) for key, declared in declared_help(cls).items()}


def bounds_of(cls: type) -> dict[str, dict[str, float]]:
    """Every key of configuration class ``cls`` that declares bounds -> them (``min``, ``max``)."""
    return {key: f.metadata["bounds"] for key, f, _ in _declared(cls) if "bounds" in f.metadata}


def accepted_by(cls: type, app: str) -> list[str]:
    """The keys of configuration class ``cls`` that ``app`` takes, in declaration order."""
    return [key for key, _, apps in _declared(cls) if app in apps]


def flat_types(cls: type) -> dict[str, Any]:
    """Every key of configuration class ``cls`` with its type (Flower's run config is checked against these)."""
    return {key_of(f): kind for _, f, kind in _settings(cls)}


def flat(config: Any) -> dict[str, Any]:
    """``config``'s settings by key, in declaration order: what runs stored before settings were nested."""
    values: dict[str, Any] = {}
    for concern, f, _ in _settings(type(config)):
        owner = config if concern is None else getattr(config, concern)
        values[key_of(f)] = getattr(owner, f.name)
    return values


def _grouped(cls: type, values: dict[str, Any]) -> dict[str | None, dict[str, Any]]:
    """``values`` by key, sorted out by concern (None: plain fields) and renamed to field names; a TypeError for a key
    ``cls`` does not have, as a dataclass gives for an unknown keyword."""
    where = {key_of(f): (concern, f.name) for concern, f, _ in _settings(cls)}
    unknown = sorted(set(values) - set(where))
    if unknown:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(unknown)}")
    grouped: dict[str | None, dict[str, Any]] = {}
    for key, value in values.items():
        concern, name = where[key]
        grouped.setdefault(concern, {})[name] = value
    return grouped


def _default_concerns(cls: type) -> dict[str, Any]:
    """The concern instances ``cls`` gives by default (each concern field has a default factory)."""
    concerns = concern_fields(cls)
    return {f.name: f.default_factory() for f in dataclasses.fields(cls) if f.name in concerns}  # type: ignore[misc]


def of(cls: Callable[..., C], **values: Any) -> C:
    """Configuration class ``cls`` with the settings ``values`` (by key) changed from its defaults."""
    grouped = _grouped(cls, values)  # type: ignore[arg-type]
    concerns = {
        name: dataclasses.replace(default, **grouped.get(name, {}))
        for name, default in _default_concerns(cls).items()  # type: ignore[arg-type]
    }
    return cls(**grouped.get(None, {}), **concerns)


def changed(config: C, **values: Any) -> C:
    """``config`` with the settings ``values`` (by key) changed."""
    grouped = _grouped(type(config), values)
    concerns = {
        name: dataclasses.replace(getattr(config, name), **grouped[name]) for name in grouped if name is not None
    }
    return dataclasses.replace(config, **grouped.get(None, {}), **concerns)  # type: ignore[type-var]


def concern_of_keys(cls: type) -> dict[str, str | None]:
    """Every key of configuration class ``cls`` -> the name of its concern (None: a plain field)."""
    return {key_of(f): concern for concern, f, _ in _settings(cls)}


def defaults(cls: Callable[..., Any], **required: Any) -> dict[str, Any]:
    """Every key of configuration class ``cls`` -> its default (``required``: the fields without one)."""
    return flat(cls(**required))
