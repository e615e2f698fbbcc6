"""Server optimizers in whole runs: exact resume, avg bit-identical to method §6, baselines, checkpoints, bad options."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from feast_edge.run.checkpoint import EXTRA, load_supernet
from feast_edge.sim.setup import SimulationConfig, SimulationError
from feast_edge.sim.simulate import CHECKPOINT, Simulation
from simconfigs import tiny_config


def _config(fashion_mnist_dir, **changes) -> SimulationConfig:
    return tiny_config(fashion_mnist_dir, **{"per_round": 3, "seed": 5, **changes})


def _tensors(out) -> dict[str, torch.Tensor]:
    return load_file(str(out / CHECKPOINT))


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["momentum", "adam", "yogi"])
def test_a_resumed_run_ends_bit_identical_with_each_optimizer(opt, fashion_mnist_dir, tmp_path):
    config = _config(fashion_mnist_dir, server_opt=opt)
    Simulation(config, tmp_path / "whole").run()
    assert Simulation(config, tmp_path / "split").run(stop_after=1) is None
    Simulation(config, tmp_path / "split").run(resume=True)
    a, b = _tensors(tmp_path / "whole"), _tensors(tmp_path / "split")
    assert a.keys() == b.keys() and any(k.startswith(EXTRA) for k in a)  # the optimizer's state is checkpointed
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    # A resume that dropped the state would restart momentum and step counts: the weights would differ.
    state = {k: v for k, v in a.items() if k.startswith(EXTRA)}
    assert any(bool(v.abs().sum() > 0) for v in state.values())


@pytest.mark.slow
def test_avg_is_spec_6_bit_for_bit_and_an_optimizer_changes_the_weights(fashion_mnist_dir, tmp_path):
    default = _config(fashion_mnist_dir, rounds=2)
    explicit = _config(fashion_mnist_dir, rounds=2, server_opt="avg", server_lr=1.0)
    assert explicit.fingerprint() == default.fingerprint()  # earlier runs keep their fingerprints
    Simulation(default, tmp_path / "default").run(stop_after=2)
    Simulation(explicit, tmp_path / "explicit").run(stop_after=2)
    Simulation(_config(fashion_mnist_dir, rounds=2, server_opt="adam"), tmp_path / "adam").run(stop_after=2)
    a, b, c = (_tensors(tmp_path / d) for d in ("default", "explicit", "adam"))
    assert a.keys() == b.keys() and not any(k.startswith(EXTRA) for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    # A checkpoint with optimizer state still loads as a plain supernet (export, extract, serving).
    model, record = load_supernet(tmp_path / "adam" / CHECKPOINT)
    assert set(record["extra_tensors"]) and all(k.split("/")[0] in ("m", "v", "steps") for k in record["extra_tensors"])
    assert record["fields"]["config"]["server_optimizer"]["name"] == "adam"


@pytest.mark.slow
def test_a_baseline_that_averages_takes_an_optimizer(fashion_mnist_dir, tmp_path):
    config = _config(fashion_mnist_dir, method="heterofl", rounds=2, server_opt="momentum")
    Simulation(config, tmp_path / "m").run()
    Simulation(_config(fashion_mnist_dir, method="heterofl", rounds=2), tmp_path / "a").run()
    a, b = _tensors(tmp_path / "m"), _tensors(tmp_path / "a")
    assert any(k.startswith(EXTRA + "momentum/") for k in a)
    assert any(not torch.equal(a[k], b[k]) for k in b)


def test_the_centralized_reference_refuses_a_server_optimizer(fashion_mnist_dir):
    with pytest.raises(SimulationError, match="--server-opt adam needs a method whose aggregation is an average"):
        _config(fashion_mnist_dir, method="centralized", server_opt="adam")
    _config(fashion_mnist_dir, method="centralized")  # plain averaging is fine (nothing to step from)


@pytest.mark.slow
def test_resuming_with_another_optimizer_is_refused_and_writes_nothing(fashion_mnist_dir, tmp_path):
    Simulation(_config(fashion_mnist_dir, server_opt="momentum"), tmp_path).run(stop_after=1)
    before = (tmp_path / CHECKPOINT).read_bytes()
    with pytest.raises(SimulationError, match="server_optimizer.*--server-opt"):
        Simulation(_config(fashion_mnist_dir, server_opt="adam"), tmp_path).run(resume=True)
    assert (tmp_path / CHECKPOINT).read_bytes() == before


@pytest.mark.slow
def test_a_flipped_byte_in_the_optimizer_state_is_caught(fashion_mnist_dir, tmp_path):
    Simulation(_config(fashion_mnist_dir, server_opt="adam", rounds=1), tmp_path).run()
    path = tmp_path / CHECKPOINT
    blob = bytearray(path.read_bytes())
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    name = next(k for k in header if k.startswith(EXTRA + "v/"))
    start, end = header[name]["data_offsets"]
    blob[8 + size + (start + end) // 2] ^= 0x01  # one bit inside a second-moment tensor
    path.write_bytes(bytes(blob))
    with pytest.raises(Exception, match="corrupt|NaN"):
        load_supernet(path)


@pytest.mark.parametrize(
    "args, option",
    [
        (["--server-opt", "sgd"], "--server-opt"),
        (["--server-opt", "adam", "--server-lr", "-1"], "--server-lr"),
        (["--server-opt", "adam", "--server-lr", "nan"], "--server-lr"),
        (["--server-opt", "adam", "--server-betas", "0.9,1.5"], "--server-betas"),
        (["--server-opt", "adam", "--server-betas", "x"], "--server-betas"),
        (["--server-opt", "yogi", "--server-tau", "0"], "--server-tau"),
        (["--server-opt", "momentum", "--server-momentum", "1"], "--server-momentum"),
        (["--method", "centralized", "--server-opt", "adam"], "--server-opt"),
    ],
)
def test_simulate_refuses_bad_server_options_in_one_line(cli, args, option, tmp_path):
    result = cli.invoke("simulate", "--out", str(tmp_path / "run"), "--rounds", "1", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and option in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args, option",
    [
        (["--server-opt", "lamb"], "--server-opt"),
        (["--server-opt", "adam", "--server-lr", "0"], "--server-lr"),
        (["--server-opt", "adam", "--server-tau", "-1"], "--server-tau"),
    ],
)
def test_feast_server_refuses_bad_server_options_in_one_line(server_cli, args, option, tmp_path):
    result = server_cli.invoke("run", "--broker", "mqtt://127.0.0.1:1", "--out", str(tmp_path / "run"), *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and option in lines[0], result.stderr
    assert not (tmp_path / "run").exists()
