"""Personal models against training alone: did federating pay, device by device? (issue 53, deliverable 3)

    PYTHONPATH=. python bench/bench_personal_vs_local.py [--data fmnist|digits] [--clients 8] [--rounds 10]
        [--alpha 0.1] [--train-limit 4000] [--seed 0] [--threads 1] [--json FILE]

One label-skewed fleet (Dirichlet(--alpha) shards: most devices hold a few classes; --gamma 0: shards of alike size
whatever the budget), every device holding out 10 % of its shard per class as the device agent does, and every device
in every round's cohort. Side by side, per device:

    A  personal    FEAST's federation (``feast-edge simulate``'s rounds, fmnist-small or a ``preset new`` preset), the
                   device's served variant of the last round's weights (BN on the server's calibration split), then
                   the device's personalization step as ``simulate --personalize auto`` runs it
                   (``feast_edge.sim.personalize_clients``: ``feast_edge.personalize.select.personal_step``)
    B  local only  the same variant, freshly initialised from the same seed, trained on the device's own training
                   split alone with the same recipe (``feast_edge.local.cotrain.local_train``, the client's own step)
                   for the same local epochs in total (--rounds x the recipe's epochs, the same lr schedule), BN
                   recalibrated on its own training images

Both are counted on the device's own held-out split (the figure a device reports) and on --test-limit test images
of every class (what a model tuned to a few classes forgets). Prints progress lines, a table per device (its classes,
the classes its personal model was tuned to, both accuracies), the means and their ratio, and the share of devices
for which federating did not pay: personal <= local only on the device's own held-out split, the worst-client figure
the personalization literature reports. ``--data digits``: scikit-learn's 1,797 digits as 16x16 image folders, with
a preset ``feast-edge preset new`` writes for them (and ``cache build``), in --work. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from feast_edge.evaluate.evaluation import calibrated_variant, correct_count
from feast_edge.local.cotrain import local_train
from feast_edge.local.recipe import scheduled_lr
from feast_edge.personalize.select import Choice, personal_step
from feast_edge.sim.setup import SimulationConfig, build_setup
from feast_edge.sim.simulate import Simulation
from feast_edge.space.arch import Arch
from feast_edge.space.supernet import Supernet

sys.path.insert(0, str(Path(__file__).parent))  # bench_label_skew: the digits as image folders and their preset
from bench_label_skew import digits_folders, digits_preset


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def machine() -> str:
    """The CPU's model name, its cores and PyTorch's threads (no host name, no path)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if "model name" in ln), platform.processor())
    return f"{cpu}, {torch.get_num_threads()} PyTorch threads, torch {torch.__version__}"


def local_only(setup, config: SimulationConfig, client: str, arch, index: int) -> tuple[torch.nn.Module, int]:
    """B: ``arch`` from a fresh supernet (the federation's seed), trained on ``client``'s training split alone with
    the federation's recipe and lr schedule, one call of the client's local step per round; BN on its own images."""
    images, labels = setup.client_data(client)
    train, schedule = config.recipe_settings()
    model = Supernet(setup.preset, seed=config.seed)
    for t in range(config.training.rounds):
        lr = scheduled_lr(schedule, train.lr, t, config.training.rounds)
        local_train(model, images, labels, [arch], arch, train, lr=lr, seed=config.seed * 100_003 + index * 1_009 + t)
    return calibrated_variant(model, arch, images).cpu().eval(), train.epochs * config.training.rounds


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=("fmnist", "digits"), default="fmnist")
    parser.add_argument("--fmnist-dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.1, help="Dirichlet alpha_eff of the shards (label skew)")
    parser.add_argument("--train-limit", type=int, default=4000, help="fmnist: the clients' pool of training images")
    parser.add_argument("--test-limit", type=int, default=1000)
    parser.add_argument("--gamma", type=float, default=0.0, help="shard sizes ~ budget^gamma (0: alike)")
    parser.add_argument("--val-samples", type=int, default=None, help="the server's validation split (500; digits 150)")
    parser.add_argument("--personalize", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None, help="--data digits: where its folders and preset go")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch intra-op threads (1: steady beside other work)")
    parser.add_argument("--json", type=Path, help="write every device's figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    say(f"{machine()}; {args.data}, {args.clients} devices, {args.rounds} rounds, alpha {args.alpha}, seed {args.seed}")

    with tempfile.TemporaryDirectory() as scratch:
        if args.data == "digits":
            work = args.work or Path(scratch) / "digits"
            data = digits_folders(work, args.seed)
            where = {"preset": str(digits_preset(work, data)), "dataset": "imagefolder", "data_dir": str(data)}
            where |= {"calib_samples": 150, "train_limit": None}
        else:
            where = {"data_dir": args.fmnist_dir, "train_limit": args.train_limit}
        config = SimulationConfig.of(
            **where,
            gamma=args.gamma,
            val_samples=args.val_samples or (150 if args.data == "digits" else 500),
            clients=args.clients,
            per_round=args.clients,  # every device trains in every round: B gets the same local epochs as A
            rounds=args.rounds,
            alpha_eff=args.alpha,
            test_limit=args.test_limit,
            eval_every=args.rounds,
            holdout=0.1,
            personalize=args.personalize,
            seed=args.seed,
        )
        setup = build_setup(config)
        sim = Simulation(config, Path(scratch) / "run", setup=setup)
        began = time.perf_counter()
        # The rounds alone (no test of every cached variant): the served variants are the last round's weights.
        sim.loop.run(
            sim.collector, on_round=lambda r: say(f"A: FEAST round {r.round}/{args.rounds}, loss {r.loss:.3f}")
        )
        federated = time.perf_counter() - began
        say(f"A: {args.rounds} rounds, {federated:.0f} s")
        points, calibration = sim.method.points(), setup.calibration_images()
        test_images, test_labels = setup.test_set.images[: args.test_limit], setup.test_set.labels[: args.test_limit]
        names = setup.preset.task.classes
        devices = []
        for i, (client, budget) in enumerate(zip(setup.client_ids, setup.population.budgets)):
            point = points[sim.method.served(float(budget))]
            images, labels = setup.client_data(client)
            held_images, held_labels = setup.client_holdout(client)
            # A: what feast_edge.sim.personalize_clients.personalize_clients does for the client (simulate --personalize).
            began = time.perf_counter()
            served = sim.method.point_network(point, calibration, "cpu")
            outcome, own = personal_step(
                served, images, labels, held_images, held_labels, setup.preset, Choice.parse(args.personalize),
                seed=args.seed,
            )  # fmt: skip
            personal = outcome.model if outcome.model is not None else served
            personalized = time.perf_counter() - began
            began = time.perf_counter()
            alone, epochs = local_only(setup, config, client, Arch.from_dict(dict(point.detail)), i)
            seconds = time.perf_counter() - began
            held = own.examples
            local_right = correct_count(alone, held_images, held_labels, setup.preset) if held else 0
            devices.append(
                {
                    "device": client,
                    "budget_macs": float(budget),
                    "served_macs": int(point.macs),
                    "classes": [names[k] for k in sorted(set(labels.tolist()))],
                    "train_examples": int(labels.numel()),
                    "holdout_examples": held,
                    "method": outcome.method,
                    "tuned": "" if outcome.model is None or outcome.tuned is None else outcome.tuned.words(),
                    "served": own.served_accuracy,
                    "personal": own.personal_accuracy,
                    "local": local_right / held if held else None,
                    "served_test": correct_count(served, test_images, test_labels, setup.preset) / len(test_labels),
                    "personal_test": correct_count(personal, test_images, test_labels, setup.preset) / len(test_labels),
                    "local_test": correct_count(alone, test_images, test_labels, setup.preset) / len(test_labels),
                    "local_epochs": epochs,
                    "personal_seconds": round(personalized, 1),
                    "local_seconds": round(seconds, 1),
                }
            )
            d = devices[-1]
            say(
                f"B: {client} alone, {epochs} epochs on {d['train_examples']} images, {seconds:.0f} s: own held-out "
                f"{pct(d['local'])} (personal {pct(d['personal'])})"
            )
    report(devices, args, federated)
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": machine(), "args": vars(args) | {"json": str(args.json)},
                                         "devices": devices}, indent=2, default=str))  # fmt: skip


def report(devices: list[dict], args: argparse.Namespace, federated: float) -> None:
    """The table per device, the means, their ratio and the share of devices for which federating did not pay."""
    print(f"\n{args.data}, {len(devices)} devices, Dirichlet alpha_eff {args.alpha}, {args.rounds} rounds, seed "
          f"{args.seed}; {machine()}")  # fmt: skip
    header = ("device", "served MACs", "classes", "train", "held-out", "own acc: served", "personal (method)",
              "local only", "paid?", "test acc: served", "personal", "local only")  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    measured = [d for d in devices if d["holdout_examples"]]
    for d in devices:
        paid = "-" if not d["holdout_examples"] else "yes" if d["personal"] > d["local"] else "no"
        cells = (
            d["device"], f"{d['served_macs'] / 1e6:.2f}M", f"{len(d['classes'])}/10", str(d["train_examples"]),
            str(d["holdout_examples"]), pct(d["served"]), f"{pct(d['personal'])} ({d['method'] or 'served kept'})",
            pct(d["local"]), paid, pct(d["served_test"]), pct(d["personal_test"]), pct(d["local_test"]),
        )  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    for d in devices:
        if d["tuned"]:
            print(f"* {d['device']}: personal model {d['tuned']}")
    if not measured:
        print("no device holds a held-out split: nothing to compare")
        return
    keys = ("served", "personal", "local", "served_test", "personal_test", "local_test")
    mean = {k: statistics.fmean(d[k] for d in measured) for k in keys}
    lost = [d["device"] for d in measured if d["personal"] <= d["local"]]
    print(
        f"\nown held-out accuracy, mean over {len(measured)} devices: served {pct(mean['served'])}, personal "
        f"{pct(mean['personal'])}, local only {pct(mean['local'])} (personal / local only "
        f"{mean['personal'] / max(mean['local'], 1e-9):.3f}); test accuracy: served {pct(mean['served_test'])}, "
        f"personal {pct(mean['personal_test'])}, local only {pct(mean['local_test'])}"
    )
    print(
        f"federating did not pay (personal <= local only on its own held-out split) for {len(lost)} of "
        f"{len(measured)} devices ({100 * len(lost) / len(measured):.0f} %)" + (f": {', '.join(lost)}" if lost else "")
    )
    personalizing = sum(d["personal_seconds"] for d in devices)
    print(f"time: A {federated:.0f} s of rounds + {personalizing:.0f} s of personalization, B (local only) "
          f"{sum(d['local_seconds'] for d in devices):.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
