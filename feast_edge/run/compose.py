"""One composition root: every run (``feast-edge simulate``, ``feast-server run``, the Flower ServerApp) is built from
its settings (feast_edge.settings.run_concerns.RunConcerns: the configuration's concerns) by :func:`compose`, so a
feature is one setting, one module and one hook here.

    compose(host, environment, settings) -> RunLoop
      1. the host's parts (:class:`HostParts`): model, cache, method, the run store's identity (kind, fingerprint,
         recorded config), the server's held split, the checkpoint's extra fields
      2. the environment (feast_edge.run.environment): first its capabilities refuse what it cannot run, with the
         reason; then how clients are reached (its collector), the secure-sums transport, the validator
      3. the loop: the release and its stages (feast_edge.run.stages), the scheduler, the release policy and the
         collector's wrappers, all chosen here from the settings and passed to RunLoop's constructor

    scheduler / policy                   when
    SyncRounds / EveryRound              synchronous rounds (method §4), the collector on the environment's clock
    StratifiedRounds / EveryRound        --secure-agg: stratified cohorts, plans capped at what a round reveals
    AsyncSlots / Buffered                --mode async: the environment's jobs, released every K updates

    collector = environment.collector()
              -> environment.secure_sums(...)   --secure-agg: per-segment sums over the environment's transport
              -> environment.timed(...)         synchronous rounds: the environment's clock (a simulation's virtual one)

The environment's ``before_release`` runs before every release (synchronous or asynchronous), its ``resumed``
after a resume and its ``served`` when the served round changes (the simulation's versions, feast_edge.sim.versions). Nothing patches a built loop: a new scheduler, policy or wrapper is one branch here and one module
(CONTRIBUTING.md, "Where a change goes").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from feast_edge.cache.variants import VariantCache
from feast_edge.evaluate.evaluation import Validation
from feast_edge.route.reveal import Reveal
from feast_edge.run.asynchronous import AsyncSlots, Buffered, parameter_names
from feast_edge.run.environment import Environment
from feast_edge.run.loop import Hooks, RunLoop
from feast_edge.run.policy import EveryRound, ReleasePolicy
from feast_edge.run.round_record import RoundMethod
from feast_edge.run.schedule import Scheduler, SyncRounds
from feast_edge.run.stages import release_of
from feast_edge.run.strategy import FeastStrategy
from feast_edge.run.stratified import StratifiedRounds
from feast_edge.settings.run_concerns import RunConcerns
from feast_edge.settings.validated import RunError
from feast_edge.space.preset import Preset


@dataclass
class HostParts:
    """What a run is hosted with, before any environment: the model and its cache, the method that trains it, and
    the identity its run directory is checked against."""

    model: torch.nn.Module
    cache: VariantCache
    preset: Preset
    out: str | Path
    kind: str  # "simulation" or "server": a run directory of one kind never resumes as the other
    fingerprint: str
    config: Mapping[str, Any]  # the settings a checkpoint records
    method: RoundMethod | None = None  # None: FEAST's steps (feast_edge.run.strategy)
    model_record: Mapping[str, Any] | None = None  # a model that is not a Supernet: its checkpoint header
    validation: Validation | None = None  # the server's held split (None: the environment's validator, if any)
    extra_fields: Callable[[], Mapping[str, Any]] = field(default=dict)
    # The fingerprint of a stored config as this run computes its own: a resume may then extend the run's horizon
    # (feast_edge.run.store.EXTENDABLE); None: it may not.
    fingerprint_of: Callable[[Mapping[str, Any]], str] | None = None


def refuse(environment: Environment, settings: RunConcerns) -> None:
    """A RunError with the reason where ``environment`` cannot run the features of ``settings``."""
    why = environment.capabilities.refused(settings)
    if why:
        raise RunError(why)


def compose(host: HostParts, environment: Environment, settings: RunConcerns) -> RunLoop:
    """The run loop of ``settings`` (a SimulationConfig's or ServerConfig's concerns) in ``environment`` (see the
    module docstring)."""
    refuse(environment, settings)
    model = host.model
    method = host.method if host.method is not None else FeastStrategy.of_settings(model, host.cache, settings)
    release = release_of(settings, model, method)
    secure = settings.secure.secure_agg
    collector = environment.collector()
    if secure:  # per-segment sums, never one update (feast_edge.secagg)
        collector = environment.secure_sums(collector)
    rules = settings.schedule.rules()
    scheduler: Scheduler
    policy: ReleasePolicy
    if rules is not None:  # buffered asynchronous rounds (feast_edge.run.asynchronous)
        jobs = environment.jobs(collector, parameter_names(model))
        scheduler = AsyncSlots(settings, method, model, rules, jobs)
        policy = Buffered(release, rules.staleness)
    else:
        if secure:  # stratified cohorts, plans capped at what a round reveals
            scheduler = StratifiedRounds(
                settings, method, model, Reveal(host.preset, host.cache, settings.reveal_over())
            )
        else:
            scheduler = SyncRounds(settings, method, model)
        policy = EveryRound(release, settings.min_clients)
        collector = environment.timed(collector)
    return RunLoop(
        model,
        host.cache,
        settings,
        host.out,
        kind=host.kind,
        fingerprint=host.fingerprint,
        config=host.config,
        validation=host.validation,
        extra_fields=host.extra_fields,
        method=method,
        model_record=host.model_record,
        validator=environment.validator() if host.validation is None else None,
        release=release,
        scheduler=scheduler,
        policy=policy,
        collector=collector,
        hooks=Hooks(before_release=environment.before_release, resumed=environment.resumed, served=environment.served),
        fingerprint_of=host.fingerprint_of,
    )
