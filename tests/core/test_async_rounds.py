"""Buffered asynchronous rounds (feast_edge.run.asynchronous) and the virtual clock (feast_edge.run.clock): the
per-coordinate staleness weights on hand-built deltas from different versions, stale updates refused and counted, the
idle-device draw, and simulations that are reproducible and, with K = M = the cohort and no delays, synchronous."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch

from feast_edge.aggregate.sparse import aggregate
from feast_edge.aggregate.weights import bounded_weights
from feast_edge.dashboard.runs import load_runs
from feast_edge.privacy.accountant import accounted
from feast_edge.report.runs import load_run
from feast_edge.report.summary import write_report
from feast_edge.run.asynchronous import AsyncSlots, Buffered, parameter_names
from feast_edge.run.checkpoint import load_supernet
from feast_edge.run.clock import ClockModel, VirtualClock
from feast_edge.run.collect import ClientUpdate, Collected
from feast_edge.run.jobs import ClockJobs
from feast_edge.run.release import Release
from feast_edge.run.round_record import RoundRecord
from feast_edge.run.stages.weight_cap import WeightCapStage
from feast_edge.run.store import CHECKPOINT
from feast_edge.settings.buffered import SERVER_LR, AsyncSettings, discount
from feast_edge.settings.run_concerns import RunConcerns
from feast_edge.settings.validated import RunError
from feast_edge.sim.setup import SimulationError
from feast_edge.sim.simulate import Simulation
from simconfigs import tiny_config


class _Model(torch.nn.Module):
    def __init__(self, size: int = 4) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(size), requires_grad=False)


class _Method:
    """Each client routes a leading slice of ``w`` of its own length."""

    def __init__(self, lengths: Mapping[str, int]) -> None:
        self.lengths = dict(lengths)

    def plans(self, t: int, cohort: Sequence[str], budget: Any) -> dict[str, int]:
        return {c: self.lengths[c] for c in cohort}

    def aggregate(self, t: int, global_state: Any, updates: Sequence[ClientUpdate], plans: Any) -> None:
        aggregate(global_state, [(u.state, u.samples) for u in updates], inplace=True)


class _Collector:
    """Client c returns its routed slice of the version it was sent, plus ``step[c]``; ``sent`` logs (client, w)."""

    def __init__(self, step: Mapping[str, float]) -> None:
        self.step = dict(step)
        self.sent: list[tuple[str, list[float]]] = []

    def clients(self, needed: int) -> list[str]:
        return sorted(self.step)

    def budget(self, client: str) -> float:
        return 1.0

    def collect(self, t: int, cohort: Sequence[str], plans: Any, global_state: Any, lr: float) -> Collected:
        self.sent += [(c, global_state["w"].tolist()) for c in cohort]
        return Collected([ClientUpdate(c, {"w": global_state["w"][: plans[c]] + self.step[c]}, 1) for c in cohort])


class _Clock:
    """Job k takes ``seconds[k]`` (1 s where not given); ``lost`` jobs never arrive."""

    def __init__(self, seconds: Mapping[int, float], lost: Sequence[int] = ()) -> None:
        self.seconds, self.lost = dict(seconds), set(lost)

    def duration(self, client: str, update: ClientUpdate, plan: Any, job: int) -> float:
        return self.seconds.get(job, 1.0)

    def drops(self, client: str, job: int) -> bool:
        return job in self.lost


def _release(model: torch.nn.Module, slots: AsyncSlots, policy: Buffered, collector: Any, t: int) -> RoundRecord:
    """What the run loop does with one step: gather, then the policy's release."""
    step = slots.gather(t, collector, 1, lambda ctx: None, [])
    record = RoundRecord(round=t + 1, lr=step.lr, cohort=step.ctx.cohort, staleness=dict(step.got.staleness))
    record.rejected, record.dropped = step.got.rejected, step.got.dropped
    step.ctx.record = record
    policy.release(step.ctx, model.state_dict(), step.got.updates, step.plans, None)
    return record


def _slots(model, lengths, rules, clock, rounds=10) -> tuple[AsyncSlots, Buffered]:
    settings = RunConcerns.of_keys(rounds=rounds, per_round=len(lengths))
    method = _Method(lengths)
    return AsyncSlots(settings, method, model, rules, ClockJobs(clock, parameter_names(model))), Buffered(
        Release(method, []), rules.staleness
    )


def test_a_stale_update_is_rebased_on_the_current_model_and_discounted_coordinate_by_coordinate() -> None:
    model = _Model()
    # Jobs: 0 a (1 s), 1 b (5 s), 2 c (1 s) from version 0; then 3 a (1 s), 4 c (10 s) from version 1.
    slots, policy = _slots(model, {"a": 4, "b": 2, "c": 4}, AsyncSettings(2, 3, 5, "sqrt"), _Clock({1: 5.0, 4: 10.0}))
    collector = _Collector({"a": 1.0, "b": 2.0, "c": 3.0})
    first = _release(model, slots, policy, collector, 0)
    assert first.cohort == ["a", "c"] and first.staleness == {"a": 0, "c": 0}
    assert model.w.tolist() == [2.0, 2.0, 2.0, 2.0]  # (1 + 3) / 2: fresh updates, the synchronous mean
    second = _release(model, slots, policy, collector, 1)
    # a trained from version 1 (Δ = 1, fresh); b from version 0 (Δ = 2 on its 2 coordinates, 1 release stale).
    assert second.cohort == ["a", "b"] and second.staleness == {"a": 0, "b": 1}
    s = discount("sqrt", 1)
    assert s == pytest.approx(1 / math.sqrt(2))
    head = 2.0 + (1.0 * 1.0 + s * 2.0) / (1.0 + s)  # θ[u] + Σ n s Δ[u] / Σ n s over the updates covering u
    assert model.w.tolist() == pytest.approx([head, head, 3.0, 3.0])
    assert slots.now == 5.0 and dict(slots.participation) == {"a": 2, "b": 1, "c": 1}
    # Each device was sent the version current when its slot was filled.
    assert collector.sent == [
        ("a", [0.0] * 4),
        ("b", [0.0] * 4),
        ("c", [0.0] * 4),
        ("a", [2.0] * 4),
        ("c", [2.0] * 4),
    ]


class _NormModel(_Model):
    """``w`` and a running variance (a buffer), as a BatchNorm layer holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("var", torch.full((4,), 4.0))


class _NormCollector(_Collector):
    """As _Collector, each client also sending its own running variance ``var[c]`` (its data's, not a step)."""

    def __init__(self, step: Mapping[str, float], var: Mapping[str, float]) -> None:
        super().__init__(step)
        self.var = dict(var)

    def collect(self, t: int, cohort: Sequence[str], plans: Any, global_state: Any, lr: float) -> Collected:
        got = super().collect(t, cohort, plans, global_state, lr)
        for u in got.updates:
            u.state["var"] = torch.full((plans[u.client],), self.var[u.client])
        return got


def test_a_stale_update_rebases_its_parameters_but_its_running_statistics_are_taken_as_sent() -> None:
    model = _NormModel()
    slots, policy = _slots(model, {"a": 4, "b": 2, "c": 4}, AsyncSettings(2, 3, 5, "sqrt"), _Clock({1: 5.0, 4: 10.0}))
    collector = _NormCollector({"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 1.0, "b": 0.5, "c": 3.0})
    _release(model, slots, policy, collector, 0)
    assert model.var.tolist() == [2.0] * 4  # a's and c's, fresh
    _release(model, slots, policy, collector, 1)
    # b sent a variance of 0.5 from version 0, whose variance was 4.0: rebased as a step it would be
    # 2.0 + (0.5 - 4.0) = -1.5 and drag the mean below zero; a statistic of b's data, it enters as sent.
    s = discount("sqrt", 1)
    assert model.var.tolist() == pytest.approx([(1.0 + s * 0.5) / (1 + s)] * 2 + [1.0, 1.0])
    head = 2.0 + (1.0 + s * 2.0) / (1.0 + s)  # the parameters still take b's step on the current model
    assert model.w.tolist() == pytest.approx([head, head, 3.0, 3.0])


def test_self_reported_counts_are_capped_against_every_device_heard_from_not_the_release_alone() -> None:
    counts = {"a": 10, "b": 300, "c": 300, "d": 300}

    class Claims(_Collector):
        def collect(self, t, cohort, plans, global_state, lr):
            got = super().collect(t, cohort, plans, global_state, lr)
            return Collected([replace(u, samples=counts[u.client], self_reported=True) for u in got.updates])

    class Speeds(_Clock):  # everyone takes 1 s from version 0; from version 1 on, c and d take 10 s
        def duration(self, client, update, plan, job):
            return 10.0 if job >= 4 and client in "cd" else 1.0

    model = _Model()
    settings = RunConcerns.of_keys(rounds=5, per_round=4)
    method = _Method(dict.fromkeys(counts, 4))
    slots = AsyncSlots(
        settings, method, model, AsyncSettings(2, 4, 5, "constant"), ClockJobs(Speeds({}), parameter_names(model))
    )
    release = Release(method, [WeightCapStage(2.0)])
    policy, collector = Buffered(release, "constant"), Claims({"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0})

    def step(t: int) -> RoundRecord:
        got = slots.gather(t, collector, 1, lambda ctx: None, [])
        got.ctx.record = record = RoundRecord(round=t + 1, lr=got.lr, cohort=got.ctx.cohort)
        valid = release.prepare(got.ctx, model.state_dict(), got.got.updates)
        policy.release(got.ctx, model.state_dict(), valid, got.plans, None)
        return record

    assert step(0).cohort == ["a", "b", "c", "d"]  # all four arrive at once
    second = step(1)
    assert second.cohort == ["a", "b"]
    # The release's own lower median is a's 10: b would count for 20. Against every device heard from (10, 300,
    # 300, 300) the cap is 600, and b keeps its 300.
    assert bounded_weights([10, 300], [True, True], 2.0) == [10, 20]
    assert second.capped == {}
    before = (10 * 1 + 300 * 2 + 300 * 3 + 300 * 4) / 910
    assert model.w.tolist() == pytest.approx([before + (10 * 1 + 300 * 2) / 310] * 4)


def test_an_update_staler_than_the_bound_is_refused_with_the_reason_and_counted() -> None:
    model = _Model()
    slots, policy = _slots(model, {"a": 4, "b": 2, "c": 4}, AsyncSettings(2, 3, 0, "sqrt"), _Clock({1: 5.0, 4: 10.0}))
    collector = _Collector({"a": 1.0, "b": 2.0, "c": 3.0})
    _release(model, slots, policy, collector, 0)
    second = _release(model, slots, policy, collector, 1)
    assert second.rejected == {"b": "stale: trained from release 0 of 1, 1 behind (--max-staleness 0)"}
    assert slots.refused == {"b": 1}
    # b was drawn again at once, from version 1, and its fresh update made the release.
    assert second.cohort == ["a", "b"] and second.staleness == {"a": 0, "b": 0}
    assert ("b", [2.0] * 4) in collector.sent


def test_a_lost_job_costs_only_its_own_update() -> None:
    model = _Model()
    slots, policy = _slots(model, {"a": 4, "b": 4, "c": 4}, AsyncSettings(2, 3, 5, "sqrt"), _Clock({}, lost=[0]))
    record = _release(model, slots, policy, _Collector({"a": 1.0, "b": 2.0, "c": 3.0}), 0)
    assert record.dropped == ["a"] and record.cohort == ["b", "c"] and slots.dropped == {"a": 1}
    assert model.w.tolist() == [2.5] * 4


def test_an_inverse_discount_weighs_a_stale_update_by_one_over_one_plus_its_staleness(
    tmp_path, fashion_mnist_dir
) -> None:
    # From the command line to the release: --staleness inverse is taken, recorded and run.
    config = tiny_config(fashion_mnist_dir, rounds=2, mode="async", buffer=2, concurrency=3, staleness="inverse")
    assert config.schedule.rules().staleness == "inverse" and config.decisive()["staleness"] == "inverse"
    sim = Simulation(config, tmp_path)
    sim.run()
    assert sim.loop.policy.staleness == "inverse" and all(h.applied for h in sim.history)


def test_the_discounts_and_the_settings_checks() -> None:
    assert [discount("sqrt", t) for t in (0, 3)] == [1.0, 0.5]
    assert [discount("hinge", t) for t in (0, 2, 3, 5)] == [1.0, 1.0, 0.5, 0.25]
    assert discount("constant", 9) == 1.0
    assert [discount("inverse", t) for t in (0, 1, 3)] == [1.0, 0.5, 0.25]
    with pytest.raises(RunError, match="--staleness 'cubic' is not a staleness discount"):
        AsyncSettings(2, 3, 5, "cubic")
    with pytest.raises(RunError, match="--concurrency 1 must be at least --buffer 2"):
        AsyncSettings(2, 1, 5)


def test_no_device_starves_when_fast_devices_could_fill_every_slot() -> None:
    # Four fast devices (1 s) and two slow ones (20 s), 3 slots, releases of 2: a freed slot draws among the idle
    # devices only, so the slow ones keep being drawn and released.
    clients = {c: 4 for c in ("f1", "f2", "f3", "f4", "s1", "s2")}

    class Slow(_Clock):
        def duration(self, client, update, plan, job):
            return 20.0 if client.startswith("s") else 1.0

    model = _Model()
    slots, policy = _slots(model, clients, AsyncSettings(2, 3, 100, "sqrt"), Slow({}), rounds=120)
    collector = _Collector(dict.fromkeys(clients, 0.5))
    for t in range(120):
        _release(model, slots, policy, collector, t)
    counts = dict(slots.participation)
    assert set(counts) == set(clients) and min(counts["s1"], counts["s2"]) >= 5, counts


def _clock(**settings: Any) -> VirtualClock:
    budgets = {f"c{i}": b for i, b in enumerate((1e6, 2e6, 4e6, 8e6))}
    return VirtualClock(ClockModel(**settings), budgets, seed=3, payload_params=lambda plan: plan)


def test_the_virtual_clock_times_training_on_the_tier_and_transfers_on_the_link() -> None:
    update = ClientUpdate("c1", {}, 10, train_macs=5_000_000_000)
    clock = _clock(rate=1e10, link_mbps=8.0)
    # c1 holds a quarter of the top budget: 1e10 / 4 MAC/s; 1 M float32 parameters down and up at 1 MB/s.
    assert clock.duration("c1", update, 1_000_000, job=0) == pytest.approx(5e9 / 2.5e9 + 2 * 4e6 / 1e6)
    assert clock.duration("c1", update, None, job=0) == pytest.approx(2.0)  # nothing routed: training alone
    slowed = _clock(rate=1e10, link_mbps=8.0, stragglers=1.0, straggler_factor=10.0)
    assert slowed.duration("c1", update, None, job=0) == pytest.approx(20.0)


def test_the_uniform_clock_takes_one_second_and_its_jitter_is_seeded_per_job() -> None:
    update = ClientUpdate("c0", {}, 10, train_macs=1)
    assert {_clock(kind="uniform").duration("c0", update, 5, job=j) for j in range(20)} == {1.0}
    jittered = [_clock(kind="uniform", jitter=0.5).duration("c0", update, 5, job=j) for j in range(200)]
    again = [_clock(kind="uniform", jitter=0.5).duration("c3", update, 5, job=j) for j in range(200)]
    assert jittered == again  # the job's seed decides it, not the client or a hidden state
    logs = torch.tensor([math.log(x) for x in jittered])
    assert abs(float(logs.mean())) < 0.1 and 0.4 < float(logs.std()) < 0.6  # exp(0.5 · N(0, 1))
    lost = [_clock(dropout=0.25).drops("c0", j) for j in range(400)]
    assert lost == [_clock(dropout=0.25).drops("c2", j) for j in range(400)] and 60 < sum(lost) < 140


# ------------------------------------------------------------------------------------- simulations


def _weights(path):
    return load_supernet(path)[0].state_dict()


@pytest.mark.slow
def test_k_equal_m_equal_the_cohort_without_delays_is_the_synchronous_run(tmp_path, fashion_mnist_dir) -> None:
    sync = tiny_config(fashion_mnist_dir, rounds=2, seed=5)
    same = sync.changed(mode="async", buffer=2, concurrency=2, clock="uniform", server_lr=1.0)
    a = Simulation(sync, tmp_path / "sync").run()
    b = Simulation(same, tmp_path / "async").run()
    wa, wb = _weights(tmp_path / "sync" / CHECKPOINT), _weights(tmp_path / "async" / CHECKPOINT)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["cohort"] for r in a["rounds"]] == [r["cohort"] for r in b["rounds"]]
    assert b["timeline"]["staleness"] == {"mean": 0.0, "max": 0, "refused": 0}
    assert b["timeline"]["virtual_seconds"] == 2.0 and b["timeline"]["releases"] == 2


@pytest.mark.slow
def test_without_a_server_lr_an_asynchronous_release_moves_a_quarter_of_the_way(tmp_path, fashion_mnist_dir) -> None:
    sync = tiny_config(fashion_mnist_dir, rounds=1, seed=5)
    stepped = sync.changed(mode="async", buffer=2, concurrency=2, clock="uniform")
    assert stepped.server_optimizer().lr == SERVER_LR == 0.25 and sync.server_optimizer().identity
    first = Simulation(stepped, tmp_path / "async")
    start = {k: v.clone() for k, v in first.model.state_dict().items()}
    first.run()
    Simulation(sync, tmp_path / "sync").run()
    mean, moved = _weights(tmp_path / "sync" / CHECKPOINT), _weights(tmp_path / "async" / CHECKPOINT)
    params = {n for n, _ in first.model.named_parameters()}
    for k in params:  # θ + η (the release's mean - θ); buffers (BN statistics) keep the mean itself
        torch.testing.assert_close(moved[k], start[k] + SERVER_LR * (mean[k] - start[k]), rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(mean[k], start[k]) for k in params)
    assert all(torch.equal(moved[k], mean[k]) for k in mean if k not in params)


@pytest.mark.slow
def test_an_asynchronous_simulation_is_reproducible_from_its_seed(tmp_path, fashion_mnist_dir) -> None:
    config = tiny_config(
        fashion_mnist_dir, rounds=3, seed=2, mode="async", buffer=2, concurrency=3, stragglers=0.5, jitter=0.3
    )
    first = Simulation(config, tmp_path / "a").run()
    again = Simulation(config, tmp_path / "b").run()
    wa, wb = _weights(tmp_path / "a" / CHECKPOINT), _weights(tmp_path / "b" / CHECKPOINT)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert first["timeline"] == again["timeline"]
    timeline = first["timeline"]
    assert timeline["mode"] == "async" and timeline["releases"] == 3 and timeline["virtual_seconds"] > 0
    assert sum(timeline["participation"].values()) == 6  # K updates per release
    rows = (tmp_path / "a" / "rounds.csv").read_text().splitlines()
    assert ",clock,staleness_mean,staleness_max," in rows[0] and len(rows) == 4
    assert json.loads((tmp_path / "a" / "results.json").read_text())["timeline"] == timeline
    run = load_run(tmp_path / "a")  # feast-edge report: its own group, and the virtual time
    assert run.group == "feast (async K=2 M=3 S=10 sqrt η=0.25)" and run.virtual_seconds == timeline["virtual_seconds"]
    assert [c for c, _ in run.validation_in_time] == [t for t, _ in timeline["accuracy_vs_time"]]
    written = write_report([tmp_path / "a"], tmp_path / "report")
    assert tmp_path / "report" / "accuracy_vs_time.png" in written.plots
    assert "feast (async K=2 M=3 S=10 sqrt η=0.25)" in written.report.read_text(encoding="utf-8")
    history = load_runs([tmp_path / "a"]).snapshot()["history"]  # feast-edge dashboard: time and staleness per release
    for entry, record in zip(history, first["rounds"], strict=True):
        taus = list(record["staleness"].values())
        assert entry["clock"] == record["clock"] and entry["staleness_max"] == max(taus)
        assert entry["staleness_mean"] == pytest.approx(sum(taus) / len(taus))


def test_what_async_rounds_do_not_offer_is_refused_with_the_reason() -> None:
    with pytest.raises(SimulationError, match="--mode async trains FEAST's routed slices; heterofl"):
        tiny_config(mode="async", method="heterofl")
    with pytest.raises(SimulationError, match="central DP weighs every buffered update alike .* --staleness constant"):
        tiny_config(mode="async", dp_noise=1.0, dp_clip=1.0, clients=10)
    with pytest.raises(SimulationError, match="unsampled: accounted as if one device were in every release"):
        tiny_config(mode="async", staleness="constant", dp_noise=1.0, dp_clip=1.0, dp_epsilon=1.0, rounds=50)
    with pytest.raises(SimulationError, match="--concurrency 10 is more than --clients 4"):
        tiny_config(mode="async", buffer=2, concurrency=10)
    with pytest.raises(SimulationError, match="--mode 'later' is unknown"):
        tiny_config(mode="later")


@pytest.mark.slow
def test_robust_rules_and_server_optimizers_release_the_buffer(tmp_path, fashion_mnist_dir) -> None:
    base = tiny_config(fashion_mnist_dir, rounds=2, seed=4, mode="async", buffer=2, concurrency=3, stragglers=0.5)
    plain = Simulation(base, tmp_path / "mean").run()
    for name, changes in {
        "trimmed": {"aggregation": "trimmed-mean", "trim": 0.25},
        "adam": {"server_opt": "adam"},
    }.items():
        other = Simulation(base.changed(**changes), tmp_path / name).run()
        assert [r["cohort"] for r in other["rounds"]] == [r["cohort"] for r in plain["rounds"]]  # the same draws
        a, b = _weights(tmp_path / "mean" / CHECKPOINT), _weights(tmp_path / name / CHECKPOINT)
        assert all(torch.isfinite(b[k]).all() for k in b if b[k].is_floating_point())
        assert any(not torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.slow
def test_a_resumed_asynchronous_run_drops_what_was_in_flight_and_keeps_the_clock(tmp_path, fashion_mnist_dir) -> None:
    config = tiny_config(fashion_mnist_dir, rounds=3, seed=2, mode="async", buffer=2, concurrency=3, stragglers=0.5)
    assert Simulation(config, tmp_path).run(stop_after=2) is None
    resumed = Simulation(config, tmp_path).run(resume=True)
    clocks = [r["clock"] for r in resumed["rounds"]]
    assert len(clocks) == 3 and clocks == sorted(clocks) and clocks[2] > clocks[1]
    assert resumed["timeline"]["releases"] == 3


@pytest.mark.slow
def test_a_compute_budget_ends_either_mode_at_the_same_training_work(tmp_path, fashion_mnist_dir) -> None:
    sync = tiny_config(fashion_mnist_dir, rounds=3, seed=6)
    full = Simulation(sync, tmp_path / "full").run()
    first = full["rounds"][0]["train_macs"]
    # Asynchronous releases of two clients' updates are cheaper than a round: room for many more.
    modes = {"sync": sync, "async": sync.changed(mode="async", buffer=2, concurrency=3, rounds=200)}
    for name, config in modes.items():
        run = Simulation(config.changed(compute_budget=first), tmp_path / name)
        results = run.run()
        spent = [r["train_macs"] for r in results["rounds"]]
        # It stops before the step after the one that reached the budget, and says why.
        assert sum(spent[:-1]) < first <= sum(spent) and len(spent) < config.training.rounds, (name, spent)
        assert "the compute budget is spent" in run.loop.stopped


@pytest.mark.slow
def test_central_dp_accounts_each_release_without_sampling_over_the_releases_a_device_was_in(
    tmp_path, fashion_mnist_dir
) -> None:
    dp = dict(dp_clip=0.5, dp_noise=0.8, dp_seed=11, rounds=4, eval_every=4, clients=6, per_round=2)
    released = Simulation(
        tiny_config(fashion_mnist_dir, mode="async", buffer=2, concurrency=4, staleness="constant", **dp),
        tmp_path / "async",
    ).run()
    sampled = Simulation(tiny_config(fashion_mnist_dir, **dp), tmp_path / "sync").run()
    seen: Counter[str] = Counter()
    for r in released["rounds"]:
        seen.update(r["cohort"])
        record = r["dp"]
        assert record["sampled"] is False and record["population"] == 6 and record["cohort"] == 2
        # one Gaussian mechanism (q = 1) per release the most frequent device was in
        want = accounted([(1, 1)] * max(seen.values()), 0.8, record["delta"])
        assert record["epsilon"] == pytest.approx(want.value)
        assert r["samples"] == len(r["updated"])  # uniform weights, no staleness discount
    assert max(seen.values()) < len(released["rounds"])  # counting a device's own releases is tighter than all
    block = released["privacy"]
    assert block["sampling"].startswith("none") and block["epsilon_by"] is None
    assert block["epsilon"] == released["rounds"][-1]["dp"]["epsilon"]
    # the same noise over sampled synchronous rounds of the same size: amplification makes its ε smaller
    assert sampled["privacy"]["sampling"] == "uniform cohorts"
    assert "sampled" not in sampled["rounds"][-1]["dp"]
    assert sampled["privacy"]["epsilon"] < block["epsilon"]


@pytest.mark.slow
def test_federated_validation_personalization_and_local_dp_run_in_async_mode(tmp_path, fashion_mnist_dir) -> None:
    base = dict(mode="async", buffer=2, concurrency=3, rounds=3, eval_every=3, seed=1)
    checked = Simulation(
        tiny_config(fashion_mnist_dir, validate_on="devices", holdout=0.2, personalize="auto", **base),
        tmp_path / "devices",
    ).run()
    assert checked["rounds"][-1]["val_accuracy"] is not None  # validated on the clients' held-out splits
    assert checked["rounds"][-1]["validation"]["devices"]
    assert len(checked["personalization"]["clients"]) == 4  # every client's own step after the last release
    private = Simulation(
        tiny_config(fashion_mnist_dir, dp_mode="local", dp_clip=0.5, dp_noise=0.5, **base), tmp_path / "local"
    ).run()
    most = max(Counter(c for r in private["rounds"] for c in r["cohort"]).values())
    delta = private["rounds"][-1]["dp"]["delta"]
    assert private["privacy"]["epsilon"] == pytest.approx(accounted([(1, 1)] * most, 0.5, delta, "local").value)
