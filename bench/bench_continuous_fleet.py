"""A federation without an end over Mosquitto with real agents: folders that grow, a late joiner, a server and a broker
restarted mid-run, against a finite run of the same fleet started at the beginning.

    PYTHONPATH=. python bench/bench_continuous_fleet.py [--minutes 60] [--grow-every 5] [--grow 40] [--join-after 20]
        [--restart-server-at 30] [--restart-broker-at 40] [--finite-rounds 20] [--work DIR]

The fleet: four ``feast-agent run`` processes on image folders of Fashion-MNIST training images (PNG files,
<root>/<class name>/<file>, each device its own disjoint images, 20 per class to start), budgets 2M, 6M, 12M and 40M
MACs (``--budget``), ``--rescan 30``; a private Mosquitto on a free loopback port; ``feast-server run --continuous``
without server data (the devices validate on their held-out splits), cohorts of 3, validation every 2 rounds.

During the run: every ``--grow-every`` minutes each device's folder gains ``--grow`` images (its next unused ones,
every class alike); the fourth device starts only after ``--join-after`` minutes; the server is killed (SIGKILL) at
``--restart-server-at`` minutes and started again with the same command, the broker at ``--restart-broker-at``.
At ``--minutes`` the run is stopped (``feast-server stop``): the agents leave with their served models (ONNX).

Then the same fleet, on the folders as they were at the start, runs a finite ``--finite-rounds`` run.

Figures: rounds done, each device's test accuracy of its served ONNX model on the first 2,000 Fashion-MNIST test
images (a split no device trains on; onnxruntime) for both runs, the late joiner's model time after it joined, that no
round was lost across the restarts (the checkpoint's rounds are 1..R, none twice), and that no image moved between
training and held-out as the folders grew (feast_edge.data.holdout's split of each device's first folder against its
last: every image first held out is still held out, every image first trained on is still trained on). Prints
progress lines and a table; writes a record to bench/results/ (bench/_records.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _records import write_record

from feast_edge.data.images import FASHION_MNIST_CLASSES, FASHION_MNIST_DIR, load_fashion_mnist
from feast_edge.run.checkpoint import read_record

BUDGETS = ("2M", "6M", "12M", "40M")
START_PER_CLASS = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    def __init__(self, work: Path) -> None:
        self.port, self.conf = free_port(), work / "mosquitto.conf"
        self.conf.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\n")
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(["mosquitto", "-c", str(self.conf)], stderr=subprocess.DEVNULL)
        time.sleep(0.5)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def write_images(root: Path, images: np.ndarray, labels: np.ndarray, names: list[int]) -> None:
    from PIL import Image

    for i in names:
        folder = root / FASHION_MNIST_CLASSES[int(labels[i])]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i].reshape(images.shape[-2:])).save(folder / f"img-{i:05d}.png")


def spawn(command: list[str], log: Path) -> subprocess.Popen:
    sink = open(log, "a")  # noqa: SIM115 - the process writes to it after this returns
    return subprocess.Popen(
        command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )


def cli(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def rounds_done(out: Path) -> int:
    path = out / "checkpoint.safetensors"
    try:
        return int(read_record(path)["fields"]["round"]) if path.is_file() else 0
    except Exception:  # noqa: BLE001 - a checkpoint being replaced: ask again
        return -1


def test_accuracy(onnx: Path, images: np.ndarray, labels: np.ndarray) -> float:
    import torch

    from feast_edge.evaluate.predict import load_model

    model = load_model(onnx, threads=2)
    correct = 0
    for begin in range(0, len(images), 500):
        probabilities = model.probabilities(torch.from_numpy(images[begin : begin + 500]))
        correct += int((probabilities.argmax(1) == labels[begin : begin + 500]).sum())
    return correct / len(images)


def splits(folder: Path, fraction: float = 0.1) -> tuple[set[bytes], set[bytes]]:
    """(trained, held out): the decoded images of a folder (by their bytes) as the agent splits it (by content)."""
    import hashlib

    from feast_edge.data.holdout import content_split
    from feast_edge.data.sources import load_data
    from feast_edge.space.preset import load_preset

    data = load_data(folder, load_preset("fmnist-small").task, cache_dir=False)
    train, held = content_split(data.images, data.labels, fraction)
    key = [hashlib.sha256(data.images[i].numpy().tobytes()).digest() for i in range(len(data.labels))]
    return {key[i] for i in train.tolist()}, {key[i] for i in held.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--grow-every", type=float, default=5)
    parser.add_argument("--grow", type=int, default=40)
    parser.add_argument("--join-after", type=float, default=20)
    parser.add_argument("--restart-server-at", type=float, default=30)
    parser.add_argument("--restart-broker-at", type=float, default=40)
    parser.add_argument("--finite-rounds", type=int, default=20)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-continuous-fleet-"))
    train = load_fashion_mnist(FASHION_MNIST_DIR, "train")
    test = load_fashion_mnist(FASHION_MNIST_DIR, "test")
    train_images, train_labels = train.images.numpy(), train.labels.numpy()
    test_images, test_labels = test.images[:2000].numpy(), test.labels[:2000].numpy()
    rng = np.random.default_rng(0)
    by_class = [rng.permutation(np.flatnonzero(train_labels == c)) for c in range(10)]
    devices = [f"dev-{i}" for i in range(len(BUDGETS))]
    pools = {d: [by_class[c][i :: len(devices)].tolist() for c in range(10)] for i, d in enumerate(devices)}
    used = {d: START_PER_CLASS for d in devices}
    for d in devices:
        write_images(
            work / "start" / d,
            train_images,
            train_labels,
            [i for c in range(10) for i in pools[d][c][:START_PER_CLASS]],
        )
        write_images(
            work / "live" / d, train_images, train_labels, [i for c in range(10) for i in pools[d][c][:START_PER_CLASS]]
        )
    figures: dict = {"settings": vars(args), "devices": {}}

    def run(name: str, folders: Path, continuous: bool) -> dict:
        broker = Broker(work)
        broker.start()
        out, federation = work / name, f"bench{name}{os.getpid()}"
        url = f"mqtt://127.0.0.1:{broker.port}"
        common = ["--insecure", "--broker", url, "--federation", federation]
        horizon = ["--continuous"] if continuous else ["--rounds", str(args.finite_rounds)]
        server_cmd = cli("feast_edge.server.cli", "run", *common, "--out", str(out), "--per-round", "3",
                         "--min-clients", "2", "--start-clients", "3" if continuous else "4", "--eval-every", "2",
                         "--round-timeout", "300", "--wait-timeout", "0", "--threads", "1", *horizon)  # fmt: skip
        server = spawn(server_cmd, work / f"{name}-server.log")
        agents: dict[str, subprocess.Popen] = {}
        began = time.monotonic()
        minutes = lambda: (time.monotonic() - began) / 60

        def agent(d: str) -> subprocess.Popen:
            return spawn(cli("feast_edge.agent.cli", "run", *common, "--device-id", d, "--data", str(folders / d),
                             "--budget", BUDGETS[devices.index(d)], "--model-dir", str(work / f"{name}-models" / d),
                             "--threads", "1", "--rescan", "30", "--register-timeout", "600"),
                         work / f"{name}-{d}.log")  # fmt: skip

        late = devices[-1] if continuous else None
        for d in devices:
            if d != late:
                agents[d] = agent(d)
        events: dict = {}
        next_growth = args.grow_every
        while continuous and minutes() < args.minutes:
            time.sleep(2)
            if late not in agents and minutes() >= args.join_after:
                agents[late] = agent(late)
                events["joined_at_round"] = rounds_done(out)
                events["joined_minute"] = minutes()
            if (
                late in agents
                and "late_model_minutes" not in events
                and any((work / f"{name}-models" / late).glob("*.onnx"))
            ):
                events["late_model_minutes"] = minutes() - events["joined_minute"]
                events["late_model_round"] = rounds_done(out)
            if "server_restart" not in events and minutes() >= args.restart_server_at:
                server.send_signal(signal.SIGKILL)
                server.wait(30)
                events["server_restart"] = rounds_done(out)
                server = spawn(server_cmd, work / f"{name}-server.log")
            if "broker_restart" not in events and minutes() >= args.restart_broker_at:
                broker.stop()
                time.sleep(3)
                broker.start()
                events["broker_restart"] = rounds_done(out)
            if minutes() >= next_growth:
                next_growth += args.grow_every
                for d in devices:
                    take = [i for c in range(10) for i in pools[d][c][used[d] : used[d] + args.grow // 10]]
                    used[d] += args.grow // 10
                    write_images(folders / d, train_images, train_labels, take)
                print(
                    f"{minutes():.1f} min: round {rounds_done(out)}; folders grown to {used[devices[0]] * 10} images each",
                    flush=True,
                )
        if continuous:
            subprocess.run(cli("feast_edge.server.cli", "stop", "--out", str(out)), check=True)
        server.wait(1800)
        for process in agents.values():
            try:
                process.wait(300)
            except subprocess.TimeoutExpired:
                process.kill()
        broker.stop()
        history = read_record(out / "checkpoint.safetensors")["fields"]["history"]
        result = {
            "rounds": len(history),
            "no_round_lost": [h["round"] for h in history] == list(range(1, len(history) + 1)),
            "minutes": minutes(),
            "events": events,
            "test_accuracy": {},
        }
        for d in devices:
            models = sorted((work / f"{name}-models" / d).glob("*.onnx"))
            result["test_accuracy"][d] = None if not models else test_accuracy(models[0], test_images, test_labels)
        print(f"{name}: {len(history)} rounds in {minutes():.1f} min; test accuracy "
              + ", ".join(f"{d} {'-' if a is None else f'{100 * a:.1f}%'}" for d, a in result["test_accuracy"].items()), flush=True)  # fmt: skip
        return result

    figures["continuous"] = run("continuous", work / "live", continuous=True)
    figures["finite"] = run("finite", work / "start", continuous=False)
    moved = {}
    for d in devices:
        trained0, held0 = splits(work / "start" / d)
        trained1, held1 = splits(work / "live" / d)
        moved[d] = {"held_out_then_trained": len(held0 & trained1), "trained_then_held_out": len(trained0 & held1),
                    "held_out_first": len(held0), "held_out_last": len(held1)}  # fmt: skip
    figures["split_moves"] = moved
    print(json.dumps(moved))
    print(f"record: {write_record('continuous-fleet', figures)}")


if __name__ == "__main__":
    main()
