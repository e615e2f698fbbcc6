"""The served round of a server without data on a label-skewed fleet, honest and beside one lying validator (issue 53).

    python bench/bench_served_round.py [--data fmnist|digits] [--seeds 0,1,2] [--rounds 20] [--train-limit 3000]
                                       [--test-limit 2000] [--calib 500] [--threads 1] [--work DIR]

A 3-client FEAST simulation validated by its devices (``SimulationConfig.of(validate_on="devices", holdout=0.1)``,
``eval_every=1``, all three clients every round), its shards replaced by label-skewed ones as in
bench/bench_label_skew.py (each class's examples of the pool dealt in equal, disjoint, seeded parts to the clients
that hold it):

    dev-a  the smallest cached variant's MACs   classes 0-3
    dev-b  the middle cached variant's MACs     classes 2-7
    dev-c  the largest cached variant's MACs    classes 0, 1, 5-9   (lacks 2, 3, 4)

``--data fmnist``: Fashion-MNIST, preset fmnist-small, a ``--train-limit`` pool, the first ``--test-limit`` test
images. ``--data digits``: scikit-learn's 1,797 digits as 16x16 PNG folders (a seeded, stratified 20 % test folder),
a preset from ``feast-edge preset new --input 1x16x16 --budgets 0.8M..8M`` and ``feast-edge cache build``, the
whole training folder as the pool.

After every round the global weights are kept. Each device's served variant (its largest affordable) is then
extracted from the served round's weights, from each of the last 5 rounds' and from the last round's, BN-recalibrated
on ``--calib`` of the device's own training split as an agent does (``calibrated_static``, class-balanced), and tested
on the all-class test set. Targets: served within 1 point of the mean of the last 5 rounds (on digits: not below the
last round). The tables also count "not below": served at least the mean of the last 5 less 1 point (a served round
newer than most of the window, while the model still improves, is above the mean by more than a point).

Liars are replayed on the same training (a liar lies only in validation, so every round's weights are the honest
run's): one client's recorded (correct, total) counts are altered, each round's validation record recomputed
(``InProcessValidation.record``) and ``served_round`` run over the altered history.

    100-then-0  100 % on every target at the first validation, 0 % afterwards
    plausible   in range, favouring an early round: at the first 3 validations, per target, its true figure raised to
                the best other device's; afterwards its true figure less 15 points, never below the worst other's

    candidate   honest in every round but the last, where it reports the candidate the honest devices score
                lower (the round's own weights or the mean of the last rounds') all right and the other all wrong:
                the lie aimed at the choice between the two (feast_edge.evaluate.candidates)

Per liar (dev-b, then dev-c) and kind: the round the fleet is served, the honest devices' test accuracy there against
the honest run's (target: within 3 points), the device distrusted and from which round (target: the 100-then-0 liar),
and any honest device flagged as possibly false (target: none).

The last round's two candidates (its own weights and the mean of the last rounds', validated on the same held-out
examples; the better offered to the served-round rule) against the rule before them, which validated the mean alone in
the round's stead ("before"): which weights each serves per device and seed, and their test accuracy in test images.
Both use the run's window (--serve-average's default: rounds 16-20 of the default 20, which the rule before the
window fit the run averaged too; for fewer rounds the window is shorter than that rule's 5).
Prints progress lines, a table per seed and a summary; writes a record to bench/results/ (bench/_records.py), whose
tables in docs/benchmarks.md are declared in bench/tables/served_round.py.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from feast_edge.cache.variants import load_cache
from feast_edge.evaluate.candidates import MEAN, choose_candidate
from feast_edge.evaluate.evaluation import accuracy
from feast_edge.evaluate.federated import calibrated_static
from feast_edge.evaluate.served_round import figures_of, served_round
from feast_edge.run.checkpoint import load_supernet
from feast_edge.run.round_record import RoundRecord
from feast_edge.sim.setup import SimulationConfig, build_setup
from feast_edge.sim.simulate import Simulation
from feast_edge.space.extract import extract
from feast_edge.space.preset import load_preset

sys.path.insert(0, str(Path(__file__).parent))  # bench_label_skew, for --data digits; _records
from _records import cpu, write_record  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# device -> the class indices it holds (bench_label_skew.py's DEVICES), in budget order: smallest, middle, largest
DEVICES = {
    "dev-a": (0, 1, 2, 3),
    "dev-b": (2, 3, 4, 5, 6, 7),
    "dev-c": (0, 1, 5, 6, 7, 8, 9),
}
LIARS = ("dev-b", "dev-c")
KINDS = ("100-then-0", "plausible", "candidate")
LAST = 5  # the last rounds the served round is compared with
EARLY = 3  # validations the plausible liar favours
DROP = 0.15  # how far below its true figure the plausible liar reports afterwards
SKEW_STREAM = 53


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def cpu_line() -> str:
    """Vendor, model name, family and model (lscpu), the cores and torch's version."""
    c = cpu()
    return (
        f"{c['vendor']} {c['model_name']} (family {c['family']}, model {c['model']}), {c['cores']} cores, torch "
        f"{torch.__version__}, {torch.get_num_threads()} intra-op thread(s)"
    )


# ----------------------------------------------------------------------------------------------------- the data


def digits_data(work: Path, seed: int) -> tuple[str, Path]:
    """scikit-learn's digits as ``work/data/{train,test}/<class>/`` PNGs (20 % stratified, seeded, test) and a preset
    written by ``feast-edge preset new`` with its ``cache build``; returns (the preset's path, the data folder)."""
    from bench_label_skew import digits_folders, digits_preset

    data = digits_folders(work, seed)
    return str(digits_preset(work, data)), data


def skewed(setup, holders: list[list[int]], seed: int):
    """The setup's population with label-skewed shards: each class's pool examples dealt in equal, disjoint, seeded
    parts to the clients that hold it (the budgets, plans and client ids unchanged)."""
    classes = setup.preset.classes
    labels = setup.train_set.labels.numpy()[setup.pool]
    rng = np.random.default_rng([seed, SKEW_STREAM])
    owner = np.full(len(labels), -1)
    for c in range(classes):
        who = [i for i, held in enumerate(holders) if c in held]
        index = rng.permutation(np.flatnonzero(labels == c))
        for i, part in zip(who, np.array_split(index, len(who)) if who else []):
            owner[part] = i
    shards = []
    for i in range(len(holders)):
        shard = np.flatnonzero(owner == i)
        shard.flags.writeable = False
        shards.append(shard)
    counts = np.stack([np.bincount(labels[s], minlength=classes) for s in shards])
    counts.flags.writeable = False
    old = setup.population
    partition = dataclasses.replace(
        old.partition, shards=tuple(shards), classes=np.arange(classes), class_counts=counts, draws=1
    )
    sizes = counts.sum(axis=1)
    return dataclasses.replace(old, partition=partition, allocation=sizes / sizes.sum())


def fleet(args: argparse.Namespace, seed: int, preset_ref: str, data_dir: Path | None):
    """The config, the label-skewed setup, device -> client id, device -> its served cache entry, device -> budget."""
    preset = load_preset(preset_ref)
    cache = load_cache(preset)
    entries = sorted(cache.entries, key=lambda e: e.macs)
    budgets = (entries[0].macs, entries[len(entries) // 2].macs, entries[-1].macs)
    digits = args.data == "digits"
    config = SimulationConfig.of(
        preset=preset_ref,
        dataset="imagefolder" if digits else "fashion-mnist",
        data_dir=str(data_dir) if digits else str(args.fmnist_dir),
        clients=len(DEVICES),
        per_round=len(DEVICES),
        rounds=args.rounds,
        budgets=tuple(float(b) for b in budgets),
        eval_every=1,
        validate_on="devices",
        holdout=0.1,
        seed=seed,
        train_limit=None if digits else args.train_limit,
        test_limit=args.test_limit,
        calib_samples=args.calib,
        val_samples=args.val_samples,
    )
    setup = build_setup(config)
    if digits:  # the server holds nothing: its validation and calibration splits go back to the devices' pool
        setup.pool = np.arange(len(setup.train_set))
    names = [preset.class_names[c] for c in range(preset.classes)]
    wanted = [[names.index(class_names(args)[c]) for c in held] for held in DEVICES.values()]
    setup.population = skewed(setup, wanted, seed)
    clients = dict(zip(DEVICES, setup.client_ids))
    served = {d: cache.largest_affordable(b) for d, b in zip(DEVICES, budgets)}
    return config, setup, clients, served, dict(zip(DEVICES, budgets))


def class_names(args: argparse.Namespace) -> tuple[str, ...]:
    """The class names in the data set's own label order (what DEVICES' indices mean)."""
    if args.data == "digits":
        from bench_label_skew import DIGIT_NAMES

        return DIGIT_NAMES
    return load_preset("fmnist-small").class_names


# ------------------------------------------------------------------------------------------------------ liars


def altered(
    reports: dict[int, dict[str, list[tuple[int, int]]]],
    liar: str,
    kind: str,
    served_index: dict[str, int],
    candidates: dict[int, dict[str, list[tuple[int, int]]]] | None = None,
) -> tuple[dict[int, dict[str, list[tuple[int, int]]]], dict[int, dict[str, list[tuple[int, int]]]]]:
    """The recorded reports (and those of the last round's second candidate) with ``liar``'s counts replaced as
    ``kind`` lies (see the module docstring)."""
    candidates = candidates or {}
    out, others = {}, {r: {d: list(c) for d, c in rep.items()} for r, rep in candidates.items()}
    for position, round_ in enumerate(sorted(reports)):
        round_reports = {d: list(c) for d, c in reports[round_].items()}
        if liar not in round_reports:
            out[round_] = round_reports
            continue
        if kind == "candidate":
            if round_ in others and liar in others[round_]:
                honest = [d for d in round_reports if d != liar and d in others[round_]]
                gain = sum(
                    others[round_][d][served_index[d]][0] / others[round_][d][served_index[d]][1]
                    - round_reports[d][served_index[d]][0] / round_reports[d][served_index[d]][1]
                    for d in honest
                )
                worse_is_mean = gain <= 0  # the honest devices favour the round's own weights (or tie)
                right = [(n, n) for _, n in round_reports[liar]]
                wrong = [(0, n) for _, n in round_reports[liar]]
                round_reports[liar], others[round_][liar] = (wrong, right) if worse_is_mean else (right, wrong)
            out[round_] = round_reports
            continue
        others_now = {d: c for d, c in round_reports.items() if d != liar}
        # the others' figures on their own served variants, where nobody else tested one of the liar's targets
        fallback = [
            c[served_index[d]][0] / c[served_index[d]][1] for d, c in others_now.items() if c[served_index[d]][1]
        ]
        lied = []
        for k, (correct, total) in enumerate(round_reports[liar]):
            if total == 0:
                lied.append((0, 0))
                continue
            if kind == "100-then-0":
                lied.append((total if position == 0 else 0, total))
                continue
            theirs = [c[k][0] / c[k][1] for c in others_now.values() if c[k][1] > 0] or fallback
            true = correct / total
            rate = max(true, max(theirs)) if position < EARLY else max(true - DROP, min(theirs))
            lied.append((min(total, max(0, round(rate * total))), total))
        round_reports[liar] = lied
        if round_ in others and liar in others[round_]:
            others[round_][liar] = list(lied)  # the same lie about the mean: its paired difference is 0
        out[round_] = round_reports
    return out, others


def replay(validator, reports: dict, candidates: dict, span: list[int]) -> tuple[object, bool]:
    """The served-round choice over recorded (or altered) counts: each round's record rebuilt as the run builds it,
    the last round's two candidates chosen between first; (the choice, whether the mean was the offered candidate)."""
    history = []
    for round_ in sorted(reports):
        result, validation = validator.record(reports[round_])
        record = RoundRecord(round=round_, lr=0.0, cohort=[], validation=validation, val_accuracy=result.accuracy)
        if round_ in candidates:
            theirs, other = validator.record(candidates[round_])
            record.candidates = {"of": span, "mean": {"val_accuracy": theirs.accuracy, "validation": other}}
        history.append(record)
        choose_candidate(history, record)
    choice = served_round([(h.round, h.validation) for h in history])
    return choice, history[-1].candidates.get("choice") == MEAN


def before_candidates(validator, span: list[int]):
    """The choice of the rule before the two candidates: the last round validated as the mean alone, in its stead."""
    records = [(r, validator.record(validator.reports[r])[1]) for r in sorted(validator.reports)]
    last = records[-1][0]
    if last in validator.candidate_reports:
        records[-1] = (last, validator.record(validator.candidate_reports[last])[1])
    return served_round(records)


def averaged(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The mean of several rounds' weights (floating tensors; counters such as BN's batch count: the last's)."""
    return {
        k: torch.stack([s[k] for s in states]).mean(0) if v.is_floating_point() else v.clone()
        for k, v in states[-1].items()
    }


def named_round(reason: str) -> int | None:
    found = re.match(r"round (\d+):", reason)
    return int(found.group(1)) if found else None


# ------------------------------------------------------------------------------------------------------ one seed


def run_seed(args: argparse.Namespace, seed: int, preset_ref: str, data_dir: Path | None, work: Path) -> dict:
    began = time.monotonic()
    config, setup, clients, served, budgets = fleet(args, seed, preset_ref, data_dir)
    devices = {c: d for d, c in clients.items()}
    sizes = {d: int(setup.population.sizes[setup.client_ids.index(c)]) for d, c in clients.items()}
    say(
        f"seed {seed}: "
        + ", ".join(
            f"{d} budget {budgets[d] / 1e6:.2f}M -> served {served[d].macs / 1e6:.2f}M, shard {sizes[d]} "
            f"(classes {','.join(map(str, DEVICES[d]))})"
            for d in DEVICES
        )
    )
    sim = Simulation(config, work / f"seed-{seed}", setup=setup)
    validator = sim.loop.validator
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    round_began = time.monotonic()

    def on_round(record) -> None:
        nonlocal round_began
        snapshots[record.round] = {k: v.detach().clone() for k, v in sim.model.state_dict().items()}
        figures = figures_of(record.validation)
        shown = ", ".join(f"{devices[c]} {100 * f.accuracy:.1f}" for c, f in sorted(figures.items()))
        flags = [devices[c] for c in record.validation.get("flagged", {})]
        differs = [devices[c] for c in record.validation.get("differs", {})]
        say(
            f"  seed {seed} round {record.round}/{config.training.rounds}: loss {record.loss or 0:.3f}, held-out on the served "
            f"variants {shown}; served round {sim.best.get('round')}"
            + (f"; flagged {flags}" if flags else "")
            + (f"; differs {differs}" if differs else "")
            + f" ({record.seconds:.0f} s training, {time.monotonic() - round_began - record.seconds:.0f} s validation)"
        )
        round_began = time.monotonic()

    sim.loop.run(sim.collector, on_round=on_round)
    trained = time.monotonic() - began
    history = [(h.round, h.validation) for h in sim.history if h.validation.get("source") == "devices"]
    honest = served_round(history)
    span = sim.history[-1].candidates.get("of") or sim.history[-1].average_of
    replayed, _ = replay(validator, validator.reports, validator.candidate_reports, span)
    before = before_candidates(validator, span)
    if honest.round != sim.best.get("round") or replayed.round != honest.round:
        say(
            f"  WARNING: served round {honest.round} from the history, {replayed.round} replayed, "
            f"{sim.best.get('round')} in the run's best"
        )
    honest_flagged = sorted({(r, devices[c]) for r, v in history for c in v.get("flagged", {})})
    honest_differs = sorted({devices[c] for _, v in history for c in v.get("differs", {})})
    say(
        f"  seed {seed}: trained {config.training.rounds} rounds in {trained:.0f} s; served round {honest.round}: {honest.reason}"
    )

    # --- the test set, each device's served variant from kept weights
    preset = setup.preset
    test_images, test_labels = setup.test_set.images, setup.test_set.labels
    if config.test_limit is not None:
        test_images, test_labels = test_images[: config.test_limit], test_labels[: config.test_limit]
    scratch = copy.deepcopy(sim.model)
    scores: dict[tuple[str, int], float] = {}

    def score(device: str, round_: int | str) -> float:
        if (device, round_) not in scores:
            scratch.load_state_dict(snapshots[round_])
            model = extract(scratch, served[device].arch)
            images, labels = setup.client_data(clients[device])
            calibrated_static(model, preset, images, args.calib, labels=labels)
            scores[device, round_] = accuracy(model, test_images, test_labels, preset)
        return scores[device, round_]

    last = config.training.rounds
    window = list(range(max(1, last - LAST + 1), last + 1))
    snapshots["average"] = averaged([snapshots[r] for r in window])
    # What the run serves: best.safetensors (the last round's own weights or the mean of the last rounds', whichever
    # its devices' paired figures favoured, where the rule chose the last round)
    snapshots["served"] = load_supernet(sim.loop.selected_checkpoint(), preset)[0].state_dict()
    offered_mean = sim.history[-1].candidates.get("choice") == MEAN

    # The run's tail mean (its window: --serve-average's default, rounds 16-20 of 20, the window before it fit the
    # run too): what the devices validated beside the last round's own weights
    snapshots["candidate"] = averaged([snapshots[r] for r in range(span[0], span[1] + 1)]) if span else snapshots[last]

    def weights_of(round_: int | None, mean: bool = offered_mean) -> int | str:
        """The weights served when the rule chooses ``round_``: the tail mean where the last round offered it."""
        return "candidate" if mean and round_ == last else round_

    rows = {}
    for device in DEVICES:
        mean5 = statistics.mean(score(device, r) for r in window)
        rows[device] = {
            "budget": budgets[device],
            "served_macs": served[device].macs,
            "shard": sizes[device],
            "served_round": honest.round
            if weights_of(honest.round) != "candidate"
            else f"{last} (mean of {span[0]}-{span[1]})",
            "candidates": sim.history[-1].candidates.get("reason"),
            "served": score(device, "served"),
            "mean_last": mean5,
            "last": score(device, last),
            "window": {r: score(device, r) for r in window},
            "average": score(device, "average"),
            "before": score(device, weights_of(before.round, mean=True)),
            "before_weights": str(weights_of(before.round, mean=True)),
            "served_weights": str(weights_of(honest.round)),
        }
        r = rows[device]
        say(
            f"  {device}: served round {honest.round} {100 * r['served']:.2f} %, mean of rounds {window[0]}-{last} "
            f"{100 * mean5:.2f} %, round {last} {100 * r['last']:.2f} %, the average of their weights "
            f"{100 * r['average']:.2f} %"
        )

    # --- liars, replayed
    served_index = {c: validator.targets.index(served[d]) for d, c in clients.items()}
    liars = []
    for liar in LIARS:
        for kind in KINDS:
            reports, others = altered(validator.reports, clients[liar], kind, served_index, validator.candidate_reports)
            records = [(r, validator.record(reports[r])[1]) for r in sorted(reports)]
            choice, mean = replay(validator, reports, others, span)
            flagged = sorted({(r, devices[c]) for r, v in records for c in v.get("flagged", {})})
            honest_devices = [d for d in DEVICES if d != liar]
            case = {
                "liar": liar,
                "kind": kind,
                "served_round": choice.round,
                "reason": choice.reason,
                "honest": {d: (score(d, weights_of(choice.round, mean)), rows[d]["served"]) for d in honest_devices},
                "offered_mean": mean,
                "distrusted": {devices[c]: named_round(why) for c, why in choice.distrusted.items()},
                "liar_flagged": [r for r, d in flagged if d == liar],
                "honest_flagged": [(r, d) for r, d in flagged if d != liar],
            }
            liars.append(case)
            say(
                f"  liar {liar} {kind}: served round {choice.round}; "
                + ", ".join(f"{d} {100 * a:.2f} % (honest run {100 * b:.2f} %)" for d, (a, b) in case["honest"].items())
                + f"; distrusted {case['distrusted'] or 'none'}; liar flagged in rounds {case['liar_flagged'] or 'none'}"
                + f"; honest flagged {case['honest_flagged'] or 'none'}"
            )
    seconds = time.monotonic() - began
    say(f"seed {seed} done in {seconds:.0f} s ({trained:.0f} s training and validation)")
    return {
        "seed": seed,
        "rounds": config.training.rounds,
        "test_images": int(test_labels.shape[0]),
        "served_round": honest.round,
        "reason": honest.reason,
        "honest_flagged": honest_flagged,
        "honest_differs": honest_differs,
        "devices": rows,
        "liars": liars,
        "seconds": seconds,
        "seconds_training": trained,
        "validation": {r: {devices[c]: list(f) for c, f in v.get("served", {}).items()} for r, v in history},
        "targets_macs": [e.macs for e in validator.targets],
        "reports": {r: {devices[c]: counts for c, counts in rep.items()} for r, rep in validator.reports.items()},
        "candidate_reports": {
            r: {devices[c]: counts for c, counts in rep.items()} for r, rep in validator.candidate_reports.items()
        },
        "before_round": before.round,
        "candidates": sim.history[-1].candidates.get("reason"),
        "mixes": {devices[c]: mix for c, mix in validator.mixes.items()},
    }


# ------------------------------------------------------------------------------------------------------ tables


def pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def seed_tables(result: dict, tolerance: float, liar_tolerance: float) -> None:
    seed, last = result["seed"], result["rounds"]
    print(
        f"\nseed {seed}: served round {result['served_round']} of {last} ({result['reason']}); honest run flagged: "
        f"{result['honest_flagged'] or 'none'}; differs (explained by classes): {result['honest_differs'] or 'none'}"
    )
    print(
        f"| device (budget -> served) | shard | served round | served | mean of rounds {last - LAST + 1}-{last} "
        f"| round {last} | served - mean | within {100 * tolerance:g} pt |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for device, r in result["devices"].items():
        gap = r["served"] - r["mean_last"]
        print(
            f"| {device} ({r['budget'] / 1e6:.2f}M -> {r['served_macs'] / 1e6:.2f}M) | {r['shard']} | "
            f"{r['served_round']} | {pct(r['served'])} | {pct(r['mean_last'])} | {pct(r['last'])} | "
            f"{100 * gap:+.2f} pt | {'yes' if abs(gap) <= tolerance + 1e-12 else '**no**'} |"
        )
    print(
        f"\n| liar | lie | served round | honest devices: served (honest run) | within {100 * liar_tolerance:g} pt "
        "| distrusted (from round) | liar flagged in rounds | honest flagged |"
    )
    print("|---|---|---:|---|---|---|---|---|")
    for case in result["liars"]:
        honest = ", ".join(f"{d} {pct(a)} ({pct(b)})" for d, (a, b) in case["honest"].items())
        within = all(abs(a - b) <= liar_tolerance + 1e-12 for a, b in case["honest"].values())
        distrusted = ", ".join(f"{d} ({r})" for d, r in case["distrusted"].items()) or "none"
        flagged = _rounds(case["liar_flagged"])
        honest_flagged = ", ".join(f"{d} r{r}" for r, d in case["honest_flagged"]) or "none"
        print(
            f"| {case['liar']} | {case['kind']} | {case['served_round']} | {honest} | {'yes' if within else '**no**'} "
            f"| {distrusted} | {flagged} | {honest_flagged} |"
        )


def _rounds(rounds: list[int]) -> str:
    if not rounds:
        return "none"
    if len(rounds) > 3 and rounds == list(range(rounds[0], rounds[-1] + 1)):
        return f"{rounds[0]}-{rounds[-1]}"
    return ", ".join(map(str, rounds))


def summary(results: list[dict], tolerance: float, liar_tolerance: float) -> None:
    seeds = ", ".join(str(r["seed"]) for r in results)
    print(f"\nsummary over seeds {seeds}:")
    print(
        "| device | served rounds | served (mean) | mean of last 5 (mean) | last round (mean) | |served - mean5| max "
        f"| within {100 * tolerance:g} pt | not below mean5 - {100 * tolerance:g} pt | served >= last "
        f"| the last 5 rounds' weights averaged (mean) | |averaged - mean5| max | averaged within {100 * tolerance:g} pt |"
    )
    print("|---|---|---:|---:|---:|---:|---|---|---|---:|---:|---|")
    for device in DEVICES:
        rows = [r["devices"][device] for r in results]
        gaps = [abs(x["served"] - x["mean_last"]) for x in rows]
        within = sum(g <= tolerance + 1e-12 for g in gaps)
        above = sum(x["served"] >= x["mean_last"] - tolerance - 1e-12 for x in rows)
        not_below = sum(x["served"] >= x["last"] - 1e-12 for x in rows)
        averaged = [abs(x["average"] - x["mean_last"]) for x in rows]
        print(
            f"| {device} | {', '.join(str(x['served_round']) for x in rows)} | "
            f"{pct(statistics.mean(x['served'] for x in rows))} | {pct(statistics.mean(x['mean_last'] for x in rows))} "
            f"| {pct(statistics.mean(x['last'] for x in rows))} | {100 * max(gaps):.2f} pt | {within} of {len(rows)} "
            f"| {above} of {len(rows)} | {not_below} of {len(rows)} | {pct(statistics.mean(x['average'] for x in rows))} "
            f"| {100 * max(averaged):.2f} pt | {sum(g <= tolerance + 1e-12 for g in averaged)} of {len(rows)} |"
        )
    print(
        f"\n| liar | lie | served rounds (honest run's) | honest devices' largest change | within {100 * liar_tolerance:g} "
        'pt | liar named "possibly false" (first round) | liar distrusted | honest device flagged |'
    )
    print("|---|---|---|---:|---|---|---|---|")
    for liar in LIARS:
        for kind in KINDS:
            cases = [(r, c) for r in results for c in r["liars"] if c["liar"] == liar and c["kind"] == kind]
            changes = [abs(a - b) for _, c in cases for a, b in c["honest"].values()]
            within = sum(all(abs(a - b) <= liar_tolerance + 1e-12 for a, b in c["honest"].values()) for _, c in cases)
            distrusted = [c["distrusted"].get(liar) for _, c in cases]
            named = sum(d is not None for d in distrusted)
            rounds_named = ", ".join(f"r{d}" for d in distrusted if d is not None)
            others = {d for _, c in cases for d in c["distrusted"] if d != liar}
            flagged = sum(bool(c["honest_flagged"]) for _, c in cases)
            first_flags = [c["liar_flagged"][0] for _, c in cases if c["liar_flagged"]]
            print(
                f"| {liar} | {kind} | "
                + ", ".join(f"{c['served_round']} ({r['served_round']})" for r, c in cases)
                + f" | {100 * max(changes):.2f} pt | {within} of {len(cases)} | {len(first_flags)} of {len(cases)}"
                + (f" ({', '.join(f'r{r}' for r in first_flags)})" if first_flags else "")
                + f" | {named} of {len(cases)}"
                + (f" ({rounds_named})" if rounds_named else "")
                + (f"; honest distrusted: {sorted(others)}" if others else "")
                + f" | {flagged} of {len(cases)} |"
            )
    honest_flagged = sum(bool(r["honest_flagged"]) for r in results)
    print(f"\nhonest runs with a device flagged as possibly false: {honest_flagged} of {len(results)}")
    candidates_table(results)


def candidates_table(results: list[dict]) -> None:
    """The last round's two candidates against the rule before them (the mean alone in the round's stead)."""
    print(
        "\nthe served weights with two candidates (after) against the mean alone (before), per device and seed "
        "(test accuracy; difference in test images):"
    )
    print("| seed | device | before | after | same weights | after - before |")
    print("|---:|---|---|---|---|---:|")
    same, moved = 0, []
    for r in results:
        for device, row in r["devices"].items():
            images = round((row["served"] - row["before"]) * r["test_images"])
            alike = row["before_weights"] == row["served_weights"]
            same += alike
            moved += [] if alike else [images]
            print(
                f"| {r['seed']} | {device} | {_weights(row['before_weights'])} {pct(row['before'])} | "
                f"{_weights(row['served_weights'])} {pct(row['served'])} | {'yes' if alike else 'no'} | {images:+d} |"
            )
    total = sum(len(r["devices"]) for r in results)
    print(
        f"\nsame weights in {same} of {total} device-seeds; where they differ, after - before: "
        + (", ".join(f"{m:+d}" for m in moved) + " test images" if moved else "none")
    )
    for r in results:
        print(f"seed {r['seed']}: {r['candidates']}")


def _weights(name: str) -> str:
    return "the mean" if name == "candidate" else f"round {name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=("fmnist", "digits"), default="fmnist")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--train-limit", type=int, default=3000, help="fmnist: the pool the three clients share")
    parser.add_argument("--test-limit", type=int, default=2000, help="the first N test images (digits: all 359)")
    parser.add_argument("--calib", type=int, default=500, help="BN-calibration examples per device (the agent's 500)")
    parser.add_argument("--val-samples", type=int, default=100, help="the server's validation split (unused)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--tolerance", type=float, default=1.0, help="points: served against the last 5 rounds")
    parser.add_argument("--liar-tolerance", type=float, default=3.0, help="points: honest devices beside a liar")
    parser.add_argument("--fmnist-dir", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a new temporary one)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.rounds < LAST:
        sys.exit(f"--rounds {args.rounds}: at least {LAST}")
    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix=f"bench-served-round-{args.data}-"))
    work.mkdir(parents=True, exist_ok=True)
    say(f"{platform.node()}: {cpu_line()}; work folder {work}")
    began = time.monotonic()
    if args.data == "digits":
        preset_ref, data_dir = digits_data(work, 0)
        say(f"digits: image folders and preset {Path(preset_ref).name} (preset new, cache build) written")
    else:
        preset_ref, data_dir = "fmnist-small", None
    results = []
    for seed in seeds:
        results.append(run_seed(args, seed, preset_ref, data_dir, work))
        (work / "results.json").write_text(json.dumps(results, indent=2, default=str))
    tolerance, liar_tolerance = args.tolerance / 100, args.liar_tolerance / 100
    print(
        f"\n{args.data}, {args.rounds} rounds, seeds {args.seeds}, 3 clients every round, device validation (holdout "
        f"0.1, eval every round), BN calibration {args.calib}, {results[0]['test_images']} test images; {cpu_line()}; "
        f"{time.monotonic() - began:.0f} s in all"
    )
    for result in results:
        seed_tables(result, tolerance, liar_tolerance)
    summary(results, tolerance, liar_tolerance)
    print(f"\nfigures in {work / 'results.json'}")
    kept = ("seed", "rounds", "test_images", "served_round", "reason", "before_round", "candidates", "devices", "liars")
    record = write_record(
        f"served-round-{args.data}",
        {"seeds": seeds, "rounds": args.rounds, "results": [{k: r[k] for k in kept} for r in results]},
    )
    print(f"record: {record.relative_to(REPO)}")


if __name__ == "__main__":
    main()
