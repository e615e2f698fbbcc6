"""A label-skewed fleet as a new user sets it up, under two [train] recipes side by side (issue 37).

    python bench/bench_label_skew.py [--data digits|fmnist] [--rounds 20] [--recipes paper,preset] [--work DIR]

A real data set nobody tuned to, written as image folders ``DIR/<class>/``: scikit-learn's 1,797 handwritten digits
(8x8 values 0..16, upscaled to 16x16 grey PNG, classes ``zero``..``nine``), or a Fashion-MNIST subset (28x28,
``--per-class`` training images of each class). A stratified, seeded share (``--test-share``) is the test folder; the
rest is split without overlap over three label-skewed devices whose budgets grow with their classes' skew:

    dev-a  0.8M MACs  classes 0-3          (Fashion-MNIST: 1.5M)
    dev-b  3M         classes 2-7          (6M)
    dev-c  8M         classes 0, 1, 5-9    (20M)

Then, as a user types them: ``feast-edge preset new --classes-from TRAIN``, ``feast-edge cache build --preset FILE``,
and per recipe a ``feast-server run`` without data and three ``feast-agent run`` processes over the local Mosquitto
(a fresh federation id each), ``--rounds`` rounds, and ``feast-agent evaluate`` of each device's served ONNX model on
the test folder. Recipes (``--recipes``, run one after the other on the same preset, cache and folders):

    paper   no [train] table: method §7's recipe, what `preset new` wrote before issue 37
    preset  the [train] table `preset new` writes now (docs/presets.md)
    NAME:KEY=VALUE;KEY=VALUE   any other [train] table, for screening (e.g. 'b32:augment="none";lr=0.05;batch_size=32')

Prints progress lines, then per device: budget -> served MACs, own held-out accuracy (the agent's, in its manifest),
test accuracy, the classes below 50 % on the test folder, and the change from the first recipe to each other one.
Every process runs one intra-op thread in float32 (--amp off); the federations run one at a time. ``--serving-rule
largest`` gives each device its own tier (the server's default may serve a smaller variant that validated better), so
the top device's own variant is the one tested. ``--preset fmnist-small`` (with ``--data fmnist``) runs a shipped
preset and its cache instead of ``preset new`` and ``cache build`` (recipe ``preset``: the shipped [train]).
Figures: docs/presets.md §1.1 and docs/experiments.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import tomllib
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# device -> (the class indices it holds, its budget on digits, its budget on Fashion-MNIST)
DEVICES = {
    "dev-a": ((0, 1, 2, 3), "0.8M", "1.5M"),
    "dev-b": ((2, 3, 4, 5, 6, 7), "3M", "6M"),
    "dev-c": ((0, 1, 5, 6, 7, 8, 9), "8M", "20M"),
}
BUDGET_RANGE = {"digits": "0.8M..8M", "fmnist": "1.5M..20M"}
INPUT = {"digits": "1x16x16", "fmnist": "1x28x28"}
TRAIN_HEADER = "[train]"


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def digits_set() -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """scikit-learn's digits as uint8 16x16 images (values 0..16 scaled to 0..255, bilinear upscaling) and labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    small = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
    images = np.stack([np.asarray(Image.fromarray(im, "L").resize((16, 16), Image.BILINEAR)) for im in small])
    return images, digits.target.astype(np.int64), DIGIT_NAMES


def digits_folders(work: Path, seed: int) -> Path:
    """:func:`digits_set` as ``work/data/{train,test}/<name>/`` PNG files, a fifth of each class (seeded) testing."""
    images, labels, names = digits_set()
    rng = np.random.default_rng(seed)
    root = work / "data"
    for c, name in enumerate(names):
        index = rng.permutation(np.flatnonzero(labels == c))
        n_test = round(0.2 * len(index))
        for split, part in (("test", index[:n_test]), ("train", index[n_test:])):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in part.tolist():
                Image.fromarray(images[i], "L").save(folder / f"{i:05d}.png")
    return root


def digits_preset(work: Path, data: Path) -> Path:
    """``feast-edge preset new`` for the digits' folders, then ``feast-edge cache build``: what a new user runs."""
    preset = work / "digits.toml"
    cli = [sys.executable, "-m", "feast_edge.cli.main"]
    steps = (
        [*cli, "preset", "new", "--input", "1x16x16", "--classes-from", str(data / "train"), "--budgets", "0.8M..8M",
         "--out", str(preset)],
        [*cli, "cache", "build", "--preset", str(preset)],
    )  # fmt: skip
    for step in steps:
        began = time.monotonic()
        done = subprocess.run(step, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"{' '.join(step[3:5])} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        say(f"{' '.join(step[3:5])}: {time.monotonic() - began:.0f} s")
    return preset


def fmnist_set(root: Path, per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """``per_class`` Fashion-MNIST training images of each class (seeded draw) and labels."""
    from feast_edge.data.images import load_fashion_mnist
    from feast_edge.space.preset import load_preset

    train = load_fashion_mnist(root, "train")
    labels = train.labels.numpy()
    rng = np.random.default_rng(seed)
    picked = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:per_class] for c in range(10)])
    return train.images[picked, 0].numpy(), labels[picked], load_preset("fmnist-small").class_names


def split_folders(
    images: np.ndarray, labels: np.ndarray, names: tuple[str, ...], root: Path, test_share: float, seed: int
) -> dict[str, int]:
    """Write ``root/train/<class>/`` (all training images), ``root/test/<class>/`` and ``root/devices/<dev>/<class>/``.

    Per class, a seeded ``test_share`` goes to the test folder; the rest is dealt in equal, disjoint parts to the
    devices that hold the class. Returns the number of images in each folder."""
    rng = np.random.default_rng(seed)
    counts: dict[str, int] = {}

    def save(folder: Path, index: np.ndarray) -> None:
        for i in index.tolist():
            (folder / names[labels[i]]).mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[i], "L").save(folder / names[labels[i]] / f"{i:05d}.png")
        counts[folder.name] = counts.get(folder.name, 0) + len(index)

    for c in range(len(names)):
        index = rng.permutation(np.flatnonzero(labels == c))
        n_test = round(test_share * len(index))
        save(root / "test", index[:n_test])
        save(root / "train", index[n_test:])
        holders = [d for d, (classes, _, _) in DEVICES.items() if c in classes]
        for device, part in zip(holders, np.array_split(index[n_test:], len(holders))):
            save(root / "devices" / device, part)
    return counts


def run_logged(command: list[str], log: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    with open(log, "w") as out:
        done = subprocess.run(command, check=False, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[2:5])} failed (exit {done.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    return done


def spawn(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """``command`` as a process of this checkout, its output in ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)


def parse_recipes(text: str) -> dict[str, str | None]:
    """``paper,preset,NAME:KEY=VALUE;...`` -> name -> the [train] table's body (None: as `preset new` wrote it)."""
    recipes: dict[str, str | None] = {}
    for item in text.split(","):
        item = item.strip()
        if item == "paper":
            recipes[item] = ""
        elif item == "preset":
            recipes[item] = None
        elif ":" in item:
            name, body = item.split(":", 1)
            recipes[name] = "\n".join(p.strip() for p in body.split(";") if p.strip())
        else:
            sys.exit(f"--recipes: {item!r} is not paper, preset or NAME:KEY=VALUE;KEY=VALUE")
    return recipes


def recipe_preset(written: Path, folder: Path, body: str | None) -> Path:
    """``written`` (with its cache) copied to ``folder``, its [train] table replaced by ``body`` (None: kept)."""
    folder.mkdir(parents=True, exist_ok=True)
    text = written.read_text()
    if body is not None:
        head = text.split(f"\n{TRAIN_HEADER}\n")[0].rstrip("\n")
        text = head + (f"\n\n{TRAIN_HEADER}\n{body}\n" if body else "\n")
    target = folder / written.name
    target.write_text(text)
    cache = written.with_name(written.stem + ".cache.json")
    (folder / cache.name).write_bytes(cache.read_bytes())
    return target


def federation(
    preset: Path, run_dir: Path, data: Path, budgets: dict[str, str], args: argparse.Namespace, env: dict[str, str]
) -> dict[str, dict]:
    """One ``feast-server run`` and three ``feast-agent run`` processes; each device's manifest and test scores."""
    fed = f"bench-skew-{uuid.uuid4().hex[:10]}"
    logs, models = run_dir / "logs", run_dir / "models"
    logs.mkdir(parents=True, exist_ok=True)
    server = [
        sys.executable, "-m", "feast_edge.server.cli", "run", "--insecure", "--broker", args.broker,
        "--federation", fed, "--preset", str(preset), "--out", str(run_dir / "server"), "--rounds", str(args.rounds),
        "--per-round", "3", "--min-clients", "3", "--start-clients", "3", "--seed", str(args.seed),
        "--round-timeout", "600", "--wait-timeout", "300", "--threads", "1",
    ]  # fmt: skip
    if args.serving_rule:
        server += ["--serving-rule", args.serving_rule]
    processes = {"server": spawn(server, logs / "server.log", env)}
    for device, budget in budgets.items():
        agent = [
            sys.executable, "-m", "feast_edge.agent.cli", "run", "--insecure", "--broker", args.broker,
            "--federation", fed, "--device-id", device, "--data", str(data / "devices" / device),
            "--preset", str(preset), "--budget", budget, "--model-dir", str(models), "--threads", "1",
            "--amp", "off", "--register-timeout", "300",
        ]  # fmt: skip
        processes[device] = spawn(agent, logs / f"{device}.log", env)
    began, seen = time.monotonic(), 0
    try:
        while any(p.poll() is None for p in processes.values()):
            time.sleep(5)
            rounds = re.findall(r"round (\d+)/\d+", (logs / "server.log").read_text(errors="replace"))
            done = max((int(r) for r in rounds), default=0)
            if done != seen:
                seen = done
                say(f"  round {done}/{args.rounds} ({time.monotonic() - began:.0f} s)")
            if time.monotonic() - began > args.timeout:
                sys.exit(f"federation {fed} ran past --timeout {args.timeout} s; logs in {logs}")
    finally:
        for p in processes.values():
            if p.poll() is None:
                p.terminate()
                p.wait(30)
    failed = {name: p.returncode for name, p in processes.items() if p.returncode != 0}
    if failed:
        sys.exit(f"federation {fed}: {failed} exited non-zero; logs in {logs}")
    say(f"  federation finished in {time.monotonic() - began:.0f} s; evaluating the served models on the test folder")
    results = {}
    for device in budgets:
        manifest = json.loads((models / f"{device}.json").read_text())
        evaluate = [
            sys.executable, "-m", "feast_edge.agent.cli", "evaluate", "--model", str(models / f"{device}.onnx"),
            "--data", str(data / "test"), "--json", "--threads", "1",
        ]  # fmt: skip
        evaluated = subprocess.run(evaluate, capture_output=True, text=True, cwd=REPO, env=env, check=True)
        results[device] = {"manifest": manifest, "test": json.loads(evaluated.stdout)}
    return results


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f} %"


def report(found: dict[str, dict[str, dict]], budgets: dict[str, str], names: tuple[str, ...]) -> None:
    print(
        "\n| recipe | device (budget -> served) | classes held | own held-out | test folder | classes < 50 % on test |"
    )
    print("|---|---|---|---|---|---|")
    for recipe, devices in found.items():
        for device, r in devices.items():
            m, test = r["manifest"], r["test"]
            held = ", ".join(names[c] for c in DEVICES[device][0])
            weak = ", ".join(
                f"{c['class']} {100 * c['accuracy']:.1f} %" for c in test["classes"] if c["accuracy"] < 0.5
            )
            print(
                f"| {recipe} | {device} ({budgets[device]} -> {m['macs'] / 1e6:.2f}M) | {held} | "
                f"{_pct(m.get('holdout_accuracy'))} | {_pct(test['accuracy'])} | {weak or '-'} |"
            )
    print("\nper-class test accuracy (%):")
    print("| recipe | device | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for recipe, devices in found.items():
        for device, r in devices.items():
            by_name = {c["class"]: c["accuracy"] for c in r["test"]["classes"]}
            print(f"| {recipe} | {device} | " + " | ".join(f"{100 * by_name.get(n, 0):.0f}" for n in names) + " |")
    recipes = list(found)
    if len(recipes) > 1:
        base = recipes[0]
        print(f"\nchange from '{base}' (test accuracy, points and ratio):")
        for recipe in recipes[1:]:
            cells = []
            for device in budgets:
                a, b = found[base][device]["test"]["accuracy"], found[recipe][device]["test"]["accuracy"]
                cells.append(f"{device} {100 * (b - a):+.2f} pt (x{b / a:.2f})" if a else f"{device} {100 * b:.2f} %")
            mean_a = np.mean([found[base][d]["test"]["accuracy"] for d in budgets])
            mean_b = np.mean([found[recipe][d]["test"]["accuracy"] for d in budgets])
            print(f"  {recipe}: " + ", ".join(cells) + f"; fleet mean {100 * mean_a:.2f} % -> {100 * mean_b:.2f} %")


def make_preset(args: argparse.Namespace, work: Path, cli: list[str], env: dict[str, str]) -> Path:
    """``feast-edge preset new --classes-from`` on the training folder, then ``feast-edge cache build``."""
    written = work / f"{args.data}.toml"
    began = time.monotonic()
    new = [
        *cli, "preset", "new", "--input", INPUT[args.data], "--classes-from", str(work / "data" / "train"),
        "--budgets", BUDGET_RANGE[args.data], "--out", str(written),
    ]  # fmt: skip
    run_logged(new, work / "preset-new.log", env)
    written_train = tomllib.loads(written.read_text()).get("train", {})
    say(f"preset new: {written} ({time.monotonic() - began:.0f} s); its [train]: {written_train}")
    began = time.monotonic()
    run_logged([*cli, "cache", "build", "--preset", str(written)], work / "cache-build.log", env)
    entries = json.loads(written.with_name(written.stem + ".cache.json").read_text())["entries"]
    say(f"cache build: {len(entries)} variants ({time.monotonic() - began:.0f} s)")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=("digits", "fmnist"), default="digits")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--recipes", default="paper,preset", help="paper, preset or NAME:KEY=VALUE;... (comma-separated)"
    )
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: /tmp/bench-label-skew-DATA)")
    parser.add_argument("--broker", default="mqtt://127.0.0.1:1883")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--serving-rule",
        default=None,
        help="feast-server run --serving-rule (largest: the top device gets its own tier)",
    )
    parser.add_argument(
        "--preset",
        default=None,
        help="a shipped preset (e.g. fmnist-small, with --data fmnist) instead of preset new and cache build",
    )
    parser.add_argument("--test-share", type=float, default=0.2)
    parser.add_argument("--per-class", type=int, default=250, help="fmnist: images of each class (train and test)")
    parser.add_argument("--fmnist-dir", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one federation may take")
    args = parser.parse_args()
    recipes = parse_recipes(args.recipes)
    work = args.work or Path(f"/tmp/bench-label-skew-{args.data}")
    if work.exists() and any(work.iterdir()):
        sys.exit(f"--work {work} is not empty; remove it or choose another folder")
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln),
        "?",
    )
    avx512 = "avx512f" in Path("/proc/cpuinfo").read_text()
    machine = f"{cpu}, {os.cpu_count()} cores, avx512 {'yes' if avx512 else 'no'}"
    say(f"{platform.node()}: {machine}; work folder {work}")

    if args.data == "digits":
        images, labels, names = digits_set()
    else:
        images, labels, names = fmnist_set(args.fmnist_dir, args.per_class, args.seed)
    counts = split_folders(images, labels, names, work / "data", args.test_share, args.seed)
    say(f"{args.data}: {len(labels)} images written: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    budgets = {d: (b_digits if args.data == "digits" else b_fmnist) for d, (_, b_digits, b_fmnist) in DEVICES.items()}

    cli = [sys.executable, "-m", "feast_edge.cli.main"]
    if args.preset:  # a shipped preset and its cache instead of preset new + cache build (e.g. fmnist-small)
        written = work / f"{args.preset}.toml"
        written.write_bytes((REPO / "feast_edge" / "presets" / f"{args.preset}.toml").read_bytes())
        cache = (REPO / "feast_edge" / "caches" / f"{args.preset}.json").read_bytes()
        written.with_name(written.stem + ".cache.json").write_bytes(cache)
        say(f"preset {args.preset} (shipped) and its cache, instead of preset new and cache build")
    else:
        written = make_preset(args, work, cli, env)

    found: dict[str, dict[str, dict]] = {}
    for recipe, body in recipes.items():
        preset = recipe_preset(written, work / recipe, body)
        train = tomllib.loads(preset.read_text()).get("train", {})
        say(f"recipe {recipe}: [train] {train or '(none: method §7)'}; {args.rounds} rounds")
        found[recipe] = federation(preset, work / recipe, work / "data", budgets, args, env)
        for device, r in found[recipe].items():
            own, test = r["manifest"].get("holdout_accuracy"), r["test"]["accuracy"]
            say(f"  {device}: own held-out {_pct(own)}, test {_pct(test)}")
    (work / "results.json").write_text(json.dumps(found, indent=2))
    rule = args.serving_rule or "the server default"
    print(f"\n{args.data}, {args.rounds} rounds, seed {args.seed}, serving rule {rule}; {machine}")
    report(found, budgets, names)
    print(f"\nfigures in {work / 'results.json'}")


if __name__ == "__main__":
    main()
