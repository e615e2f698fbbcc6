"""The demo's served model against the last round's own weights, and what the second candidate costs each device.

    PYTHONPATH=. python bench/bench_served_demo.py [--out DIR] [--rounds 6] [--seed 0] [--calib 800] [--reuse]

Runs ``feast-edge demo`` (a broker, a server without data, four agents on their own image folders; ``--dashboard
off``) and keeps every round's global weights as the server checkpoints them (a hard link to each
``checkpoint.safetensors`` as it is replaced). Then, for each device of the demo, its served variant (the manifest's
architecture) is extracted from:

    own        the last round's own weights (checkpoint.safetensors)
    mean K     the tail mean the devices validated beside them (the window that fits the run: rounds 5-6 of 6)
    mean 5     the mean of the last 5 rounds' weights: what the served model was before the window fit the run
               (--serve-average 5 by default; a 6-round demo served the mean of rounds 2-6)
    served     best.safetensors: what the run serves now (its reason is printed)

each BN-recalibrated on the same 800 Fashion-MNIST training images (the first 800, every class) and tested on the
10,000-image test split; "served - own" is the target's figure (at least -0.3 points). The cost of the second
candidate per device: the bytes of one more routed payload of its evaluation plan, and the seconds of one more
evaluation of its targets on its own data (timed here, the median of 3, beside the first candidate's); the agents'
logs' validation times (two candidates at the last round, one before) are printed too, but the demo's agents share
the machine with each other's training, so they vary with what else runs. A record of the run is written to
bench/results/ (bench/_records.py); its tables in docs/benchmarks.md are declared in bench/tables/served_demo.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _records import cpu, write_record  # noqa: E402

from feast_edge.agent.local_data import load_clients  # noqa: E402
from feast_edge.cache.variants import load_cache  # noqa: E402
from feast_edge.data.images import load_fashion_mnist  # noqa: E402
from feast_edge.errors import FeastError  # noqa: E402
from feast_edge.evaluate.evaluation import accuracy  # noqa: E402
from feast_edge.evaluate.federated import calibrated_static, held_out_counts  # noqa: E402
from feast_edge.route.plans import plan_client  # noqa: E402
from feast_edge.run.average import default_window  # noqa: E402
from feast_edge.run.checkpoint import load_supernet, read_record  # noqa: E402
from feast_edge.server.registry import Registry  # noqa: E402
from feast_edge.space.arch import Arch  # noqa: E402
from feast_edge.space.cost import count_params  # noqa: E402
from feast_edge.space.extract import extract  # noqa: E402
from feast_edge.space.preset import load_preset  # noqa: E402

OLD_WINDOW = 5  # the rounds averaged before the window fit the run


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def keep_rounds(server: Path, kept: Path, stop: threading.Event) -> None:
    """Hard-link each round's checkpoint as the server writes it (each write replaces the file: a new inode)."""
    kept.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    while not stop.is_set():
        path = server / "checkpoint.safetensors"
        try:
            done = int(read_record(path)["fields"]["round"])
            if done not in seen:
                target = kept / f"round-{done}.safetensors"
                target.unlink(missing_ok=True)
                os.link(path, target)
                seen.add(done)
        except (FeastError, OSError, KeyError, ValueError):
            pass  # not written yet, or replaced while read: the next look takes it
        stop.wait(0.2)


def run_demo(args: argparse.Namespace, demo: Path, kept: Path) -> float:
    command = [
        sys.executable, "-m", "feast_edge.cli.main", "demo", "--out", str(demo), "--rounds", str(args.rounds),
        "--seed", str(args.seed), "--data", str(args.data), "--dashboard", "off",
    ]  # fmt: skip
    say("running: feast-edge " + " ".join(command[4:]))
    stop = threading.Event()
    watcher = threading.Thread(target=keep_rounds, args=(demo / "server", kept, stop), daemon=True)
    began = time.monotonic()
    with open(args.out / "demo.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        watcher.start()
        code = process.wait()
    stop.set()
    watcher.join()
    if code != 0:
        sys.exit(f"feast-edge demo exited {code}; see {args.out / 'demo.log'}")
    return time.monotonic() - began


def averaged(paths: list[Path]) -> dict[str, torch.Tensor]:
    states = [load_supernet(p)[0].state_dict() for p in paths]
    return {
        k: torch.stack([s[k] for s in states]).mean(0) if v.is_floating_point() else v.clone()
        for k, v in states[-1].items()
    }


def timed_evaluation(args, device, preset, limit, targets, scratch, candidates, repeats: int = 3) -> float:
    """Median seconds of one candidate's evaluation on ``device``'s own data, as its agent runs it (the targets it may
    evaluate, each BN-recalibrated on its training split, tested on its held-out split): what a second candidate adds."""
    data = load_clients(args.out / "demo" / "devices" / device, device, task=preset.task, holdout=0.1)[0]
    affordable = [e.arch for e in targets if e.macs <= limit]
    seconds = []
    for _ in range(repeats):
        for state in list(candidates.values())[:2]:
            scratch.load_state_dict(state)
            began = time.perf_counter()
            held_out_counts(
                scratch, affordable, data.images, data.holdout_images, data.holdout_labels, 500,
                train_labels=data.labels,
            )  # fmt: skip
            seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def validation_seconds(log: str, device: str) -> tuple[list[float], list[float]]:
    """The seconds of each of ``device``'s validations in its agent log: (one candidate, two candidates)."""
    one, two = [], []
    pattern = rf"{re.escape(device)} validated \d+ variant\(s\)( of 2 candidate models)? on .*? in ([\d.]+) s"
    for found in re.finditer(pattern, log):
        (two if found.group(1) else one).append(float(found.group(2)))
    return one, two


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="working folder (default: a new temporary one)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calib", type=int, default=800, help="BN-calibration images (the first N training images)")
    parser.add_argument("--data", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    parser.add_argument("--reuse", action="store_true", help="score the demo already in --out (no new run)")
    args = parser.parse_args()
    args.out = args.out or Path(tempfile.mkdtemp(prefix="bench-served-demo-"))
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)
    machine = cpu()
    say(f"{machine['model_name']} (family {machine['family']}, model {machine['model']}), {machine['cores']} cores")
    demo, kept = args.out / "demo", args.out / "rounds"
    seconds = None
    if not args.reuse:
        shutil.rmtree(kept, ignore_errors=True)
        seconds = run_demo(args, demo, kept)
        say(f"demo finished in {seconds:.0f} s")
    server = demo / "server"
    last = int(read_record(server / "checkpoint.safetensors")["fields"]["round"])
    rounds = {int(p.stem.split("-")[1]): p for p in kept.glob("round-*.safetensors")}
    missing = sorted(set(range(1, last + 1)) - set(rounds))
    if missing:
        sys.exit(f"rounds {missing} were not kept (the watcher missed them); run again")
    window = list(range(max(1, last - OLD_WINDOW + 1), last + 1))
    fit = list(range(last - default_window(last) + 1, last + 1))  # the window that fits the run (its tail mean)
    candidates = {
        "own": load_supernet(rounds[last])[0].state_dict(),
        **({f"mean {fit[0]}-{last}": averaged([rounds[r] for r in fit])} if len(fit) > 1 else {}),
        f"mean {window[0]}-{last}": averaged([rounds[r] for r in window]),
        "served": load_supernet(server / "best.safetensors")[0].state_dict()
        if (server / "best.safetensors").is_file()
        else load_supernet(rounds[last])[0].state_dict(),
    }
    manifests = [json.loads(p.read_text()) for p in sorted((server / "models").glob("*.json"))]
    manifests = [m for m in manifests if "device" in m]
    preset = load_preset(manifests[0]["preset"])
    cache = load_cache(preset)
    train, test = load_fashion_mnist(args.data, "train"), load_fashion_mnist(args.data, "test")
    calib_images, calib_labels = train.images[: args.calib], train.labels[: args.calib].long()
    test_images, test_labels = test.images, test.labels.long()
    reason = manifests[0]["served_round"]["reason"]
    say(f"served: {reason}")
    scratch = load_supernet(rounds[last])[0]
    registry = Registry(server / "devices.sqlite", readonly=True)
    history = read_record(server / "checkpoint.safetensors")["fields"]["history"]
    points = next((h["validation"].get("points") for h in reversed(history) if h.get("validation")), {}) or {}
    targets = [cache.entries[int(label.split()[1])] for label in points]  # what the last validation tested
    rows = {}
    for manifest in manifests:
        device, arch = manifest["device"], Arch.from_dict(manifest["arch"])
        scores = {}
        for name, state in candidates.items():
            scratch.load_state_dict(state)
            model = extract(scratch, arch)
            calibrated_static(model, preset, calib_images, args.calib, labels=calib_labels)
            scores[name] = accuracy(model, test_images, test_labels, preset)
        registered = registry.get(device)
        limit = max(registered.budget_macs, int(registered.profile.get("evaluate_macs") or 0))
        payload = 4 * count_params(plan_client(cache, limit).layout(preset, preset.classes))
        evaluation = timed_evaluation(args, device, preset, limit, targets, scratch, candidates)
        log = next((args.out / "demo" / "logs").glob(f"agent-{device}*.log"), None)
        one, two = validation_seconds(log.read_text(errors="replace"), device) if log else ([], [])
        rows[device] = {
            "macs": manifest["macs"],
            "test": scores,
            "served_minus_own": scores["served"] - scores["own"],
            "second_candidate_bytes": payload,
            "validation_seconds_one": one,
            "validation_seconds_two": two,
            "evaluation_seconds": evaluation,
        }
        say(
            f"{device}: " + ", ".join(f"{n} {100 * a:.2f}%" for n, a in scores.items())
            + f"; served - own {100 * rows[device]['served_minus_own']:+.2f} points; second candidate "
            f"{payload / 1e6:.2f} MB; one candidate's evaluation {evaluation:.2f} s (median of 3); validation in the "
            f"run {statistics.median(one) if one else float('nan'):.2f} s with one, "
            f"{statistics.median(two) if two else float('nan'):.2f} s with two"
        )  # fmt: skip
    names = list(candidates)
    print(f"\n{args.rounds}-round demo, seed {args.seed}; test split 10,000 images, BN on the first {args.calib} "
          f"training images; {machine['model_name']} (family {machine['family']}, model {machine['model']})")  # fmt: skip
    print(f"served: {reason}\n")
    print(
        "| device | " + " | ".join(names) + " | served - own | >= -0.3 | 2nd candidate: bytes | its evaluation "
        "| validation in the run, 1 / 2 candidates |"
    )
    print("|---|" + "---:|" * len(names) + "---:|---|---:|---:|---:|")
    for device, r in rows.items():
        one, two = r["validation_seconds_one"], r["validation_seconds_two"]
        print(
            f"| {device} | " + " | ".join(f"{100 * r['test'][n]:.2f}%" for n in names)
            + f" | {100 * r['served_minus_own']:+.2f} | {'yes' if r['served_minus_own'] >= -0.003 else '**no**'} "
            f"| {r['second_candidate_bytes'] / 1e6:.2f} MB | {r['evaluation_seconds']:.2f} s "
            f"| {statistics.median(one) if one else float('nan'):.2f} / {statistics.median(two) if two else float('nan'):.2f} s |"
        )  # fmt: skip
    record = write_record(
        "served-demo",
        {"rounds": args.rounds, "seed": args.seed, "calib": args.calib, "served_reason": reason,
         "demo_seconds": seconds, "devices": rows},
    )  # fmt: skip
    print(f"\nrecord: {record.relative_to(Path(__file__).resolve().parents[1])}")


if __name__ == "__main__":
    main()
