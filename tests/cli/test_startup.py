"""What a command pays before it does anything: its imports.

Importing torchvision pulls in its models and with them ``torch._dynamo``: about two seconds on a 2-core AMD EPYC
(Zen 2), more on a Jetson, for every ``feast-agent``, ``feast-server`` and ``feast-edge`` start. Only the
Fashion-MNIST reader and the training augmenter use it, so they import it when they run. These tests hold that line
in a fresh interpreter (a test process has long imported everything); they time nothing.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CONSOLE_MODULES = ("feast_edge.agent.cli", "feast_edge.server.cli", "feast_edge.cli.main")


def _torchvision_after(steps: dict[str, str]) -> dict[str, bool]:
    """In one fresh interpreter, whether torchvision is imported after each step's code runs (in order)."""
    probe = ["import sys"]
    for name, code in steps.items():
        probe += [code, f"print({name!r}, 'torchvision' in sys.modules, 'torch' in sys.modules)"]
    result = subprocess.run([sys.executable, "-c", "\n".join(probe)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert all(flags.split()[1] == "True" for flags in seen.values()), seen  # the probe sees torch: it works
    return {name: flags.split()[0] == "True" for name, flags in seen.items()}


@pytest.mark.slow  # a federation or a real simulation of several seconds: out of the fast loop
def test_the_console_scripts_start_without_torchvision_and_its_two_users_import_it_when_they_run(
    fashion_mnist_dir,
) -> None:
    seen = _torchvision_after(
        {
            **{module: f"import {module}" for module in CONSOLE_MODULES},
            "augmenter": "from feast_edge.local.augment import BatchAugmenter; BatchAugmenter((0.5,), (0.5,), 10)",
        }
    )
    assert seen == {**dict.fromkeys(CONSOLE_MODULES, False), "augmenter": True}
    seen = _torchvision_after(
        {
            "import": "from pathlib import Path; from feast_edge.data.images import load_fashion_mnist",
            "reader": f"load_fashion_mnist(Path({str(fashion_mnist_dir)!r}), 'test')",
        }
    )
    assert seen == {"import": False, "reader": True}


def test_a_process_a_test_starts_under_three_workers_on_two_cores_takes_one_thread() -> None:
    from commands import share_the_cores

    environ = {"PYTEST_XDIST_WORKER_COUNT": "3"}
    share_the_cores(environ, cores=2)
    probe = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    result = subprocess.run(
        probe, capture_output=True, text=True, timeout=120, env={**environ, "PATH": "/usr/bin:/bin"}
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1"]
    shares = {}
    for workers, cores in [("2", 16), ("4", 2), ("1", 16)]:
        environ = {"PYTEST_XDIST_WORKER_COUNT": workers}
        share_the_cores(environ, cores)
        shares[workers, cores] = environ.get("OMP_NUM_THREADS")
    assert shares == {("2", 16): "8", ("4", 2): "1", ("1", 16): None}  # one worker: PyTorch's own default
    mine = {"PYTEST_XDIST_WORKER_COUNT": "2", "OMP_NUM_THREADS": "3"}
    share_the_cores(mine, cores=2)
    assert mine["OMP_NUM_THREADS"] == "3"  # the caller's setting is kept
