"""--amp at the command line: unknown modes and impossible combinations are one error line; a bf16 simulation records it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from simconfigs import cli_options, tiny_config

# One round on fmnist-tiny, validated once (the options --amp and --deterministic are about).
TINY = cli_options(tiny_config(seed=3, rounds=1, eval_every=1))


def test_an_unknown_amp_mode_is_one_error_line(cli, agent_cli, tmp_path: Path) -> None:
    cli.assert_user_error(
        cli.invoke("simulate", "--out", str(tmp_path / "run"), "--amp", "fp8"),
        "--amp 'fp8' is unknown; choose one of off, auto, bf16, fp16",
    )
    result = agent_cli.invoke(
        "run",
        "--broker",
        "mqtt://127.0.0.1:1",
        "--device-id",
        "d1",
        "--data",
        str(tmp_path),
        "--budget",
        "40M",
        "--amp",
        "int8",
    )
    agent_cli.assert_user_error(result, "--amp 'int8' is unknown")
    assert not (tmp_path / "run").exists()


def test_amp_with_a_baseline_is_refused(cli, tmp_path: Path) -> None:
    cli.assert_user_error(
        cli.invoke("simulate", "--out", str(tmp_path), "--method", "heterofl", "--amp", "bf16"),
        "--amp bf16 applies to --method feast only",
    )


@pytest.mark.slow  # real simulations, subprocesses
def test_a_bf16_simulation_trains_in_bf16_and_keeps_float32_weights(cli, tmp_path: Path, fashion_mnist_dir) -> None:
    runs = {}
    for amp in ("off", "bf16"):
        out = tmp_path / amp
        result = cli.run(
            "simulate",
            "-o",
            str(out),
            *TINY,
            "--amp",
            amp,
        )
        assert result.returncode == 0, result.stderr
        assert ("training on cpu, " + ("bf16 autocast" if amp == "bf16" else "float32")) in result.stdout
        runs[amp] = json.loads((out / "results.json").read_text())["config"]
    assert runs["bf16"]["amp"] == "bf16" and runs["off"]["amp"] == "off"
    from safetensors.torch import load_file

    off, bf16 = (load_file(str(tmp_path / amp / "checkpoint.safetensors")) for amp in ("off", "bf16"))
    weights = [k for k, v in off.items() if v.is_floating_point()]
    assert all(bf16[k].dtype == torch.float32 for k in weights)
    assert any(not torch.equal(off[k], bf16[k]) for k in weights)  # the local passes ran in bfloat16


@pytest.mark.slow  # real simulations, subprocesses
def test_deterministic_kernels_change_nothing_on_the_cpu(cli, tmp_path: Path, fashion_mnist_dir) -> None:
    """--deterministic runs (no CPU op lacks a deterministic kernel) and ends with the weights of a plain run."""
    from safetensors.torch import load_file

    for name, extra in (("plain", ()), ("strict", ("--deterministic",))):
        result = cli.run(
            "simulate",
            "-o",
            str(tmp_path / name),
            *TINY,
            *extra,
        )
        assert result.returncode == 0, result.stderr
    plain, strict = (load_file(str(tmp_path / name / "checkpoint.safetensors")) for name in ("plain", "strict"))
    assert plain.keys() == strict.keys() and all(torch.equal(plain[k], strict[k]) for k in plain)
    recorded = {
        json.loads((tmp_path / name / "results.json").read_text())["config"]["deterministic"]
        for name in ("plain", "strict")
    }
    assert recorded == {False, True}
