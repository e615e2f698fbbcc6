"""``feast-edge demo`` end to end, reduced to one round and small shards to keep CI time down.

The full demo (3 rounds, 800 examples per device) is timed in the report; here
the same code path runs with ``--rounds 1``: embedded broker, partition,
``feast-server`` and four ``feast-agent`` processes with different profiles,
export, push, onnxruntime, summary table.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

PROFILES = ("raspberry-pi-5", "jetson-nano", "laptop-cpu", "desktop-gpu")


@pytest.mark.slow
@pytest.mark.broker  # the demo's embedded broker is the mosquitto program
@pytest.mark.timeout(900)
def test_demo_trains_exports_and_times_a_model_for_every_device(cli, tmp_path: Path, fashion_mnist_dir: Path) -> None:
    result = cli.run("demo", "--rounds", "1", "--samples", "150", "--out", str(tmp_path / "demo"), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "broker: mosquitto (embedded" in out
    assert "round 1/1  replies 4/4  aggregated" in out
    for name in PROFILES:
        assert (tmp_path / "demo" / "device-models" / f"{name}.onnx").is_file()
        row = next(line for line in out.splitlines() if line.startswith(f"│ {name} "))
        assert f"{name}.onnx" in row and row.count("%") == 2
    assert "Wall time" in out


def _amqtt_env() -> dict[str, str]:
    """amqtt as `pip install 'feast-edge[amqtt]'` gives it: installed here, or in the directory make venv puts beside the
    venv (amqtt and flwr cannot share an environment; pyproject.toml says why)."""
    if importlib.util.find_spec("amqtt") is not None:
        return {}
    side = Path(sys.prefix) / "amqtt-side"
    if not (side / "amqtt").is_dir():
        pytest.skip(f"amqtt is not installed (pip install 'feast-edge[amqtt]'; make venv puts it in {side})")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(side), os.environ.get("PYTHONPATH")]))}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_runs_on_the_pure_python_broker(cli, tmp_path: Path, fashion_mnist_dir: Path) -> None:
    result = cli.run(
        "demo",
        "--rounds",
        "1",
        "--samples",
        "100",
        "--profiles",
        "jetson-nano,raspberry-pi-5",
        "--embedded-broker",
        "amqtt",
        "--out",
        str(tmp_path / "demo"),
        env=_amqtt_env(),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "broker: amqtt (embedded, pure Python)" in result.stdout
    assert "round 1/1  replies 2/2  aggregated" in result.stdout


def test_demo_without_the_data_set_says_how_to_get_it(cli, tmp_path: Path) -> None:
    result = cli.invoke("demo", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "demo"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("error: Fashion-MNIST is not installed in")
    assert "apt-get install dataset-fashion-mnist" in result.stderr
