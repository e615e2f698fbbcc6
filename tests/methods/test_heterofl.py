"""HeteroFL baseline: top-left slicing, the Scaler, count-normalised aggregation, analytic cost, a real short run."""

from __future__ import annotations

import pytest
import torch

from feast_edge.local.recipe import cosine_lr
from feast_edge.run.cohort import client_seed, sample_round_cohort
from feast_edge.run.collect import ClientUpdate
from feast_edge.sim.methods import MethodError, method_class
from feast_edge.sim.methods.heterofl import HeteroFL, heterofl_shape
from feast_edge.sim.methods.resnet18 import (
    ResNet18,
    ResNetShape,
    Scaler,
    build_network,
    leading_state,
    resnet_cost,
    tensor_shapes,
)
from feast_edge.sim.setup import SimulationConfig, build_setup
from feast_edge.space.counting import measure_macs, measure_params
from feast_edge.space.preset import load_preset

TINY = ResNetShape(in_channels=3, input_size=8, classes=5, hidden=(3, 6, 12, 24))


@pytest.fixture(scope="module")
def config(fashion_mnist_dir) -> SimulationConfig:
    return SimulationConfig.of(
        method="heterofl",
        data_dir=str(fashion_mnist_dir),
        train_limit=1200,
        clients=6,
        per_round=6,
        rounds=3,
        val_samples=500,
        calib_samples=200,
        test_limit=500,
    )


@pytest.fixture(scope="module")
def setup(config):
    return build_setup(config)


@pytest.fixture
def method(setup, config) -> HeteroFL:
    return HeteroFL(setup, config)


# ---------------------------------------------------------------- the client sub-model
def test_tier_shapes_are_ceil_of_ratio_times_width_with_input_and_classes_whole():
    shapes = tensor_shapes(TINY, 0.5)  # widths (3, 6, 12, 24) -> ceil(1.5, 3, 6, 12) = (2, 3, 6, 12)
    assert shapes["stem.weight"] == (2, 3, 3, 3)  # image channels not sliced
    assert shapes["stages.0.0.bn1.weight"] == (2,)
    assert shapes["stages.0.0.conv1.weight"] == (2, 2, 3, 3)
    assert "stages.0.0.shortcut.weight" not in shapes  # stride 1, same width: identity shortcut
    assert shapes["stages.1.0.conv1.weight"] == (3, 2, 3, 3)
    assert shapes["stages.1.0.shortcut.weight"] == (3, 2, 1, 1)
    assert shapes["stages.1.1.conv1.weight"] == (3, 3, 3, 3)
    assert shapes["stages.3.1.conv2.weight"] == (12, 12, 3, 3)
    assert shapes["norm.bias"] == (12,)
    assert shapes["classifier.weight"] == (5, 12)  # classes not sliced
    assert shapes["classifier.bias"] == (5,)
    assert set(shapes) == set(tensor_shapes(TINY, 1.0))  # same names as the global model


def test_payload_is_a_copy_of_the_top_left_slice_of_every_global_tensor(method):
    glob = method.model.state_dict()
    with torch.no_grad():
        glob["stem.weight"].copy_(torch.arange(16 * 9, dtype=torch.float32).view(16, 1, 3, 3))
    payload = method.payload(0.25, glob)  # fmnist-small widths (16, 32, 64, 128) -> (4, 8, 16, 32)
    assert set(payload) == set(glob)
    assert torch.equal(payload["stem.weight"], torch.arange(4 * 9, dtype=torch.float32).view(4, 1, 3, 3))
    assert torch.equal(payload["stages.1.0.shortcut.weight"], glob["stages.1.0.shortcut.weight"][:8, :4])
    assert torch.equal(payload["classifier.weight"], glob["classifier.weight"][:, :32])
    assert torch.equal(payload["classifier.bias"], glob["classifier.bias"])
    for name, tensor in payload.items():
        assert torch.equal(tensor, glob[name][tuple(slice(0, n) for n in tensor.shape)])
    payload["stem.weight"].add_(1.0)
    assert glob["stem.weight"][0, 0, 0, 0] == 0  # a copy: training the payload cannot touch the global model
    assert method.payload_params(0.25) == sum(t.numel() for t in payload.values()) == method.points()[2].params


def test_sliced_network_computes_the_same_as_a_network_loaded_with_the_slices():
    big = ResNet18(TINY)
    shapes = tensor_shapes(TINY, 0.5)
    small = ResNet18(TINY, 0.5)
    small.load_state_dict(leading_state(big.state_dict(), shapes))
    built = build_network(TINY, 0.5, big.state_dict())
    x = torch.randn(4, 3, 8, 8)
    assert torch.equal(built(x), small(x))


# ---------------------------------------------------------------- the Scaler
def test_scaler_divides_by_the_ratio_in_training_only():
    scaler = Scaler(0.25)
    x = torch.tensor([1.0, -2.0, 0.5])
    assert torch.equal(scaler.train()(x), torch.tensor([4.0, -8.0, 2.0]))
    assert torch.equal(scaler.eval()(x), x)
    assert not list(scaler.parameters())


def test_scaler_sits_before_every_batchnorm():
    net = ResNet18(TINY, 0.5)
    seen = {}
    net.stages[0][0].bn1.register_forward_hook(lambda m, args, out: seen.__setitem__("bn1", args[0]))
    net.norm.register_forward_hook(lambda m, args, out: seen.__setitem__("norm", args[0]))
    x = torch.randn(4, 3, 8, 8)
    stem = net.stem(x)
    net.train()(x)
    assert torch.allclose(seen["bn1"], stem / 0.5)  # the stem's output, divided by r
    train_norm_in = seen["norm"]
    net.eval()(x)
    assert torch.equal(seen["bn1"], stem)  # identity at evaluation
    assert not torch.equal(train_norm_in, seen["norm"])


# ---------------------------------------------------------------- aggregation
def test_aggregation_averages_each_position_over_the_tiers_that_hold_it(method):
    glob = method.model.state_dict()
    with torch.no_grad():
        for t in glob.values():
            t.fill_(7.0)
    half = {k: torch.full_like(v, 1.0) for k, v in method.payload(0.5, glob).items()}  # n = 2
    quarter = {k: torch.full_like(v, 4.0) for k, v in method.payload(0.25, glob).items()}  # n = 1
    updates = [ClientUpdate("a", half, samples=2), ClientUpdate("b", quarter, samples=1)]
    method.aggregate(0, glob, updates, {})
    model = method.model.state_dict()  # written in place
    w = model["classifier.weight"]  # [10, 128]: tier 1/2 holds columns :64, tier 1/4 columns :32
    assert torch.all(w[:, :32] == 2.0)  # (2·1 + 1·4) / (2 + 1)
    assert torch.all(w[:, 32:64] == 1.0)  # only the 1/2 client
    assert torch.all(w[:, 64:] == 7.0)  # nobody: unchanged
    assert torch.all(model["classifier.bias"] == 2.0)  # classes are in every slice
    conv = model["stages.1.0.conv1.weight"]  # [32, 16, 3, 3]; 1/2 -> [:16, :8], 1/4 -> [:8, :4]
    assert torch.all(conv[:8, :4] == 2.0)
    assert torch.all(conv[:8, 4:8] == 1.0) and torch.all(conv[8:16, :8] == 1.0)
    assert torch.all(conv[16:] == 7.0) and torch.all(conv[:, 8:] == 7.0)
    assert torch.all(model["stages.3.1.bn2.weight"][:32] == 2.0) and torch.all(
        model["stages.3.1.bn2.weight"][64:] == 7.0
    )


# ---------------------------------------------------------------- cost
def test_analytic_cost_matches_a_hand_count():
    one = ResNetShape(in_channels=1, input_size=4, classes=2, hidden=(1, 1, 1, 1), blocks=(1, 1, 1, 1))
    # stem 1·1·9·4² = 144; stage 0 (4×4) 2·9·16 = 288; stage 1 (2×2) 2·9·4 + proj 4 = 76; stages 2, 3 (1×1) 19 each; fc 2
    # params: stem 9; per block bn1 2 + conv1 9 + bn2 2 + conv2 9 = 22 (+1 projection in stages 1-3); final BN 2; fc 2 + 2
    assert resnet_cost(one) == (144 + 288 + 76 + 19 + 19 + 2, 9 + 22 + 23 + 23 + 23 + 2 + 4)


@pytest.mark.parametrize("preset_name", ["paper-cifar100", "fmnist-small", "paper-tinyimagenet"])
def test_analytic_cost_equals_forward_hook_count(preset_name):
    preset = load_preset(preset_name)
    shape = heterofl_shape(preset)
    for ratio in (1.0, 0.5, 0.25, 0.125, 0.0625, 0.3):
        with torch.no_grad():
            net = ResNet18(shape, ratio)
        macs, params = resnet_cost(shape, ratio)
        assert measure_macs(net, (preset.in_channels, preset.input_size, preset.input_size)) == macs
        assert measure_params(net) == params


def test_network_scale_is_the_papers_resnet18_on_cifar_and_fits_the_cap_elsewhere():
    assert heterofl_shape(load_preset("paper-cifar100")).hidden == (64, 128, 256, 512)
    preset = load_preset("fmnist-small")
    shape = heterofl_shape(preset)
    w = shape.hidden[0]
    assert shape.hidden == (w, 2 * w, 4 * w, 8 * w) and w % 8 == 0
    wider = ResNetShape(shape.in_channels, shape.input_size, shape.classes, tuple(c + c // w * 8 for c in shape.hidden))
    assert resnet_cost(shape)[0] <= preset.budget_cap < resnet_cost(wider)[0]


# ---------------------------------------------------------------- plans, options, record
def test_a_client_trains_the_largest_tier_within_its_budget(method):
    macs = {p.detail["ratio"]: p.macs for p in method.points()}
    assert [p.detail["ratio"] for p in method.points()] == [0.0625, 0.125, 0.25, 0.5, 1.0]
    assert method.tier_for(macs[0.25]) == 0.25
    assert method.tier_for(macs[0.5] - 1) == 0.25
    assert method.tier_for(1e12) == 1.0
    plans = method.plans(0, ["a", "b"], {"a": macs[0.125], "b": macs[1.0]}.__getitem__)
    assert plans == {"a": 0.125, "b": 1.0}
    with pytest.raises(MethodError, match="--budget-min") as err:
        method.tier_for(macs[0.0625] - 1)
    assert "\n" not in str(err.value)


def test_tiers_option_and_model_record(setup, config):

    m = method_class("heterofl")(setup, config.changed(method_options=(("tiers", "1,0.125"),)))
    assert [p.label for p in m.points()] == ["tier 1/8", "tier 1"]
    record = m.model_record()
    assert record["hidden"] == [16, 32, 64, 128] and record["tiers"] == [0.125, 1.0]
    assert (record["classes"], record["in_channels"], record["input_size"], record["stem_stride"]) == (10, 1, 28, 1)
    for bad in ("0,1", "1,1.5", "1,1"):
        with pytest.raises(MethodError, match="tiers"):
            HeteroFL(setup, config.changed(method_options=(("tiers", bad),)))
    with pytest.raises(MethodError, match="raise --budget-min"):  # the population's poorest client cannot run tier 1/2
        HeteroFL(setup, config.changed(method_options=(("tiers", "1,0.5"),)))


# ---------------------------------------------------------------- training
def test_local_training_is_deterministic_and_leaves_the_global_model_alone(method, setup):
    glob = method.model.state_dict()
    before = {k: v.clone() for k, v in glob.items()}
    cid = setup.client_ids[2]
    images, labels = setup.client_data(cid)
    images, labels = images[:70], labels[:70]
    seed = client_seed(0, 0, cid)
    first = method.train_client(0, cid, 0.25, glob, images, labels, 0.05, seed)
    second = method.train_client(0, cid, 0.25, glob, images, labels, 0.05, seed)
    assert all(torch.equal(before[k], glob[k]) for k in glob)
    assert first.state.keys() == method.payload(0.25, glob).keys()
    assert all(torch.equal(first.state[k], second.state[k]) for k in first.state)
    assert not torch.equal(first.state["stem.weight"], glob["stem.weight"][:4])
    assert (first.samples, first.samples_seen) == (70, 70)
    assert first.train_macs == 3 * 70 * method.points()[2].macs
    assert torch.equal(
        HeteroFL(setup, method.config).model.state_dict()["stem.weight"], before["stem.weight"]
    )  # init from the seed


@pytest.mark.slow
def test_short_fashion_mnist_run_learns(method, setup, config):
    train = config.train_config()
    budgets = dict(zip(setup.client_ids, (float(b) for b in setup.population.budgets)))
    for t in range(config.training.rounds):
        cohort = sample_round_cohort(setup.client_ids, config.population.per_round, config.seed, t)
        plans = method.plans(t, cohort, budgets.__getitem__)
        updates = method.collect(
            t, cohort, plans, method.model.state_dict(), cosine_lr(train.lr, t, config.training.rounds)
        )
        method.aggregate(t, method.model.state_dict(), updates, plans)
    assert 1.0 in set(method.plans(0, setup.client_ids, budgets.__getitem__).values())  # the largest tier was trained
    calibration = setup.calibration_images()
    accs = method.evaluate(method.points(), calibration, setup.test_set.images[:500], setup.test_set.labels[:500])
    assert accs[-1] > 0.2, accs
