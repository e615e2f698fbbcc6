"""``feast-edge simulate --dashboard``: the simulation's clients, rounds and results on the page while it runs."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from simconfigs import cli_options, tiny_config

# A real feast-edge simulate process with its dashboard.
pytestmark = [pytest.mark.slow]


def test_a_simulation_shows_its_clients_rounds_and_results_live(tmp_path: Path, fashion_mnist_dir: Path) -> None:
    out = tmp_path / "sim"
    command = [
        sys.executable,
        "-m",
        "feast_edge.cli",
        "simulate",
        "--out",
        str(out),
        # fmnist-tiny; 1,200 examples: rounds of a second or more, so the polls below see one in progress
        *cli_options(
            tiny_config(
                fashion_mnist_dir,
                clients=3,
                rounds=3,
                train_limit=1200,
                val_samples=60,
                calib_samples=30,
                test_limit=60,
                eval_every=1,
            )
        ),  # fmt: skip
        "--dashboard",
        "127.0.0.1:0",
        "--tensorboard",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[dict] = []
    output = ""
    try:
        assert process.stdout is not None
        for line in process.stdout:  # the address comes before the first round
            output += line
            found = re.search(r"dashboard: (http://\S+)", line)
            if found:
                url = found.group(1)
                break
        else:
            raise AssertionError(f"no dashboard address in the output:\n{output}")
        with httpx.Client(timeout=5) as client:
            while process.poll() is None:
                try:
                    seen.append(client.get(url + "api/state").json())
                except httpx.HTTPError:
                    break  # the simulation finished and stopped its dashboard
                time.sleep(0.1)
        output += process.stdout.read()
    finally:
        process.kill() if process.poll() is None else None
        process.wait(30)
    assert process.returncode == 0, output
    assert seen, "the dashboard answered no request while the simulation ran"
    last = seen[-1]
    assert last["kind"] == "simulation" and last["run"]["method"] == "feast" and last["run"]["rounds_total"] == 3
    assert [d["name"] for d in last["devices"]] == ["client-000", "client-001", "client-002"]
    assert all(d["budget_macs"] > 0 and d["variant"]["macs"] <= d["budget_macs"] for d in last["devices"])
    assert any(
        s["round"] is not None
        and {m["state"] for m in s["round"]["members"]} <= {"routed", "training", "uploading", "aggregated"}
        for s in seen
    )
    rounds_seen = {h["round"] for s in seen for h in s["history"]}
    assert rounds_seen <= {1, 2, 3} and rounds_seen, rounds_seen
    assert all(
        0 < h["bytes_down"] <= h["broadcast_bytes"] for s in seen for h in s["history"]
    )  # routed slices, never more than a broadcast
    assert "feast-edge dashboard" in output  # how to browse the finished run
    assert (out / "rounds.csv").read_text().count("\n") == 4 and any((out / "tensorboard").iterdir())
