"""Federated validation: a server without data asks the round's cohort to test the aggregated model (method §8).

    after round t's aggregation (every ``--eval-every`` rounds and the last):
      per online cohort device:  its routed slice of the new global model + Evaluate(the probes and the served
                                 variants it may evaluate: up to its registered evaluation limit, which a
                                 device may set above its serving budget, memory allowing)
      per answer:                Evaluated: (correct, total) per probe on the device's held-out split,
                                 each probe BN-recalibrated on the device's training split first
      -> per probe Σ correct / Σ total over the devices (sample-weighted); the round's validation accuracy is
         the mean over the probes some device tested; each device's result on its served variant votes on the
         served round (feast_edge.evaluate.served_round)

The probes are the server-held protocol's (``probe_indices`` over the cache) and give the round's figure; the
served variants are tested beside them so that the serving rule (``feast_edge.evaluate.coverage``) can compare them,
and ``tested_by`` records whose held-out split (whose classes) each covered. Only devices that registered a held-out split are asked; those that do not answer by
the deadline are left out of that round's figure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from feast_edge.cache.variants import CacheEntry, VariantCache
from feast_edge.evaluate.device_validation import device_record, validation_targets
from feast_edge.evaluate.evaluation import probe_indices
from feast_edge.evaluate.federated import CALIBRATION, DEFAULT_VAL_RULE, Validated
from feast_edge.protocol import MAX_PROBES, Evaluate, RoutedRequest
from feast_edge.protocol.features import EVALUATE_CANDIDATES
from feast_edge.route.envelope import route_state
from feast_edge.route.payload import encode
from feast_edge.route.plans import ClientPlan, plan_client
from feast_edge.run.loop import RoundRecord
from feast_edge.server.devices import DeviceBook
from feast_edge.server.exchange import Expect, RoundExchange
from feast_edge.space.arch import Arch
from feast_edge.space.preset import Preset

log = logging.getLogger(__name__)


def send_routed_request(
    exchange: RoundExchange,
    kind: type[RoutedRequest],
    plan: ClientPlan,
    archs: list[Arch],
    global_state: Mapping[str, torch.Tensor],
    preset: Preset,
    *,
    t: int,
    device: str,
    instance: str,
    calibration: int,
    payload_dtype: str,
    expect: Expect,
    candidates: Sequence[Mapping[str, torch.Tensor]] = (),
) -> bool:
    """Send ``device`` its routed slice of ``global_state`` and a ``kind`` request (evaluate, calibrate) about ``archs``;
    an evaluation's further ``candidates`` (other global states) go out as routed slices of the same plan after it."""
    classes = preset.classes
    manifest = plan.manifest(preset, classes, t, "routed", device, payload_dtype)
    layout = plan.layout(preset, classes)
    blob = encode(route_state(global_state, layout, preset), manifest)
    info = exchange.describe(device, blob)
    also = []
    for state in candidates:
        more = encode(route_state(state, layout, preset), manifest)
        also.append((more, exchange.describe(device, more)))
    message = kind.for_plan(
        plan,
        archs,
        federation=exchange.topics.federation,
        round=t,
        device=device,
        instance=instance,
        transfer=info,
        timeout=exchange.time_left(),
        calibration=calibration,
        payload_dtype=payload_dtype,
    )
    if also:
        message = replace(message, candidates=tuple(more.to_dict() for _, more in also))
    return exchange.send(device, message, blob, info, expect, also)


def in_order(
    targets: Sequence[CacheEntry], asked: Sequence[Arch], counts: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """A device's counts for the targets it was ``asked`` about (in that order), in the order of ``targets``."""
    by_probe = dict(zip(asked, counts))
    return [by_probe.get(e.arch, (0, 0)) for e in targets]


def evaluation_budget(devices: DeviceBook, device: str) -> int:
    """The largest variant (MACs) ``device`` may evaluate and calibrate: what it registered, at least its budget."""
    registered = devices.registry.get(device)
    if registered is None:
        return 0
    limit = registered.profile.get("evaluate_macs", 0)
    return max(registered.budget_macs, limit if isinstance(limit, int) else 0)


def _holds_out(devices: DeviceBook, device: str) -> bool:
    """Whether ``device`` registered a held-out split (agents before the task contract, or with --holdout 0, did not)."""
    registered = devices.registry.get(device)
    holdout = registered.profile.get("holdout", 0) if registered is not None else 0
    return isinstance(holdout, int) and holdout > 0


def registered_record(
    devices: DeviceBook,
    cache: VariantCache,
    reports: Mapping[str, list[tuple[int, int]]],
    targets: list[CacheEntry],
    probes: list[CacheEntry],
    rule: str,
    max_weight_ratio: float,
    t: int,
    trained: Collection[int] | None = None,
    say: bool = True,
) -> tuple[Validated, dict[str, Any]]:
    """``device_record`` of the devices' ``reports`` with what they registered (each one's budget: the variant it is
    served, its largest affordable, of the ``trained`` ones where given; its held-out class mix), its disagreements
    logged (``say``); MQTT's and Flower's validation share it."""
    served, mixes = {}, {}
    for device in reports:
        registered = devices.registry.get(device)
        if registered is not None and cache.affordable(registered.budget_macs):
            servable = cache.servable(registered.budget_macs, trained)
            if servable:
                served[device] = servable[-1]
        counts = registered.profile.get("holdout_counts") if registered is not None else None
        mixes[device] = [int(n) for n in counts] if isinstance(counts, list) else []
    result, record = device_record(reports, targets, probes, cache, served, mixes, rule, max_weight_ratio)
    for device, why in sorted(result.flagged.items()) if say else ():
        log.warning("round %d: %s's validation disagrees with the other devices: %s", t + 1, device, why)
    for device, why in sorted(result.differs.items()) if say else ():
        log.info("round %d: %s's validation differs from the other devices': %s", t + 1, device, why)
    return result, record


class FederatedValidation:
    """``validator(t, record)`` for the run loop: the cohort tests round ``t``'s model on its held-out data."""

    def __init__(
        self,
        exchange: RoundExchange,
        devices: DeviceBook,
        preset: Preset,
        cache: VariantCache,
        global_state: Mapping[str, torch.Tensor],
        *,
        probes: int = 3,
        calibration: int = CALIBRATION,
        payload_dtype: str = "float32",
        rule: str = DEFAULT_VAL_RULE,
        max_weight_ratio: float = 8.0,
        trained: Callable[[], Collection[int] | None] = lambda: None,
    ) -> None:
        """``trained``: the cache indices of the variants every slice of which a release moved so far (secure
        aggregation: a device is served the largest of those it affords); None: every variant."""
        self.exchange, self.devices, self.preset, self.cache = exchange, devices, preset, cache
        self.trained = trained
        self.rule, self.max_weight_ratio = rule, max_weight_ratio
        self.global_state = global_state  # aliases the model's tensors: always the current global model
        self.probes = [cache.entries[i] for i in probe_indices(len(cache), probes)]
        self.calibration, self.payload_dtype = calibration, payload_dtype
        self.last: dict[str, float] = {}  # probe label -> accuracy of the last validation
        # The same as points (label, macs, params, val_accuracy), for the dashboard's accuracy-vs-MACs chart.
        self.validated: list[dict[str, Any]] = []

    def targets(self, trained: Collection[int] | None = None) -> list[CacheEntry]:
        """What a validation tests: the probes and the variants the registered devices are served, by MACs."""
        return validation_targets(
            self.cache, self.probes, (d.budget_macs for d in self.devices.registry.devices()), MAX_PROBES, trained
        )

    def __call__(
        self, t: int, record: RoundRecord, alternative: Mapping[str, torch.Tensor] | None = None
    ) -> float | None:
        """Ask the online cohort devices that hold out examples to test the round's model, gather their counts, and
        fill ``record.validation`` (the round's figure, per target, whose data, the served variants' votes). With
        ``alternative`` (the tail mean), devices whose agent implements ``evaluate-candidates`` test it too in the
        same request, on the same examples (``record.candidates["mean"]``); the others test the round's own weights
        only, and the log says so."""
        online = set(self.devices.online())
        asked = [d for d in record.cohort if d in online and _holds_out(self.devices, d)]
        if not asked:
            log.warning(
                "round %d: no online cohort device holds out examples (feast-agent run --holdout) to validate the model "
                "on; no validation this round",
                t + 1,
            )
            return None
        began = time.monotonic()
        self.exchange.open(t)
        trained = self.trained()
        targets = self.targets(trained)
        paired = [] if alternative is None else [d for d in asked if self.devices.supports(d, EVALUATE_CANDIDATES)]
        if alternative is not None and len(paired) < len(asked):
            log.warning(
                "round %d: %s validate(s) only the round's own weights, not the mean of the last rounds beside them: "
                "their agents do not implement %s (an older feast-agent; upgrade it to let them compare the two)",
                t + 1,
                ", ".join(d for d in asked if d not in paired),
                EVALUATE_CANDIDATES,
            )
        sent = {
            d: self._ask(t, d, targets, [alternative] if d in paired and alternative is not None else []) for d in asked
        }
        reports, others = self._gather(t, sent, targets, set(paired))
        unsettled = self.exchange.close()
        result, record.validation = registered_record(
            self.devices, self.cache, reports, targets, self.probes, self.rule, self.max_weight_ratio, t, trained
        )
        self._keep(targets, record.validation["points"])
        record.validation["missing"] = sorted(set(asked) - set(reports))
        record.validation["seconds"] = round(time.monotonic() - began, 3)
        if alternative is not None:
            mean: dict[str, Any] = {"val_accuracy": None, "validation": {}}
            if others:
                theirs, mean["validation"] = registered_record(
                    self.devices,
                    self.cache,
                    others,
                    targets,
                    self.probes,
                    self.rule,
                    self.max_weight_ratio,
                    t,
                    trained,
                    say=False,
                )
                mean["val_accuracy"] = theirs.accuracy
                mean["validation"]["missing"] = sorted(set(asked) - set(others))
            record.candidates = {"mean": mean}
        shown = "none" if result.accuracy is None else f"{100 * result.accuracy:.2f}%"
        log.info(
            "round %d: federated validation (%s of %d device(s), %s held-out examples): %s%s%s",
            t + 1,
            self.rule,
            len(reports),
            record.validation["samples"],
            shown,
            f"; the mean of the last rounds tested beside it by {len(others)} device(s)"
            if alternative is not None
            else "",
            f"; no answer from {', '.join(unsettled.missing)}" if unsettled.missing else "",
        )
        return result.accuracy

    def _ask(
        self, t: int, device: str, targets: list[CacheEntry], candidates: Sequence[Mapping[str, torch.Tensor]]
    ) -> list[Arch]:
        """Send ``device`` its routed slice of the model (and of each further candidate) and the targets it may
        evaluate; returns those targets.

        A device evaluates every target it may (its registered evaluation limit, at least its budget): the served
        variants above its budget are validated on its classes too (evaluation is a one-off, not serving)."""
        registered = self.devices.registry.get(device)
        assert registered is not None
        plan = plan_client(self.cache, evaluation_budget(self.devices, device))
        probes = [e.arch for e in targets if e.arch in plan.affordable]
        send_routed_request(
            self.exchange,
            Evaluate,
            plan,
            probes,
            self.global_state,
            self.preset,
            t=t,
            device=device,
            instance=registered.instance,
            calibration=self.calibration,
            payload_dtype=self.payload_dtype,
            expect=Expect(max_bytes=0, max_samples=0),
            candidates=candidates,
        )
        return probes

    def _gather(
        self, t: int, sent: Mapping[str, list[Arch]], targets: list[CacheEntry], paired: set[str]
    ) -> tuple[dict[str, list[tuple[int, int]]], dict[str, list[tuple[int, int]]]]:
        """Each answering device's (correct, total) per target, in the server's order of targets, and the same of the
        further candidate where it tested one on the same examples; an answer that does not fit what was asked
        (another number of results, more examples than the device registered) is ignored, and a further
        candidate's counts from a device not sent one (in ``paired``), or on other examples than the first's, are
        left out."""
        reports: dict[str, list[tuple[int, int]]] = {}
        others: dict[str, list[tuple[int, int]]] = {}
        for reply in self.exchange.replies():
            if reply.evaluation is None:
                log.warning("round %d: %s did not validate the model: %s", t + 1, reply.device, reply.error)
                continue
            counts = reply.evaluation.counts()
            registered = self.devices.registry.get(reply.device)
            affordable = sent.get(reply.device, [])
            if len(counts) != len(affordable):
                log.warning(
                    "round %d: %s answered %d results for %d probes; ignored",
                    t + 1,
                    reply.device,
                    len(counts),
                    len(affordable),
                )
                continue
            held_out = registered.profile.get("holdout", 0) if registered is not None else 0
            if any(n > held_out for _, n in counts):
                # The counts weigh the figure: no device may weigh more than the held-out split it registered.
                log.warning(
                    "round %d: %s reports more examples than the %s it registered as held out; its counts are ignored",
                    t + 1,
                    reply.device,
                    held_out,
                )
                continue
            # Back to the server's order of targets: a device answers only for those it may evaluate.
            reports[reply.device] = in_order(targets, affordable, counts)
            for other in reply.evaluation.candidate_counts()[:1] if reply.device in paired else ():
                if [n for _, n in other] != [n for _, n in counts]:
                    log.warning(
                        "round %d: %s tested the second candidate on other examples than the first; left out of the "
                        "comparison",
                        t + 1,
                        reply.device,
                    )
                    continue
                others[reply.device] = in_order(targets, affordable, other)
        return reports, others

    def _keep(self, targets: list[CacheEntry], points: dict[str, float]) -> None:
        """The last validation's points, also as the dashboard's accuracy-vs-MACs entries."""
        self.last = points
        self.validated = [
            {"label": f"variant {self.cache.entries.index(e)}", "macs": e.macs, "params": e.params,
             "val_accuracy": points[f"variant {self.cache.entries.index(e)}"]}
            for e in targets
            if f"variant {self.cache.entries.index(e)}" in points
        ]  # fmt: skip
