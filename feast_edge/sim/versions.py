"""``simulate --versions``: every change of the served round is a new version, which each present device installs
only if it is not worse than the model it runs (feast_edge.versions: the gate, the canaries, the registry).

    the served round changes (the run loop's ``served`` hook; the model holds the served weights)
    -> version v = VersionBook.add(...)                   versions.sqlite in --out, every offer and decision a row
    -> canaries = draw_canaries(the present devices' budgets, --canary, seed, v): at least one per budget tier
       each canary is offered v: its served variant (the largest it affords) extracted, BN recalibrated on the
       training examples it holds (class-balanced, as an agent does), and judged against the network it runs on its
       held-out split (gate.judge: paired, the served-round rule's test)
    -> judge_canaries(their verdicts, the devices the served-round rule distrusts): promoted or held
       promoted   every other present device is offered v and gates it the same way
       held       only present devices that run no model yet are offered v (they have nothing to regress from)
    a device that runs nothing installs without a comparison (decision ``first``)

``--install-gate off``: no canaries; every present device is offered every version and installs it (``ungated``,
with the figures the gate would have judged), what a fleet without the gate runs. A lying validator
(``--lying-validators``, feast_edge.sim.device_validation) reports every version a regression (all of its held-out
examples wrong against all right) and acts on its report: it keeps the model it runs.

Devices are present from the step they join (feast_edge.sim.growth); a device that joins between two versions runs
nothing until the next. The networks the devices run live in this process only: a resumed simulation cannot go on
with them and is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from feast_edge.cache.variants import CacheEntry
from feast_edge.evaluate.evaluation import pixel_batches
from feast_edge.evaluate.federated import calibrated_static
from feast_edge.run.round_record import RoundRecord
from feast_edge.settings.validated import RunError
from feast_edge.sim.setup import Setup
from feast_edge.space.extract import extract
from feast_edge.space.static import StaticResNet
from feast_edge.space.supernet import Supernet
from feast_edge.versions.book import FILENAME, OFFERED, VersionBook, weights_digest
from feast_edge.versions.canary import draw_canaries, judge_canaries
from feast_edge.versions.gate import FIRST, UNGATED, Verdict, from_counts, judge

BYTES_PER_PARAM = 4  # a version is shipped as its served variant's float32 weights


@dataclass(frozen=True)
class Installed:
    """What a device runs: a version's served variant, calibrated on the device's training examples at install."""

    version: int
    network: StaticResNet
    entry: CacheEntry
    step: int  # the step (0-based round) it was installed at


@torch.no_grad()
def outcomes(network: StaticResNet, images: torch.Tensor, labels: torch.Tensor, setup: Setup) -> torch.Tensor:
    """Per example, whether ``network`` classifies it right (in the examples' order)."""
    network.eval()
    right = [
        network(x).argmax(dim=1) == labels[start : start + x.shape[0]]
        for x, start in zip(pixel_batches(images, setup.preset, 500), range(0, images.shape[0], 500))
    ]
    return torch.cat(right) if right else torch.zeros(0, dtype=torch.bool)


def served_network(
    setup: Setup, supernet: Supernet, device: str, budget: float, t: int, calibration: int
) -> tuple[StaticResNet, CacheEntry]:
    """``device``'s served variant of ``supernet`` (the largest it affords), BN recalibrated on ``calibration`` of the
    training examples it holds at step ``t``, class-balanced (feast_edge.evaluate.federated.calibrated_static)."""
    entry = setup.cache.largest_servable(budget)
    network = extract(supernet, entry.arch)
    images, labels = setup.client_data(device, t)
    calibrated_static(network, setup.preset, images, calibration, labels=labels)
    return network.eval(), entry


def measured_accuracy(setup: Setup, network: StaticResNet, device: str, t: int) -> float | None:
    """``network``'s accuracy on ``device``'s test split at step ``t`` (None: the device has no test examples)."""
    images, labels = setup.client_test(device, t)
    return float(outcomes(network, images, labels, setup).float().mean()) if labels.numel() else None


class SimulatedVersions:
    """The simulation's devices as version holders (see the module docstring); ``served(record)`` is the loop's
    hook."""

    def __init__(
        self,
        setup: Setup,
        model: Supernet,
        budgets: Mapping[str, float],
        *,
        canary: float,
        gated: bool,
        seed: int,
        calibration: int,
        out: str | Path | None = None,
        liars: Collection[str] = (),
    ) -> None:
        """``out``: the run directory, where versions.sqlite is kept (None: in memory)."""
        self.setup, self.model, self.budgets = setup, model, dict(budgets)
        self.canary, self.gated, self.seed, self.calibration = canary, gated, seed, calibration
        self.liars = frozenset(liars)
        self.book = VersionBook(":memory:" if out is None else Path(out) / FILENAME)
        self.running: dict[str, Installed] = {}
        self.macs: dict[str, int] = {}  # device -> forward MACs spent judging versions (BN calibration included)
        self.moved: dict[str, int] = {}  # device -> bytes of versions offered to it

    def present(self, t: int) -> list[str]:
        """The devices present at step ``t``."""
        ids = self.setup.client_ids
        return list(ids) if self.setup.growth is None else self.setup.growth.present(ids, t)

    def served(self, record: RoundRecord) -> None:
        """A new version from the served weights the model holds after ``record`` (see the module docstring)."""
        t, at = record.round - 1, float(record.clock if record.clock is not None else record.round)
        present = self.present(t)
        budgets = {d: self.budgets[d] for d in present}
        canaries = draw_canaries(budgets, self.canary, self.seed, len(self.book.versions()) + 1) if self.gated else ()
        version = self.book.add(
            round=record.round,
            reason=str(record.validation.get("served_reason") or f"round {record.round} served"),
            weights_sha256=weights_digest(self.model.state_dict()),
            state="canary" if canaries else "direct",
            canaries=canaries,
            average_of=tuple(record.average_of) if record.average_of else None,  # type: ignore[arg-type]
            val_accuracy=record.val_accuracy,
            at=at,
        )
        v = version.number
        if not canaries:
            for device in present:
                self.offer(device, v, t, at)
            return
        reports = {d: self.offer(d, v, t, at) for d in canaries}
        promotion = judge_canaries(reports, set(record.validation.get("distrusted") or {}))
        self.book.decide(v, "promoted" if promotion.promote else "held", promotion.reason, at=at)
        for device in present:
            if device not in reports and (promotion.promote or device not in self.running):
                self.offer(device, v, t, at)

    def offer(self, device: str, version: int, t: int, at: float) -> Verdict:
        """``device`` is offered ``version`` (the model's weights) at step ``t``: it judges it, installs it or not, and
        both are recorded."""
        network, entry = served_network(self.setup, self.model, device, self.budgets[device], t, self.calibration)
        self.book.record(device, version, OFFERED, figures={"bytes": entry.params * BYTES_PER_PARAM}, at=at)
        self.moved[device] = self.moved.get(device, 0) + entry.params * BYTES_PER_PARAM
        current = self.running.get(device)
        if current is None:
            verdict = Verdict(True, FIRST)
        else:
            images, labels = self.setup.client_holdout(device, t)
            verdict = judge(
                outcomes(network, images, labels, self.setup), outcomes(current.network, images, labels, self.setup)
            )
            n = verdict.examples
            self.macs[device] = self.macs.get(device, 0) + n * (entry.macs + current.entry.macs)
            if device in self.liars and n:  # its report: every example wrong on the new version, right on its own
                verdict = from_counts(n, 0, n, 0, n)
            if not self.gated:
                verdict = dataclasses.replace(verdict, install=True, decision=UNGATED)
        self.macs[device] = self.macs.get(device, 0) + self.calibration * entry.macs
        if verdict.install:
            self.running[device] = Installed(version, network, entry, t)
        running = self.running[device].version if device in self.running else None
        self.book.record(
            device, version, verdict.decision, figures=verdict.figures(), reason=verdict.words(), running=running, at=at
        )
        return verdict

    def test_accuracies(self, t: int) -> dict[str, float | None]:
        """Each present device's accuracy of the network it runs on its test split at step ``t`` (None: it runs none,
        or holds no test examples)."""
        return {
            d: measured_accuracy(self.setup, self.running[d].network, d, t) if d in self.running else None
            for d in self.present(t)
        }

    def resumed(self) -> None:
        """A resumed run cannot go on with the networks its devices ran (they lived in the stopped process)."""
        if self.book.versions():
            raise RunError(
                f"--versions: the networks the devices ran were in the stopped process ({self.book.path} holds their "
                "record); run again without --resume into a new --out"
            )
