"""One hosted client's round: wait for the routed payload, train it (``step.train``), send the update or decline.

The round message is parsed once (``Assignment.parse``), before any wait, so a
round this agent cannot train is refused at once. The wait ends when the payload
is complete, at the deadline (``timeout`` seconds after the round message
arrived, on this agent's clock), or when the inbox says a newer round or the
federation's end overtook it; other messages wait in the inbox meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from feast_edge import protocol
from feast_edge.agent.config import AgentConfig
from feast_edge.agent.hosted import Hosted
from feast_edge.agent.inbox import Inbox, Incoming
from feast_edge.agent.secure_round import SecureRounds
from feast_edge.agent.step import Assignment, Declined, Job, Trained, train, train_state
from feast_edge.errors import FeastError
from feast_edge.privacy.local import DeviceLedger, stricter
from feast_edge.protocol import MAX_REASON, Calibrate, Evaluate, RoundStart, RoutedRequest
from feast_edge.space.preset import Preset
from feast_edge.transport.errors import LinkError
from feast_edge.transport.link import Link
from feast_edge.transport.topics import Topics
from feast_edge.transport.transfer import Confirmations

log = logging.getLogger(__name__)


class RoundRunner:
    """Runs the rounds the server routes to hosted clients, one at a time, in the agent's thread."""

    def __init__(
        self,
        config: AgentConfig,
        preset: Preset,
        link: Link,
        topics: Topics,
        inbox: Inbox,
        receipts: Confirmations,
        report: Callable[[str, dict[str, Any]], None],
        stop: threading.Event,
    ) -> None:
        """``report(device_id, values)`` publishes where a round stands; ``receipts`` holds the uploads awaiting one."""
        self.config, self.preset, self.link, self.topics = config, preset, link, topics
        self.inbox, self.receipts, self.report, self.stop = inbox, receipts, report, stop
        self.training = False  # True while a client trains (a stop signal then interrupts it at once)
        self.between_steps: Callable[[], None] | None = None  # called after every training step (the agent's threads)
        self.ledger = DeviceLedger(None if config.dp_ledger is None else Path(config.dp_ledger), config.dp_delta)
        self.secure: SecureRounds | None = None  # the agent's secure-aggregation stages (rounds with ``secure`` terms)

    def run(self, client: Hosted, incoming: Incoming) -> bool:
        """Round ``incoming.message`` of ``client``; True when its update was sent."""
        start, device_id = incoming.message, client.device_id
        assert isinstance(start, RoundStart)
        shown, deadline = start.shown, incoming.at + start.timeout
        try:
            assignment = Assignment.parse(start, self.preset)
        except FeastError as exc:
            log.error("%s: refused the round message for %s: %s", shown, device_id, exc)
            return False
        required, asked = self.config.required_dp(), start.local_dp()
        if required is not None and asked is None:  # this device trusts no server with its raw update
            log.warning("%s: %s requires local DP and the round asks for none; declined", shown, device_id)
            return self._decline(
                assignment,
                "this device requires local differential privacy (feast-agent run --dp-clip/--dp-noise) and the "
                "round asks for none: run the server with --dp-mode local",
            )
        info = assignment.transfer
        blob = client.downloads.wait(
            info,
            deadline,
            abandon=lambda: self.stop.is_set() or self.inbox.overtaken(device_id, incoming.number),
            progress=lambda done: self.report(
                device_id, {"phase": "downloading", "round": start.round, "done": done, "total": info.count}
            ),
        )
        if blob is None:
            failed = client.downloads.failures.get(info.transfer)
            if failed is not None:  # it came and could not be verified, even fetched again: the server stops waiting
                return self._decline(assignment, f"its routed payload could not be verified: {failed}")
            why = "before the deadline (or a newer round or the federation's end overtook it)"
            log.warning("%s: no routed payload for %s %s; skipped", shown, device_id, why)
            return False
        self.report(device_id, {"phase": "training", "round": start.round})
        try:
            dp = stricter(asked, required)
            job = Job.of(assignment, blob, client.data, self.preset, self.config.torch_device, self.config.amp, dp)
        except FeastError as exc:
            log.error("%s: refused the routed payload for %s: %s", shown, device_id, exc)
            return self._decline(assignment, f"refused the routed payload: {exc}")
        log.info(
            "%s: %s trains %d variants on %d examples (routed payload %.2f MB)",
            shown,
            device_id,
            len(job.plan.affordable),
            client.data.samples,
            len(blob) / 1e6,
        )
        self.training = True
        try:
            outcome = train(job, self.between_steps) if not start.secure else self._masked(job, incoming, deadline)
        finally:
            self.training = False
        if isinstance(outcome, Declined):
            return self._decline(assignment, outcome.reason)
        if job.dp is not None:  # counted before it leaves: an update that may have left is spent
            eps = self.ledger.record(device_id, self.config.federation, job.dp.noise)
            spent = (
                "ε not computed here: pip install dp-accounting (the ledger keeps every update)"
                if eps is None
                else f"local DP ε = {eps:.3g} at δ = {self.ledger.delta:.2g}"
            )
            log.info(
                "%s: %s clipped its update to C = %g and noised it (z = %g): %s after %d noised updates from this device",
                shown,
                device_id,
                job.dp.clip,
                job.dp.noise,
                spent,
                self.ledger.updates(device_id),
            )
        if time.monotonic() > deadline:
            late = time.monotonic() - deadline
            log.warning("%s: %s finished %.1f s after the server's deadline; sending anyway", shown, device_id, late)
        return self._upload(client, assignment, outcome, deadline)

    def _masked(self, job: Job, incoming: Incoming, deadline: float) -> Trained | Declined:
        """A secure round's step: train, then mask the change per segment once the share box came (secure_round)."""
        start = incoming.message
        assert isinstance(start, RoundStart) and self.secure is not None
        trained = train_state(job, self.between_steps)
        if isinstance(trained, Declined):
            return trained
        self.report(start.device, {"phase": "masking", "round": start.round})
        upload = self.secure.masked_upload(
            start,
            job.routed,
            trained.state,
            deadline,
            abandon=lambda: self.stop.is_set() or self.inbox.overtaken(start.device, incoming.number),
        )
        if isinstance(upload, str):
            log.warning("%s: no masked update from %s: %s", job.shown, start.device, upload)
            return Declined(f"secure aggregation: {upload}")
        return Trained(upload, trained.result, trained.compute_seconds)

    def answer(self, client: Hosted, incoming: Incoming) -> bool:
        """Answer a request about the routed model of ``client`` (evaluate or calibrate); True when answered."""
        message, device_id = incoming.message, client.device_id
        assert isinstance(message, RoutedRequest)
        shown = f"round {message.round + 1}"
        if self.config.required_dp() is not None:  # held-out counts and BN statistics would leave unnoised
            log.warning("%s: %s requires local DP: the %s request is not answered", shown, device_id, message.kind)
            return False
        try:
            info = message.transfer_info()
        except FeastError as exc:
            log.error("%s: refused the %s request for %s: %s", shown, message.kind, device_id, exc)
            return False
        blob = client.downloads.wait(
            info,
            incoming.at + message.timeout,
            abandon=lambda: self.stop.is_set() or self.inbox.overtaken(device_id, incoming.number),
        )
        if blob is None:
            log.warning(
                "%s: the model of the %s request did not reach %s in time; skipped", shown, message.kind, device_id
            )
            return False
        if isinstance(message, Calibrate):
            return self._calibrate(client, message, blob)
        assert isinstance(message, Evaluate)
        others = []
        for info in message.candidate_infos():  # further candidate models, sent after the first
            other = client.downloads.wait(
                info,
                incoming.at + message.timeout,
                abandon=lambda: self.stop.is_set() or self.inbox.overtaken(device_id, incoming.number),
            )
            if other is None:
                log.warning("%s: a candidate model of the evaluate request did not reach %s in time", shown, device_id)
                return False
            others.append(other)
        return self._evaluate(client, message, blob, others)

    def _evaluate(self, client: Hosted, message: Evaluate, blob: bytes, others: list[bytes]) -> bool:
        """Federated validation: test the routed model's probes (and those of each further candidate, on the same
        examples) on the held-out data; publish the counts."""
        from feast_edge.agent.on_device import answer_evaluation

        began, device_id, shown = time.perf_counter(), client.device_id, f"round {message.round + 1}"
        try:
            answer = answer_evaluation(message, blob, client.data, self.preset, str(self.config.torch_device), others)
        except FeastError as exc:
            log.error("%s: could not validate the model for %s: %s", shown, device_id, exc)
            return False
        self.link.publish(self.topics.events(device_id), answer.encode())
        shown_counts = "; ".join(
            ", ".join(f"{c}/{n}" for c, n in counts) for counts in [answer.counts(), *answer.candidate_counts()]
        )
        log.info(
            "%s: %s validated %d variant(s)%s on its %d held-out examples (correct: %s) in %.1f s",
            shown,
            device_id,
            len(message.probes),
            f" of {1 + len(others)} candidate models" if others else "",
            client.data.holdout,
            shown_counts,
            time.perf_counter() - began,
        )
        return True

    def _calibrate(self, client: Hosted, message: Calibrate, blob: bytes) -> bool:
        """Federated BN statistics of the served variants on this device's training split, uploaded like an update."""
        from feast_edge.agent.on_device import answer_calibration

        began, device_id = time.perf_counter(), client.device_id
        info = message.transfer_info()
        try:
            statistics, examples = answer_calibration(
                message, blob, client.data, self.preset, str(self.config.torch_device)
            )
        except FeastError as exc:
            log.error("round %d: no BN statistics from %s: %s", message.round + 1, device_id, exc)
            declined = protocol.Declined(
                federation=self.config.federation,
                round=message.round,
                device=device_id,
                routed=info.transfer,
                reason=f"no BN statistics: {exc}"[:MAX_REASON],
            )
            self.link.publish(self.topics.events(device_id), declined.encode())
            return False
        up = client.sender.describe(statistics, round=message.round, device=device_id)
        update = protocol.Update(
            federation=self.config.federation,
            round=message.round,
            device=device_id,
            transfer=up.to_dict(),
            routed=info.transfer,
            samples=client.data.samples,
            metrics={"statistics": "bn", "calibrated_on": examples},
        )
        topic, announcement = self.topics.events(device_id), update.encode()
        try:
            client.sender.announce_and_send(topic, announcement, statistics, up, timeout=self.config.send_timeout)
        except LinkError as exc:
            log.error("could not send the BN statistics of %s: %s", device_id, exc)
            return False
        log.info(
            "%s sent the BN statistics of %d served variant(s) on %d of its examples (%.1f s)",
            device_id,
            len(message.variants),
            examples,
            time.perf_counter() - began,
        )
        self.receipts.add(device_id, client.sender, topic, announcement, up, until=time.monotonic() + message.timeout)
        return True

    def _decline(self, assignment: Assignment, reason: str) -> bool:
        """Tell the server no update will come (it stops waiting for this device at once)."""
        start = assignment.start
        declined = protocol.Declined(
            federation=self.config.federation,
            round=start.round,
            device=start.device,
            routed=assignment.transfer.transfer,
            reason=reason[:MAX_REASON],
        )
        self.link.publish(self.topics.events(start.device), declined.encode())
        return False

    def _upload(self, client: Hosted, assignment: Assignment, trained: Trained, deadline: float) -> bool:
        """Announce the update and send its chunks; its receipt is awaited while the next client trains."""
        t, device_id = assignment.start.round, client.device_id
        up = client.sender.describe(trained.payload, round=t, device=device_id)
        update = protocol.Update.from_result(
            trained.result,
            federation=self.config.federation,
            round=t,
            device_id=device_id,
            transfer=up,
            routed=assignment.transfer.transfer,
            compute_seconds=trained.compute_seconds,
            torch_device=str(self.config.torch_device),
        )
        topic, announcement = self.topics.events(device_id), update.encode()
        self.report(device_id, {"phase": "uploading", "round": t, "done": 0, "total": up.count})
        shown = assignment.start.shown
        try:
            client.sender.announce_and_send(topic, announcement, trained.payload, up, timeout=self.config.send_timeout)
        except LinkError as exc:
            log.error("%s: could not send the update of %s: %s", shown, device_id, exc)
            return False
        client.rounds_trained += 1
        log.info(
            "%s: %s sent its update: loss %.4f, %.1f s training, %.2f MB",
            shown,
            device_id,
            trained.result.mean_loss,
            trained.compute_seconds,
            len(trained.payload) / 1e6,
        )
        # Until the server's receipt: what reached a restarted broker before the server subscribed again is lost.
        self.receipts.add(device_id, client.sender, topic, announcement, up, until=deadline)
        return True
