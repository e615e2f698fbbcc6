"""A federation on the devices' own data: the server holds none, agents train image folders of their own classes.

Real agent processes (``feast-agent run --data FOLDER``) on PNG/JPEG files written here, a real broker, a
server thread without ``--data``: validation is federated (the cohort tests the probes on its held-out
splits), and every device ends with an ONNX model whose BN it recalibrated on its own data and whose
held-out accuracy it reported.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
from imagefolders import write_image_folder
from strategies import FMNIST_TINY

from feast_edge.agent.local_data import load_clients
from feast_edge.dashboard import DashboardState, load_runs
from feast_edge.data.images import FASHION_MNIST_CLASSES, load_fashion_mnist
from feast_edge.evaluate.coverage import required_gain
from feast_edge.evaluate.onnx_export import read_metadata
from feast_edge.evaluate.served_round import served_round
from feast_edge.server.app import FederationServer, ServerConfig
from feast_edge.space.preset import load_preset
from feast_edge.transport.broker import LinkConfig

pytestmark = [pytest.mark.slow, pytest.mark.broker]

# Each device holds its own classes (three overlapping subsets of the ten), its own image formats and sizes, and a
# budget in fmnist-tiny's range (0.15M-1.5M MACs; the int8 test's profile is fmnist-small's raspberry-pi-5).
DEVICES = {
    "cam-a": ((0, 1, 2, 3, 4), 220_000, "png-grey"),
    "cam-b": ((3, 4, 5, 6), 750_000, "jpeg-rgb-56"),
    "cam-c": ((5, 6, 7, 8, 9), 1_500_000, "png-rgb-40"),
}
TINY = ("--preset", "fmnist-tiny")  # the agents' preset (image folders name none): the servers' below
PER_CLASS = 40


def write_folder(root: Path, classes: tuple[int, ...], style: str, train, offset: int) -> None:
    """``PER_CLASS`` Fashion-MNIST training images of each class as files ``root/<class name>/*``."""
    write_image_folder(root, dict.fromkeys(classes, PER_CLASS), style, train, FASHION_MNIST_CLASSES, offset)


def held_out(root: Path) -> int:
    """The images an agent holds out of ``root`` by default: a tenth in expectation, each by its content."""
    return load_clients(root, "any", task=load_preset(str(FMNIST_TINY)).task)[0].holdout


def test_a_server_without_data_validates_on_the_devices_and_federates_bn_statistics(
    kit, federation: str, tmp_path: Path, fashion_mnist_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Also the label-skewed top tier of issue 37: the largest variant (1.5M MACs) is reachable by cam-c alone, which
    holds classes five to nine. The server warns of it; every device evaluates it (memory allows), so its validation
    covers all ten classes; and each device is served what that validation supports."""
    caplog.set_level(logging.WARNING, logger="feast_edge.server.coverage")
    caplog.set_level(logging.INFO, logger="feast_edge.server.host")
    train = load_fashion_mnist(fashion_mnist_dir, "train")
    for k, (device, (classes, _, style)) in enumerate(DEVICES.items()):
        write_folder(tmp_path / "data" / device, classes, style, train, offset=k * PER_CLASS)
    config = ServerConfig.of(
        out=str(tmp_path / "server"),
        preset=kit.CONFIG.preset,
        federation=federation,
        rounds=2,
        per_round=3,
        min_clients=3,
        start_clients=3,
        eval_every=1,
        round_timeout=180.0,
        wait_timeout=180.0,
        batch_size=32,
        calib_samples=100,
        serve_average=2,  # round 2 has two candidates: its own weights and the mean of rounds 1-2's
    )
    live = DashboardState("federation", "own data")
    server = FederationServer(config, LinkConfig(broker=kit.LOCAL), dashboard=live)
    models = tmp_path / "models"

    def start_agents() -> dict:
        return {
            device: kit.spawn_agent(
                tmp_path / "logs",
                device,
                tmp_path / "data" / device,
                federation,
                "--budget",
                str(budget),
                "--model-dir",
                str(models),
                *TINY,
            )
            for device, (_, budget, _) in DEVICES.items()
        }

    outcome = kit.own_data_federation(server, start_agents)
    agents = outcome["agents"]

    # The served round: the rule's choice over the devices' votes on their served variants, in every manifest with
    # its reason, said in the server's log; the weights exported are that round's. No device is called possibly
    # false: they differ by their classes only.
    history = outcome["history"]
    choice = served_round([(h.round, h.validation) for h in history])
    # Round 2 offered its own weights or the mean of rounds 1-2's, whichever the three agents' paired figures favour
    # (each tested both in one request); then the rule judged it against round 1.
    candidates = history[-1].candidates
    assert candidates["of"] == [1, 2] and candidates["voters"] == sorted(DEVICES)
    averaged = choice.round == 2 and candidates["choice"] == "mean"
    step = candidates["reason"]
    reason = f"{step}; {choice.reason}" if choice.round == 2 else f"{choice.reason} (round 2's candidate: {step})"
    served = {"round": choice.round, "of": 2, "reason": reason, **({"average_of": [1, 2]} if averaged else {})}
    weights = "the mean of the weights of rounds 1-2 of 2" if averaged else f"the weights of round {choice.round} of 2"
    for m in outcome["manifests"]:
        assert m["served_round"] == served
        assert m["rounds"] == choice.round
    assert f"round 2: serving {reason}" in caplog.text
    assert [h.validation["flagged"] for h in history] == [{}, {}]
    # Federated validation: every round validated on all three devices' held-out splits.
    for record in outcome["history"]:
        assert record.applied and sorted(record.updated) == sorted(DEVICES)
        assert record.validation["source"] == "devices" and record.validation["devices"] == sorted(DEVICES)
        assert record.val_accuracy is not None and 0.0 <= record.val_accuracy <= 1.0
        # A tenth of each device's images held out (by content: Binomial(40, 0.1) of a class), never trained on.
        assert record.validation["samples"] == sum(held_out(tmp_path / "data" / device) for device in DEVICES)
    # The server's export holds weights only, their BN statistics federated: each served variant's come from every
    # device that may evaluate it (here all three: a device evaluates above its budget when memory allows), 100
    # examples each.
    for m in outcome["manifests"]:
        assert m["calibration"] == "federated" and m["file"].endswith(".variant.safetensors")
        assert m["calibration_devices"] == sorted(DEVICES) and m["calibration_samples"] == 100 * len(DEVICES)
        assert m["coverage"]["calibrated"]["missing"] == []

    # Class coverage: the top variant is trained by cam-c alone, on its five classes; said once, in one line.
    cache = server.cache
    top = cache.largest_affordable(DEVICES["cam-c"][1])
    warned = [r.getMessage() for r in caplog.records if r.name == "feast_edge.server.coverage"]
    trained_only = f"variant {top.macs / 1e6:.2f}M MACs is trained only by cam-c, on 5 of 10 classes"
    assert sum(trained_only in line for line in warned) == 1, warned
    # The checkpoint records the task's class names: feast-server status names the classes of these warnings from them
    # wherever it runs, whether or not the preset file loads there.
    from feast_edge.run.checkpoint import read_record

    assert read_record(server.out / "checkpoint.safetensors")["fields"]["classes"] == list(FASHION_MNIST_CLASSES)
    # Validation of every served variant covers all ten classes: every device tested it on its held-out split.
    served = outcome["history"][outcome["manifests"][0]["rounds"] - 1].validation  # the served checkpoint's round
    top_label = f"variant {cache.entries.index(top)}"
    assert served["tested_by"][top_label] == sorted(DEVICES)
    # The serving rule: each device's variant is the one the served round's validation supports.
    points = {int(label.split()[1]): p for label, p in served["points"].items()}
    for m in outcome["manifests"]:
        budget = DEVICES[m["device"]][1]
        largest = cache.largest_affordable(budget)
        chosen = next(i for i, e in enumerate(cache.entries) if e.macs == m["macs"])
        smaller = [points[i] for i, e in enumerate(cache.affordable(budget)[:-1]) if i in points]
        assert m["largest_affordable_macs"] == largest.macs
        if m["serving_rule"] == "largest affordable":
            # No smaller variant gains more than 2 points and 2 standard errors of the difference (the rule's bar).
            examples = {int(label.split()[1]): n for label, n in served["examples"].items()}
            top, n_top = points[cache.entries.index(largest)], examples[cache.entries.index(largest)]
            assert m["macs"] == largest.macs
            assert all(
                points[i] - top <= required_gain(top, points[i], n_top, examples[i], 0.02)
                for i, e in enumerate(cache.affordable(budget)[:-1])
                if i in points
            )
        else:
            assert m["serving_rule"].startswith("better on validation") and m["macs"] < largest.macs
            assert points[chosen] > points[cache.entries.index(largest)] + 0.02 and points[chosen] == max(smaller)
        trained = m["coverage"]["trained"]
        holders = [d for d, (_, b, _) in DEVICES.items() if b >= m["macs"]]
        assert trained["devices"] == sorted(holders)
        assert len(trained["classes"]) == len({k for d in holders for k in DEVICES[d][0]})
        assert m["coverage"]["validated"]["missing"] == []
    for device, (classes, _, _) in DEVICES.items():
        log = kit.log_text(agents[device])
        # Labels by class name: each device holds its own classes, at the task's indices.
        assert f"{len(classes)} of the task's 10 classes" in log, log[-2000:]
        assert f"; {weights} ({reason})" in log  # the served round, said
        manifest = json.loads((models / f"{device}.json").read_text())
        meta = read_metadata(models / f"{device}.onnx")
        held = held_out(tmp_path / "data" / device)
        assert meta["bn_calibration"] == "federated"
        assert int(meta["bn_calibration_samples"]) == manifest["calibration_samples"]
        assert int(meta["holdout_samples"]) == held == manifest["holdout_samples"]
        assert json.loads(meta["task"])["classes"] == list(FASHION_MNIST_CLASSES)
        report = outcome["reports"][device]
        assert report["holdout_samples"] == held and report["calibrated_on"] == manifest["calibration_samples"]
        assert report["holdout_accuracy"] == pytest.approx(manifest["holdout_accuracy"])
        assert 0.0 <= report["holdout_accuracy"] <= 1.0
        assert outcome["registry"][device].profile["holdout"] == held

    # The dashboard, live and from the run directory, says so: federated validation, federated BN statistics.
    fleet_held = sum(held_out(tmp_path / "data" / d) for d in DEVICES)
    words = f"validation: federated, on 3 devices' held-out data ({fleet_held} examples)"
    for snapshot in (live.snapshot(), load_runs([tmp_path / "server"]).snapshot()):
        assert snapshot["run"]["validation"] == words
        assert [h["validated_on"] for h in snapshot["history"]] == [
            {"source": "devices", "devices": 3, "samples": fleet_held}
        ] * 2
        for model in snapshot["models"]:
            assert model["calibration"] == "federated" and model["url"] is None
            assert model["accuracy"] == pytest.approx(outcome["reports"][model["device"]]["holdout_accuracy"])
    assert {v["label"] for v in live.snapshot()["variants"]} == set(server.federated.last)  # the devices' probe points


def test_fetch_model_calibrates_a_model_left_for_the_device_on_its_own_data(
    kit, federation: str, tmp_path: Path, fashion_mnist_dir: Path, agent_cli
) -> None:
    """An agent without --model-dir keeps no model; `fetch-model --data` later calibrates and exports it on the device."""
    train = load_fashion_mnist(fashion_mnist_dir, "train")
    classes, budget, style = DEVICES["cam-c"]
    write_folder(tmp_path / "photos", classes, style, train, offset=0)
    config = ServerConfig.of(
        out=str(tmp_path / "server"),
        preset=kit.CONFIG.preset,
        federation=federation,
        rounds=1,
        per_round=1,
        min_clients=1,
        round_timeout=120.0,
        wait_timeout=120.0,
        batch_size=32,
        calib_samples=50,
        bn_calibration="device",  # the device recalibrates on its own data (the test above covers federated)
    )
    server = FederationServer(config, LinkConfig(broker=kit.LOCAL))
    done = threading.Event()

    def run() -> None:
        server.run()
        manifests = server.export()
        server.await_device_models(manifests, server.announce_models(manifests), timeout=60)
        server.finish(manifests)
        done.set()
        server.serve(120.0)  # answers fetch-model until stopped

    server.start(timeout=5)
    threading.Thread(target=run, daemon=True).start()
    agent = kit.spawn_agent(tmp_path / "logs", "cam-c", tmp_path / "photos", federation, "--budget", str(budget), *TINY)
    try:
        assert agent.wait(180) == 0, kit.log_text(agent)[-3000:]
        assert done.wait(60), "the server did not finish"
        assert "fetch it with feast-agent fetch-model" in kit.log_text(agent)
        args = ("fetch-model", "--broker", kit.LOCAL, "--device-id", "cam-c", "--federation", federation)
        refused = agent_cli.run(*args, "--out", str(tmp_path / "m.onnx"), "--timeout", "30", timeout=120)
        assert refused.returncode == 2 and "pass --data" in refused.stderr, refused.stderr
        fetched = agent_cli.run(
            *args, "--out", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "photos"), "--timeout", "30", timeout=120
        )
    finally:
        kit.stop(agent)
        server.stop.set()
        server.close()
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    assert "held-out accuracy" in fetched.stdout and "calibrated here on 50 examples" in fetched.stdout
    meta = read_metadata(tmp_path / "m.onnx")
    assert meta["bn_calibration"] == "device" and int(meta["holdout_samples"]) == held_out(tmp_path / "photos")


def test_an_int8_profile_gets_an_int8_model_quantized_on_the_device(
    kit, federation: str, tmp_path: Path, fashion_mnist_dir: Path
) -> None:
    """Issue 22: the agent registers its profile's precision; the server without data asks it for int8; the agent
    quantizes on its own images, checks on its held-out split, keeps the int8 file and reports it."""
    import dataclasses

    from feast_edge.budget.profile import load_profile, save_profile

    train = load_fashion_mnist(fashion_mnist_dir, "train")
    classes, _, style = DEVICES["cam-c"]  # fmnist-small, the raspberry-pi-5 profile's preset
    write_folder(tmp_path / "photos", classes, style, train, offset=0)  # 200 images, 20 of them held out
    profile = dataclasses.replace(load_profile("raspberry-pi-5"), name="pi-int8", precision="int8")
    save_profile(profile, tmp_path / "pi-int8.json")
    config = ServerConfig.of(
        out=str(tmp_path / "server"),
        federation=federation,
        rounds=1,
        per_round=1,
        min_clients=1,
        round_timeout=120.0,
        wait_timeout=120.0,
        batch_size=32,
        calib_samples=50,
        bn_calibration="device",
        int8_samples=64,
        int8_tolerance=1.0,  # one round on 180 images: the test is about who quantizes where, not the model
    )
    server = FederationServer(config, LinkConfig(broker=kit.LOCAL))
    models = tmp_path / "models"
    outcome = kit.own_data_federation(
        server,
        lambda: {
            "cam-c": kit.spawn_agent(
                tmp_path / "logs",
                "cam-c",
                tmp_path / "photos",
                federation,
                "--profile",
                str(tmp_path / "pi-int8.json"),
                "--model-dir",
                str(models),
            )
        },
        timeout=300,
    )
    assert outcome["registry"]["cam-c"].precision == "int8"
    assert outcome["registry"]["cam-c"].budget_macs == int(profile.budget_macs)
    (manifest,) = outcome["manifests"]
    assert manifest["precision"] == "int8" and manifest["int8_samples"] == 64
    meta = read_metadata(models / "cam-c.onnx")
    assert meta["precision"] == "int8" and meta["int8_calibration_samples"] == "64"
    assert meta["int8_check_samples"] == "20" and meta["int8_calibration_origin"] == "device cam-c's training data"
    report = outcome["reports"]["cam-c"]
    assert report["model_precision"] == "int8" and report["int8_accuracy"] == pytest.approx(
        float(meta["int8_accuracy"])
    )
    saved = json.loads((models / "cam-c.json").read_text())
    assert saved["precision"] == "int8" and saved["sha256"] == report["model_sha256"]
