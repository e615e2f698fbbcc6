"""The release (feast_edge.run.release): the stages' steps run in their order around the method's aggregation, a
stage can end the run before a round, stage state round-trips through a checkpoint, and ``release_of`` composes the
stages a run's settings ask for in the order their guarantees need (noise before a server optimizer's step)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from feast_edge.aggregate.server_opt import ServerOpt
from feast_edge.privacy.settings import DpSettings
from feast_edge.run.collect import ClientUpdate
from feast_edge.run.release import BaseStage, Release, RoundContext, RunStops
from feast_edge.run.schedule import SyncRounds
from feast_edge.run.stages import release_of
from feast_edge.run.stages.privacy_noise import PrivacyStage
from feast_edge.run.stages.server_step import ServerStepStage
from feast_edge.run.stages.weight_cap import WeightCapStage
from feast_edge.settings.run_concerns import RunConcerns
from feast_edge.settings.validated import RunError
from feast_edge.sim.simulate import Simulation
from simconfigs import tiny_config


class Mean:
    """A method whose aggregation is the plain mean of the updates (enough to see what the stages do around it)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def aggregate(self, t: int, global_state: dict, updates: Sequence[ClientUpdate], plans: Mapping) -> None:
        self.log.append("aggregate")
        global_state["w"].copy_(torch.stack([u.state["w"] for u in updates]).mean(0))

    def routed(self, global_state: dict, updates: Sequence[ClientUpdate], names: Sequence[str]) -> dict:
        return {n: torch.ones_like(global_state[n], dtype=torch.bool) for n in names}


class Logged(BaseStage):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def admit(self, ctx: RoundContext) -> None:
        self.log.append(f"{self.name}.admit")

    def prepare(self, ctx: RoundContext, global_state: dict, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        self.log.append(f"{self.name}.prepare")
        return [replace(u, state={"w": u.state["w"] * 2}) for u in updates]

    def begin(self, ctx: RoundContext, global_state: dict) -> None:
        self.log.append(f"{self.name}.begin")

    def finish(self, ctx: RoundContext, global_state: dict, updates: Sequence[ClientUpdate], plans: Any) -> None:
        self.log.append(f"{self.name}.finish")
        global_state["w"].add_(1.0)


def _update(client: str, value: float) -> ClientUpdate:
    return ClientUpdate(client=client, state={"w": torch.full((2,), value)}, samples=10)


def test_each_step_runs_stage_by_stage_around_the_aggregation() -> None:
    log: list[str] = []
    release = Release(Mean(log), [Logged("a", log), Logged("b", log)])
    ctx = RoundContext(0, 2, ["x", "y"], [])
    release.admit(ctx)
    updates = release.prepare(ctx, {}, [_update("x", 1.0), _update("y", 3.0)])
    state = {"w": torch.zeros(2)}
    release.apply(ctx, state, updates, {})
    assert log == [
        "a.admit", "b.admit", "a.prepare", "b.prepare", "a.begin", "b.begin", "aggregate", "a.finish", "b.finish",
    ]  # fmt: skip
    assert torch.equal(state["w"], torch.full((2,), 2 * 2 * 2.0 + 2))  # mean of 4x the updates, then +1 twice


def test_a_stage_that_refuses_the_round_ends_the_run_before_anything_is_sent() -> None:
    class Budget(BaseStage):
        def admit(self, ctx: RoundContext) -> None:
            if ctx.t >= 1:
                raise RunStops(f"round {ctx.t + 1} would pass the budget")

    release = Release(Mean([]), [Budget()])
    release.admit(RoundContext(0, 2, ["x"], []))
    with pytest.raises(RunStops, match="round 2 would pass the budget"):
        release.admit(RoundContext(1, 2, ["x"], []))


def test_stage_state_round_trips_and_a_checkpoint_with_state_no_stage_keeps_is_refused(tmp_path: Path) -> None:
    settings = RunConcerns.of_keys(rounds=3, per_round=2, server_opt="momentum", server_lr=1.0)
    model = torch.nn.Linear(2, 1)
    release = release_of(settings, model, Mean([]))
    [step] = [s for s in release.stages if isinstance(s, ServerStepStage)]
    state = {k: torch.rand_like(v) if v.is_floating_point() else v for k, v in release.state.items()}
    again = release_of(settings, model, Mean([]))
    again.load(state, tmp_path / "checkpoint.safetensors")
    assert set(state) == set(step.optimizer.state) and state  # the momentum buffers, one per parameter
    assert all(torch.equal(again.state[k], state[k]) for k in state)
    plain = release_of(replace(settings, server_opt=ServerOpt()), model, Mean([]))
    assert plain.state == {}
    with pytest.raises(RunError, match=r"holds state this run keeps none of .*--server-opt"):
        plain.load(state, tmp_path / "checkpoint.safetensors")


def test_release_of_puts_privacy_first_and_the_server_step_after_its_noise() -> None:
    settings = RunConcerns.of_keys(
        rounds=3,
        per_round=2,
        dp_clip=1.0,
        dp_noise=1.0,
        dp_seed=0,
        server_opt="adam",
        server_lr=0.01,
        max_weight_ratio=8.0,
    )
    assert settings.dp == DpSettings(clip=1.0, noise=1.0, seed=0) and settings.server_opt == ServerOpt("adam", 0.01)
    stages = release_of(settings, torch.nn.Linear(2, 1), Mean([])).stages
    assert [type(s) for s in stages] == [PrivacyStage, WeightCapStage, ServerStepStage]
    plain = RunConcerns.of_keys(rounds=3, per_round=2)
    assert release_of(plain, torch.nn.Linear(2, 1), Mean([])).stages == []  # the paper's release: §6 alone


def test_the_weight_cap_notes_each_capped_client_in_the_round_record() -> None:
    from feast_edge.run.round_record import RoundRecord

    ctx = RoundContext(0, 3, ["a", "b", "c"], [], record=RoundRecord(round=1, lr=0.1, cohort=["a", "b", "c"]))
    updates = [
        replace(_update("a", 1.0), samples=10, self_reported=True),
        replace(_update("b", 1.0), samples=10, self_reported=True),
        replace(_update("c", 1.0), samples=10_000, self_reported=True),
    ]
    out = WeightCapStage(2.0).prepare(ctx, {}, updates)
    assert [u.samples for u in out] == [10, 10, 20]
    assert ctx.record.capped == {"c": [10_000, 20]}


class _Holding:
    """A release policy that keeps every round's input and releases nothing (a buffer that never fills)."""

    def __init__(self) -> None:
        self.held: list[list[str]] = []

    def release(self, ctx, global_state, valid, plans, sums) -> bool:
        self.held.append([u.client for u in valid])
        return False


class _Counting(SyncRounds):
    """Synchronous rounds that note each step they gathered."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.steps: list[int] = []

    def gather(self, t, collector, needed, admit, history):
        self.steps.append(t)
        return super().gather(t, collector, needed, admit, history)


def test_the_loop_takes_its_scheduler_and_release_policy(fashion_mnist_dir: Path, tmp_path: Path) -> None:
    sim = Simulation(tiny_config(fashion_mnist_dir, rounds=2), tmp_path)
    before = {name: t.clone() for name, t in sim.model.state_dict().items()}
    holding, counting = _Holding(), _Counting(sim.loop.settings, sim.loop.method, sim.model)
    sim.loop.policy, sim.loop.scheduler = holding, counting
    sim.run()
    assert counting.steps == [0, 1]
    assert holding.held == [r.cohort for r in sim.loop.history] and not any(r.applied for r in sim.loop.history)
    assert all(torch.equal(before[n], t) for n, t in sim.model.state_dict().items())  # nothing was released
