"""``simulate --validate-on devices``: each round's cohort validates the model on its own held-out splits, in process,
as a server without data has its devices do (server/validation.py), through the same core functions.

    per cohort client:  held_out_counts(global model, the targets its budget affords, its training split, its held-out
                        split): each variant BN-recalibrated on its training examples (class-balanced), then tested
    -> device_record(...): the round's figure, the flags and each client's figure on its served variant, which vote on
       the served round (feast_edge.evaluate.served_round)

Where the round has two candidates (its own weights and the tail mean, feast_edge.evaluate.candidates), each client
tests both on the same held-out examples, as an agent answering a two-candidate request does.

A client evaluates the variants its budget affords (an agent's ``--evaluate-up-to serving``); the routed slice it
would receive holds exactly those variants' weights, so testing them on the global model gives the same counts.

``--lying-validators K``: the first K of a permutation of the clients seeded by (seed, 17) report false counts, the
lie the served-round rule is built to catch (bench/bench_served_round.py's "100-then-0"): every example right at their
first validation, every one wrong after; their training is honest.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from feast_edge.cache.variants import VariantCache
from feast_edge.evaluate.device_validation import device_record, validation_targets
from feast_edge.evaluate.evaluation import probe_indices
from feast_edge.evaluate.federated import DEFAULT_VAL_RULE, Validated, held_out_counts
from feast_edge.run.average import loaded
from feast_edge.run.loop import RoundRecord
from feast_edge.sim.setup import Setup
from feast_edge.space.supernet import Supernet

_LIARS = 17  # seed stream (feast_edge.sim.growth's use 13-16)


def lying_clients(client_ids: Sequence[str], count: int, seed: int) -> tuple[str, ...]:
    """The ``count`` clients whose reported held-out figures are false (see the module docstring), sorted."""
    order = np.random.default_rng([seed, _LIARS]).permutation(len(client_ids))
    return tuple(sorted(client_ids[i] for i in order[:count]))


def lie(counts: Sequence[tuple[int, int]], first: bool) -> list[tuple[int, int]]:
    """A lying validator's report in place of its true ``counts``: all right at its ``first`` validation, else none."""
    return [(n if first else 0, n) for _, n in counts]


class InProcessValidation:
    """``validator(t, record)`` for the run loop: the round's cohort tests the global model on its held-out splits."""

    def __init__(
        self,
        setup: Setup,
        model: Supernet,
        cache: VariantCache,
        budgets: dict[str, float],
        *,
        probes: int = 3,
        calibration: int = 500,
        device: str = "cpu",
        rule: str = DEFAULT_VAL_RULE,
        trained: Callable[[], Collection[int] | None] = lambda: None,
        liars: Collection[str] = (),
    ) -> None:
        """``trained``: the cache indices of the variants every slice of which a release moved so far (secure
        aggregation: a client is served the largest of those it affords); None: every variant. ``liars``: the clients
        whose reports are false (see the module docstring)."""
        self.liars = frozenset(liars)
        self.first_lie: dict[str, int] = {}  # liar -> the step of its first validation
        self.setup, self.model, self.cache, self.budgets = setup, model, cache, budgets
        self.probes = [cache.entries[i] for i in probe_indices(len(cache), probes)]
        self.trained = trained
        self.servable: Collection[int] | None = None  # the trained variants of the round validated last
        self.targets = validation_targets(cache, self.probes, budgets.values())
        self.calibration, self.device, self.rule = calibration, device, rule
        self.reports: dict[int, dict[str, list[tuple[int, int]]]] = {}  # 1-based round -> the clients' counts
        self.candidate_reports: dict[int, dict[str, list[tuple[int, int]]]] = {}  # the same of the tail mean
        self.mixes: dict[str, list[int]] = {}  # client -> its held-out examples per class

    def __call__(
        self, t: int, record: RoundRecord, alternative: Mapping[str, torch.Tensor] | None = None
    ) -> float | None:
        """Each cohort client's counts on the model's weights and, with ``alternative`` (the tail mean), on those
        too, on the same held-out examples; fills ``record.validation`` (and ``record.candidates["mean"]``)."""
        reports = self._counts(record.cohort, t)
        if not reports:
            return None
        self.reports[record.round] = reports
        result, record.validation = self.record(reports)
        record.validation["missing"] = []
        if alternative is not None:
            with loaded(self.model, alternative):
                others = self._counts(record.cohort, t)
            self.candidate_reports[record.round] = others
            theirs, validation = self.record(others)
            validation["missing"] = []
            record.candidates = {"mean": {"val_accuracy": theirs.accuracy, "validation": validation}}
        return result.accuracy

    def _counts(self, cohort: list[str], t: int) -> dict[str, list[tuple[int, int]]]:
        """Per cohort client holding examples out: (correct, total) per target on the model as it is (BN recalibrated
        on the training examples it holds at step ``t``)."""
        reports: dict[str, list[tuple[int, int]]] = {}
        classes = self.setup.preset.classes
        self.servable = self.trained()
        self.targets = validation_targets(self.cache, self.probes, self.budgets.values(), trained=self.servable)
        self.model.eval()
        for client in cohort:
            held_images, held_labels = self.setup.client_holdout(client, t)
            if held_labels.numel() == 0:
                continue
            images, labels = self.setup.client_data(client, t)
            affordable = [e for e in self.targets if e.macs <= self.budgets[client]]
            counts = held_out_counts(
                self.model,
                [e.arch for e in affordable],
                images,
                held_images,
                held_labels,
                self.calibration,
                self.device,
                train_labels=labels,
            )
            if client in self.liars:
                counts = lie(counts, first=self.first_lie.setdefault(client, t) == t)
            by_target = dict(zip(affordable, counts))
            reports[client] = [by_target.get(e, (0, 0)) for e in self.targets]
            self.mixes[client] = torch.bincount(held_labels, minlength=classes).tolist()
        return reports

    def record(self, reports: dict[str, list[tuple[int, int]]]) -> tuple[Validated, dict[str, Any]]:
        """The round's figure and validation record from the clients' counts (a benchmark may replay altered ones)."""
        servable = {c: self.cache.servable(self.budgets[c], self.servable) for c in reports}
        served = {c: entries[-1] for c, entries in servable.items() if entries}
        mixes = {c: self.mixes[c] for c in reports}
        return device_record(reports, self.targets, self.probes, self.cache, served, mixes, self.rule, 0.0)
