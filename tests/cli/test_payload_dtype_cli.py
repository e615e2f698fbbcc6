"""--payload-dtype at the command line: an unsupported dtype is one error line; routing reports bytes per dtype."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize("command", [("simulate",), ("routing", "--preset", "fmnist-small")])
def test_an_unsupported_dtype_is_one_error_line(cli, command: tuple[str, ...], tmp_path: Path) -> None:
    args = (*command, "--out", str(tmp_path / "run")) if command[0] == "simulate" else command
    result = cli.invoke(*args, "--payload-dtype", "float8")
    cli.assert_user_error(result, "'float8' is not supported; choose one of float32, float16, bfloat16")


def test_the_server_refuses_an_unsupported_dtype_before_connecting(server_cli, tmp_path: Path) -> None:
    result = server_cli.invoke(
        "run", "--broker", "mqtt://127.0.0.1:1", "--out", str(tmp_path / "run"), "--payload-dtype", "int8"
    )
    server_cli.assert_user_error(
        result, "--payload-dtype 'int8' is not supported; choose one of float32, float16, bfloat16"
    )


def test_routing_counts_bytes_in_the_payload_dtype(cli) -> None:
    half = cli.invoke("routing", "--preset", "fmnist-small", "--budgets", "40M", "--payload-dtype", "float16")
    full = cli.invoke("routing", "--preset", "fmnist-small", "--budgets", "40M")
    assert half.returncode == 0 and full.returncode == 0, half.stderr + full.stderr
    line = next(row for row in half.stdout.splitlines() if "40.00M" in row or "40M" in row)
    mb_half = float(line.split("│")[5])
    mb_full = float(next(row for row in full.stdout.splitlines() if "40.00M" in row or "40M" in row).split("│")[5])
    assert mb_full == pytest.approx(2 * mb_half, rel=0.01)
    assert "as float16 vs" in half.stdout and "float32 broadcast" in half.stdout
