"""The package's import direction and module sizes, read from the source with ``ast`` (nothing is imported).

Imports run one way (STYLE.md): core (``feast_edge.*``, ``feast_edge.profiles``)
<- transport (``feast_edge.transport``) <- protocol (``feast_edge.protocol``)
<- apps (``feast_edge.server``, ``feast_edge.agent``) <- console scripts; Flower's adapter (``feast_edge.flower``)
has its records at the protocol layer and its ServerApp / ClientApp beside the server and the agent
(``feast_edge.cli``, ``feast_edge.server.cli``, ``feast_edge.agent.cli`` with ``fetch_cli``, ``profiles_cli``, ``versions_cli``
and ``identity``).
Every import counts, including those inside functions.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Source folder -> the package it is installed as (pyproject.toml [tool.setuptools.package-dir]).
PACKAGES = {
    "feast_edge": "feast_edge",
    "server": "feast_edge.server",
    "device_agent": "feast_edge.agent",
    "profiles": "feast_edge.profiles",
}
OLD_NAMES = ("server", "device_agent", "feast_mqtt")  # top-level import names before there was one, feast_edge
CORE, TRANSPORT, PROTOCOL, APPS, CONSOLE = range(5)
LAYER_NAMES = ("core", "transport", "protocol", "apps", "console")
AGENT_CONSOLE = (
    "feast_edge.agent.fetch_cli",
    "feast_edge.agent.profiles_cli",
    "feast_edge.agent.identity",
    "feast_edge.agent.versions_cli",
)  # feast-agent's commands beside its cli.py
FLOWER_APPS = ("feast_edge.flower.serverapp", "feast_edge.flower.clientapp")  # the Flower ServerApp and ClientApp
MAX_LINES = 450  # "no module much over 400 lines": past 450 a module holds more than one job


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer(module: str) -> int:
    """The layer of a ``feast_edge`` module."""
    console = ("feast_edge.cli", "feast_edge.server.cli", "feast_edge.agent.cli", *AGENT_CONSOLE)
    if any(_within(module, p) for p in console):
        return CONSOLE
    if (
        _within(module, "feast_edge.server")
        or _within(module, "feast_edge.agent")
        or any(_within(module, a) for a in FLOWER_APPS)
    ):
        return APPS
    if _within(module, "feast_edge.protocol") or _within(module, "feast_edge.flower"):
        return PROTOCOL
    if _within(module, "feast_edge.transport"):
        return TRANSPORT
    return CORE


def _app(module: str) -> str | None:
    """The application ``module`` belongs to: the server side (with the ServerApp) or the device side (the ClientApp)."""
    sides = {"feast_edge.flower.serverapp": "feast_edge.server", "feast_edge.flower.clientapp": "feast_edge.agent"}
    module = next((side for app, side in sides.items() if _within(module, app)), module)
    return next((app for app in ("feast_edge.server", "feast_edge.agent") if _within(module, app)), None)


@dataclass(frozen=True)
class Import:
    target: str  # the module imported (for ``from m import name``: ``m.name`` when that is a module)
    line: int


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    lines: int
    imports: tuple[Import, ...]


def _module_name(path: Path) -> str:
    folder = path.relative_to(REPO).parts[0]
    parts = [PACKAGES[folder], *path.relative_to(REPO / folder).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> tuple[Import, ...]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append(Import(candidate if candidate in known else base, node.lineno))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
            "import_module",
            "__import__",
        ):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append(Import(node.args[0].value, node.lineno))
    return tuple(found)


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    files = sorted(path for folder in PACKAGES for path in (REPO / folder).rglob("*.py"))
    names = {path: _module_name(path) for path in files}
    known = set(names.values())
    table = {}
    for path, name in names.items():
        source = path.read_text(encoding="utf-8")
        imports = _imports(ast.parse(source, str(path)), name, path.name == "__init__.py", known)
        table[name] = Module(name, path, source.count("\n"), imports)
    return table


def _where(module: Module, item: Import) -> str:
    return f"{module.path.relative_to(REPO)}:{item.line}"


def test_every_layer_is_found(modules: dict[str, Module]) -> None:
    """The walk sees the whole package (else the other tests would pass on nothing)."""
    assert {layer(name) for name in modules} == set(range(5))
    assert {
        "feast_edge.server.cli",
        "feast_edge.agent.agent",
        "feast_edge.profiles",
        "feast_edge.transport.link",
        "feast_edge.cli.main",
    } <= set(modules)


def test_imports_run_from_the_console_down_to_the_core(modules: dict[str, Module]) -> None:
    upward = [
        f"{_where(m, i)}: {m.name} ({LAYER_NAMES[layer(m.name)]}) imports {i.target} ({LAYER_NAMES[layer(i.target)]})"
        for m in modules.values()
        for i in m.imports
        if _within(i.target, "feast_edge") and layer(i.target) > layer(m.name)
    ]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_server_and_agent_do_not_import_each_other(modules: dict[str, Module]) -> None:
    crossing = [
        f"{_where(m, i)}: {m.name} imports {i.target}"
        for m in modules.values()
        for i in m.imports
        if _app(m.name) and _app(i.target) and _app(m.name) != _app(i.target)
    ]
    assert not crossing, "the two applications import each other:\n" + "\n".join(crossing)


def test_nothing_imports_the_old_top_level_names(modules: dict[str, Module]) -> None:
    scripts = [path for folder in ("tests", "bench") for path in sorted((REPO / folder).rglob("*.py"))]
    stale = [
        f"{_where(m, i)}: imports {i.target}"
        for m in modules.values()
        for i in m.imports
        if i.target.split(".")[0] in OLD_NAMES
    ]
    for path in scripts:
        for i in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path)), "__main__", False, set()):
            if i.target.split(".")[0] in OLD_NAMES:
                stale.append(f"{path.relative_to(REPO)}:{i.line}: imports {i.target}")
    assert not stale, (
        f"imports of {', '.join(OLD_NAMES)} (now feast_edge.server, feast_edge.agent, feast_edge.transport):\n"
        + "\n".join(stale)
    )


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself): Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles(modules: dict[str, Module]) -> None:
    """No two modules import each other, directly or through others, counting TYPE_CHECKING and function-level imports."""
    graph = {
        m.name: {i.target for i in m.imports if i.target in modules and i.target != m.name} for m in modules.values()
    }
    cycles = _cycles(graph)
    detail = [
        " <-> ".join(c)
        + ":\n"
        + "\n".join(
            f"  {_where(modules[a], i)}: {a} imports {i.target}"
            for a in c
            for i in modules[a].imports
            if i.target in c and i.target != a
        )
        for c in cycles
    ]
    assert not cycles, "import cycles:\n" + "\n".join(detail)


def test_the_cycle_check_finds_cycles() -> None:
    """The check itself: a two-module cycle and a three-module ring are found, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_module_is_much_over_400_lines(modules: dict[str, Module]) -> None:
    long = sorted((m.lines, str(m.path.relative_to(REPO))) for m in modules.values() if m.lines > MAX_LINES)
    assert not long, f"modules over {MAX_LINES} lines (split them by job):\n" + "\n".join(
        f"{path}: {n} lines" for n, path in reversed(long)
    )


def test_every_package_folder_is_in_the_wheel() -> None:
    """A folder of modules that pyproject.toml's package list forgets is missing from the wheel (its imports fail only
    where the package is installed, not in this checkout)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join((PACKAGES[folder.relative_to(REPO).parts[0]], *folder.relative_to(REPO).parts[1:]))
        for source in PACKAGES
        for folder in [REPO / source, *(p.parent for p in (REPO / source).rglob("__init__.py"))]
        if (folder / "__init__.py").is_file() and "__pycache__" not in folder.parts
    }
    assert found - listed == set(), f"add them to [tool.setuptools] packages: {sorted(found - listed)}"
