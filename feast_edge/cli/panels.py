"""A command's options built from a run's settings (feast_edge.settings) and shown in ``--help`` by concern.

:func:`settings_options` gives a command one option per setting of a configuration class that declares its help
(type, default, help and bounds from the setting's declaration, feast_edge.settings.nested.setting; short flags and
how a value is read from the command), and the command receives their values as one dict by key, ready for
``Config.of(**settings)``. :func:`by_concern` puts every option of a command in the help panel of the
concern its setting belongs to (population, training, aggregation, privacy, validation, serving, network), and the
rest in the panel named for them.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Annotated, Any, Optional

import typer
from typer.models import OptionInfo

from feast_edge.cli.common import F, option_group
from feast_edge.settings.nested import bounds_of, concern_of_keys, defaults, flat_types, help_of

PANELS = {
    None: "Model and data",
    "population": "Population",
    "training": "Training",
    "aggregation": "Aggregation",
    "privacy": "Privacy",
    "validation": "Validation",
    "serving": "Serving",
    "network": "Network",
    "schedule": "Rounds: synchronous or buffered asynchronous",
    "timing": "Virtual clock",
    "secure": "Secure aggregation",
    "versions": "Versions",
}


def option_type(kind: Any) -> Any:
    """A setting's type as typer takes it: ``X | None`` as ``Optional[X]``; a bool-or-str setting as a string."""
    args = typing.get_args(kind)
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        inner = str if len(rest) > 1 else rest[0]
        return Optional[inner] if type(None) in args else inner
    return kind


def settings_options(
    config: Callable[..., Any],
    app: str,
    *,
    exclude: Collection[str] = (),
    flags: Mapping[str, tuple[str, ...]] = {},
    parse: Mapping[str, Callable[[Any], Any]] = {},
    cli_types: Mapping[str, Any] = {},
    required: Mapping[str, Any] = {},
) -> Callable[[F], F]:
    """Give a command an option for every setting of ``config`` that declares its help, in declaration order, with
    the help ``app`` shows (feast_edge.settings.nested.Help) and the declared bounds; the command receives ``settings:
    dict`` by key. ``exclude``: settings the command takes otherwise, or not at all; ``flags``: the option's names
    where they are not ``--key`` (e.g. ``("--preset", "-p")``); ``cli_types`` and ``parse``: a setting given as text on
    the command line and how it is read; ``required``: values for the fields without a default (to read the others'
    defaults)."""
    kinds, values, bounds = flat_types(config), defaults(config, **required), bounds_of(config)
    panels = {key: PANELS[concern] for key, concern in concern_of_keys(config).items()}
    options = {}
    for key, text in help_of(config, app).items():
        if key in exclude:
            continue
        names = flags.get(key, (f"--{key.replace('_', '-')}",))
        option = typer.Option(*names, help=text, rich_help_panel=panels[key], **bounds.get(key, {}))
        default = values[key]
        if key in cli_types:
            default = None if default is None else ",".join(str(v) for v in default)
        options[key] = (cli_types.get(key, option_type(kinds[key])), default, option)

    def build(given: dict[str, Any]) -> dict[str, Any]:
        return {key: parse[key](value) if key in parse and value is not None else value for key, value in given.items()}

    return option_group("settings", options, build)


def by_concern(config: type, renamed: Mapping[str, str] = {}, rest: str = "Run") -> Callable[[F], F]:
    """Show each option of a command in the ``--help`` panel of its setting's concern in ``config`` (``renamed``:
    parameter name -> setting key where they differ); options that are no setting, and have no panel yet, in
    ``rest``."""
    panels = {key: PANELS[concern] for key, concern in concern_of_keys(config).items()}

    def decorate(func: F) -> F:
        signature = inspect.signature(func, eval_str=True)
        params = []
        for param in signature.parameters.values():
            annotation = param.annotation
            if typing.get_origin(annotation) is Annotated:
                base, *meta = typing.get_args(annotation)
                panel = panels.get(renamed.get(param.name, param.name), rest)
                meta = [_in_panel(m, panel) if isinstance(m, OptionInfo) else m for m in meta]
                annotation = Annotated.__class_getitem__((base, *meta))  # type: ignore[attr-defined]
            params.append(param.replace(annotation=annotation))

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

        wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def _in_panel(option: OptionInfo, panel: str) -> OptionInfo:
    """``option`` (a copy: option types are shared between commands) shown in ``panel``, unless it has one."""
    if option.rich_help_panel is not None:
        return option
    option = copy.copy(option)
    option.rich_help_panel = panel
    return option
