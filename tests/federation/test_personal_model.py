"""The personal model a device writes beside its served one (issue 36, deliverable 3): a real ONNX file that carries its
method, strength, examples and own held-out accuracy served -> personal, computes what the PyTorch personal model
computes, is int8 where the served file is, and disappears when a later export keeps none."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from imagefolders import write_image_folder
from rich.console import Console
from safetensors.torch import save
from tinymodels import trained_smallest

from feast_edge.agent.local_data import LocalClient
from feast_edge.agent.on_device import calibrate_served_variant
from feast_edge.agent.personal_model import personal_path
from feast_edge.cache.variants import load_cache
from feast_edge.data.images import FASHION_MNIST_CLASSES, load_fashion_mnist
from feast_edge.evaluate.evaluation import correct_count, pixel_batches
from feast_edge.evaluate.federated import calibrated_static
from feast_edge.evaluate.onnx_export import onnx_session, read_metadata
from feast_edge.personalize.select import Choice, personalize
from feast_edge.protocol import Metrics
from feast_edge.report.model_words import model_accuracy
from feast_edge.server.app import FederationServer, ServerConfig
from feast_edge.server.output import device_models_table
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import load_preset
from feast_edge.space.static import StaticResNet
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.messages import parse
from strategies import FMNIST_TINY

PRESET = load_preset(str(FMNIST_TINY))
ARCH = load_cache(PRESET).entries[0].arch
SHIRT = 6


@pytest.fixture(scope="module")
def trained(fashion_mnist_dir: Path) -> tuple[StaticResNet, LocalClient]:
    """fmnist-tiny's smallest variant trained two epochs on 1,200 balanced real images, and a device whose own images
    are nine in ten shirts (its held-out split drawn the same way)."""
    split = load_fashion_mnist(fashion_mnist_dir, "train")
    model = trained_smallest(split)
    rest = torch.arange(2000, 8000)
    shirts, others = rest[split.labels[rest] == SHIRT], rest[split.labels[rest] != SHIRT]
    train, held = torch.cat([shirts[:270], others[:30]]), torch.cat([shirts[270:360], others[30:40]])
    own = LocalClient(
        "jetson",
        split.images[train],
        split.labels[train].long(),
        None,
        None,
        None,
        "own images",
        holdout_images=split.images[held],
        holdout_labels=split.labels[held].long(),
    )
    return model.eval(), own


def _variant(model: StaticResNet, precision: str = "fp32") -> tuple[bytes, dict]:
    """The variant's weights as a server without data sends them, for the device to calibrate."""
    blob = save({k: v.contiguous() for k, v in model.state_dict().items()})
    manifest = {
        "device": "jetson",
        "arch": ARCH.to_dict(),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "preset": PRESET.name,
        "preset_digest": PRESET.digest,
        "calibration": "device",
        "calibration_samples": 200,
        "rounds": 3,
        "macs": load_cache(PRESET).entries[0].macs,
        "precision": precision,
        **({"int8_samples": 100, "int8_tolerance": 0.05} if precision == "int8" else {}),
    }
    return blob, manifest


def test_a_skewed_device_writes_a_personal_onnx_file_that_is_the_pytorch_personal_model(trained, tmp_path) -> None:
    model, own = trained
    served_path, metrics = calibrate_served_variant(
        *_variant(model), own, PRESET, tmp_path / "jetson.onnx", personalize=Choice.parse("auto")
    )
    path = personal_path(served_path)
    assert path == tmp_path / "jetson.personal.onnx"
    # The personal model the agent chose, rebuilt here the same way: the served model calibrated on the device, then
    # the same seeded selection.
    served = StaticResNet(arch_layout(PRESET, ARCH))
    served.load_state_dict(model.state_dict())
    calibrated_static(served, PRESET, own.images, 200, labels=own.labels)
    outcome = personalize(served, own.images, own.labels, PRESET, Choice.parse("auto"), holdout=own.holdout)
    assert outcome.model is not None and outcome.method == metrics["personal_method"]
    pixels = own.holdout_images.float().div(255.0).numpy()
    session = onnx_session(path)
    got = session.run(None, {session.get_inputs()[0].name: pixels})[0]
    with torch.no_grad():
        want = torch.cat([outcome.model(x) for x in pixel_batches(own.holdout_images, PRESET, 500)]).numpy()
    assert np.allclose(got, want, atol=1e-4)
    # What the file and its manifest say: method, strength, examples, own held-out accuracy served -> personal.
    meta, manifest = read_metadata(path), json.loads(path.with_suffix(".json").read_text())
    served_right = correct_count(served, own.holdout_images, own.holdout_labels, PRESET)
    personal_right = correct_count(outcome.model, own.holdout_images, own.holdout_labels, PRESET)
    assert personal_right > served_right  # nine in ten shirts: the personal model is right more often here
    numbers = ("personal_strength", "personal_examples", "holdout_accuracy_served", "holdout_accuracy_personal")
    in_file = {"personal_method": meta["personal_method"], **{k: json.loads(meta[k]) for k in numbers}}
    for facts in (manifest, in_file):
        assert facts["personal_method"] == outcome.method
        assert facts["personal_strength"] == outcome.strength
        assert facts["personal_examples"] == outcome.fit_examples
        assert facts["holdout_accuracy_served"] == pytest.approx(served_right / own.holdout)
        assert facts["holdout_accuracy_personal"] == pytest.approx(personal_right / own.holdout)
    assert (
        manifest["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        and manifest["macs"] == metrics["model_macs"]
    )
    assert metrics["personal_accuracy"] == pytest.approx(personal_right / own.holdout)
    assert metrics["holdout_accuracy"] == pytest.approx(served_right / own.holdout)  # the served model's, unchanged
    assert read_metadata(served_path).get("personal_method") is None  # the served file is the served model alone

    # A later export that keeps no personal model removes the earlier one: the files on the device belong together.
    _, again = calibrate_served_variant(
        *_variant(model), own, PRESET, tmp_path / "jetson.onnx", personalize=Choice.parse("off")
    )
    assert not path.exists() and not path.with_suffix(".json").exists()
    assert again["personal_method"] == "" and "off" in again["personal_reason"]
    assert again["personal_accuracy"] == again["holdout_accuracy"]


THREE = (0, 2, 6)  # T-shirt_top, Pullover, Shirt
TUNED_WORDS = "tuned to 3 of 10 classes: T-shirt_top, Pullover, Shirt; serve the global model for the others"


def test_a_device_holding_three_classes_names_them_wherever_its_personal_models_accuracy_goes(
    trained, tmp_path, fashion_mnist_dir, agent_cli, caplog
) -> None:
    """Its log line, its manifest and ONNX metadata, what it reports to the server (through the bounded parser) and the
    server's reading of that report, and ``feast-agent evaluate`` on an all-class folder, per class."""
    model, _ = trained
    split = load_fashion_mnist(fashion_mnist_dir, "train")
    rest = torch.arange(2000, 8000)
    mine = rest[torch.isin(split.labels[rest].long(), torch.tensor(THREE))]
    train, held = mine[:240], mine[240:300]
    own = LocalClient(
        "jetson",
        split.images[train],
        split.labels[train].long(),
        None,
        None,
        None,
        "own images",
        holdout_images=split.images[held],
        holdout_labels=split.labels[held].long(),
    )
    with caplog.at_level(logging.INFO, logger="feast_edge.agent.personal_model"):
        served_path, metrics = calibrate_served_variant(
            *_variant(model), own, PRESET, tmp_path / "jetson.onnx", personalize=Choice.parse("prior:1")
        )
    path = personal_path(served_path)
    written = next(r.getMessage() for r in caplog.records if "personal model written to" in r.getMessage())
    assert written.endswith(f"personal ({own.holdout} examples); {TUNED_WORDS}")
    names = ["T-shirt_top", "Pullover", "Shirt"]
    manifest, meta = json.loads(path.with_suffix(".json").read_text()), read_metadata(path)
    assert (manifest["personal_classes"], manifest["personal_task_classes"]) == (names, 10)
    assert (json.loads(meta["personal_classes"]), json.loads(meta["personal_task_classes"])) == (names, 10)
    # What the server learns: the names and the count, through the same parser every message passes.
    sent = parse(Metrics(federation="lab", round=0, device="jetson", values=metrics).encode())
    assert (sent.values["personal_classes"], sent.values["personal_task_classes"]) == (names, 10)
    server_side = model_accuracy({"device": "jetson", "calibration": "device", "rounds": 3}, sent.values)
    assert server_side["personal_tuned"] == TUNED_WORDS

    # feast-agent evaluate on ten images of every class: per-class counts, the classes it was not tuned to, and its
    # accuracy over its own three classes apart from the other seven.
    test = load_fashion_mnist(fashion_mnist_dir, "test")
    write_image_folder(tmp_path / "every-class", dict.fromkeys(range(10), 10), "png-grey", test, FASHION_MNIST_CLASSES)
    result = agent_cli.invoke("evaluate", "--model", str(path), "--data", str(tmp_path / "every-class"), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    per_class = {c["class"]: c for c in report["classes"]}
    assert len(per_class) == 10 and all(c["examples"] == 10 for c in per_class.values())
    assert {name for name, c in per_class.items() if c["tuned"]} == set(names)
    personal = report["personal"]
    others = [n for k, n in enumerate(FASHION_MNIST_CLASSES) if k not in THREE]
    assert (personal["personal_classes"], personal["not_tuned_to"], personal["tuned"]) == (names, others, TUNED_WORDS)
    on_three, on_others = personal["on_tuned_classes"], personal["on_other_classes"]
    assert on_three["correct"] == sum(per_class[n]["correct"] for n in names) and on_three["examples"] == 30
    assert on_others["correct"] == sum(per_class[n]["correct"] for n in others) and on_others["examples"] == 70
    table = agent_cli.invoke("evaluate", "--model", str(path), "--data", str(tmp_path / "every-class"))
    assert table.returncode == 0, table.stderr
    assert f"personal model {TUNED_WORDS}: " in " ".join(table.stdout.split())
    assert "no: serve the global model" in table.stdout
    # The served file is no personal model: its report has no such part; predict names the classes too.
    served_report = json.loads(
        agent_cli.invoke(
            "evaluate", "--model", str(served_path), "--data", str(tmp_path / "every-class"), "--json"
        ).stdout
    )
    assert "personal" not in served_report and "tuned" not in served_report["classes"][0]
    predicted = agent_cli.invoke("predict", "--model", str(path), str(tmp_path / "every-class" / "Shirt"))
    assert predicted.returncode == 0 and f"personal model {TUNED_WORDS}" in " ".join(predicted.stdout.split())


def test_the_personal_model_is_int8_where_the_served_one_is(trained, tmp_path) -> None:
    model, own = trained
    served_path, metrics = calibrate_served_variant(
        *_variant(model, "int8"), own, PRESET, tmp_path / "jetson.onnx", personalize=Choice.parse("prior:1")
    )
    manifest = json.loads(personal_path(served_path).with_suffix(".json").read_text())
    assert manifest["personal_method"] == "prior" and manifest["personal_strength"] == 1.0
    meta = read_metadata(personal_path(served_path))
    # Quantized on the device's own training images and checked on its held-out split, as the served file is.
    assert meta["precision"] == manifest["precision"] == ("int8" if "int8_accuracy" in manifest else "fp32")
    assert "int8_accuracy" in manifest or "int8_refused" in manifest
    assert metrics["personal_precision"] == manifest["precision"]


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("best", "--personalize 'best' is unknown; choose one of auto, off, prior, head, bn, proximal"),
        ("head:0.5", "--personalize head:0.5: its epochs must be a whole number of epochs in [1, 20]"),
    ],
)
def test_feast_agent_run_refuses_an_unknown_personalize_setting_in_one_line(agent_cli, tmp_path, value, needle) -> None:
    result = agent_cli.invoke(
        "run",
        "--device-id",
        "jetson",
        "--broker",
        "mqtt://127.0.0.1:1",
        "--data",
        str(tmp_path),
        "--budget",
        "1M",
        "--personalize",
        value,
    )
    agent_cli.assert_user_error(result, needle)


# A federation over the local Mosquitto: one device holds every class evenly and most of the images, the other fewer,
# nine in ten of them shirts (as the demo's Jetson's are). Budgets in fmnist-tiny's range. The skewed device holds
# enough (33 held out, 60 to select on) that its personal model's margin is several images, not one: with 15 held
# out, one CPU's arithmetic gave a tie (12 of 15 both).
FLEET = {
    "cam-even": (dict.fromkeys(range(10), 50), 1_500_000),
    "jetson-shirts": ({SHIRT: 300, 0: 10, 2: 10, 4: 10}, 220_000),
}


@pytest.mark.slow
@pytest.mark.broker
def test_a_skewed_device_of_a_real_federation_ends_with_a_personal_model_that_beats_its_served_one(
    kit, federation: str, tmp_path: Path, fashion_mnist_dir: Path, agent_cli
) -> None:
    train = load_fashion_mnist(fashion_mnist_dir, "train")
    for k, (device, (counts, _)) in enumerate(FLEET.items()):
        write_image_folder(tmp_path / "data" / device, counts, "png-grey", train, FASHION_MNIST_CLASSES, 200 * k)
    config = ServerConfig.of(
        out=str(tmp_path / "server"),
        preset=kit.CONFIG.preset,
        federation=federation,
        rounds=2,
        per_round=2,
        min_clients=2,
        start_clients=2,
        round_timeout=180.0,
        wait_timeout=180.0,
        batch_size=32,
        calib_samples=100,
    )
    server = FederationServer(config, LinkConfig(broker=kit.LOCAL))
    models = tmp_path / "models"

    def start_agents() -> dict:
        agents = {}
        for device, (_, budget) in FLEET.items():
            options = ("--budget", str(budget), "--model-dir", str(models), "--preset", "fmnist-tiny")
            agents[device] = kit.spawn_agent(
                tmp_path / "logs", device, tmp_path / "data" / device, federation, *options
            )
        return agents

    outcome = kit.own_data_federation(server, start_agents)
    agents = outcome["agents"]

    # The skewed device: its personal model, chosen on its selection split, beats the served one on its held-out split.
    personal = json.loads((models / "jetson-shirts.personal.json").read_text())
    report = outcome["reports"]["jetson-shirts"]
    assert personal["holdout_accuracy_personal"] > personal["holdout_accuracy_served"]
    assert report["holdout_accuracy"] == pytest.approx(personal["holdout_accuracy_served"])
    assert report["personal_accuracy"] == pytest.approx(personal["holdout_accuracy_personal"])
    assert report["personal_method"] == personal["personal_method"] and report["personal_sha256"] == personal["sha256"]
    assert "personal model written to" in kit.log_text(agents["jetson-shirts"])
    # Every device reported both figures (a device that keeps the served model reports it twice, with its reason).
    for device in FLEET:
        got = outcome["reports"][device]
        assert got["personal_accuracy"] is not None and got["personal_reason"]
        if not got["personal_method"]:
            assert (
                got["personal_accuracy"] == got["holdout_accuracy"]
                and not (models / f"{device}.personal.onnx").exists()
            )
    # The server's table of the devices' models shows both, for every device.
    console = Console(record=True, width=250)
    console.print(device_models_table(outcome["manifests"], outcome["reports"], "models"))
    text = console.export_text()
    row = next(line for line in text.splitlines() if "jetson-shirts" in line)
    assert f"{100 * report['holdout_accuracy']:.2f}%" in row and f"{100 * report['personal_accuracy']:.2f}%" in row
    # feast-agent evaluate takes the personal file as it takes the served one.
    for name in ("jetson-shirts.onnx", "jetson-shirts.personal.onnx"):
        result = agent_cli.invoke(
            "evaluate", "--model", str(models / name), "--data", str(tmp_path / "data" / "jetson-shirts")
        )
        assert result.returncode == 0 and "accuracy" in result.stdout, result.stderr
