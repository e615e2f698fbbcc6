"""ScaleFL baseline: exit loss, level search, level sub-models, slice-wise aggregation, a short real run (method §9)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from feast_edge.local.recipe import cosine_lr
from feast_edge.run.cohort import client_seed, sample_round_cohort
from feast_edge.run.collect import ClientUpdate
from feast_edge.sim.methods.scalefl import ScaleFL, exit_loss
from feast_edge.sim.methods.scalefl_net import Geometry, ScaleFLNet, build_levels, level_net, load_slices, search_splits
from feast_edge.sim.registry import MethodError
from feast_edge.sim.setup import SimulationConfig, build_setup
from feast_edge.space.preset import load_preset

# One client per level on fmnist-small (levels cost 1.9M / 3.5M / 6.5M / 28.6M MACs), three of them at the top.
BUDGETS = (2.5e6, 5e6, 10e6, 30e6, 40e6, 60e6)


def _config(fashion_mnist_dir, **kw) -> SimulationConfig:
    base = {
        "data_dir": str(fashion_mnist_dir),
        "method": "scalefl",
        "clients": 6,
        "per_round": 6,
        "rounds": 3,
        "train_limit": 1200,
        "val_samples": 500,
        "calib_samples": 200,
        "test_limit": 500,
        "budgets": BUDGETS,
    }
    return SimulationConfig.of(**{**base, **kw})


@pytest.fixture(scope="module")
def scalefl(fashion_mnist_dir) -> ScaleFL:
    config = _config(fashion_mnist_dir)
    return ScaleFL(build_setup(config), config)


# ----------------------------------------------------------------------------- loss
def _softmax(v: list[float]) -> list[float]:
    e = [math.exp(x) for x in v]
    return [x / sum(e) for x in e]


def test_exit_loss_is_the_hand_computed_formula_with_a_detached_teacher():
    z1 = torch.tensor([[1.0, 0.0]], requires_grad=True)
    z2 = torch.tensor([[0.0, 2.0]], requires_grad=True)
    target = torch.tensor([[0.25, 0.75]])  # a mixed soft target
    beta, tau = 0.1, 3.0
    loss = exit_loss([z1, z2], target, beta, tau)
    loss.backward()

    s1, s2 = _softmax([1.0, 0.0]), _softmax([0.0, 2.0])
    ce1 = -(0.25 * math.log(s1[0]) + 0.75 * math.log(s1[1]))
    ce2 = -(0.25 * math.log(s2[0]) + 0.75 * math.log(s2[1]))
    p, q = _softmax([0.0, 2.0 / 3.0]), _softmax([1.0 / 3.0, 0.0])  # teacher σ(z2/τ), student σ(z1/τ)
    kl = sum(pc * math.log(pc / qc) for pc, qc in zip(p, q))
    # l = 2: weights 1/6 and 2/6; no KD term on the deepest exit.
    assert loss.item() == pytest.approx(1 / 6 * (ce1 + beta * tau**2 * kl) + 2 / 6 * ce2, rel=1e-6)
    # The teacher is detached: z2 gets only its own CE gradient; z1 gets CE + β·τ²·(q − p)/τ.
    assert z2.grad[0].tolist() == pytest.approx([2 / 6 * (s2[c] - target[0, c].item()) for c in range(2)], rel=1e-5)
    assert z1.grad[0].tolist() == pytest.approx(
        [1 / 6 * (s1[c] - target[0, c].item() + beta * tau * (q[c] - p[c])) for c in range(2)], rel=1e-5
    )


def test_exit_loss_of_a_single_exit_is_half_its_cross_entropy():
    z = torch.tensor([[0.5, -1.0, 2.0]])
    y = torch.tensor([[0.0, 0.0, 1.0]])
    assert float(exit_loss([z], y)) == pytest.approx(0.5 * -math.log(_softmax([0.5, -1.0, 2.0])[2]), rel=1e-6)


# ----------------------------------------------------------------------------- network and levels
def test_level_search_on_paper_cifar100_gives_the_papers_levels():
    geometry = Geometry.of(load_preset("paper-cifar100"))
    assert geometry.hidden == (64, 128, 256, 512)
    assert search_splits(geometry) == [(3, 0.4), (4, 0.5), (5, 0.6), (8, 1.0)]
    levels = build_levels(geometry, search_splits(geometry))
    # FEAST paper Table 4 and supplement E.5: ScaleFL spans 35M-555M MACs; the full model holds 11.27M parameters
    # with its four exits, 11.22M with the final one only (HeteroFL's ResNet-18).
    assert round(levels[0].macs / 1e6) == 35 and round(levels[-1].macs / 1e6) == 555
    assert round(levels[-1].params / 1e4) == 1122 and round(levels[-1].train_params / 1e4) == 1127
    assert [v.exit_after for v in levels] == [(3,), (3, 4), (3, 4, 5), (3, 4, 5, 8)]


def test_width_rule_takes_the_widest_network_under_the_budget_cap():
    preset = load_preset("fmnist-small")
    geometry = Geometry.of(preset)
    assert geometry.hidden == (16, 32, 64, 128)
    wider = Geometry(1, 28, 1, 10, (24, 48, 96, 192))
    assert geometry.macs(8, 1.0, (8,)) <= preset.budget_cap < wider.macs(8, 1.0, (8,))


def _counted_macs(net: torch.nn.Module, x: torch.Tensor) -> int:
    total = 0

    def hook(module, inputs, output):
        nonlocal total
        if isinstance(module, torch.nn.Conv2d):
            total += output[0].numel() * module.in_channels * module.kernel_size[0] * module.kernel_size[1]
        else:
            total += module.in_features * module.out_features

    handles = [
        m.register_forward_hook(hook) for m in net.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))
    ]
    net.eval()(x)
    for h in handles:
        h.remove()
    return total


def test_analytic_costs_match_the_built_networks():
    geometry = Geometry.of(load_preset("fmnist-small"))
    for level in build_levels(geometry, search_splits(geometry)):
        net = level_net(geometry, level)
        assert sum(p.numel() for p in net.parameters()) == level.train_params
        assert _counted_macs(net, torch.zeros(1, 1, 28, 28)) == level.train_macs


def _run_sliced(state, blocks: int, chans: list[int], exits: tuple[int, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """The global weights run at (blocks, widths) by slicing each tensor on the fly (eval-mode BN): an independent oracle."""

    def conv(name, x, out, inp, stride, pad):
        return F.conv2d(x, state[name][:out, :inp], stride=stride, padding=pad)

    def bn(name, x, c):
        return F.batch_norm(
            x,
            state[f"{name}.running_mean"][:c],
            state[f"{name}.running_var"][:c],
            state[f"{name}.weight"][:c],
            state[f"{name}.bias"][:c],
            False,
            0.0,
            1e-5,
        )

    x = F.relu(bn("stem.1", conv("stem.0.weight", x, chans[0], x.shape[1], 1, 1), chans[0]))
    c_in, logits = chans[0], []
    for k in range(blocks):
        stage, c = k // 2, chans[k // 2]
        stride = 2 if stage > 0 and k % 2 == 0 else 1
        out = F.relu(bn(f"blocks.{k}.bn1", conv(f"blocks.{k}.conv1.weight", x, c, c_in, stride, 1), c))
        out = bn(f"blocks.{k}.bn2", conv(f"blocks.{k}.conv2.weight", out, c, c, 1, 1), c)
        short = (
            bn(f"blocks.{k}.shortcut.1", conv(f"blocks.{k}.shortcut.0.weight", x, c, c_in, stride, 0), c)
            if stride > 1
            else x
        )
        x, c_in = F.relu(out + short), c
        for j, at in enumerate(exits):
            if at == k + 1:
                logits.append(F.linear(x.mean(dim=(2, 3)), state[f"exits.{j}.weight"][:, :c], state[f"exits.{j}.bias"]))
    return logits


@pytest.mark.parametrize(("level", "chans", "blocks"), [(1, [7, 13, 26, 52], 3), (2, [8, 16, 32, 64], 4)])
def test_level_submodel_is_the_leading_slice_of_the_global_model(level, chans, blocks):
    geometry = Geometry.of(load_preset("fmnist-small"))
    levels = build_levels(geometry, search_splits(geometry))
    glob = ScaleFLNet(geometry, 8, 1.0, (3, 4, 5, 8), seed=3)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-trivial BN statistics and affines and exit biases, so a wrong slice shows
        for module in glob.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=gen))
                module.running_var.copy_(0.5 + torch.rand(module.running_var.shape, generator=gen))
                module.running_mean.copy_(0.2 * torch.randn(module.running_mean.shape, generator=gen))
            if isinstance(module, (torch.nn.BatchNorm2d, torch.nn.Linear)):
                module.bias.copy_(0.2 * torch.randn(module.bias.shape, generator=gen))
    state = glob.state_dict()
    net = load_slices(level_net(geometry, levels[level - 1]), state).eval()
    shapes = {name: tuple(t.shape) for name, t in net.state_dict().items()}
    assert shapes["stem.0.weight"] == (chans[0], 1, 3, 3)  # image channels never sliced
    assert shapes["blocks.2.conv1.weight"] == (chans[1], chans[0], 3, 3)
    assert shapes["blocks.2.shortcut.0.weight"] == (chans[1], chans[0], 1, 1)
    assert shapes["exits.0.weight"] == (10, chans[1])  # classes never sliced; exit 1 sits after block 3 (stage 2)
    assert f"blocks.{blocks - 1}.conv2.weight" in shapes and f"blocks.{blocks}.conv1.weight" not in shapes
    assert f"exits.{level - 1}.bias" in shapes and f"exits.{level}.bias" not in shapes
    x = torch.randn(3, 1, 28, 28, generator=gen)
    with torch.no_grad():
        got, want = net(x), _run_sliced(state, blocks, chans, levels[level - 1].exit_after, x)
    assert len(got) == len(want) == level
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- method
def test_levels_assignment_and_points(scalefl):
    levels = scalefl.levels
    assert scalefl.plans(0, ["a", "b", "c"], {"a": 2.5e6, "b": levels[2].train_macs, "c": 1e9}.__getitem__) == {
        "a": 1,
        "b": 3,
        "c": 4,
    }
    points = scalefl.points()
    assert [p.detail for p in points] == [{"level": v.level, "blocks": v.blocks, "width": v.width} for v in levels]
    assert points[0].label == "level 1 (3 blocks, width 0.40)"
    assert [p.macs for p in points] == sorted(p.macs for p in points)
    assert scalefl.model_record()["hidden"] == [16, 32, 64, 128]


def test_a_budget_below_level_one_trains_and_is_served_level_one(fashion_mnist_dir):
    # 1.7M: above FEAST's smallest cached variant (1.45M, build_setup's floor), below ScaleFL's level 1 (1.91M).
    config = _config(fashion_mnist_dir, budgets=(1.7e6, *BUDGETS[1:]))
    scalefl = ScaleFL(build_setup(config), config)
    assert scalefl.levels[0].train_macs > 1.7e6
    assert scalefl.level_for(1.7e6) == 1 and scalefl.served(1.7e6) == 0
    assert scalefl.level_for(scalefl.levels[1].train_macs) == 2
    with pytest.raises(MethodError, match="beta"):
        ScaleFL.parse_options({"beta": "-1"})
    assert ScaleFL.parse_options({}) == {"beta": 0.1, "tau": 3.0}


def test_aggregation_averages_each_position_over_the_clients_that_trained_it(scalefl):
    state = scalefl.model.state_dict()
    before = {name: t.clone() for name, t in state.items()}
    with torch.no_grad():
        for p in scalefl.model.parameters():
            p.fill_(-7.0)

    def update(client, level, value, n):
        net = level_net(scalefl.geometry, scalefl.levels[level - 1])
        return ClientUpdate(client, {name: torch.full(p.shape, value) for name, p in net.named_parameters()}, samples=n)

    scalefl.aggregate(0, state, [update("a", 1, 1.0, 1), update("b", 2, 5.0, 3)], {"a": 1, "b": 2})
    both, only_b, nobody = (1 * 1.0 + 3 * 5.0) / 4, 5.0, -7.0
    stem = state["stem.0.weight"][:, 0, 0, 0]  # level 1: 7 of 16 channels, level 2: 8
    assert stem[:7].eq(both).all() and stem[7:8].eq(only_b).all() and stem[8:].eq(nobody).all()
    head = state["exits.0.weight"]  # exit 1 after block 3: 13 features at width 0.4, 16 at 0.5, of 32
    assert head[:, :13].eq(both).all() and head[:, 13:16].eq(only_b).all() and head[:, 16:].eq(nobody).all()
    assert state["exits.0.bias"].eq(both).all()
    assert state["exits.1.weight"][:, :16].eq(only_b).all() and state["exits.1.weight"][:, 16:].eq(nobody).all()
    assert (
        state["blocks.3.conv2.weight"][:16, :16].eq(only_b).all()
        and state["blocks.2.conv2.weight"][:13, :13].eq(both).all()
    )
    for untouched in ("exits.2.weight", "exits.3.bias", "blocks.4.conv1.weight", "blocks.7.bn2.bias"):
        assert state[untouched].eq(nobody).all()
    for name in state:  # BN statistics are not sent, so they stay
        if "running" in name:
            assert torch.equal(state[name], before[name])
    scalefl.model.load_state_dict(before)


@pytest.mark.slow
def test_short_fashion_mnist_run_beats_chance_at_the_largest_level(fashion_mnist_dir):
    # ScaleFL's own recipe for ResNets (git-disl/scale-fl config.py): batch 16, lr 0.1. With the harness's batch 64 and
    # lr 0.025 three rounds are ~15 averaged SGD steps, and the deepest exit's CE weighs only 1/(l+1) = 0.2 at level 4.
    config = _config(fashion_mnist_dir, lr=0.1, batch_size=16)
    setup = build_setup(config)
    method = ScaleFL(setup, config)
    budgets = dict(zip(setup.client_ids, setup.population.budgets))
    for t in range(config.training.rounds):
        cohort = sample_round_cohort(setup.client_ids, config.population.per_round, config.seed, t)
        plans = method.plans(t, cohort, budgets.__getitem__)
        assert sorted(set(plans.values())) == [1, 2, 3, 4]
        state = method.model.state_dict()
        snapshot = {name: x.clone() for name, x in state.items()}
        updates = method.collect(
            t, cohort, plans, state, cosine_lr(config.train_config().lr, t, config.training.rounds)
        )
        assert all(torch.equal(state[n], snapshot[n]) for n in state)  # local training leaves the global state alone
        assert all(math.isfinite(u.loss) for u in updates)
        assert [u.train_macs for u in updates] == [
            3 * u.samples_seen * method.levels[plans[u.client] - 1].train_macs for u in updates
        ]
        method.aggregate(t, state, updates, plans)
    cid = cohort[0]
    first, again = (
        method.train_client(0, cid, plans[cid], state, *setup.client_data(cid), 0.1, client_seed(config.seed, 0, cid))
        for _ in range(2)
    )
    assert all(torch.equal(again.state[n], first.state[n]) for n in first.state)  # same seed, same update
    calibration = setup.calibration_images()
    accs = method.evaluate(method.points(), calibration, setup.test_set.images[:500], setup.test_set.labels[:500])
    assert accs[-1] > 0.2, accs
