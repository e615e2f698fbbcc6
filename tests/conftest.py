"""Fixtures shared by every layer: presets, reference data and the real Fashion-MNIST files."""

from __future__ import annotations

import importlib
import io
import logging
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from commands import share_the_cores
from feast_edge.data.images import FASHION_MNIST_DIR
from feast_edge.space.preset import Preset, load_preset_file
from simconfigs import cli_options, tiny_config
from strategies import PRESETS_DIR, TINY_PRESET

# Test models are small: one intra-op thread is as fast and avoids oversubscription
# when the suite shares the machine with other work.
torch.set_num_threads(1)

share_the_cores(os.environ, os.cpu_count() or 1)  # the processes tests start (tests/commands.py)

REPO = Path(__file__).resolve().parent.parent
REFERENCE_DIR = (
    Path(__file__).resolve().parent / "data" / "reference"
)  # test data only (README.md there); never package data


# Markers that follow from a fixture a test uses, directly or through other fixtures, wherever the test lives
# (the markers: pyproject.toml). Everything else is marked where it is written (pytestmark, @pytest.mark.*).
FIXTURE_MARKERS = {
    "finished_run": (
        pytest.mark.slow,
        pytest.mark.timeout(600),
        pytest.mark.xdist_group("finished_run"),  # one worker makes it once and runs every test that reads it
    ),  # a real feast-edge simulate run (below), made by the first test that asks
    "federation": (
        pytest.mark.broker,
    ),  # a federation on the broker at 127.0.0.1:1883 (tests/federation, tests/dashboard)
    "local_broker": (pytest.mark.broker,),  # the broker at 127.0.0.1:1883 (tests/transport)
    "secure_broker": (pytest.mark.broker,),  # a private mosquitto with TLS and passwords (tests/transport)
    "password_broker": (pytest.mark.broker,),  # a private mosquitto with passwords (tests/federation)
    "provisioned": (
        pytest.mark.broker,
        pytest.mark.slow,
    ),  # keys, certificates and a private mosquitto from feast-server provision (tests/federation)
    "browser": (pytest.mark.browser,),  # headless Chromium (tests/dashboard)
}


def _parametrize_arguments(item: pytest.Item) -> set[str]:
    """The names a test's @pytest.mark.parametrize fills directly (a value, not a fixture)."""
    names: set[str] = set()
    for mark in item.iter_markers("parametrize"):
        argnames = mark.args[0] if mark.args else mark.kwargs["argnames"]
        argnames = [n.strip() for n in argnames.split(",")] if isinstance(argnames, str) else list(argnames)
        indirect = mark.kwargs.get("indirect", False)
        names |= {
            n for n in argnames if not (indirect is True or (isinstance(indirect, (list, tuple)) and n in indirect))
        }
    return names


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture of module scope (made once per module and worker: a federation, a simulation)."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(chain and chain[-1].scope == "module" for chain in defs.values())


# before pytest's own hook deselects by -m, and before pytest-xdist's reads the xdist_group marks (--dist loadgroup)
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ())) - _parametrize_arguments(
            item
        )  # e.g. test_mqtt_topics' federation is a value
        for fixture, marks in FIXTURE_MARKERS.items():
            if fixture in used:
                for mark in marks:  # after the test's own marks: a @pytest.mark.timeout on the test wins
                    item.add_marker(mark)
        # The tests of a module that share a module fixture run on one pytest-xdist worker, so that it is made once.
        if item.get_closest_marker("xdist_group") is None and _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(f"module:{item.module.__name__}"))  # type: ignore[attr-defined]
    # The longest work first, each module's tests together and in their order: modules whose slow tests share a module
    # fixture (one worker runs them in a row), then other modules with slow tests, then the rest. The workers start on
    # the long work and end on short tests, instead of one of them running a long module alone at the end.
    rank: dict[object, int] = {}
    for item in items:
        if item.get_closest_marker("slow") is not None:
            module = getattr(item, "module", None)
            grouped = any(str(m.args[0]).startswith("module:") for m in item.iter_markers("xdist_group") if m.args)
            rank[module] = min(rank.get(module, 2), 0 if grouped else 1)
    items.sort(key=lambda item: rank.get(getattr(item, "module", None), 2))


@pytest.fixture(scope="session", autouse=True)
def _data_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The decoded-image cache (feast_edge.data.decoded_cache) of this session and its subprocesses: never ~/.cache."""
    folder = tmp_path_factory.mktemp("data-cache")
    before = os.environ.get("FEAST_EDGE_DATA_CACHE")
    os.environ["FEAST_EDGE_DATA_CACHE"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("FEAST_EDGE_DATA_CACHE", None)
    else:
        os.environ["FEAST_EDGE_DATA_CACHE"] = before


@pytest.fixture(scope="session", autouse=True)
def _test_presets() -> Iterator[None]:
    """The test presets (tests/presets: fmnist-tiny, test-tiny) found by name in this session and its subprocesses.

    A shard written for fmnist-tiny names it, and an agent loads the preset its shard names; a test of which presets
    are listed or shipped takes the variable away (monkeypatch.delenv)."""
    before = os.environ.get("FEAST_EDGE_PRESET_PATH")
    os.environ["FEAST_EDGE_PRESET_PATH"] = os.pathsep.join(filter(None, [str(PRESETS_DIR), before]))
    yield
    if before is None:
        os.environ.pop("FEAST_EDGE_PRESET_PATH", None)
    else:
        os.environ["FEAST_EDGE_PRESET_PATH"] = before


@pytest.fixture(scope="session")
def repo() -> Path:
    """The repository root (where pyproject.toml is)."""
    return REPO


@pytest.fixture(scope="session")
def project_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the copied sources, feast-edge's wheel), built once per test process: the tests that install it share the
    xdist group "wheel", so one worker builds it once per run (tests/wheels.py)."""
    from wheels import build_wheel

    return build_wheel(REPO, tmp_path_factory.mktemp("project-wheel"))


@pytest.fixture(scope="session")
def tiny() -> Preset:
    return load_preset_file(TINY_PRESET)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: tiny tensors only pay for threads, and a thread count fixes float summation order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def reference_cache_csv() -> Path:
    """The FEAST paper's CIFAR-100 variant cache (tests/data/reference/), the oracle of the cost, fitness and routing tests."""
    path = REFERENCE_DIR / "feast-cifar100-cache.csv"
    assert path.is_file(), (
        f"the reference cache {path} is part of the repository; restore it (git checkout -- {path.relative_to(REPO)})"
    )
    return path


@pytest.fixture
def full_float32() -> Iterator[None]:
    """Float32 arithmetic on a GPU for the test: no TF32 in cuDNN's convolutions (PyTorch's default on Ampere and
    later) nor in matrix products, so a CUDA result can be held to the CPU's within float32 rounding (TF32 keeps 10
    mantissa bits; after a few SGD steps its weights differed from the CPU's by 1e-2 on an H200)."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture(scope="session")
def fashion_mnist_dir() -> Path:
    # CI installs Debian's dataset-fashion-mnist; a missing data set is a setup error, not a skip.
    assert (FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz").exists() or (
        FASHION_MNIST_DIR / "t10k-images-idx3-ubyte"
    ).exists(), f"Fashion-MNIST is not installed in {FASHION_MNIST_DIR}: run 'apt-get install -y dataset-fashion-mnist'"
    return FASHION_MNIST_DIR


@dataclass(frozen=True)
class FinishedRun:
    """A finished ``feast-edge simulate`` run, made once per session: its directory (read it, never write to it) and what the command printed."""

    out: Path
    clients: int
    rounds: int
    result: subprocess.CompletedProcess[str]


@pytest.fixture(scope="session")
def finished_run(cli: Cli, tmp_path_factory: pytest.TempPathFactory, fashion_mnist_dir: Path) -> FinishedRun:
    """A real, small ``feast-edge simulate`` subprocess on fmnist-tiny: 2 clients, both in each of 2 rounds, validated
    every round (seconds).

    Tests that only inspect a finished run (its results.json, checkpoint, console
    output, the dashboard of it) share this one; a test of an option or of resuming
    makes its own run.
    """
    out = tmp_path_factory.mktemp("finished") / "sim"
    clients, rounds = 2, 2
    config = tiny_config(fashion_mnist_dir, clients=clients, per_round=clients, rounds=rounds, eval_every=1)
    result = cli.run(
        "simulate",
        "--out",
        str(out),
        *cli_options(config),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return FinishedRun(out, clients, rounds, result)


@pytest.fixture(scope="session")
def simulation_run(finished_run: FinishedRun) -> Path:
    """The directory of :func:`finished_run` (read-only)."""
    return finished_run.out


class Cli:
    """A console script and the contract of its user errors, run two ways.

    ``run`` starts it as a user does, a subprocess (``python -m MODULE``): for
    real runs and for what only a fresh process shows (environment variables read
    at import time, signals, a clean exit). ``invoke`` calls the console script's
    entry function (``[project.scripts]``) in this process, with ``sys.argv``,
    stdout and stderr of its own: the same ``error:`` line and exit status,
    seconds faster (no interpreter and no torch import), for error messages,
    exit codes and ``--help``. Both return a ``CompletedProcess``.
    """

    def __init__(self, module: str, entry: str, prog: str) -> None:
        self.module = module  # python -m MODULE
        self.entry = entry  # "package.module:function", as in pyproject.toml's [project.scripts]
        self.prog = prog

    def run(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 300, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", self.module, *args],
            check=False,
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "160", **(env or {})},
            timeout=timeout,
            cwd=cwd,
        )

    def invoke(
        self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """The entry function in this process; what it changes of the process (environment, cwd, logging, signals, torch) is put back."""
        module, _, function = self.entry.partition(":")
        main = getattr(importlib.import_module(module), function)
        with _process_state({"COLUMNS": "160", **(env or {})}, cwd) as process:
            sys.argv = [self.prog, *args]
            try:
                main()
                code = 0
            except SystemExit as exc:  # what the interpreter makes of it at exit
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if exc.code is not None and not isinstance(exc.code, int):
                    print(exc.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001 - an uncaught exception: a traceback on stderr and status 1, as in a process
                traceback.print_exc()
                code = 1
        return subprocess.CompletedProcess([self.prog, *args], code, process.stdout, process.stderr)

    @staticmethod
    def assert_user_error(result: subprocess.CompletedProcess[str], fragment: str) -> None:
        """Non-zero exit, no traceback, exactly one ``error:`` line on stderr that contains ``fragment``."""
        assert result.returncode != 0
        assert "Traceback" not in result.stderr + result.stdout
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert fragment in lines[0], lines[0]


class _Captured:
    stdout = ""
    stderr = ""


@contextmanager
def _process_state(env: dict[str, str], cwd: Path | None) -> Iterator[_Captured]:
    """The per-process state a console script may change, saved and restored around it; stdout and stderr captured as text."""
    argv, streams, environ, here = sys.argv, (sys.stdin, sys.stdout, sys.stderr), dict(os.environ), os.getcwd()
    root = logging.getLogger()
    root_level, root_handlers = root.level, list(root.handlers)
    levels = {
        name: logger.level
        for name, logger in logging.Logger.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    }
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    threads, deterministic, warn_only = (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    captured, out, err = _Captured(), io.StringIO(), io.StringIO()
    os.environ.update(env)
    try:
        if cwd is not None:
            os.chdir(cwd)
        sys.stdin, sys.stdout, sys.stderr = io.StringIO(), out, err  # no terminal, as with capture_output
        yield captured
    finally:
        captured.stdout, captured.stderr = out.getvalue(), err.getvalue()
        sys.argv, (sys.stdin, sys.stdout, sys.stderr) = argv, streams
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        for handler in root.handlers:
            if handler not in root_handlers:
                handler.close()  # e.g. the --log-file handler
        root.setLevel(root_level)
        root.handlers[:] = root_handlers
        for name, level in levels.items():  # loggers made during the call keep what their modules gave them
            logging.getLogger(name).setLevel(level)
        for s, handler in handlers.items():
            signal.signal(s, handler)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


@pytest.fixture(scope="session")
def cli() -> Cli:
    """``feast-edge``: ``run`` as a subprocess, ``invoke`` in this process."""
    return Cli("feast_edge.cli", "feast_edge.cli.main:main", "feast-edge")


@pytest.fixture(scope="session")
def server_cli() -> Cli:
    """``feast-server``: ``run`` as a subprocess, ``invoke`` in this process."""
    return Cli("feast_edge.server.cli", "feast_edge.server.cli:main", "feast-server")


@pytest.fixture(scope="session")
def agent_cli() -> Cli:
    """``feast-agent``: ``run`` as a subprocess, ``invoke`` in this process."""
    return Cli("feast_edge.agent.cli", "feast_edge.agent.cli:main", "feast-agent")
