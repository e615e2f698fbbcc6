"""A federation server without its transport: what ``feast-server run`` (MQTT) and the Flower ServerApp share.

    RunHost(config)          preset, cache, the server's held data (--data), supernet, device registry, run loop
    .run_rounds(collector)   resume, the remaining rounds, rounds.csv / TensorBoard, the registry's participation
    .export_models()         each registered device's largest affordable variant (ONNX with --data)

A transport adds how devices register and how a cohort's updates are collected (the :class:`Collector`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from feast_edge.aggregate.released import recorded_variants, trained_variants
from feast_edge.cache.variants import load_cache
from feast_edge.evaluate.coverage import Serving
from feast_edge.evaluate.evaluation import Validation
from feast_edge.evaluate.served_round import served_record
from feast_edge.run.checkpoint import load_supernet, read_record
from feast_edge.run.compose import HostParts, compose
from feast_edge.run.environment import Environment
from feast_edge.run.loop import CHECKPOINT, RoundRecord, RunError, RunLoop
from feast_edge.run.roundlog import RoundLog
from feast_edge.run.stages.released import released_of
from feast_edge.server.bn_calibration import Calibrated
from feast_edge.server.config import KIND, ServerConfig, ServerError
from feast_edge.server.coverage import serving_plan, validation_points
from feast_edge.server.export import Int8Settings, export_device_models, export_device_variants
from feast_edge.server.held_data import ServerData, load_server_data
from feast_edge.server.registry import Device, Registry
from feast_edge.space.arch import Arch
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from feast_edge.versions.book import weights_digest

log = logging.getLogger(__name__)

REGISTRY = "devices.sqlite"

# Per served variant, the BN statistics gathered from the devices (model, registered devices, rounds done).
Statistics = Callable[[Supernet, list[Device], int], dict[Arch, Calibrated]]


class RunHost:
    """Settings, preset, cache, held data, supernet, registry and run loop of one federation run in ``config.out``."""

    def __init__(self, config: ServerConfig, *, on_round: Callable[[RoundRecord, int], None] | None = None) -> None:
        """The host's parts; a transport composes the run loop with its environment (:meth:`compose_loop`)."""
        self.config = config
        self.out = Path(config.out)
        self.served_digest = ""  # SHA-256 of the supernet weights the last export served (feast_edge.versions)
        self.preset = load_preset(config.preset)
        self.cache = load_cache(self.preset, config.cache)
        self.data: ServerData | None = None
        if config.data is not None:
            self.data = load_server_data(
                config.data, self.preset, config.validation.val_samples, config.validation.calib_samples
            )
        self.on_round = on_round
        self.model = Supernet(self.preset, seed=config.seed)
        self.out.mkdir(parents=True, exist_ok=True)
        self.registry = Registry(self.out / REGISTRY)
        self.loop: RunLoop

    def compose_loop(self, environment: Environment) -> None:
        """The run loop of this host's settings in ``environment`` (feast_edge.run.compose); a ServerError saying why
        where the environment cannot run them."""
        config = self.config
        host = HostParts(
            self.model,
            self.cache,
            self.preset,
            self.out,
            kind=KIND,
            fingerprint=self.fingerprint(),
            config=config.decisive(),
            fingerprint_of=self.fingerprint_of,
            validation=None
            if self.data is None
            else Validation(self.data.calibration_images, self.data.validation_images, self.data.validation_labels),
            # The task's class names too: `feast-server status` names the classes of its coverage warnings from them,
            # wherever it runs (a user preset given by a relative path may not load there).
            extra_fields=lambda: {
                "data": config.data,
                "seed": config.seed,
                "registry": self.registry.snapshot(),
                "classes": list(self.preset.task.classes),
            },
        )
        try:
            self.loop = compose(host, environment, config.run_concerns())
        except RunError as exc:
            raise ServerError(str(exc)) from None

    @property
    def validation_source(self) -> str:
        """Where models are validated and BN-calibrated: "server" (its --data) or "devices" (their own data)."""
        return "server" if self.data is not None else "devices"

    @property
    def history(self) -> list[RoundRecord]:
        return self.loop.history

    def fingerprint(self) -> str:
        return self.fingerprint_of(self.config.decisive())

    def fingerprint_of(self, decisive: Mapping[str, Any]) -> str:
        """The fingerprint of a run of these decisive settings with this host's preset."""
        data = {**decisive, "preset_digest": self.preset.digest}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def resume(self, previous: bool = False) -> int:
        """Load the last completed round from ``out``, if any (``previous``: fall back to the previous checkpoint if it is damaged)."""
        try:
            done = self.loop.resume(
                "restart with the same options to resume it, or use another --out", fall_back=previous
            )
        except RunError as exc:
            raise ServerError(str(exc)) from None
        if self.loop.recovered:
            log.warning("%s", self.loop.recovered)
        for note in self.loop.notes:  # what the resume changed (a tail mean of another window dropped)
            log.warning("%s", note)
        return done

    def saved(self) -> str:
        """Where the run stands on disk, for a message that stops it."""
        done = len(self.history)
        return f"round {done} is checkpointed in {self.out / CHECKPOINT}" if done else "no round was completed"

    def run_rounds(
        self,
        resume_previous: bool = False,
        tensorboard: bool = False,
        *,
        finished_round: Callable[[RoundRecord], None] | None = None,
    ) -> list[RoundRecord]:
        """Resume if possible, then the remaining rounds through the composed loop, each checkpointed and logged
        (``rounds.csv``, TensorBoard scalars); ``finished_round(record)`` is the transport's hook (a resume is the
        environment's, feast_edge.run.environment)."""
        cfg = self.config
        done = self.resume(previous=resume_previous)
        if done:
            of = "" if cfg.training.continuous else f" of {cfg.training.rounds}"
            log.info("resuming from %s: %d%s rounds completed", self.out / CHECKPOINT, done, of)
        roundlog = RoundLog(self.out, tensorboard=tensorboard, first_round=done + 1)

        def after(record: RoundRecord) -> None:
            roundlog.write(self.history)
            for device in record.updated:
                self.registry.touch(device, participated=record.applied)
            if not record.applied:
                log.warning(
                    "round %d: %d valid update(s) from a cohort of %d, fewer than --min-clients %d; the global model stays unchanged",
                    record.round,
                    len(record.updated),
                    len(record.cohort),
                    cfg.population.min_clients,
                )
            if record.validation.get("served_reason"):
                log.info("round %d: serving %s", record.round, record.validation["served_reason"])
            for device, why in sorted((record.validation.get("distrusted") or {}).items()):
                if why.startswith(f"round {record.round}:"):  # named once, in the round that found it out
                    log.warning("%s is distrusted since %s", device, why)
            if self.on_round is not None:
                self.on_round(record, cfg.training.horizon or 0)
            if finished_round is not None:
                finished_round(record)

        try:
            self.loop.run(start_clients=cfg.population.start_clients, on_round=after)
        finally:
            roundlog.close()
        if self.loop.stopped is not None:  # the privacy budget: refused before round 1, or ended the run
            if not self.history:
                raise ServerError(self.loop.stopped)
            log.warning("%s", self.loop.stopped)
        return self.history

    def selected_validation(self) -> tuple[dict[int, float], dict[int, int]]:
        """The federated validation of the served checkpoint's round: cache index -> accuracy, and -> the held-out
        examples behind it (both {} without one)."""
        source = self.loop.selected_checkpoint()
        history = read_record(source).get("fields", {}).get("history") if source.is_file() else None
        # The checkpoint's own history ends with the round it holds (also for `feast-server export`, which resumes
        # nothing).
        validation = (history[-1].get("validation") if isinstance(history, list) and history else None) or {}
        points = validation_points(validation.get("points") or {}, self.cache)
        examples = {i: int(n) for i, n in validation_points(validation.get("examples") or {}, self.cache).items()}
        return points, examples

    def serving(self, devices: list[Device], trained: Collection[int] | None = None) -> dict[str, Serving]:
        """Each device's served variant: its largest affordable (of the ``trained`` ones where given: --secure-agg),
        unless the federated validation of the served round found a smaller one clearly better (--serving-rule
        validated; feast_edge.evaluate.coverage)."""
        points, examples = self.selected_validation()
        rule = self.config.serving.serving_rule
        return serving_plan(self.cache, devices, points, examples, rule, trained)

    def trained_so_far(self) -> frozenset[int] | None:
        """Under --secure-agg, the variants whose every slice a release moved, as the model stands (None: every)."""
        released = released_of(self.loop.release)
        return None if released is None else trained_variants(self.preset, self.cache, released)

    def trained(self, checkpoint: Path | None = None) -> frozenset[int] | None:
        """Under --secure-agg, the cache indices of the variants whose every slice a release moved: as ``checkpoint``
        (the served one by default) records it, or, before any checkpoint, as the model stands; None without
        --secure-agg (a plain release moves every routed position)."""
        released = released_of(self.loop.release)
        if released is None:
            return None
        source = self.loop.selected_checkpoint() if checkpoint is None else checkpoint
        if not source.is_file():
            return self.trained_so_far()
        model, record = load_supernet(source, self.preset)
        return recorded_variants(self.preset, self.cache, model.state_dict(), record.get("extra_tensors", {}))

    def export_models(
        self, statistics: Statistics | None = None, model_version: int | None = None
    ) -> list[dict[str, Any]]:
        """Every registered device's model (from the best checkpoint if validated, else the last): an ONNX file
        calibrated on the server's data, or, without --data, the variant's weights for the device to export, with the
        BN statistics ``statistics`` gathers from the devices or for the device to calibrate on its own data;
        ``model_version``: the served version the manifests name (server.versions)."""
        source = self.loop.selected_checkpoint()
        if not source.is_file():
            raise ServerError(
                f"no checkpoint in {self.out}; run the federation first (feast-server run --out {self.out})"
            )
        model, record = load_supernet(source, self.preset)
        trained = None
        if released_of(self.loop.release) is not None:  # --secure-agg: serve only variants whose slices all trained
            trained = recorded_variants(self.preset, self.cache, model.state_dict(), record.get("extra_tensors", {}))
        rounds = int(read_record(source).get("fields", {}).get("round", 0))
        devices = self.registry.devices()
        if not devices:
            raise ServerError(f"no device is registered in {self.out / REGISTRY}; nothing to export")
        last = read_record(self.out / CHECKPOINT).get("fields", {}) if (self.out / CHECKPOINT).is_file() else {}
        served = served_record(int(last.get("round", rounds)), last.get("best") or {})
        log.info("serving %s (of %d rounds)", served["reason"], served["of"])
        self.served_digest = weights_digest(model.state_dict())
        where = dict(
            federation=self.config.federation,
            rounds_done=rounds,
            checkpoint=source.name,
            served=served,
            model_version=model_version,
            version_report="figures" if self.config.federated_statistics else "decision",
        )
        int8 = Int8Settings(
            self.config.serving.precision, self.config.serving.int8_samples, self.config.serving.int8_tolerance
        )
        if self.data is None:
            return export_device_variants(
                model,
                self.cache,
                devices,
                self.out,
                calibration=self.config.validation.calib_samples,
                statistics=None if statistics is None else statistics(model, devices, rounds),
                int8=int8,
                serving=self.serving(devices, trained),
                **where,
            )
        rule = self.config.serving.serving_rule
        return export_device_models(model, self.cache, devices, self.data, self.out, int8=int8, rule=rule,
                                    trained=trained, **where)  # fmt: skip
