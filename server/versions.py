"""Served models as versions: each newly served round is a version, offered to canaries first, then to every device;
each device installs it only if not worse on its own held-out split (feast_edge.versions).

    after each round      if the served round changed (feast_edge.evaluate.served_round), a new version: every
                          registered device's model is exported into ``<out>/models`` (each device calibrates its
                          variant's BN on its own data) with ``model_version`` in its manifest, and recorded in
                          ``<out>/versions.sqlite`` (round, reason, weights' SHA-256, epsilon under DP)
    canaries              --canary share of the online devices, at least one per budget tier, drawn among the agents
                          that can refuse a version (feature model-versions); each compares the version with the model
                          it runs and reports (version_report). Once every canary answered, or went offline, or
                          --round-timeout seconds passed: promoted unless more than half of them regressed
                          (feast_edge.versions.canary: the liar bound, the devices the served-round rule distrusts
                          left out), else held back with the reason
    everyone              a promoted version is offered to every online device that has not been offered it; a held
                          one, or one whose canaries are still deciding, only to devices that run no model of this
                          run (nothing to regress from). Each device decides
    no canaries           --canary 0, a finite run (mid-run versions go to late joiners only, as before; the others get
                          the final one), under DP (a canary's paired figures are held-out statistics the DP
                          guarantee does not cover: devices still decide for themselves, and report their decision
                          without figures), and the final version of a run (no later round to wait in)

An agent that does not list model-versions installs what it is sent: its installs are recorded as ``ungated`` and the
server says once that it cannot refuse one. A restarted server reads where each version stands from the registry.
An export that fails mid-run is logged and retried after the next round: it never stops the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from feast_edge.errors import FeastError
from feast_edge.protocol import VersionReport
from feast_edge.protocol.features import MODEL_VERSIONS
from feast_edge.server.registry import Device
from feast_edge.util.text import printable
from feast_edge.versions.book import OFFERED, Version, VersionBook
from feast_edge.versions.canary import draw_canaries, judge_canaries
from feast_edge.versions.gate import FIRST, INSTALLED, REFUSED, ROLLED_BACK, UNGATED

log = logging.getLogger(__name__)

MAX_REASON_KEPT = 500  # characters of a device's reason kept in the registry


class Serving(Protocol):
    """What the versions need of the server."""

    def export(self, federated_bn: bool | None = None, model_version: int | None = None) -> list[dict[str, Any]]: ...

    def announce_models(self, manifests: list[dict[str, Any]]) -> list[str]: ...

    def online_devices(self) -> list[str]: ...


@dataclass(frozen=True)
class Served:
    """What the run serves now: the round, the rounds it is the mean of, why, and the facts a version records."""

    round: int
    average_of: tuple[int, int] | None
    reason: str
    val_accuracy: float | None = None
    epsilon: float | None = None

    @property
    def key(self) -> tuple[int, tuple[int, int] | None]:
        return self.round, self.average_of


@dataclass(frozen=True)
class VersionPolicy:
    """How versions travel: ``share`` (--canary), ``seed``, ``wait`` (seconds canaries have), ``figures`` (devices
    report paired counts: not under DP), ``everyone`` (mid-run versions go to every device: --continuous; else to late
    joiners only)."""

    share: float
    seed: int
    wait: float
    figures: bool
    everyone: bool


class ServedVersions:
    """Exports each newly served round as a version and offers it as the module docstring says."""

    def __init__(
        self,
        server: Serving,
        book: VersionBook,
        devices: Callable[[], list[Device]],
        supports: Callable[[str, str], bool],
        distrusted: Callable[[], Collection[str]],
        policy: VersionPolicy,
        digest: Callable[[], str],
    ) -> None:
        """``devices()``: the registered devices; ``supports(device, feature)``: what its agent listed;
        ``distrusted()``: the devices the served-round rule no longer trusts; ``digest()``: the SHA-256 of the weights
        the last export served."""
        self.server, self.book, self.devices, self.supports = server, book, devices, supports
        self.distrusted, self.policy, self.digest = distrusted, policy, digest
        self.manifests: list[dict[str, Any]] = []
        self.exported: int | None = None  # the version models/ holds
        self.initial: set[str] | None = None  # the devices registered when this server's first round ended
        self._told: set[str] = set()  # devices whose agent cannot refuse a version, said once

    # ------------------------------------------------------------------ after each round
    def after(self, served: Served | None) -> None:
        """After a round, with what the run serves (None: nothing chosen yet)."""
        if self.initial is None:
            self.initial = {d.device_id for d in self.devices()}
        if served is None:
            return
        latest = self.book.latest()
        new = latest is None or (latest.round, latest.average_of) != served.key
        eligible = self._eligible()
        if new or self.exported != (latest.number if latest else None) or self._lacking(eligible):
            latest = self._export(served, latest, new)
            if latest is None:
                return
        for waiting in self.book.versions(state="canary"):  # a newer version does not end an older one's canaries
            self._decide(waiting)
        self._offer(latest, eligible)

    def final(self, served: Served) -> int:
        """The version the run's final export carries (a new one, offered to everyone, where the served round changed)."""
        latest = self.book.latest()
        if latest is not None and (latest.round, latest.average_of) == served.key:
            return latest.number
        return self._add(served, (), "the run's final version: offered to every device").number

    def _eligible(self) -> set[str]:
        """The online devices a mid-run version may go to: all with --continuous, else the late joiners."""
        online = set(self.server.online_devices())
        return online if self.policy.everyone else online - (self.initial or set())

    def _lacking(self, eligible: set[str]) -> bool:
        """Whether an eligible device has no model in the current export (it registered after it)."""
        return bool(eligible - {m["device"] for m in self.manifests})

    def _export(self, served: Served, latest: Version | None, new: bool) -> Version | None:
        number = (latest.number + 1) if new and latest is not None else (1 if latest is None else latest.number)
        began = time.monotonic()
        try:
            manifests = self.server.export(federated_bn=False, model_version=number)
        except FeastError as exc:
            log.warning(
                "could not export round %d's models during the run (%s); trying after the next round", served.round, exc
            )
            return None
        log.info(
            "exported the served round %d's models for %d devices as version %d (%.1f s)",
            served.round,
            len(manifests),
            number,
            time.monotonic() - began,
        )
        self.manifests, self.exported = manifests, number
        if not new:
            assert latest is not None
            return latest
        return self._add(served, self._canaries(number), "")

    def _canaries(self, number: int) -> tuple[str, ...]:
        p = self.policy
        if not (p.everyone and p.figures and p.share > 0):
            return ()
        budgets = {
            d.device_id: d.budget_macs
            for d in self.devices()
            if d.device_id in set(self.server.online_devices()) and self.supports(d.device_id, MODEL_VERSIONS)
        }
        return draw_canaries(budgets, p.share, p.seed, number)

    def _add(self, served: Served, canaries: tuple[str, ...], why: str) -> Version:
        p = self.policy
        if not why:
            why = (
                f"offered to {len(canaries)} canaries first: {', '.join(canaries)}"
                if canaries
                else "offered to every device (no canaries: "
                + (
                    "--canary 0"
                    if p.share == 0
                    else "under DP a canary's figures would leave its device unnoised"
                    if not p.figures
                    else "a run with an end serves its devices at the end"
                    if not p.everyone
                    else "no online device can refuse a version"
                )
                + ")"
            )
        version = self.book.add(
            round=served.round,
            average_of=served.average_of,
            reason=served.reason,
            weights_sha256=self.digest(),
            epsilon=served.epsilon,
            val_accuracy=served.val_accuracy,
            state="canary" if canaries else "direct",
            canaries=canaries,
            state_reason=why,
        )
        log.info("version %d: round %d (%s); %s", version.number, served.round, served.reason, why)
        return version

    # ------------------------------------------------------------------ canaries
    def _decide(self, version: Version) -> None:
        """Promote or hold a canary version once its canaries answered, left, or had --round-timeout seconds."""
        if version.state != "canary":
            return
        answers = self.book.answers(version.number)
        offered = self.book.offered(version.number)
        online = set(self.server.online_devices())
        waiting = [d for d in version.canaries if d not in answers and (d in online or d not in offered)]
        if waiting and time.time() - version.created < self.policy.wait:
            return
        # Only comparisons vote: a canary that ran no model installed it without one (its figures are the version's
        # accuracy alone).
        reports = {
            d: answers[d].verdict()
            for d in version.canaries
            if d in answers and answers[d].event in (INSTALLED, REFUSED)
        }
        promotion = judge_canaries(reports, self.distrusted())
        silent = f"; no answer from {', '.join(waiting)}" if waiting else ""
        state = "promoted" if promotion.promote else "held"
        self.book.decide(version.number, state, promotion.reason + silent)
        (log.info if promotion.promote else log.warning)("version %d %s%s", version.number, promotion.reason, silent)

    # ------------------------------------------------------------------ offers
    def _offer(self, version: Version, eligible: set[str]) -> None:
        version = self.book.version(version.number) or version
        offered = self.book.offered(version.number)
        running = self.book.running()
        # A device that runs no model of this run is offered the newest version at once, whatever its state: it has
        # nothing to regress from (one that runs a model from elsewhere still compares it with that one).
        targets = {d for d in eligible if d not in running}
        if version.state == "canary":
            targets |= {d for d in version.canaries if d in set(self.server.online_devices())}
        elif version.state != "held":
            targets = eligible
        targets = {d for d in targets - offered if running.get(d) is None or running[d].version != version.number}
        if not targets:
            return
        sent = self.server.announce_models([m for m in self.manifests if m["device"] in targets])
        if sent:
            log.info("offered version %d (round %d) to %s", version.number, version.round, ", ".join(sent))

    def offered_already(self, manifest: dict[str, Any]) -> set[str]:
        """The devices the version ``manifest`` carries was offered to (empty: a manifest without a version)."""
        number = manifest.get("model_version")
        return self.book.offered(number) if isinstance(number, int) else set()

    def record_offers(self, manifests: list[dict[str, Any]], sent: list[str]) -> None:
        """Record that ``sent`` were offered the versions their ``manifests`` carry; an agent that cannot refuse one
        installs it as it comes (``ungated``)."""
        versions = {m["device"]: m.get("model_version") for m in manifests}
        for device in sent:
            number = versions.get(device)
            if not isinstance(number, int):
                continue
            self.book.record(device, number, OFFERED)
            if not self.supports(device, MODEL_VERSIONS):
                self.book.record(device, number, UNGATED, running=number, reason="its agent cannot refuse a version")
                if device not in self._told:
                    self._told.add(device)
                    log.warning(
                        "%s's agent cannot refuse a version (it does not list the model-versions feature): it "
                        "installs each model it is sent without comparing it with the one it runs; upgrade it",
                        device,
                    )

    # ------------------------------------------------------------------ reports
    def on_report(self, message: VersionReport, registered: bool) -> str | None:
        """Record a device's version report (``registered``: whether its device is); why it was dropped, or None."""
        device = message.device
        if not registered:
            return "not a registered device"
        if not self.supports(device, MODEL_VERSIONS):
            return "its agent registered without the model-versions feature (it installs what it is sent)"
        version = self.book.version(message.version)
        if version is None:
            return f"no version {message.version} was served"
        if message.decision == ROLLED_BACK:
            ran = {e.version for e in self.book.events(device=device) if e.event not in (OFFERED, "refused")}
            if message.version not in ran or (message.running and message.running not in ran):
                return f"it never ran version {message.version} (or the version {message.running} it went back to)"
        elif device not in self.book.offered(message.version):
            return f"version {message.version} was not offered to it"
        elif message.decision == UNGATED:
            return "an agent that reports cannot be ungated"
        figures = (
            {
                k: getattr(message, k)
                for k in ("examples", "new_correct", "old_correct", "new_only", "old_only")
                if getattr(message, k)
            }
            if self.policy.figures
            else {}
        )
        reason = printable(message.reason[:MAX_REASON_KEPT], MAX_REASON_KEPT)
        event = self.book.record(
            device,
            message.version,
            message.decision,
            figures=figures,
            reason=reason,
            running=message.running or None,
        )
        words = event.verdict().words() if message.decision not in (ROLLED_BACK, FIRST) else message.decision
        if message.decision == ROLLED_BACK:
            words = f"rolled back by hand from version {message.version} to {message.running or 'none of this run'}"
        log.info("%s, version %d: %s%s", device, message.version, words, f" ({reason})" if reason else "")
        return None
