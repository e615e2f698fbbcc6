"""Federated BN statistics: a server without data calibrates each served variant on the devices' data (method §8).

    after the last round, before export (``feast-server run --bn-calibration federated``, the default without --data):
      per online registered device:  its routed slice of the exported model + Calibrate(the served variants it can afford)
      per answer:                    an upload of per-layer, per-channel BN input means and variances on a seeded
                                     sample of the device's training split (at most the examples it was asked for and
                                     registered), weighted by its registered examples (capped: --max-weight-ratio)
      per served variant:            robust_statistics(the answers of the devices that can run it, --bn-rule)
                                     -> its BN buffers; refused reports are named (feast_edge.evaluate.bn_robust)

A variant is calibrated on the data of every device that may evaluate it: its registered evaluation limit (memory
allowing, above its serving budget; at least its budget), so that a large variant's statistics are not those of the
few devices that can serve it. A device that does not answer by the deadline, or whose statistics are malformed,
is left out; a variant no device answered for falls back to calibration on each device it serves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from feast_edge.cache.variants import VariantCache
from feast_edge.evaluate.bn_robust import DEFAULT_BN_RULE, Report, robust_statistics
from feast_edge.evaluate.bn_stats import (
    MIN_EXAMPLES,
    StatisticsError,
    Stats,
    decode_statistics,
    layer_channels,
    statistics_size,
)
from feast_edge.protocol import Calibrate
from feast_edge.route.plans import plan_client
from feast_edge.server.devices import DeviceBook
from feast_edge.server.exchange import Expect, RoundExchange
from feast_edge.server.validation import evaluation_budget, send_routed_request
from feast_edge.space.arch import Arch
from feast_edge.space.preset import Preset
from feast_edge.space.static import StaticResNet

log = logging.getLogger(__name__)

MAX_CALIBRATION = 100_000  # examples a device may report its statistics on (the agent's own cap)


@dataclass(frozen=True)
class Calibrated:
    """One served variant's federated BN statistics: the combined moments, who contributed, on how many examples."""

    stats: Stats
    devices: tuple[str, ...]
    examples: int


class FederatedCalibration:
    """``calibrate(t, state, variants)``: the online devices' BN statistics of ``variants``, combined per variant."""

    def __init__(
        self,
        exchange: RoundExchange,
        devices: DeviceBook,
        preset: Preset,
        cache: VariantCache,
        *,
        calibration: int,
        payload_dtype: str = "float32",
        rule: str = DEFAULT_BN_RULE,
        max_weight_ratio: float = 8.0,
    ) -> None:
        self.exchange, self.devices, self.preset, self.cache = exchange, devices, preset, cache
        self.calibration, self.payload_dtype = calibration, payload_dtype
        self.rule, self.max_weight_ratio = rule, max_weight_ratio

    def calibrate(
        self, t: int, global_state: Mapping[str, torch.Tensor], variants: Mapping[Arch, StaticResNet]
    ) -> dict[Arch, Calibrated]:
        """Ask every online registered device for the statistics of the ``variants`` (extracted models) it can run."""
        began, exchange = time.monotonic(), self.exchange
        layers = {arch: layer_channels(model) for arch, model in variants.items()}
        asked: dict[str, list[Arch]] = {}
        exchange.open(t)
        for device in self.devices.online():
            registered = self.devices.registry.get(device)
            if registered is None or registered.samples < MIN_EXAMPLES:
                continue
            plan = plan_client(self.cache, evaluation_budget(self.devices, device))  # above its budget, memory allowing
            archs = [a for a in plan.affordable if a in variants]
            if not archs:
                continue
            expect = Expect(max_bytes=statistics_size([layers[a] for a in archs]), max_samples=registered.samples)
            sent = send_routed_request(
                exchange,
                Calibrate,
                plan,
                archs,
                global_state,
                self.preset,
                t=t,
                device=device,
                instance=registered.instance,
                calibration=self.calibration,
                payload_dtype=self.payload_dtype,
                expect=expect,
            )
            if sent:
                asked[device] = archs
        if asked:
            log.info(
                "federated BN statistics of %d served variant(s): asked %s", len(variants), ", ".join(sorted(asked))
            )
        reports: dict[Arch, list[Report]] = {a: [] for a in variants}
        examples: dict[str, int] = {}
        for reply in exchange.replies() if asked else ():
            archs = asked.get(reply.device)
            if reply.update is None or reply.payload is None or archs is None:
                log.warning("no BN statistics from %s: %s", reply.device, reply.error or "no upload")
                continue
            registered = self.devices.registry.get(reply.device)
            samples = registered.samples if registered is not None else 0
            bound = min(MAX_CALIBRATION, samples, self.calibration)  # what it was asked for, of what it registered
            try:
                examples[reply.device], stats = decode_statistics(
                    reply.payload, [layers[a] for a in archs], max(bound, MIN_EXAMPLES)
                )
            except StatisticsError as exc:
                log.warning("rejected the BN statistics of %s: %s", reply.device, exc)
                continue
            weight = float(min(reply.update.samples, samples))  # its registered examples at most (--max-samples)
            for arch, variant_stats in zip(archs, stats):
                reports[arch].append(Report(reply.device, weight, variant_stats))
        unsettled = exchange.close()  # also when nobody was asked: the exchange holds no open request afterwards
        if unsettled.missing:
            log.warning("no BN statistics from %s before the deadline", ", ".join(unsettled.missing))
        combined = {}
        for arch in variants:
            macs = next((e.macs for e in self.cache.entries if e.arch == arch), None)
            shown = str(arch) if macs is None else f"{macs / 1e6:.2f}M MACs"
            got = robust_statistics(reports[arch], self.rule, self.max_weight_ratio) if reports[arch] else None
            for device, why in sorted(got.refused.items() if got is not None else ()):
                log.warning("variant %s: refused the BN statistics of %s: %s", shown, device, why)
            if got is not None and got.stats is not None:
                used = tuple(sorted(got.used))
                combined[arch] = Calibrated(got.stats, used, sum(examples[d] for d in used))
                log.info(
                    "variant %s: BN statistics of %d device(s) (%s), %d examples, %s%s",
                    shown,
                    len(used),
                    ", ".join(used),
                    combined[arch].examples,
                    self.rule,
                    f" ({got.note})" if got.note else "",
                )
            else:
                log.warning(
                    "variant %s: no usable BN statistics%s; the devices it serves calibrate it on their own data",
                    shown,
                    f" ({got.note})" if got is not None and got.note else " (no device sent any)",
                )
        log.info("federated BN calibration took %.1f s", time.monotonic() - began)
        return combined
