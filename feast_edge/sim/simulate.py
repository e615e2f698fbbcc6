"""The paper's research protocol in one process (method §4–§8), with checkpoints and exact resume.

``Simulation(config, out_dir).run()`` builds the server-held splits, the
client population and the global supernet, then runs the federation's run
loop (``feast_edge.run.loop.RunLoop``, the one ``feast-server`` runs) with an
in-process collector: each cohort member's local co-training runs here, through
the same functions an agent runs (``feast_edge.local.update``). The loop writes
``checkpoint.safetensors`` atomically after every round and keeps
``best.safetensors``; at the end the simulation tests every cached variant of
the best checkpoint and writes ``results.json``, ``variants.csv`` and
``rounds.csv``.

All randomness derives from ``config.seed`` and the round index, so a resumed
run ends with exactly the weights of an uninterrupted one.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from feast_edge.aggregate.released import recorded_variants, trained_variants
from feast_edge.evaluate.evaluation import Validation, population_accuracy
from feast_edge.evaluate.served_round import served_record
from feast_edge.privacy.private_rounds import privacy_summary
from feast_edge.run.asynchronous import parameter_names
from feast_edge.run.clock import VirtualClock, timeline
from feast_edge.run.collect import Collector
from feast_edge.run.compose import HostParts, compose
from feast_edge.run.loop import BEST, CHECKPOINT, RoundRecord, RunError
from feast_edge.run.roundlog import ROUNDS_CSV, RoundLog, write_rounds_csv
from feast_edge.run.stages.released import released_of
from feast_edge.settings import SettingsError, flat
from feast_edge.settings.run_concerns import RunConcerns
from feast_edge.sim.device_validation import InProcessValidation, lying_clients
from feast_edge.sim.environment import Clients, SimulationEnvironment
from feast_edge.sim.population import Population
from feast_edge.sim.registry import method_class
from feast_edge.sim.setup import Setup, SimulationConfig, SimulationError, build_setup
from feast_edge.sim.config import fingerprint_of
from feast_edge.util.atomic import atomic_write_bytes

KIND = "simulation"
log = logging.getLogger(__name__)


@dataclass
class RoundProgress:
    """What the progress display shows after each round (``round`` is 1-based)."""

    round: int
    rounds: int
    loss: float
    val_accuracy: float | None
    best_val: float | None
    served_round: int | None = None  # --validate-on devices: the round served so far (feast_edge.evaluate.served_round)
    clock: float | None = None  # the virtual clock's seconds at the end of the round (feast_edge.run.clock)
    staleness: int | None = None  # --mode async: the largest staleness among the release's updates
    withheld: int = 0  # --secure-agg: segments that kept their global value (fewer than c + 2 contributors)
    present: int | None = None  # clients that join over time: those present at the round (feast_edge.sim.growth)
    visible: int | None = None  # ... and the training examples they hold


class Simulation:
    """One simulated federation, checkpointed in ``out_dir``."""

    def __init__(
        self,
        config: SimulationConfig,
        out_dir: str | Path,
        *,
        setup: Setup | None = None,
        matched: Mapping[str, Any] | None = None,
        threads: Mapping[str, Any] | None = None,
        clients: Clients | None = None,
    ) -> None:
        """``setup``: one already built from ``config`` (its data and population); ``matched``: how its rounds were
        matched to another run's training compute (feast_edge.sim.matched), recorded in results.json; ``threads``: the
        intra-op threads the run computes on and why (``{"intra_op": 2, "chosen": "..."}``), recorded there too;
        ``clients``: how the clients are reached (feast_edge.sim.environment; ``--nproc``: over processes)."""
        self.threads = dict(threads) if threads is not None else None
        self.config = config
        self.out = Path(out_dir)
        self.setup = setup if setup is not None else build_setup(config)
        self.matched = dict(matched) if matched is not None else None
        self.preset = self.setup.preset
        self.method = method_class(config.method)(self.setup, config)
        self.model = self.method.model
        s = self.setup
        on_devices = config.validation.validate_on == "devices"
        try:
            settings = RunConcerns.of(
                config,
                min_clients=1,
                device=config.device,
                averaging=self.method.averaging,
                compute_budget=config.timing.compute_budget,
            )
        except SettingsError as exc:
            raise SimulationError(str(exc)) from None
        budgets = {cid: float(b) for cid, b in zip(s.client_ids, s.population.budgets)}
        self.clock = VirtualClock(
            config.timing.model(), budgets, config.seed, self.method.payload_params, settings.aggregation.payload_dtype
        )
        self.environment = SimulationEnvironment(
            s,
            self.method,
            config,
            self.clock,
            parameter_names(self.model),
            validator=self._device_validation() if on_devices else None,
            clients=clients,
            out=self.out,
        )
        host = HostParts(
            self.model,
            s.cache,
            self.preset,
            self.out,
            kind=KIND,
            fingerprint=config.fingerprint(),
            config=config.decisive(),
            fingerprint_of=fingerprint_of,
            method=self.method,
            model_record=None if self.method.supernet else self.method.model_record(),
            validation=None if on_devices else Validation(s.calibration_images(), *s.validation_data()),
        )
        try:
            self.loop = compose(host, self.environment, settings)
        except RunError as exc:
            raise SimulationError(str(exc)) from None

    @property
    def collector(self) -> Collector:
        """How one round's cohort trains, before the virtual clock (:meth:`run_round`)."""
        assert self.environment.untimed is not None
        return self.environment.untimed

    def _device_validation(self) -> InProcessValidation:
        """--validate-on devices: each round's cohort tests the model on its held-out splits (a server without data)."""
        c, s = self.config, self.setup
        budgets = {cid: float(b) for cid, b in zip(s.client_ids, s.population.budgets)}
        return InProcessValidation(
            s,
            self.model,
            s.cache,
            budgets,
            probes=c.validation.probe_variants,
            calibration=c.validation.calib_samples,
            device=c.device,
            trained=lambda: self.trained(),
            liars=lying_clients(s.client_ids, c.validation.lying_validators, c.seed),
        )

    def trained(self, extra: Mapping[str, Any] | None = None) -> frozenset[int] | None:
        """Under --secure-agg, the cache indices of the variants whose every slice a release moved: as the model
        stands, or as the checkpoint whose extra tensors are ``extra`` recorded it; None without (every variant)."""
        released = released_of(self.loop.release)
        if released is None:
            return None
        if extra is not None:
            return recorded_variants(self.preset, self.setup.cache, self.model.state_dict(), extra)
        return trained_variants(self.preset, self.setup.cache, released)

    @property
    def history(self) -> list[RoundRecord]:
        return self.loop.history

    @property
    def best(self) -> dict[str, Any]:
        return self.loop.best

    def resume(self) -> int:
        """Load ``checkpoint.safetensors``; returns the number of completed rounds."""
        path = self.out / CHECKPOINT
        if not path.is_file():
            raise SimulationError(
                f"--resume: no checkpoint at {path}; run without --resume to start, or point --out at the run to resume"
            )
        try:
            done = self.loop.resume("rerun with the same options, or use a new --out without --resume")
        except RunError as exc:
            raise SimulationError(f"--resume: {exc}") from None
        for note in self.loop.notes:  # what the resume changed (a tail mean of another window dropped)
            log.warning("%s", note)
        for record in self.history:  # the last round's record was checkpointed before it was counted
            self.counted(record)
        return done

    def run_round(self, t: int) -> RoundRecord:
        """Round ``t`` alone (no checkpoint): cohort -> route -> local co-training -> sparse aggregation."""
        return self.counted(self.loop.run_round(t, self.collector, 1))

    def counted(self, record: RoundRecord) -> RoundRecord:
        """``record`` with the clients present at its step and the training examples they hold, where clients join
        or shards grow (feast_edge.sim.growth: a function of the settings and the step)."""
        if self.setup.growth is not None and record.present is None:
            record.present, record.visible = self.setup.growth.counts(record.round - 1)
        return record

    def run(
        self,
        resume: bool = False,
        on_round: Callable[[RoundProgress], None] | None = None,
        stop_after: int | None = None,
        on_test: Callable[[int, int], None] | None = None,
        on_record: Callable[[RoundRecord], None] | None = None,
        tensorboard: bool = False,
        on_personal: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any] | None:
        """Run (or resume) to the last round, then test; ``stop_after`` rounds ends early (returns None).

        After every round ``rounds.csv`` is rewritten (and TensorBoard scalars added with ``tensorboard``); ``on_record``
        gets the round's record (e.g. a dashboard); ``on_personal(done, clients)`` follows ``--personalize``.
        """
        self.out.mkdir(parents=True, exist_ok=True)
        if resume:
            self.resume()
        rounds = self.config.training.rounds
        log = RoundLog(self.out, tensorboard=tensorboard, first_round=len(self.history) + 1)

        def progress(record: RoundRecord) -> None:
            self.counted(record)
            log.write(self.history)
            if on_record is not None:
                on_record(record)
            if on_round is not None:
                on_round(
                    RoundProgress(
                        record.round,
                        rounds,
                        record.loss or 0.0,
                        record.val_accuracy,
                        self.best.get("val_accuracy"),
                        self.best.get("round") if self.config.validation.validate_on == "devices" else None,
                        record.clock,
                        max(record.staleness.values(), default=0) if self.config.schedule.mode == "async" else None,
                        len(record.withheld),
                        record.present,
                        record.visible,
                    )
                )

        # Without a horizon (--continuous) the simulation stops after --rounds, tested as a finished one; it goes on
        # from there when run again with a larger --rounds (nothing it computed depends on where it stopped).
        continuous = self.config.training.continuous
        ends = [n for n in (stop_after, rounds if continuous else None) if n is not None]
        try:
            self.loop.run(on_round=progress, stop_after=min(ends) if ends else None)
        finally:
            log.close()
        if not (self.loop.finished or (continuous and len(self.history) >= rounds)):
            return None
        return self.finish(on_test, on_personal)

    # ----------------------------------------------------------------- results
    def finish(
        self,
        on_test: Callable[[int, int], None] | None = None,
        on_personal: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]:
        """Test every cached variant of the best checkpoint (and, with ``personalize``, run every client's
        personalization step on its served variant); write results.json, variants.csv, rounds.csv."""
        s, cfg = self.setup, self.config
        dp = cfg.dp_settings()
        best_path = self.out / BEST
        trained = self.trained()  # under --secure-agg: of the served checkpoint
        if best_path.is_file():
            model, record = self.loop.load(best_path)
            if model is not self.model:
                self.model.load_state_dict(model.state_dict())
            trained = self.trained(record.get("extra_tensors", {})) if trained is not None else None
        test_images, test_labels = s.test_set.images, s.test_set.labels
        if cfg.test_limit is not None:
            test_images, test_labels = test_images[: cfg.test_limit], test_labels[: cfg.test_limit]
        calib = s.calibration_images()
        points = self.method.points()
        accs = self.method.evaluate(points, calib, test_images, test_labels, cfg.device, on_test)
        budgets = [float(b) for b in s.population.budgets]
        served = [self.method.served(b) for b in budgets]
        if trained:  # --secure-agg: the largest affordable variant whose every slice trained (none, where no round
            # was released: the run stopped before its first, each variant marked untrained below)
            served = [s.cache.entries.index(s.cache.largest_servable(b, trained)) for b in budgets]
        variants = []
        for i, (p, a) in enumerate(zip(points, accs)):
            variants.append(
                {
                    "index": i,
                    **p.to_dict(),
                    "test_accuracy": a,
                    **({"arch": dict(p.detail)} if {"d", "e", "w"} <= set(p.detail) else {}),
                    **({} if trained is None else {"trained": i in trained}),
                }
            )
        results = {
            "method": cfg.method,
            "method_summary": self.method.summary,
            "config": {**flat(cfg), "train": cfg.train_config().settings(), "lr_schedule": cfg.recipe_settings()[1]},
            "preset": self.preset.name,
            "best": self.best,
            "served_round": served_record(len(self.history), self.best),
            "population": population_summary(s.population),
            **({"growth": s.growth.summary()} if s.growth is not None else {}),
            "population_accuracy": population_accuracy(served, accs),
            "variants": variants,
            "served": served,
            "communication": communication_summary(self.history),
            "compute": {"train_macs_total": sum(h.train_macs for h in self.history)},
            **({"matched_compute": self.matched} if self.matched is not None else {}),
            **({"threads": self.threads} if self.threads is not None else {}),
            **(
                {"personalization": self.personalization(served, on_personal)}
                if cfg.serving.personalize != "off"
                else {}
            ),
            **({"privacy": privacy_summary(dp, [h.dp for h in self.history], self.loop.stopped)} if dp else {}),
            "timeline": timeline(self.history, cfg.schedule.mode),
            "rounds": [asdict(h) for h in self.history],
            "seconds_total": sum(h.seconds for h in self.history),
        }
        atomic_write_bytes(self.out / "results.json", json.dumps(results, indent=2).encode())
        _write_csv(
            self.out / "variants.csv",
            ["index", "label", "macs", "params", "test_accuracy", "detail"],
            [
                [v["index"], v["label"], v["macs"], v["params"], f"{v['test_accuracy']:.4f}", json.dumps(v["detail"])]
                for v in results["variants"]
            ],
        )
        write_rounds_csv(self.out / ROUNDS_CSV, self.history)
        return results

    def personalization(self, served: list[int], progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Every client's personalization step on the variant it is served (feast_edge.sim.personalize_clients)."""
        from feast_edge.personalize.select import Choice
        from feast_edge.sim.personalize_clients import personalize_clients

        cfg = self.config
        return personalize_clients(
            self.setup,
            self.method,
            served,
            Choice.parse(cfg.serving.personalize),
            seed=cfg.seed,
            device=cfg.device,
            progress=progress,
            t=self.history[-1].round - 1 if self.history else 0,  # what each client holds after the last round
        )


def population_summary(population: Population) -> dict[str, Any]:
    """α_eff, shard sizes, budgets and per-class counts of a population (method §4)."""
    sizes = population.sizes
    return {
        "clients": population.n_clients,
        "gamma": population.gamma,
        "alpha_eff": population.alpha_eff,
        "shard_size_min": int(sizes.min()),
        "shard_size_max": int(sizes.max()),
        "budgets": [float(b) for b in population.budgets],
        "shard_sizes": [int(n) for n in sizes],
        "class_counts": population.partition.class_counts.tolist(),
    }


def communication_summary(history: list[RoundRecord]) -> dict[str, Any]:
    """Routed vs full-supernet traffic over the rounds run (both directions), in parameters and in bytes (payload dtype
    against a float32 broadcast)."""
    routed = 2 * sum(h.routed_params for h in history)
    full = 2 * sum(h.full_params for h in history)
    routed_bytes = 2 * sum(h.routed_bytes for h in history)
    full_bytes = 2 * sum(h.full_bytes for h in history)
    return {
        "routed_params_total": routed,
        "full_params_total": full,
        "reduction": full / routed if routed else None,
        "routed_bytes_total": routed_bytes,
        "full_bytes_total": full_bytes,
        "bytes_reduction": full_bytes / routed_bytes if routed_bytes else None,
    }


def _write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    writer.writerows(rows)
    atomic_write_bytes(path, buffer.getvalue().encode())
