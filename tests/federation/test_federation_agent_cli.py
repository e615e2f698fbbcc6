"""feast-agent's local pieces: which data each hosted client gets, and the profile command wired to device profiling."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from feast_edge.agent.local_data import client_budgets, load_clients, parse_shard
from feast_edge.cache.variants import load_cache
from feast_edge.data.images import DataError
from feast_edge.sim.shards import read_index, read_shard, write_partition
from feast_edge.space.preset import load_preset


@pytest.fixture(scope="module")
def partition(kit, tmp_path_factory: pytest.TempPathFactory, fashion_mnist_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("partition")
    write_partition(kit.CONFIG.changed(clients=4, per_round=2), out)
    return out


def test_shards_of_a_fashion_mnist_directory_are_disjoint_and_cover_it(fashion_mnist_dir: Path) -> None:
    parts = [load_clients(fashion_mnist_dir, "lab", shard=f"{i}/3")[0] for i in range(3)]
    assert sum(p.samples for p in parts) == 60_000
    again = load_clients(fashion_mnist_dir, "lab", shard="1/3")[0]
    assert torch.equal(again.images, parts[1].images) and torch.equal(again.labels, parts[1].labels)  # deterministic
    keys = [set(map(bytes, p.images.view(p.samples, -1).numpy()[:500])) for p in parts]
    assert not (keys[0] & keys[1]) and not (keys[1] & keys[2])


def test_virtual_clients_split_the_agents_part(fashion_mnist_dir: Path) -> None:
    whole = load_clients(fashion_mnist_dir, "pi", shard="2/10")[0]
    hosted = load_clients(fashion_mnist_dir, "pi", clients=3, shard="2/10")
    assert [c.device_id for c in hosted] == ["pi-0", "pi-1", "pi-2"]
    assert torch.equal(torch.cat([c.labels for c in hosted]), whole.labels)
    assert all(c.budget_macs is None for c in hosted)


def test_partition_clients_keep_their_ids_budgets_and_shards(partition: Path) -> None:
    index = read_index(partition)
    hosted = load_clients(partition, "host", clients=2, offset=1)
    assert [c.device_id for c in hosted] == [e["client_id"] for e in index["clients"][1:3]]
    for c, entry in zip(hosted, index["clients"][1:3]):
        shard = read_shard(partition / entry["file"])
        assert (
            c.budget_macs == entry["budget_macs"]
            and torch.equal(c.images, shard.images)
            and c.samples == entry["samples"]
        )
    assert len(load_clients(partition, "host")) == 4
    single = load_clients(partition / "client-003.safetensors", "my-id")
    assert single[0].device_id == "my-id" and single[0].preset == "fmnist-tiny"  # kit.CONFIG's


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda p: load_clients(p / "nowhere", "d"), "does not exist; pass a Fashion-MNIST directory"),
        (lambda p: load_clients(p / "client-000.safetensors", "d", clients=2), "one client's shard file"),
        (lambda p: load_clients(p, "d", clients=3, offset=2), "outside the 4 clients"),
        (lambda p: load_clients(p, "d", shard="0/2"), "--shard cuts a Fashion-MNIST directory"),
        (lambda p: parse_shard("3/3"), "must be i/N with 0 <= i < N"),
    ],
)
def test_bad_data_choices_are_clear_errors(partition: Path, call, needle: str) -> None:
    with pytest.raises(DataError, match=needle):
        call(partition)


def test_a_corrupt_shard_file_is_refused(partition: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(Exception, match="is not a safetensors shard file"):
        load_clients(bad, "d")


@pytest.mark.slow  # a feast-agent process timing ONNX variants
def test_profile_command_measures_this_device_and_writes_a_usable_profile(kit, tmp_path: Path) -> None:
    out = tmp_path / "here.json"
    for _ in range(3):  # the profiler refuses timings made noisy by other work on these cores, as it should: again
        result = subprocess.run(
            [sys.executable, "-m", "feast_edge.agent.cli", "profile", "--out", str(out), "--variants", "3",
             "--repeats", "3", "--name", "ci-host", "--latency-target-ms", "100000"],
            cwd=kit.REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )  # fmt: skip
        if "dominated by noise" not in result.stderr:
            break
    assert result.returncode == 0, result.stderr
    from feast_edge.budget.profile import load_profile
    from feast_edge.cache.variants import load_cache
    from feast_edge.space.preset import load_preset

    profile = load_profile(out)
    assert profile.name == "ci-host" and profile.device == "cpu" and len(profile.measurements) == 3
    assert (
        profile.runtime.startswith("onnxruntime ") and len(profile.holdout) == 3
    )  # timed as served, three variants held out of the fit
    assert profile.budget_macs >= load_cache(load_preset(profile.preset)).smallest.macs
    assert "use it with: feast-agent run --profile" in result.stdout


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ((), "--precision 'fp8' is unknown; choose fp32 (float32), int8 (onnxruntime static quantization) or auto"),
        (("--runtime", "torch"), "--precision int8 times onnxruntime's int8 files"),
    ],
)
def test_profile_command_refuses_a_precision_it_cannot_time_in_one_line(
    agent_cli, tmp_path: Path, extra: tuple[str, ...], needle: str
) -> None:
    precision = "int8" if extra else "fp8"
    result = agent_cli.invoke("profile", "--out", str(tmp_path / "p.json"), "--precision", precision, *extra)
    agent_cli.assert_user_error(result, needle)
    assert result.returncode == 2 and not (tmp_path / "p.json").exists()


@pytest.mark.slow  # a federation or a real simulation of several seconds: out of the fast loop
def test_partition_command_writes_exactly_the_simulators_shards(kit, tmp_path: Path, fashion_mnist_dir: Path) -> None:
    from feast_edge.sim.setup import SimulationConfig, build_setup

    out = tmp_path / "part"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "feast_edge.cli",
            "partition",
            "--out",
            str(out),
            "--clients",
            "3",
            "--budgets",
            "3M,40M",
            "--train-limit",
            "300",
            "--val-samples",
            "50",
            "--calib-samples",
            "20",
            "--seed",
            "3",
        ],
        cwd=kit.REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    setup = build_setup(
        SimulationConfig.of(
            clients=3, per_round=1, budgets=(3e6, 40e6, 3e6), train_limit=300, val_samples=50, calib_samples=20, seed=3
        )
    )
    index = read_index(out)
    assert [c["client_id"] for c in index["clients"]] == setup.client_ids
    for entry, budget in zip(index["clients"], setup.population.budgets):
        shard = read_shard(out / entry["file"])
        images, labels = setup.client_data(entry["client_id"])
        assert (
            shard.budget_macs == float(budget)
            and torch.equal(shard.images, images)
            and torch.equal(shard.labels, labels)
        )


def test_client_budgets_check_each_hosted_client(kit, partition: Path) -> None:
    preset = load_preset(kit.CONFIG.preset)  # fmnist-tiny: cached variants from 0.148M MACs
    cache = load_cache(preset)
    hosted = load_clients(partition, "host", clients=2)
    index = read_index(partition)["clients"]
    assert client_budgets(hosted, preset, cache, None) == {e["client_id"]: int(e["budget_macs"]) for e in index[:2]}
    assert set(client_budgets(hosted, preset, cache, 1e6).values()) == {1_000_000}  # --budget overrides the shards'
    with pytest.raises(DataError, match="below the smallest cached variant"):
        client_budgets(hosted, preset, cache, 1e5)
    with pytest.raises(DataError, match="appears twice"):
        client_budgets([hosted[0], hosted[0]], preset, cache, None)
    with pytest.raises(DataError, match="no MAC budget for device d"):
        client_budgets([replace(hosted[0], device_id="d", budget_macs=None)], preset, cache, None)
    with pytest.raises(DataError, match="pass --preset fmnist-tiny"):
        client_budgets(hosted, load_preset("paper-cifar100"), load_cache(load_preset("paper-cifar100")), 600e6)
    with pytest.raises(DataError, match="hosts no clients"):
        client_budgets([], preset, cache, None)
