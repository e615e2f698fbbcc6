"""``feast-edge demo``: a whole deployment on one machine, from broker to one ONNX model per device.

1. an MQTT broker: the one given with ``--broker``, else an embedded one on a free
   loopback port (the ``mosquitto`` binary when installed, else the pure-Python
   amqtt broker);
2. a partition of Fashion-MNIST whose client budgets are the device profiles'
   (``feast-edge partition``), each device's share written out as its own image
   folder (``devices/<device>/<class name>/*.png``: a different mix of classes per
   device, as a lab's devices would hold their own camera images);
3. ``feast-server run`` *without data* and one ``feast-agent run --profile P --data
   devices/<device>`` process per profile: each agent checks its folder against the
   task, decodes it once (cached), holds 10 % out, trains on the rest;
4. the rounds, each validated on the devices' held-out splits (federated
   validation), then every device's served variant (its largest affordable) sent
   to it, BN-recalibrated on its own data and exported to ONNX there;
5. each device's model timed in onnxruntime and tested on the Fashion-MNIST test
   split; a summary table with the accuracy each device measured itself, of the
   served model and of the personal model it made after the last round
   (``feast-agent run --personalize auto``, the default), their means and the
   worst of each, with its own device.

``--server-data`` runs the paper's server-held protocol instead (the agents train
their shard files, the server validates and calibrates on its held-out split).

While it waits, the demo follows the processes' console logs (``logs/*.log``;
everything at debug level goes to ``logs/*.debug.log``) and prints a status
line at least every 10 s: who is up and registered, the round lines, export.
"""

from __future__ import annotations

import getpass
import json
import shutil
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from feast_edge.report.model_words import chosen_by, fleet_accuracy, model_accuracy
from feast_edge.server.brokers import MOSQUITTO, Broker, free_port, resolve_kind, start_broker, start_mosquitto
from feast_edge.server.demo_fleet import DemoError, Fleet, relative
from feast_edge.server.output import add_fleet_rows, personal_cell
from feast_edge.server.provision import provision
from feast_edge.util.cores import affinity_cpus

# Every process is the demo's own, so feast-server waits for every device: a busy machine makes a round slower, and
# dropping the update of a device the machine slowed down would throw its training away. An agent that dies goes
# offline (its last will), and the round goes on without it; the demo itself gives up only on a stalled federation.
ROUND_WAIT_S = 24 * 3600


def _provisioned_broker(out: Path, logs: Path, federation: str, names: list[str], kind: str) -> tuple[Broker, Path]:
    """Credentials for the server and every device, and an embedded broker that enforces them (as far as it can)."""
    kind, port, credentials = resolve_kind(kind), free_port(), out / "credentials"
    done = provision(
        credentials, federation, names, hosts=("127.0.0.1",), port=port, bind="127.0.0.1", broker_user=getpass.getuser()
    )
    if kind == MOSQUITTO:
        enforces = "TLS, a client certificate per identity (CN = device id), the ACL (each device on its own topics), no anonymous clients; every message signed"
        return start_mosquitto(
            done.broker_config, port, logs / "broker.log", url=f"mqtts://127.0.0.1:{port}", enforces=enforces
        ), credentials
    broker = start_broker(logs, kind)
    broker.enforces = "no authentication, TLS or ACL (amqtt); only the Ed25519 signatures of the provisioned bundles: unsigned or forged messages are dropped"
    return broker, credentials


def _check_data(data: Path) -> None:
    names = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    missing = [n for n in names if not (data / n).is_file() and not (data / f"{n}.gz").is_file()]
    if missing:
        raise DemoError(
            f"Fashion-MNIST is not installed in {data} (missing {', '.join(missing)}); install it with "
            "'apt-get install dataset-fashion-mnist' (as root, or with sudo; it goes to /usr/share/datasets/fashion-mnist) or pass --data DIR"
        )


def _device_folders(
    index: dict[str, Any], partition: Path, target: Path, names: list[str], class_names: tuple[str, ...]
) -> list[Path]:
    """Each client's shard of the partition written out as an image folder ``target/<device>/<class name>/<n>.png``."""
    from PIL import Image

    from feast_edge.sim.shards import read_shard

    folders = []
    for name, entry in zip(names, index["clients"]):
        shard = read_shard(partition / entry["file"])
        folder = target / name
        for n, (image, label) in enumerate(zip(shard.images, shard.labels.tolist())):
            (folder / class_names[label]).mkdir(parents=True, exist_ok=True)
            Image.fromarray(image[0].numpy(), "L").save(folder / class_names[label] / f"{n:05d}.png")
        folders.append(folder)
    return folders


def _test_accuracy(path: Path, images: Any, labels: Any) -> float:
    from feast_edge.evaluate.onnx_export import INPUT_NAME, OUTPUT_NAME, onnx_session

    session = onnx_session(path, threads=1)
    correct = 0
    for start in range(0, len(labels), 500):
        x = images[start : start + 500].float().div(255.0).numpy().astype(np.float32)
        logits = session.run([OUTPUT_NAME], {INPUT_NAME: x})[0]
        correct += int((logits.argmax(axis=1) == labels[start : start + 500].numpy()).sum())
    return correct / len(labels)


def thread_plan(cores: int, samples: list[int]) -> tuple[int, list[int]]:
    """The demo's threads on ``cores`` cores: the server's, and each agent's (``samples``: each agent's shard size).

    The agents train at the same moment, so together they take max(cores, agents) threads: one each when there are at
    least as many agents as cores, else the cores shared out, the largest shards first (the round waits for them).
    The server computes (aggregation, validation, export) only while the agents wait for it: every core then.
    """
    agents = len(samples)
    threads = [1] * agents
    spare = max(0, cores - agents)
    order = sorted(range(agents), key=lambda i: (-samples[i], i))
    for k in range(spare):
        threads[order[k % agents]] += 1
    return max(1, cores), threads


def _server_opt_args(server_opt: Mapping[str, Any]) -> list[str]:
    """``feast-server run``'s --server-* options for the given config keywords (unset ones keep the server's default)."""
    args = []
    for key, value in server_opt.items():
        if value is not None:
            text = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
            args += [f"--{key.replace('_', '-')}", text]
    return args


def run_demo(
    *,
    broker: str | None,
    rounds: int,
    samples: int,
    profiles: list[str],
    data: Path,
    out: Path | None,
    seed: int,
    console: Console,
    embedded_broker: str = "auto",
    test_samples: int = 2000,
    local_epochs: int = 1,
    dashboard: str | None = "127.0.0.1:0",
    server_data: bool = False,
    gamma: float = 1.0,
    server_opt: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Run the demo (see the module docstring); returns one summary row per device."""
    from feast_edge.budget.profile import load_profile
    from feast_edge.sim.setup import SimulationConfig
    from feast_edge.sim.shards import write_partition

    def say(text: str) -> None:
        console.print(text, soft_wrap=True, highlight=False)

    began = time.monotonic()
    _check_data(data)
    if dashboard:
        from feast_edge.dashboard.app import parse_bind

        parse_bind(dashboard)  # a malformed --dashboard is refused here, not by the server once everything runs
    if len(profiles) < 2:
        raise DemoError("--profiles needs at least two device profiles")
    loaded = [load_profile(p) for p in profiles]
    presets = {p.preset for p in loaded}
    if len(presets) != 1:
        raise DemoError(
            f"the profiles were derived for different presets ({', '.join(sorted(presets))}); pick profiles of one preset"
        )
    preset = presets.pop()
    names = [p.name for p in loaded]
    if len(set(names)) != len(names):
        raise DemoError("each profile may appear once (its name is the device id)")
    out = Path("feast-demo") if out is None else out
    for part in (
        "partition",
        "devices",
        "server",
        "device-models",
        "logs",
        "credentials",
    ):  # a fresh run every time; nothing else in --out is touched
        shutil.rmtree(out / part, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    owned: Broker | None = None
    fleet = Fleet(logs, names, rounds)
    try:
        federation = f"demo-{uuid.uuid4().hex[:8]}"
        if broker is None:
            owned, credentials = _provisioned_broker(out, logs, federation, names, embedded_broker)
            say(f"broker: {owned.kind}; it enforces {owned.enforces}")
            identity = {
                "server": ["--credentials", str(credentials / "server")],
                **{n: ["--credentials", str(credentials / "devices" / n)] for n in names},
            }
            if not owned.url.startswith("mqtts://"):  # amqtt: the bundles' TLS broker URL does not apply
                identity = {name: [*args, "--broker", owned.url] for name, args in identity.items()}
        else:
            say(
                f"broker: {broker} (given with --broker; not provisioned: anonymous clients, no signatures, so the "
                "server and agents run with --insecure)"
            )
            identity = {
                name: ["--insecure", "--broker", broker, "--federation", federation]
                + ([] if name == "server" else ["--device-id", name])
                for name in ["server", *names]
            }
        n = len(loaded)
        config = SimulationConfig.of(
            preset=preset,
            data_dir=str(data),
            clients=n,
            per_round=n,
            rounds=rounds,
            budgets=tuple(p.budget_macs for p in loaded),
            train_limit=samples * n,
            val_samples=1000,
            calib_samples=200,
            seed=seed,
            gamma=gamma,
        )
        say(f"data: splitting {samples * n} Fashion-MNIST training examples over {n} devices by budget...")
        index = write_partition(config, out / "partition")
        shards = ", ".join(f"{p.name} {c['samples']}" for p, c in zip(loaded, index["clients"]))
        if server_data:
            say(f"data: {shards} examples (shard files); the server holds 1000 validation + 200 calibration")
            device_data = [out / "partition" / entry["file"] for entry in index["clients"]]
        else:
            from feast_edge.space.preset import load_preset

            device_data = _device_folders(
                index, out / "partition", out / "devices", names, load_preset(preset).task.classes
            )
            say(
                f"data: {shards} examples, written as PNG files to {relative(out / 'devices')}/<device>/<class>/; "
                "the server holds no data (each device validates on its 10 % held-out split and calibrates its own model)"
            )
        python = sys.executable
        server_threads, agent_threads = thread_plan(len(affinity_cpus()), [c["samples"] for c in index["clients"]])
        fleet.spawn(
            "server",
            [
                python,
                "-m",
                "feast_edge.server.cli",
                "run",
                *identity["server"],
                "--out",
                str(out / "server"),
                "--preset",
                preset,
                "--rounds",
                str(rounds),
                "--per-round",
                str(n),
                "--min-clients",
                str(max(1, n // 2)),
                "--start-clients",
                str(n),
                "--round-timeout",
                str(ROUND_WAIT_S),
                "--seed",
                str(seed),
                *(["--data", str(out / "partition")] if server_data else ["--calib-samples", "200"]),
                "--eval-every",
                "1" if server_data else "2",
                "--wait-timeout",
                "180",
                "--threads",
                str(server_threads),
                "--local-epochs",
                str(local_epochs),
                *_server_opt_args(server_opt or {}),
                *(["--dashboard", dashboard] if dashboard else []),
            ],
        )
        received = out / "device-models"
        for i, (profile, entry) in enumerate(zip(loaded, device_data)):
            fleet.spawn(
                profile.name,
                [
                    python,
                    "-m",
                    "feast_edge.agent.cli",
                    "run",
                    *identity[profile.name],
                    "--data",
                    str(entry),
                    "--profile",
                    profiles[names.index(profile.name)],
                    "--device",
                    "cpu",
                    "--threads",
                    str(agent_threads[i]),
                    "--model-dir",
                    str(received),
                    "--register-timeout",
                    "180",
                ],
            )
        say(
            f"started feast-server and {n} feast-agent processes ({', '.join(f'{p.name} {p.budget_macs / 1e6:.1f}M MACs' for p in loaded)}); "
            f"federation {federation!r}; console logs in {logs}/*.log, everything in *.debug.log"
        )
        fleet.follow_federation(say)
        fleet.await_models(received, say)
        fleet.stop()
        rows = _device_rows(loaded, received, data, test_samples, say)
        table = summary_table(rows, f"feast-edge demo: {n} devices, {rounds} rounds, {preset}", server_data)
        # Outside a terminal rich would squeeze the table into 80 columns.
        (console if console.is_terminal else Console(file=console.file, width=200)).print(table)
        if not server_data:
            say(
                "own acc: what each device measured on its own held-out split (10 % of its images, never trained on), "
                "of the served model and of the personal model it made on its own training images after the last "
                "round (a method only where it beat the served model on a selection split of them); the server saw "
                "only counts"
            )
        say(
            f"onnxruntime latency: batch 1, one thread, this machine's CPU (the profiles' budgets describe the real devices). "
            f"Wall time {time.monotonic() - began:.1f} s; everything is in {out}."
            + (f" Browse the finished run: feast-edge dashboard {out / 'server'}" if dashboard else "")
        )
        return rows
    finally:
        fleet.stop()
        if owned is not None:
            owned.stop()


def _device_rows(loaded: list[Any], received: Path, data: Path, test_samples: int, say: Any) -> list[dict[str, Any]]:
    """Time and test each device's received ONNX model in onnxruntime."""
    from feast_edge.data.images import load_fashion_mnist
    from feast_edge.evaluate.onnx_export import measure_latency

    say(
        f"testing each received model in onnxruntime: latency (batch 1, 50 runs) and accuracy on {test_samples} test images"
    )
    test = load_fashion_mnist(data, "test")
    images, labels = test.images[:test_samples], test.labels[:test_samples]
    rows = []
    for i, profile in enumerate(loaded, 1):
        say(f"  {i}/{len(loaded)} {profile.name}")
        path = received / f"{profile.name}.onnx"
        manifest = json.loads(path.with_suffix(".json").read_text())
        latency = measure_latency(path, repeats=50)
        rows.append(
            {
                "device": profile.name,
                "budget_macs": profile.budget_macs,
                "macs": manifest["macs"],
                "params": manifest["params"],
                "own": own_accuracy(path, manifest),
                "calibrated": (
                    f"{manifest['calibration']} ({manifest.get('calibration_samples')})"
                    if manifest.get("calibration") in ("device", "federated")
                    else "server"
                ),
                "test_accuracy": _test_accuracy(path, images, labels),
                "test_images": len(labels),
                "onnx": f"{path.parent.name}/{path.name}",
                "latency_ms": latency["median_ms"],
                "predicted_ms": profile.latency_ms(manifest["macs"]),
                "chosen_by": chosen_by(manifest),  # the largest affordable, or a smaller one better on validation
            }
        )
    return rows


def own_accuracy(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The accuracy of the model the device kept at ``path`` (``manifest``: its ``.json``), and of its personal model:
    ``{device}.personal.json`` beside it (written by the agent for this served file; none: the served model is kept),
    checked as the server checks a device's report (:func:`feast_edge.report.model_words.model_accuracy`)."""
    report = {"holdout_accuracy": manifest.get("holdout_accuracy"), "personal_method": ""}
    report["personal_accuracy"] = report["holdout_accuracy"]  # the served model kept: its accuracy is the personal one
    personal = path.with_name(f"{path.stem}.personal.json")
    if personal.is_file():
        written = json.loads(personal.read_text())
        if written.get("served_sha256") == manifest.get("sha256"):  # not a stale one of an earlier served file
            report.update(
                personal_method=written.get("personal_method"),
                personal_strength=written.get("personal_strength"),
                personal_accuracy=written.get("holdout_accuracy_personal"),
                # the classes it was tuned to (absent from a file written before them)
                **{k: written[k] for k in ("personal_classes", "personal_task_classes") if k in written},
            )
    return model_accuracy(manifest, report)


def summary_table(rows: list[dict[str, Any]], title: str, server_data: bool) -> Table:
    """One row per device (:func:`_device_rows`): its model, own accuracy served -> personal, its test accuracy and
    latency; then the means over the devices and the worst of each column."""
    smaller = [f"* {r['device']}: {r['chosen_by']}" for r in rows if r.get("chosen_by", "").startswith("smaller")]
    folder = str(Path(rows[0]["onnx"]).parent)
    captions = [f"ONNX files: {folder}/DEVICE.onnx" + ("" if server_data else ", DEVICE.personal.onnx beside it")]
    if not server_data:
        captions.append(
            "personalization on (feast-agent run --personalize auto, the default); own acc: each device's held-out split"
        )
    table = Table(title=title, caption="\n".join(captions + smaller))
    # With --server-data the devices train shard files, which hold no held-out split: they make no personal model.
    accuracy = ["val acc"] if server_data else ["own acc, served", "own acc, personal"]
    for col in ("device", "budget", "variant MACs", "params", "BN calibrated on", *accuracy, "test acc", "latency ms"):
        # folded, never cut with an ellipsis: a device's name is what a reader looks for, however narrow the terminal
        header = f"test acc ({rows[0]['test_images']})" if col == "test acc" else col
        table.add_column(header, justify="left" if col in ("device", "own acc, personal") else "right", overflow="fold")
    for i, r in enumerate(rows):
        own = r["own"]
        served = "-" if own["accuracy"] is None else f"{100 * own['accuracy']:.2f}%"
        table.add_row(
            r["device"],
            f"{r['budget_macs'] / 1e6:.2f}M",
            f"{r['macs'] / 1e6:.2f}M" + ("*" if r.get("chosen_by", "").startswith("smaller") else ""),
            f"{r['params'] / 1e6:.3f}M",
            r["calibrated"],
            *([served] if server_data else [served, personal_cell(own)]),
            f"{100 * r['test_accuracy']:.2f}%",
            f"{r['latency_ms']:.3f}",
            end_section=i == len(rows) - 1,
        )
    if not server_data:  # the models are the server's: the devices have no own accuracy to average
        add_fleet_rows(table, fleet_accuracy((r["device"], r["own"]) for r in rows), 5)
    return table
