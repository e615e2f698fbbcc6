"""Server optimizers on sparse aggregation (feast_edge.aggregate.server_opt) against a NumPy reference of each rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from feast_edge.aggregate.robust import aggregate_updates
from feast_edge.aggregate.server_opt import (
    ServerOpt,
    ServerOptimizer,
    parse_betas,
    routed_masks,
)
from feast_edge.settings.validated import RunError, recorded_settings, server_opt_of

SHAPES = {"w": (6, 5), "b": (7,)}
# Per round, the leading boxes the cohort was routed: overlapping and not nested ((4, 2) sticks out of (3, 4)); rows 4-5
# of w and entries 5-6 of b go unrouted in rounds 2-4 and come back in round 5.
ROUNDS = [
    [((6, 5), (7,)), ((3, 4), (3,))],
    [((4, 5), (5,)), ((3, 4), (3,)), ((4, 2), (2,))],
    [((3, 4), (4,)), ((4, 2), (2,))],
    [((2, 2), (1,))],
    [((4, 5), (5,)), ((1, 1), (1,))],
    [((6, 5), (7,)), ((3, 4), (3,))],
]


def _payloads(rng: np.random.Generator) -> list[list[tuple[dict[str, np.ndarray], float]]]:
    """Each round's payloads: random leading slices and sample counts."""
    return [
        [({"w": rng.normal(size=bw), "b": rng.normal(size=bb)}, float(rng.integers(5, 50))) for bw, bb in cohort]
        for cohort in ROUNDS
    ]


def _reference(opt: ServerOpt, theta: dict[str, np.ndarray], rounds) -> dict[str, np.ndarray]:
    """The rules of the module docstring, written out per position in float64 (state only where routed)."""
    theta = {k: v.astype(np.float64).copy() for k, v in theta.items()}
    state = {k: {s: np.zeros(v.shape) for s in ("b", "m", "v", "k")} for k, v in theta.items()}
    b1, b2 = opt.betas
    for payloads in rounds:
        for name, x in theta.items():
            num, den = np.zeros(x.shape), np.zeros(x.shape)
            for values, n in payloads:
                box = tuple(slice(0, e) for e in values[name].shape)
                num[box] += n * values[name]
                den[box] += n
            routed = den > 0
            delta = np.where(routed, num / np.where(routed, den, 1) - x, 0.0)
            st = state[name]
            if opt.name == "avg":
                step = opt.lr * delta
            elif opt.name == "momentum":
                st["b"] = np.where(routed, opt.momentum * st["b"] + delta, st["b"])
                step = opt.lr * st["b"]
            else:
                st["k"] = np.where(routed, st["k"] + 1, st["k"])
                st["m"] = np.where(routed, b1 * st["m"] + (1 - b1) * delta, st["m"])
                if opt.name == "adam":
                    v = b2 * st["v"] + (1 - b2) * delta**2
                else:
                    v = st["v"] - (1 - b2) * delta**2 * np.sign(st["v"] - delta**2)
                st["v"] = np.where(routed, v, st["v"])
                k = np.maximum(st["k"], 1)
                m_hat, v_hat = st["m"] / (1 - b1**k), st["v"] / (1 - b2**k)
                step = opt.lr * m_hat / (np.sqrt(v_hat) + opt.tau)
            theta[name] = np.where(routed, x + step, x)
    return theta


def _run(opt: ServerOpt, theta: dict[str, np.ndarray], rounds) -> tuple[dict[str, torch.Tensor], ServerOptimizer]:
    """The same rounds through the library: method §6's aggregate in place, then the optimizer's step."""
    state = {k: torch.tensor(v, dtype=torch.float32) for k, v in theta.items()}
    optimizer = ServerOptimizer(opt, {k: tuple(v.shape) for k, v in state.items()})
    for payloads in rounds:
        updates = [
            (f"c{i}", {k: torch.tensor(v, dtype=torch.float32) for k, v in values.items()}, n)
            for i, (values, n) in enumerate(payloads)
        ]
        before = optimizer.snapshot(state)
        aggregate_updates(state, updates, inplace=True)
        optimizer.step(state, before, routed_masks(state, [u[1] for u in updates], list(SHAPES)))
    return state, optimizer


@pytest.mark.parametrize(
    "opt",
    [
        ServerOpt("avg", lr=0.7),
        ServerOpt("momentum", lr=1.0, momentum=0.9),
        ServerOpt("adam", lr=0.05, betas=(0.9, 0.99), tau=1e-3),
        ServerOpt("yogi", lr=0.05, betas=(0.8, 0.95), tau=1e-2),
    ],
    ids=lambda o: o.name,
)
def test_each_rule_matches_the_numpy_reference_on_overlapping_envelopes(opt):
    rng = np.random.default_rng(7)
    theta = {k: rng.normal(size=s) for k, s in SHAPES.items()}
    rounds = _payloads(rng)
    got, _ = _run(opt, theta, rounds)
    want = _reference(opt, theta, rounds)
    for name in SHAPES:
        np.testing.assert_allclose(got[name].numpy(), want[name], rtol=2e-5, atol=2e-6)
    # The rule is not the plain mean (the comparison would otherwise not test it).
    plain = _reference(ServerOpt("avg"), theta, rounds)
    assert not np.allclose(want["w"], plain["w"], atol=1e-3)


@pytest.mark.parametrize("name", ["momentum", "adam", "yogi"])
def test_an_unrouted_position_keeps_its_value_and_its_state(name):
    rng = np.random.default_rng(3)
    theta = {k: rng.normal(size=s) for k, s in SHAPES.items()}
    rounds = _payloads(rng)
    _, optimizer = _run(ServerOpt(name), theta, rounds[:2])
    kept = {k: v.clone() for k, v in optimizer.state.items()}
    state, optimizer2 = _run(ServerOpt(name), theta, rounds[:3])
    # Round 3 routes w[:4, :5] and b[:4] only: w rows 4-5 and b[4:] keep their state, the routed part moves.
    for key, value in optimizer2.state.items():
        inside = (slice(0, 4),) if key.endswith("/b") else (slice(0, 4), slice(0, 5))
        outside = (slice(4, None),)
        assert torch.equal(value[outside], kept[key][outside]), key
        assert not torch.equal(value[inside], kept[key][inside]), key
    before, _ = _run(ServerOpt(name), theta, rounds[:2])
    assert torch.equal(state["w"][4:], before["w"][4:]) and torch.equal(state["b"][4:], before["b"][4:])


def test_avg_at_lr_1_is_the_identity_and_records_nothing():
    opt = ServerOpt()
    assert opt.identity and opt.settings() == {}
    assert not ServerOpt("avg", lr=0.5).identity and not ServerOpt("momentum").identity
    assert ServerOpt("adam").lr == 0.01 and ServerOpt("momentum").lr == 1.0
    assert opt.describe() == "avg (method §6's sparse mean)"
    assert ServerOpt("adam").describe() == "adam (lr 0.01, betas 0.9,0.99, tau 0.001)"
    assert ServerOpt("momentum", lr=0.1).describe() == "momentum (lr 0.1, momentum 0.9)"
    assert ServerOpt("yogi", lr=0.1).settings() == {
        "server_optimizer": {"name": "yogi", "lr": 0.1, "betas": (0.9, 0.99), "tau": 1e-3}
    }


def test_the_fingerprint_of_a_plain_run_is_unchanged_and_an_optimizer_changes_it():
    from feast_edge.local.recipe import TrainConfig

    train = TrainConfig()
    plain = recorded_settings(train, "cosine", "mean", 0.1, None, "float32")
    assert recorded_settings(train, "cosine", "mean", 0.1, None, "float32", ServerOpt()) == plain
    with_adam = recorded_settings(train, "cosine", "mean", 0.1, None, "float32", ServerOpt("adam"))
    assert with_adam["server_optimizer"]["name"] == "adam" and with_adam != plain


@pytest.mark.parametrize(
    "settings, option",
    [
        (dict(name="sgd"), "--server-opt"),
        (dict(name="adam", lr=-0.1), "--server-lr"),
        (dict(name="adam", lr=math.nan), "--server-lr"),
        (dict(name="adam", lr=math.inf), "--server-lr"),
        (dict(name="momentum", momentum=1.0), "--server-momentum"),
        (dict(name="adam", betas=(0.9, 1.0)), "--server-betas"),
        (dict(name="yogi", betas=(-0.1, 0.9)), "--server-betas"),
        (dict(name="yogi", betas=(0.9,)), "--server-betas"),
        (dict(name="adam", tau=0.0), "--server-tau"),
        (dict(name="adam", tau=-1e-3), "--server-tau"),
    ],
)
def test_out_of_range_settings_are_refused_naming_the_option(settings, option):
    with pytest.raises(ValueError, match=option):
        ServerOpt(**settings)
    with pytest.raises(RunError, match=option):
        server_opt_of(
            settings["name"],
            settings.get("lr"),
            settings.get("momentum", 0.9),
            settings.get("betas", (0.9, 0.99)),
            settings.get("tau", 1e-3),
        )


def test_a_method_that_does_not_average_refuses_an_optimizer_but_takes_plain_averaging():
    with pytest.raises(RunError, match="--server-opt momentum needs a method whose aggregation is an average"):
        server_opt_of("momentum", None, 0.9, (0.9, 0.99), 1e-3, averaging=False)
    assert server_opt_of("avg", None, 0.9, (0.9, 0.99), 1e-3, averaging=False).identity


def test_betas_parse_from_the_command_line_form():
    assert parse_betas("0.9,0.999") == (0.9, 0.999)
    with pytest.raises(ValueError, match="--server-betas"):
        parse_betas("0.9;0.99")


def test_state_loads_only_with_matching_names_and_shapes():
    opt = ServerOptimizer(ServerOpt("adam"), SHAPES)
    assert set(opt.state) == {f"{k}/{n}" for k in ("m", "v", "steps") for n in SHAPES}
    other = ServerOptimizer(ServerOpt("momentum"), SHAPES)
    with pytest.raises(ValueError, match="does not match --server-opt adam"):
        opt.load(other.state)
    bad = dict(opt.state)
    bad["m/w"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="m/w"):
        opt.load(bad)


@pytest.mark.parametrize("rule", ["clip", "median"])
def test_a_robust_rule_sets_the_target_the_optimizer_steps_towards(rule):
    rng = np.random.default_rng(11)
    theta = {k: torch.tensor(rng.normal(size=s), dtype=torch.float32) for k, s in SHAPES.items()}
    payloads = _payloads(rng)[1]  # three overlapping, non-nested boxes
    updates = [(f"c{i}", {k: torch.tensor(v, dtype=torch.float32) for k, v in p.items()}, n) for i, (p, n) in
               enumerate(payloads)]  # fmt: skip
    target = aggregate_updates(theta, updates, rule=rule, clip_norm=0.5)  # new tensors; theta untouched
    state = {k: v.clone() for k, v in theta.items()}
    optimizer = ServerOptimizer(ServerOpt("momentum", lr=0.5), SHAPES)
    before = optimizer.snapshot(state)
    aggregate_updates(state, updates, inplace=True, rule=rule, clip_norm=0.5)
    optimizer.step(state, before, routed_masks(state, [u[1] for u in updates], list(SHAPES)))
    for name in SHAPES:  # first step: b = Δ = target − θ, θ ← θ + 0.5·b
        want = theta[name] + 0.5 * (target[name] - theta[name])
        torch.testing.assert_close(state[name], want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(state["w"], target["w"])
