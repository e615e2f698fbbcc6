"""One composition root (feast_edge.run.compose): every run's loop is built from its settings and an environment, the
three apps alike, and what used to differ between them does not.

* the scheduler, release policy and collector wrappers a combination of rounds and sums gets, in the simulation and
  on the server, with nothing patched after the loop is built;
* every combination of rounds, sums and privacy in each of the three environments: accepted with the fingerprint the
  code before the composition root gave it, or refused with the same reason (tests/combinations.py);
* the environment's hook before every release (the server's threads: asynchronous releases too), the release step
  the server says it runs, refusals kept with their reason and counted by kind, and the clock both live views show.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from combinations import ENVIRONMENTS, RECORD, combinations, outcome, server_fingerprint

from feast_edge.flower.serverapp.environment import FLOWER
from feast_edge.run.asynchronous import AsyncSlots, Buffered, parameter_names
from feast_edge.run.clock import TimedRounds, clock_entry, timeline
from feast_edge.run.collect import REFUSED, STALE, ClientUpdate, Collected
from feast_edge.run.jobs import REJECTED, ClockJobs
from feast_edge.run.loop import Hooks
from feast_edge.run.policy import EveryRound
from feast_edge.run.round_record import RoundRecord, refusal_kinds
from feast_edge.run.schedule import SyncRounds
from feast_edge.run.stratified import StratifiedRounds
from feast_edge.server.app import FederationServer
from feast_edge.server.config import ServerConfig, ServerError
from feast_edge.server.environment import ServerEnvironment
from feast_edge.settings.buffered import AsyncSettings
from feast_edge.settings.run_concerns import RunConcerns
from feast_edge.sim.environment import SimulationEnvironment
from feast_edge.sim.simulate import Simulation
from feast_edge.transport.broker import LinkConfig
from simconfigs import tiny_config

# --------------------------------------------------------------------------- what compose chooses


@pytest.mark.parametrize(
    ("changes", "scheduler", "policy"),
    [
        ({}, SyncRounds, EveryRound),
        ({"secure_agg": True, "per_round": 3, "clients": 4}, StratifiedRounds, EveryRound),
        ({"mode": "async", "buffer": 2, "concurrency": 2}, AsyncSlots, Buffered),
    ],
)
def test_a_simulation_is_composed_from_its_settings(
    tmp_path: Path, fashion_mnist_dir: Path, changes, scheduler, policy
):
    sim = Simulation(tiny_config(fashion_mnist_dir, **changes), tmp_path)
    loop = sim.loop
    assert type(loop.scheduler) is scheduler and type(loop.policy) is policy
    assert isinstance(sim.environment, SimulationEnvironment)
    # synchronous rounds run on the virtual clock (the collector's outer wrapper); asynchronous jobs read it directly
    assert isinstance(loop.collector, TimedRounds) == (policy is EveryRound)
    assert loop.policy.pipeline is loop.release  # one release, the policy's and the loop's


def test_the_server_is_composed_before_it_connects_with_its_hooks(tmp_path: Path) -> None:
    config = ServerConfig.of(out=str(tmp_path), preset="fmnist-small", data=None, mode="sync")
    server = FederationServer(config, LinkConfig())
    assert isinstance(server.environment, ServerEnvironment) and not server.link.connected
    assert type(server.loop.scheduler) is SyncRounds and server.loop.collector is server.collector
    assert server.loop.hooks.before_release == server.environment.before_release
    assert server.loop.hooks.resumed == server.environment.resumed


# --------------------------------------------------------------------------- the combinations, recorded before


def test_every_combination_is_accepted_or_refused_as_before_or_by_its_environment() -> None:
    recorded = json.loads(RECORD.read_text())["outcomes"]
    reasons = {"flower": [why for why in (FLOWER.asynchronous, FLOWER.secure, FLOWER.privacy)]}
    for environment in ENVIRONMENTS:
        for mode, sums, privacy, settings in combinations():
            key = f"{environment}/{mode}/{sums}/{privacy}"
            now, then = outcome(environment, settings), recorded[key]
            if now == then:
                continue
            # a refusal may come from the environment's declared capabilities, with their reason
            assert "refused" in now and any(why in now["refused"] for why in reasons.get(environment, [])), (
                key,
                then,
                now,
            )
    assert len(recorded) == len(ENVIRONMENTS) * len(combinations())


@pytest.mark.parametrize(("mode", "sums", "privacy", "settings"), combinations())
def test_the_flower_environment_refuses_what_it_cannot_run_with_its_declared_reason(mode, sums, privacy, settings):
    # A configuration a server accepts, in the Flower environment: refused by Flower's capabilities unless it is
    # synchronous, plain and without DP; the server's and the simulation's environments refuse nothing of it.
    try:
        config = ServerConfig.of(out="/runs/x", data="/data/partition", **settings)
    except ServerError:
        return  # refused by the settings themselves (the recorded outcomes above)
    why = FLOWER.refused(config)
    expected = {"async": FLOWER.asynchronous}.get(mode) or {"secure": FLOWER.secure}.get(sums)
    expected = expected or (FLOWER.privacy if privacy != "none" else None)
    assert why == expected
    assert ServerEnvironment.capabilities.refused(config) is None
    assert SimulationEnvironment.capabilities.refused(config) is None
    server_fingerprint(config)  # an accepted configuration has a fingerprint


# --------------------------------------------------------------------------- the hooks


def test_the_environment_chooses_the_servers_threads_before_every_asynchronous_release(
    tmp_path: Path, fashion_mnist_dir: Path
) -> None:
    # The loop calls the environment's hook before each release, whoever schedules it; on the server that hook
    # chooses the threads (before, an asynchronous server never re-chose them: they were chosen after a collect).
    sim = Simulation(tiny_config(fashion_mnist_dir, mode="async", buffer=2, concurrency=2, rounds=3), tmp_path)
    calls: list[int] = []
    sim.loop.hooks = Hooks(before_release=lambda: calls.append(len(sim.history)))
    sim.run()
    assert calls == [0, 1, 2]

    class Threads:
        steps: list[str] = []

        def use(self, step: str) -> int:
            self.steps.append(step)
            return 1

    config = ServerConfig.of(out=str(tmp_path / "server"), preset="fmnist-small", data=str(fashion_mnist_dir))
    server = FederationServer(config.changed(mode="async"), LinkConfig(), threads=Threads())  # type: ignore[arg-type]
    server.loop.hooks.before_release()
    assert server.threads.steps == ["aggregating"]  # type: ignore[union-attr]


@pytest.mark.broker
def test_the_server_names_the_release_step_its_loop_runs(tmp_path: Path, fashion_mnist_dir: Path, caplog) -> None:
    config = ServerConfig.of(out=str(tmp_path), preset="fmnist-small", data=str(fashion_mnist_dir), mode="async")
    server = FederationServer(config, LinkConfig(broker="mqtt://127.0.0.1:1883"))
    try:
        with caplog.at_level(logging.INFO, logger="feast_edge.server.app"):
            server.start()
    finally:
        server.close()
    # asynchronous releases by plain averaging step a quarter of the way: not method §6's sparse mean
    assert server.loop.settings.server_opt.describe() == "avg (lr 0.25)"
    assert "server optimizer avg (lr 0.25)" in caplog.text and "method §6" not in caplog.text


# --------------------------------------------------------------------------- refusals by kind


class _Refusing:
    """Clients whose update the collector refuses, with the reason, and the others' updates."""

    def __init__(self, refuse: Mapping[str, str]) -> None:
        self.refuse = dict(refuse)

    def clients(self, needed: int) -> list[str]:
        return ["a", "b", "c"]

    def budget(self, client: str) -> float:
        return 1.0

    def collect(self, t: int, cohort: Sequence[str], plans: Any, global_state: Any, lr: float) -> Collected:
        ok = [ClientUpdate(c, {"w": global_state["w"].clone() + 1}, 1) for c in cohort if c not in self.refuse]
        return Collected(ok, rejected={c: why for c, why in self.refuse.items() if c in cohort})


class _Uniform:
    def duration(self, client: str, update: ClientUpdate, plan: Any, job: int) -> float:
        return 1.0

    def drops(self, client: str, job: int) -> bool:
        return False


def test_a_refused_update_in_an_asynchronous_simulation_keeps_its_reason() -> None:
    # Before, the in-process jobs recorded an update the collector refused as lost, without its reason.
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    jobs = ClockJobs(_Uniform(), parameter_names(model))
    jobs.start(0, _Refusing({"b": "changes its slice by 9.0 (L2), over --max-update-norm 1"}), ["a", "b"],
               {"a": 2, "b": 2}, model.state_dict(), 0.1)  # fmt: skip
    _, arrived = jobs.arrive()
    outcome = {a.client: (a.outcome, a.reason) for a in arrived}
    assert outcome["b"] == (REJECTED, "changes its slice by 9.0 (L2), over --max-update-norm 1")
    settings = RunConcerns.of_keys(rounds=2, per_round=2)

    class Method:
        def plans(self, t, cohort, budget):
            return dict.fromkeys(cohort, 2)

    slots = AsyncSlots(settings, Method(), model, AsyncSettings(1, 2, 0, "sqrt"), ClockJobs(_Uniform(), {"w"}))
    got = slots.gather(0, _Refusing({"b": "a bad payload"}), 1, lambda ctx: None, []).got
    assert got.rejected.get("b") == "a bad payload" and "b" not in got.dropped


def test_refusals_are_counted_by_kind_not_by_their_words() -> None:
    stale = RoundRecord(round=2, lr=0.1, cohort=["a"], rejected={"a": "stale: 3 behind"}, refusals={"a": STALE})
    # a refusal whose message happens to start with "stale" is not a stale update
    worded = RoundRecord(round=3, lr=0.1, cohort=["b"], rejected={"b": "stale-looking payload"}, refusals={})
    made = timeline([stale, worded], "async")
    assert made["staleness"]["refused"] == 1
    assert made["refused_by_kind"] == {REFUSED: 1, STALE: 1}
    # feast-server status reads stored records the same way; a record written before kinds were kept says it in words
    assert refusal_kinds({"rejected": {"b": "stale-looking payload"}, "refusals": {}}) == {"b": REFUSED}
    assert refusal_kinds({"rejected": {"a": "stale: trained from release 0 of 3"}}) == {"a": STALE}
    assert Counter(refusal_kinds(json.loads(json.dumps(stale.__dict__))).values()) == {STALE: 1}


# --------------------------------------------------------------------------- the clock both live views show


def test_the_simulations_live_view_shows_the_virtual_clock(tmp_path: Path, fashion_mnist_dir: Path) -> None:
    from feast_edge.cli.live import SimulationLive
    from feast_edge.dashboard.state import DashboardState

    sim = Simulation(tiny_config(fashion_mnist_dir, mode="async", buffer=2, concurrency=2, rounds=1), tmp_path)
    live = SimulationLive(DashboardState("simulation", "clock"), sim)
    live.attach()
    sim.run(on_record=live.round_finished)
    [entry] = live.state.snapshot()["history"]
    record = sim.history[-1]
    assert record.clock and entry["clock"] == record.clock
    assert {k: entry[k] for k in clock_entry(record.clock, record.staleness)} == clock_entry(
        record.clock, record.staleness
    )


def test_the_simulations_live_view_sees_each_round_start_under_secure_sums(tmp_path: Path, fashion_mnist_dir: Path):
    # The live view hooks the in-process collector beneath every wrapper (before, under --secure-agg it set the hook
    # on the secure wrapper, which never called it).
    from feast_edge.cli.live import SimulationLive
    from feast_edge.dashboard.state import DashboardState

    config = tiny_config(fashion_mnist_dir, secure_agg=True, clients=4, per_round=3, rounds=1)
    sim = Simulation(config, tmp_path)
    live = SimulationLive(DashboardState("simulation", "secure"), sim)
    live.attach()
    sim.run(on_record=live.round_finished)
    assert set(live._down) == set(sim.history[0].cohort) and all(b > 0 for b in live._down.values())
