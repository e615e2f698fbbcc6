"""The feast-edge command line: its contracts in this process (``cli.invoke``), a real simulation as a subprocess (``cli.run``)."""

from __future__ import annotations

import io
import json
import os
import re
import time
from pathlib import Path

import pytest
from rich.console import Console

from feast_edge.budget.profile import load_profile
from feast_edge.cache.variants import load_cache
from feast_edge.cli.population import cycled_budgets, population_budgets
from feast_edge.cli.progress import Stage
from feast_edge.errors import FeastError
from feast_edge.server.demo_fleet import Fleet
from feast_edge.space.preset import load_preset
from strategies import FMNIST_TINY, TINY_PRESET

JSON_ARCH = '{"d":[3,7,6,7],"e":[0.18,0.18,0.1,0.1],"w":[2,0,0,0,0]}'
SMALL_ARCH = '{"d":[1,0,1,0],"e":[0.5,0.5,0.5,0.5],"w":[2,2,2,2,2]}'


def test_arch_json_reports_spec_figures(cli):
    result = cli.invoke("arch", "--preset", "paper-cifar100", "--classes", "10", "--json", "--arch", JSON_ARCH)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert (record["macs"], record["params"]) == (24957968, 327522)
    assert [s["blocks"] for s in record["stages"]] == [4, 8, 7, 8]
    assert sum(s["macs"] for s in record["stages"]) + record["stem"]["macs"] + record["classifier"]["macs"] == 24957968


def test_arch_table_accepts_text_form(cli):
    result = cli.invoke(
        "arch", "-p", "paper-cifar100", "-c", "10", "-a", "d=[3,7,6,7] e=[0.18,0.18,0.1,0.1] w=[2,0,0,0,0]"
    )
    assert result.returncode == 0, result.stderr
    assert "24,957,968" in result.stdout and "stage 4" in result.stdout


def test_help_everywhere(cli):
    for command in ([], ["arch"], ["export"], ["init"], ["presets"]):
        result = cli.invoke(*command, "--help")
        assert result.returncode == 0 and "Usage" in result.stdout


def test_user_preset_directory_is_listed(cli, monkeypatch):
    monkeypatch.delenv("FEAST_EDGE_PRESET_PATH")  # the session's (tests/conftest.py): listed only when set below
    assert "test-tiny" not in cli.invoke("presets").stdout
    result = cli.invoke("presets", env={"FEAST_EDGE_PRESET_PATH": str(TINY_PRESET.parent)})
    assert result.returncode == 0 and "test-tiny" in result.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["arch", "-p", "no-such-preset", "-a", JSON_ARCH], "unknown preset 'no-such-preset'; choose one of"),
        (["arch", "-p", "paper-cifar100", "-a", '{"d":[3,7'], "arch is not valid JSON"),
        (
            ["arch", "-p", "paper-cifar100", "-a", JSON_ARCH.replace("[2,0,0,0,0]", "[2,0,0,0,12]")],
            "w[4] = 12 is out of range",
        ),
        (["arch", "-p", "paper-cifar100", "-a", "d=1"], "cannot parse arch"),
    ],
)
def test_bad_arch_input_is_one_line(cli, args, fragment):
    cli.assert_user_error(cli.invoke(*args), fragment)


@pytest.fixture(scope="module")
def small_checkpoint(cli, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "small.safetensors"
    result = cli.invoke("init", "--preset", "fmnist-small", "--out", str(path), "--seed", "1")
    assert result.returncode == 0, result.stderr
    return path


def test_export_writes_onnx(cli, small_checkpoint, tmp_path, fashion_mnist_dir):
    out = tmp_path / "model.onnx"
    result = cli.invoke(
        "export",
        "-k",
        str(small_checkpoint),
        "-a",
        SMALL_ARCH,
        "-o",
        str(out),
        "--calibration-data",
        str(fashion_mnist_dir),
        "--calibration-samples",
        "128",
    )
    assert result.returncode == 0, result.stderr
    from feast_edge.evaluate.onnx_export import read_metadata

    meta = read_metadata(out)
    assert meta["preset"] == "fmnist-small" and meta["bn_recalibrated"] == "true"


def test_export_refuses_checkpoint_of_another_preset(cli, small_checkpoint, tmp_path):
    cli.assert_user_error(
        cli.invoke(
            "export",
            "-k",
            str(small_checkpoint),
            "-p",
            "paper-cifar100",
            "-a",
            JSON_ARCH,
            "-o",
            str(tmp_path / "m.onnx"),
        ),
        "holds a supernet of preset 'fmnist-small', not 'paper-cifar100'",
    )


def test_export_refuses_unwritable_output(cli, small_checkpoint, tmp_path):
    cli.assert_user_error(
        cli.invoke("export", "-k", str(small_checkpoint), "-a", SMALL_ARCH, "-o", str(tmp_path / "missing" / "m.onnx")),
        "directory",
    )
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(locked, os.W_OK):  # root ignores permission bits; the check must still refuse a directory target
        cli.assert_user_error(
            cli.invoke("export", "-k", str(small_checkpoint), "-a", SMALL_ARCH, "-o", str(locked)), "it is a directory"
        )
    else:
        cli.assert_user_error(
            cli.invoke("export", "-k", str(small_checkpoint), "-a", SMALL_ARCH, "-o", str(locked / "m.onnx")),
            "not writable",
        )


def test_export_refuses_arch_of_another_preset(cli, small_checkpoint, tmp_path):
    cli.assert_user_error(
        cli.invoke("export", "-k", str(small_checkpoint), "-a", JSON_ARCH, "-o", str(tmp_path / "m.onnx")),
        "preset fmnist-small allows",
    )


def test_export_refuses_pickle_checkpoint(cli, tmp_path):
    bogus = tmp_path / "model.pt"
    bogus.write_bytes(b"\x80\x04\x95not-a-checkpoint")
    cli.assert_user_error(
        cli.invoke("export", "-k", str(bogus), "-a", SMALL_ARCH, "-o", str(tmp_path / "m.onnx")),
        "not a safetensors checkpoint",
    )


def test_cache_build_and_show(cli, tmp_path):
    out = tmp_path / "cache.json"
    result = cli.invoke(
        "cache",
        "build",
        "-p",
        "fmnist-small",
        "--targets",
        "8M,20M",
        "--population",
        "16",
        "--generations",
        "5",
        "-o",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["preset"] == "fmnist-small" and len(record["entries"]) in (1, 2)
    shown = cli.invoke("cache", "show", "-p", "fmnist-small", "--cache", str(out))
    assert shown.returncode == 0 and "fmnist-small" in shown.stdout


def test_cache_of_another_preset_is_refused(cli, tmp_path):
    out = tmp_path / "cache.json"
    assert (
        cli.invoke(
            "cache",
            "build",
            "-p",
            "fmnist-small",
            "--targets",
            "8M",
            "--population",
            "8",
            "--generations",
            "2",
            "-o",
            str(out),
        ).returncode
        == 0
    )
    cli.assert_user_error(
        cli.invoke("cache", "show", "-p", "paper-cifar100", "--cache", str(out)), "not 'paper-cifar100'"
    )


def test_extract_finds_an_arch_under_budget(cli, small_checkpoint, tmp_path):
    result = cli.invoke(
        "extract", "-p", "fmnist-small", "--macs", "12M", "--population", "32", "--generations", "10", "--json"
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["macs"] <= 12e6
    onnx_out = tmp_path / "extracted.onnx"
    result = cli.invoke(
        "extract",
        "-p",
        "fmnist-small",
        "--macs",
        "12M",
        "--population",
        "32",
        "--generations",
        "10",
        "-k",
        str(small_checkpoint),
        "-o",
        str(onnx_out),
    )
    assert result.returncode == 0, result.stderr
    from feast_edge.evaluate.onnx_export import read_metadata

    assert int(read_metadata(onnx_out)["macs"]) <= 12e6


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["extract", "-p", "fmnist-small", "--macs", "1M"], "below the smallest architecture"),
        (["extract", "-p", "fmnist-small", "--macs", "twelve"], "cannot read 'twelve' as a MAC count"),
        (["cache", "build", "-p", "fmnist-small", "--targets", ",", "-o", "/tmp/x.json"], "--targets is empty"),
    ],
)
def test_bad_search_input_is_one_line(cli, args, fragment):
    cli.assert_user_error(cli.invoke(*args), fragment)


# --- simulate and partition ----------------------------------------------------------------------


def test_simulate_says_each_stage_and_the_one_based_best_round(finished_run):
    """The console output and results.json of the shared finished run (tests/conftest.py): 2 clients, 2 rounds, validated each round."""
    result, out = finished_run.result, finished_run.out
    lines = result.stdout.splitlines()
    assert lines[0].startswith("loading fashion-mnist from ") and lines[1].startswith(
        "population of 2 clients"
    )  # said before the slow start-up
    rounds = [line for line in lines if line.startswith("round ")]  # a start line, one per round, heartbeats between
    assert rounds[0].startswith("round 0/2 ") and [line.split()[1] for line in rounds] == sorted(
        line.split()[1] for line in rounds
    )
    reported = [line for line in rounds if " loss " in line]
    assert [line.split()[1] for line in reported] == ["1/2", "2/2"]
    assert re.search(r"loss \d+\.\d{3}  val \d+\.\d{2}%  best \d+\.\d{2}%", reported[-1])
    n = len(load_cache(load_preset(FMNIST_TINY)).entries)  # the finished run's preset
    testing = [line for line in lines if line.startswith(f"testing {n} cached variants (BN recalibration + test set) ")]
    assert testing[0].split(") ")[1].startswith(f"0/{n}") and testing[-1].split(") ")[1].startswith(f"{n}/{n}")
    results = json.loads((out / "results.json").read_text())
    validated = {r["round"]: r["val_accuracy"] for r in results["rounds"]}
    assert sorted(validated) == [1, 2] and results["best"]["round"] == max(validated, key=validated.get)
    # The table's title names the preset by name, and may wrap where the table is narrower (rich): read it as words.
    assert (
        f"fmnist-tiny, feast: test accuracy per served model (best checkpoint, round {results['best']['round']})"
        in (" ".join(result.stdout.split()))
    )


def test_simulate_errors_are_one_line(cli, tmp_path):
    cli.assert_user_error(cli.invoke("simulate", "-o", str(tmp_path), "--gamma", "-1"), "--gamma -1.0 must be >= 0")
    cli.assert_user_error(cli.invoke("simulate", "-o", str(tmp_path), "--data", str(tmp_path)), "Fashion-MNIST file")
    cli.assert_user_error(
        cli.invoke("simulate", "-o", str(tmp_path), "--budget-min", "1M"), "below the smallest cached variant"
    )
    cli.assert_user_error(
        cli.invoke("simulate", "-o", str(tmp_path), "--variants", "bogus", "--train-limit", "400"),
        "variants = 'bogus' is unknown",
    )
    cli.assert_user_error(
        cli.invoke("simulate", "-o", str(tmp_path), "--method", "bogus"),
        "unknown method 'bogus'; choose one of: feast, centralized, heterofl",
    )
    cli.assert_user_error(
        cli.invoke("simulate", "-o", str(tmp_path), "--method", "min"),
        "--method min is an ablation of FEAST; use --method feast --variants min",
    )
    cli.assert_user_error(
        cli.invoke("simulate", "-o", str(tmp_path), "--method", "heterofl", "--method-option", "depth=3"),
        "--method heterofl takes no option depth; its options: tiers",
    )
    cli.assert_user_error(
        cli.invoke("simulate", "-o", str(tmp_path), "--method", "scalefl", "--method-option", "beta"),
        "--method-option 'beta' is not KEY=VALUE",
    )
    cli.assert_user_error(
        cli.invoke("simulate", "-o", str(tmp_path), "--method", "fiarse", "--method-option", "sizes=half"),
        "--method-option sizes='half' for fiarse is malformed",
    )
    cli.assert_user_error(
        cli.invoke("simulate", "-o", str(tmp_path), "--augment", "jitter"), "augment = 'jitter' is unknown"
    )
    cli.assert_user_error(
        cli.invoke("simulate", "-o", str(tmp_path), "--recipe", "warmup=3"), "unknown training setting(s) warmup"
    )
    cli.assert_user_error(
        cli.invoke(
            "simulate",
            "-o",
            str(tmp_path / "fresh"),
            "--resume",
            "--clients",
            "4",
            "--per-round",
            "2",
            "--train-limit",
            "400",
        ),
        "no checkpoint at",
    )


def test_server_run_takes_the_ablation_as_variants_and_refuses_method(server_cli, tmp_path):
    """feast-server run trains FEAST: its ablation is --variants, as in feast-edge simulate, where --method is the algorithm."""
    refused = server_cli.invoke(
        "run", "--out", str(tmp_path), "--method", "min+max"
    )  # refused before anything else, the broker included
    server_cli.assert_user_error(
        refused, "feast-server run has no --method; the ablation is --variants min+max (as in feast-edge simulate)"
    )
    server_cli.assert_user_error(
        server_cli.invoke("run", "--method", "heterofl"),
        "the ablation is --variants MODE (min, max, min+max, min+max+kd, full)",
    )
    bogus = server_cli.invoke(
        "run", "--insecure", "--broker", "mqtt://127.0.0.1:1", "--out", str(tmp_path / "run"), "--variants", "bogus"
    )
    server_cli.assert_user_error(bogus, "variants = 'bogus' is unknown")
    assert "--variants" in server_cli.invoke("run", "--help", env={"COLUMNS": "200"}).stdout


def test_server_eval_every_help_says_the_devices_validate_without_data(server_cli):
    text = " ".join(server_cli.invoke("run", "--help", env={"COLUMNS": "200"}).stdout.replace("│", " ").split())
    option = text[text.index("--eval-every") : text.index("--val-samples")]
    assert "on --data, or without it on the held-out examples of the round's devices" in option, option
    assert "needs --data" not in option


def test_partition_takes_the_population_options_of_simulate(cli, tmp_path, fashion_mnist_dir):
    result = cli.invoke(
        "partition",
        "-o",
        str(tmp_path),
        "--clients",
        "3",
        "--profiles",
        "jetson-nano,desktop-gpu",
        "--train-limit",
        "90",
        "--val-samples",
        "50",
        "--calib-samples",
        "20",
    )
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "index.json").read_text())
    nano, gpu = load_profile("jetson-nano").budget_macs, load_profile("desktop-gpu").budget_macs
    assert [c["budget_macs"] for c in index["clients"]] == [nano, gpu, nano]
    assert sum(c["samples"] for c in index["clients"]) == 90
    helps = {command: cli.invoke(command, "--help").stdout for command in ("simulate", "partition")}
    for option in (
        "--budgets",
        "--profiles",
        "--gamma",
        "--zipf-s",
        "--alpha-eff",
        "--budget-cap",
        "--val-samples",
        "--train-limit",
        "--cache",
    ):
        assert all(text.count(f"{option} ") == 1 for text in helps.values()), option


def test_budget_list_is_cycled_over_clients():
    assert cycled_budgets("2M, 5M", 5) == (2e6, 5e6, 2e6, 5e6, 2e6)
    with pytest.raises(FeastError, match="--budgets is empty"):
        cycled_budgets(" , ", 3)


def test_population_from_device_profiles():
    nano, gpu = load_profile("jetson-nano").budget_macs, load_profile("desktop-gpu").budget_macs
    assert population_budgets(None, "jetson-nano,desktop-gpu", 3, "fmnist-small") == (nano, gpu, nano)
    assert population_budgets(None, None, 3, "fmnist-small") is None
    with pytest.raises(FeastError, match="pass one of them"):
        population_budgets("2M", "jetson-nano", 3, "fmnist-small")
    with pytest.raises(FeastError, match="not paper-cifar100"):
        population_budgets(None, "jetson-nano", 3, "paper-cifar100")


def test_a_stage_outside_a_terminal_says_where_it_stands_and_keeps_a_heartbeat():
    out = io.StringIO()
    with Stage(Console(file=out, width=200), "round", 3, heartbeat=0.05) as stage:  # a StringIO is no terminal
        stage.update(1, "loss 2.000", line=True)
        deadline = time.monotonic() + 30
        while len(out.getvalue().splitlines()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        stage.update(2)  # no line of its own
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("round 0/3  (") and lines[1].startswith("round 1/3  loss 2.000  (")
    assert lines[2].startswith(
        "round 1/3  ("
    )  # a heartbeat: the count and the time, not the last round's figures again
    assert lines[-1].startswith("round 2/3  (")  # the last line says where the step ended


# --- demo: following its processes through their console logs -------------------------------------


def test_demo_reads_round_lines_with_or_without_time_stamps_and_says_what_it_waits_for(tmp_path: Path):
    fleet = Fleet(tmp_path, ["pi", "nano", "gpu"], rounds=2)
    (tmp_path / "server.log").write_text(
        "10:00:00 connected to MQTT broker at 127.0.0.1:1883 as feast-1\n"
        "10:00:09 round 1/2  replies 3/3  aggregated  loss 2.1000  val 12.00%  4.0 s\n"
        "10:00:10 warning: round 2: nano went offline; not waiting for its update\n"
        "round 2/2  replies 2/3  aggregated  loss 2.0000  val 13.00%  4.0 s\n"
    )
    assert fleet.round_lines() == [
        "round 1/2  replies 3/3  aggregated  loss 2.1000  val 12.00%  4.0 s",
        "round 2/2  replies 2/3  aggregated  loss 2.0000  val 13.00%  4.0 s",
    ]
    (tmp_path / "agent-pi.log").write_text(
        "10:00:01 registered pi with federation 'f'; waiting for rounds\n10:00:05 round 1/2: pi sent its update: loss 2.2\n"
    )
    (tmp_path / "agent-nano.log").write_text("10:00:01 connected to MQTT broker at 127.0.0.1:1883 as feast-2\n")
    since = 0.0
    assert re.fullmatch(
        r"feast-server up; agents registered 1/3 \(waiting: nano connected, gpu starting\) \(\d+ s\)",
        fleet.status(0, since),
    )
    (tmp_path / "agent-nano.log").write_text("registered nano with federation 'f'\n")
    (tmp_path / "agent-gpu.log").write_text("registered gpu with federation 'f'\n")
    assert fleet.status(0, since).startswith("round 1/2 running: updates sent 1/3 ")
    assert fleet.status(2, since).startswith("devices preparing their models: 0/3 done (exporting: pi, nano, gpu) (")
    (tmp_path / "agent-pi.log").write_text(
        "10:01:00 exported the model of pi (BN of the federation's data) to m/pi.onnx\n"
        "10:01:00 pi: personalizing the served model on its data (--personalize auto)\n"
    )
    (tmp_path / "agent-nano.log").write_text(
        "exported the model of nano to m/nano.onnx\nnano: personalizing the served model on its data\n"
        "nano keeps the served model alone: no method beat the served model on the selection split\n"
    )
    (tmp_path / "agent-gpu.log").write_text(
        "exported the model of gpu to m/gpu.onnx\ngpu: personalizing the served model on its data\n"
        "gpu: personal model written to m/gpu.personal.onnx: chose prior (tau 1)\n"
    )
    assert fleet.status(2, since).startswith("devices preparing their models: 2/3 done (personalizing: pi) (")
    (tmp_path / "agent-pi.log").write_text("exported the model of pi to m/pi.onnx\n")  # --personalize off
    assert fleet.status(2, since).startswith("devices preparing their models: 3/3 done (")
    # Progress, which the demo's stall limit watches: round lines, updates sent, devices done with their model.
    assert fleet.progress() == (2, 0, 3)
    (tmp_path / "agent-nano.log").write_text("round 3/3: nano sent its update: loss 1.9\n")
    assert fleet.progress() == (2, 1, 2)


def test_heartbeat_speaks_while_a_step_runs_and_stops_after(caplog) -> None:
    import logging
    import threading

    from feast_edge.cli.common import heartbeat

    logger = logging.getLogger("feast_edge.test")
    with caplog.at_level(logging.INFO, logger="feast_edge.test"):
        with heartbeat(logger, "still exporting", every=0.01):
            for _ in range(500):  # the block waits until the heartbeat has spoken (or 5 s pass)
                if any(r.getMessage().startswith("still exporting (") for r in caplog.records):
                    break
                threading.Event().wait(0.01)
        count = len(caplog.records)
        threading.Event().wait(0.05)
    assert count >= 1 and caplog.records[0].getMessage().startswith("still exporting (")
    assert len(caplog.records) == count  # nothing after the block ended
