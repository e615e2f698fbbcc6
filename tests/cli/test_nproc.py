"""``feast-edge simulate --nproc N``: the cohort spread over processes gives the weights of one process, bit for bit on CPU."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from feast_edge.cli.worker import COMMAND
from feast_edge.sim.distributed import Spread
from feast_edge.sim.simulate import CHECKPOINT, Simulation
from simconfigs import tiny_config
from strategies import FMNIST_TINY

# The --nproc path's real-size guard: RUN trains fmnist-small (the default preset); the other runs use fmnist-tiny.
# Both runs use one intra-op thread per process: the thread count changes PyTorch's float summation order.
RUN = (
    "--clients",
    "4",
    "--per-round",
    "4",
    "--rounds",
    "2",
    "--train-limit",
    "400",
    "--val-samples",
    "200",
    "--calib-samples",
    "100",
    "--test-limit",
    "200",
    "--eval-every",
    "1",
    "--device",
    "cpu",
    "--threads",
    "1",
)


def _simulate(cli, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    result = cli.run("simulate", *RUN, "--out", str(out), *extra)
    assert result.returncode == 0, result.stderr + result.stdout[-2000:]
    return result


def _assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = load_file(a), load_file(b)
    assert ta.keys() == tb.keys() and ta
    different = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not different, f"{len(different)} of {len(ta)} tensors differ, e.g. {different[:3]}"


@pytest.fixture(scope="module")
def one_process(cli, fashion_mnist_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("nproc1")
    _simulate(cli, out)
    return out


@pytest.mark.slow
def test_two_processes_give_the_weights_of_one(cli, one_process, tmp_path):
    result = _simulate(cli, tmp_path, "--nproc", "2")
    assert "spread over 2 processes (this machine, gloo, 1 intra-op thread each)" in result.stdout
    for name in ("checkpoint.safetensors", "best.safetensors"):
        _assert_same_tensors(one_process / name, tmp_path / name)
    rows = [list(csv.DictReader((d / "rounds.csv").open())) for d in (one_process, tmp_path)]
    assert [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]]
    tests = [
        [v["test_accuracy"] for v in json.loads((d / "results.json").read_text())["variants"]]
        for d in (one_process, tmp_path)
    ]
    assert tests[0] == tests[1]


@pytest.mark.slow
def test_capped_weights_are_the_same_in_one_process_or_two(cli, tmp_path):
    """--max-weight-ratio treats the shard sizes as claims on every rank's updates: a ratio small enough to bind
    lowers the same weights, and gives the same model, whether the cohort trains in one process or is spread."""
    runs = [tmp_path / "one", tmp_path / "two"]
    tiny = ("--preset", str(FMNIST_TINY), "--max-weight-ratio", "0.5")
    _simulate(cli, runs[0], *tiny)
    _simulate(cli, runs[1], *tiny, "--nproc", "2")
    capped = [[r["capped"] for r in json.loads((d / "results.json").read_text())["rounds"]] for d in runs]
    assert capped[0] == capped[1] and any(capped[0]), capped
    _assert_same_tensors(runs[0] / "checkpoint.safetensors", runs[1] / "checkpoint.safetensors")


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--nproc", "5"], "--nproc 5 exceeds the cohort (--per-round 4)"),
        (["--nproc", "0"], "--nproc 0 must be at least 1"),
        (["--nproc", "2", "--method", "centralized"], "--method centralized trains one pooled model"),
        (["--nproc", "2", "--dist-backend", "nccl"], "--dist-backend nccl needs CUDA GPUs"),
    ],
)
def test_unusable_process_counts_are_one_line_errors(cli, tmp_path, extra, fragment):
    result = cli.invoke("simulate", *RUN, "--out", str(tmp_path), *extra)
    assert result.returncode == 2
    cli.assert_user_error(result, fragment)
    assert not any(tmp_path.iterdir())  # refused before anything ran


def _children(pid: int) -> list[int]:
    return [int(p) for f in Path(f"/proc/{pid}/task").glob("*/children") for p in f.read_text().split()]


@pytest.mark.slow
def test_a_killed_worker_stops_the_run_with_one_line(fashion_mnist_dir, tmp_path):
    args = [*RUN, "--preset", str(FMNIST_TINY), "--clients", "8", "--rounds", "20", "--train-limit", "2000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "feast_edge.cli", "simulate", *args, "--nproc", "2", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / CHECKPOINT).exists():  # round 1 done: the worker is serving
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stderr.read() if proc.poll() is not None else "no round in 120 s"
            )
            time.sleep(0.1)
        workers = _children(proc.pid)
        assert len(workers) == 1
        subprocess.run(["kill", "-9", str(workers[0])], check=True)
        _, err = proc.communicate(timeout=60)  # a hang fails here
    finally:
        proc.kill()
    assert proc.returncode == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [
        "error: simulation process 1 of 2 was killed by signal 9; rerun (--resume continues from the last checkpoint)"
    ]


@pytest.mark.slow
def test_a_spread_run_resumes_to_the_weights_of_an_uninterrupted_one(fashion_mnist_dir, tmp_path, one_thread):
    config = tiny_config(fashion_mnist_dir, per_round=3, rounds=3, seed=3, batch_size=64)
    Simulation(config, tmp_path / "whole").run()
    for stop_after, resume in (
        (1, False),
        (None, True),
    ):  # "killed" after round 1, resumed with the cohort spread over 3 processes
        spread = Spread(config, nproc=2 if stop_after else 3, threads=1, command=COMMAND)
        sim = Simulation(config, tmp_path / "resumed", clients=spread.clients)
        try:
            sim.run(resume=resume, stop_after=stop_after)
        finally:
            spread.close()
    _assert_same_tensors(tmp_path / "whole" / CHECKPOINT, tmp_path / "resumed" / CHECKPOINT)


@pytest.mark.slow
def test_secure_sums_release_the_same_weights_whatever_the_number_of_processes(fashion_mnist_dir, tmp_path, one_thread):
    """--secure-agg over a cohort spread over 2 processes: fresh random masks every run, the same released weights
    (the masks cancel exactly and the fixed-point sum is exact)."""
    config = tiny_config(fashion_mnist_dir, per_round=3, clients=3, rounds=2, seed=3, batch_size=64).changed(
        secure_agg=True, colluders=0
    )
    whole = Simulation(config, tmp_path / "whole")
    whole.run()
    assert all(h.applied for h in whole.loop.history)
    spread = Spread(config, nproc=2, threads=1, command=COMMAND)
    sim = Simulation(config, tmp_path / "spread", clients=spread.clients)
    try:
        sim.run()
    finally:
        spread.close()
    assert [h.withheld for h in sim.loop.history] == [h.withheld for h in whole.loop.history]
    _assert_same_tensors(tmp_path / "whole" / CHECKPOINT, tmp_path / "spread" / CHECKPOINT)
