"""Federated validation on Flower: a run without server data has each validated round's cohort nodes test the model on
their own held-out splits, as ``feast-server run`` without ``--data`` has its agents do (server/validation.py).

    after round t's aggregation (every eval-every rounds and the last; the run loop calls the validator):
      per cohort node that registered a held-out split:
                    an "evaluate" Message (validation_records): its routed slice of the new global model and the
                    targets it may evaluate (the probes and the served variants its budget affords)
      per answer:   (correct, total) per target, each BN-recalibrated on the node's training split first; refused
                    when it cannot be (another device, round or slice, more or fewer results than targets, a total
                    above the node's registered held-out examples); a node without a held-out split declines
      -> device_record(...): the round's figure (robust over the nodes, --val-rule), the flags (explained by the
         nodes' registered held-out class mixes where they can be) and each node's figure on its served variant,
         which votes on the served round (feast_edge.evaluate.served_round, in the run loop)

Where no cohort node holds examples out, the round is not validated; where no round is, the last round is served.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace

import torch
from flwr.app import Message, RecordDict

from feast_edge.cache.variants import CacheEntry, VariantCache
from feast_edge.evaluate.device_validation import validation_targets
from feast_edge.evaluate.evaluation import probe_indices
from feast_edge.evaluate.federated import CALIBRATION, DEFAULT_VAL_RULE
from feast_edge.flower import records, validation_records
from feast_edge.flower.serverapp.collector import NodeBook
from feast_edge.protocol import MAX_PROBES, Declined, Evaluate, Evaluated
from feast_edge.route.envelope import route_state
from feast_edge.route.plans import plan_client
from feast_edge.run.loop import RoundRecord
from feast_edge.server.devices import DeviceBook
from feast_edge.server.validation import evaluation_budget, in_order, registered_record
from feast_edge.space.arch import Arch
from feast_edge.space.preset import Preset
from feast_edge.space.supernet import Supernet
from feast_edge.transport.errors import ProtocolError

log = logging.getLogger(__name__)


class FlowerValidation:
    """``validator(t, record)`` for the run loop: round ``t``'s cohort nodes test the model on their held-out data."""

    def __init__(
        self,
        nodes: NodeBook,
        preset: Preset,
        cache: VariantCache,
        model: Supernet,
        *,
        probes: int = 3,
        calibration: int = CALIBRATION,
        payload_dtype: str = "float32",
        rule: str = DEFAULT_VAL_RULE,
        max_weight_ratio: float = 8.0,
        timeout: float = 300.0,
    ) -> None:
        self.nodes, self.preset, self.cache = nodes, preset, cache
        self.model = model  # the run loop's global model: its state is read at each validation
        self.probes = [cache.entries[i] for i in probe_indices(len(cache), probes)]
        self.calibration, self.payload_dtype, self.timeout = calibration, payload_dtype, timeout
        self.rule, self.max_weight_ratio = rule, max_weight_ratio

    @property
    def devices(self) -> DeviceBook:
        return self.nodes.devices

    def targets(self) -> list[CacheEntry]:
        """What a validation tests: the probes and the variants the registered nodes are served, by MACs."""
        return validation_targets(
            self.cache, self.probes, (d.budget_macs for d in self.devices.registry.devices()), MAX_PROBES
        )

    def holdout(self, device: str) -> int:
        """The held-out examples ``device`` registered (0: it cannot validate)."""
        registered = self.devices.registry.get(device)
        held = registered.profile.get("holdout", 0) if registered is not None else 0
        return held if isinstance(held, int) and not isinstance(held, bool) and held > 0 else 0

    def __call__(
        self, t: int, record: RoundRecord, alternative: Mapping[str, torch.Tensor] | None = None
    ) -> float | None:
        """The cohort nodes' counts on round ``t``'s model and, with ``alternative`` (the tail mean), on that too in
        the same message, on the same examples (the ClientApp ships with this ServerApp, so every node can)."""
        asked = [d for d in record.cohort if self.nodes.node(d) is not None and self.holdout(d)]
        if not asked:
            log.warning(
                "round %d: no cohort node holds out examples to validate the model on (node config holdout, or run "
                "config node-holdout on Flower's Simulation Engine); no validation this round",
                t + 1,
            )
            return None
        began = time.monotonic()
        targets = self.targets()
        state = self.model.state_dict()
        messages, sent = [], {}
        for device in asked:
            content, request, archs = self._request(t, device, targets, state, alternative)
            node = self.nodes.node(device)
            messages.append(Message(content, dst_node_id=node, message_type="evaluate", group_id=str(t)))
            sent[node] = (device, request, archs)
        reports: dict[str, list[tuple[int, int]]] = {}
        others: dict[str, list[tuple[int, int]]] = {}
        refused: dict[str, str] = {}
        for reply in self.nodes.grid.send_and_receive(messages, timeout=self.timeout):
            node = reply.metadata.src_node_id
            if node not in sent or sent[node][0] in reports or sent[node][0] in refused:
                continue
            device, request, archs = sent[node]
            outcome = self._counts(reply, request, self.holdout(device))
            if isinstance(outcome, str):
                refused[device] = outcome
                log.warning("round %d: %s did not validate the model: %s", t + 1, device, outcome)
                continue
            reports[device] = in_order(targets, archs, outcome.counts())  # back to the ServerApp's order of targets
            for other in outcome.candidate_counts()[:1]:
                others[device] = in_order(targets, archs, other)
        unanswered = [d for d in asked if d not in reports and d not in refused]
        result, record.validation = registered_record(
            self.devices, self.cache, reports, targets, self.probes, self.rule, self.max_weight_ratio, t
        )
        record.validation["missing"] = sorted(set(asked) - set(reports))
        record.validation["seconds"] = round(time.monotonic() - began, 3)
        if alternative is not None:
            theirs, validation = registered_record(
                self.devices, self.cache, others, targets, self.probes, self.rule, self.max_weight_ratio, t, say=False
            )
            validation["missing"] = sorted(set(asked) - set(others))
            record.candidates = {
                "mean": {"val_accuracy": theirs.accuracy if others else None, "validation": validation}
            }
        accuracy = result.accuracy
        log.info(
            "round %d: federated validation (%s of %d node(s), %s held-out examples): %s%s",
            t + 1,
            self.rule,
            len(reports),
            record.validation["samples"],
            "none" if accuracy is None else f"{100 * accuracy:.2f}%",
            f"; no answer from {', '.join(unanswered)}" if unanswered else "",
        )
        return accuracy

    def _request(
        self,
        t: int,
        device: str,
        targets: list[CacheEntry],
        state: Mapping[str, torch.Tensor],
        alternative: Mapping[str, torch.Tensor] | None,
    ) -> tuple[RecordDict, Evaluate, list[Arch]]:
        """The validation content for ``device``, its request and the targets it names: those its registered
        evaluation limit (at least its budget) affords, with its routed slice of ``state`` (and of ``alternative``,
        a further candidate)."""
        plan = plan_client(self.cache, evaluation_budget(self.devices, device))
        archs = [e.arch for e in targets if e.arch in plan.affordable]
        layout = plan.layout(self.preset, self.preset.classes)
        routed, *extra = (
            records.wire(route_state(s, layout, self.preset), self.payload_dtype)
            for s in [state, *([alternative] if alternative is not None else [])]
        )
        describe = dict(federation=self.nodes.federation, round=t, device=device, kind="routed")
        info = records.describe(routed, **describe)
        registered = self.devices.registry.get(device)
        assert registered is not None
        request = Evaluate.for_plan(
            plan,
            archs,
            federation=self.nodes.federation,
            round=t,
            device=device,
            instance=registered.instance,
            transfer=info,
            timeout=self.timeout,
            calibration=self.calibration,
            payload_dtype=self.payload_dtype,
        )
        if extra:
            request = replace(request, candidates=tuple(records.describe(m, **describe).to_dict() for m in extra))
        return validation_records.validation_content(request, routed, extra), request, archs

    @staticmethod
    def _counts(reply: Message, request: Evaluate, holdout: int) -> Evaluated | str:
        """A node's answer, or why there is none (its ClientApp failed, it declined, its counts were refused)."""
        if reply.has_error():
            return f"the ClientApp failed: {reply.error.reason[:300]}"
        try:
            answer = validation_records.read_counts(reply.content, request, holdout)
        except ProtocolError as exc:
            return f"its counts were refused: {exc}"
        except Exception as exc:  # noqa: BLE001 - whatever a reply holds, it is the reply's fault: refuse it
            return f"its counts were refused: unreadable reply ({type(exc).__name__})"
        if isinstance(answer, Declined):
            return f"it declined: {answer.reason}"
        return answer
