"""FIARSE baseline (method §9): global top-k masks, the threshold-controlled biased gradient, sparse-Δ aggregation, a real run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feast_edge.local.recipe import cosine_lr
from feast_edge.run.cohort import client_seed, sample_round_cohort
from feast_edge.sim.methods import MethodError, method_class
from feast_edge.sim.methods.fiarse import (
    DELTA,
    MASK,
    Fiarse,
    ThresholdMask,
    apply_sparse_deltas,
    hard_mask,
    kept_count,
    masks,
    model_size,
    threshold,
)
from feast_edge.sim.setup import SimulationConfig, build_setup
from feast_edge.space.cost import count_macs
from feast_edge.space.geometry import supernet_layout

# ----------------------------------------------------------------------------- size, threshold, mask


def test_model_size_is_the_clipped_budget_fraction():
    assert model_size(25e6, 100_000_000) == 0.25
    assert model_size(1e3, 100_000_000) == 1 / 256
    assert model_size(3e8, 100_000_000) == 1.0


def test_threshold_and_mask_are_a_global_top_k_across_tensors():
    a = torch.tensor([[0.5, -0.45], [0.3, 0.05]])
    b = torch.tensor([-0.04, 0.2, 0.01])
    # |θ| over both: .5 .45 .3 .2 .05 .04 .01; k = ⌊0.5·7⌋ = 3 -> τ = 0.3, all three kept weights in a
    tau = threshold([a, b], 0.5)
    assert float(tau) == pytest.approx(0.3)
    m = masks({"a": a, "b": b}, tau)
    assert m["a"].tolist() == [[True, True], [True, False]]
    assert m["b"].tolist() == [False, False, False]  # a per-tensor top-50 % would keep 0.2 here
    # k = ⌊(4/7)·7⌋ = 4 (not 3 from 7·(4/7) = 3.9999...): τ = 0.2 and b's 0.2 joins
    assert float(threshold([a, b], 4 / 7)) == pytest.approx(0.2)
    assert float(threshold([a, b], 1.0)) == pytest.approx(0.01)  # size 1 keeps everything
    assert float(threshold([a, b], 1e-9)) == pytest.approx(0.5)  # at least one weight is kept
    assert kept_count(7, 0.5) == 3 and kept_count(7, 4 / 7) == 4 and kept_count(7, 1e-9) == 1


# ----------------------------------------------------------------------------- threshold-controlled biased gradient

W = [0.6, -0.3, 0.2, -0.9]
UPSTREAM = [1.0, 2.0, 3.0, -1.0]
TAU = 0.3


def _grad(fn) -> torch.Tensor:
    w = torch.tensor(W, dtype=torch.float64, requires_grad=True)
    out = fn(w, torch.tensor(TAU, dtype=torch.float64))
    (out * torch.tensor(UPSTREAM, dtype=torch.float64)).sum().backward()
    return out.detach(), w.grad


def test_threshold_mask_forward_and_biased_gradient_by_hand():
    out, grad = _grad(ThresholdMask.apply)
    assert out.tolist() == pytest.approx([0.6, -0.3, 0.0, -0.9])
    # g·m·(1 + 2τ|θ|/(|θ|+τ)²): 0.6 -> 1 + 0.36/0.81 = 13/9; -0.3 (at τ) -> 1.5; 0.2 masked -> 0; -0.9 -> 1 + 0.54/1.44 = 1.375
    assert grad.tolist() == pytest.approx([13 / 9 * 1.0, 1.5 * 2.0, 0.0, 1.375 * -1.0])


class _FloatBern(torch.autograd.Function):
    """The original's Bern(|θ|, τ) (fiarse/model/model_utils.py), returning a float mask so its backward runs."""

    @staticmethod
    def forward(ctx, scores, tau):
        ctx.save_for_backward(scores, tau)
        return (scores >= tau).to(scores.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        scores, tau = ctx.saved_tensors
        grad = torch.nan_to_num(2 * tau / (scores + tau) ** 2, nan=0.0, posinf=0.0, neginf=0.0)
        return grad_output * grad * (scores >= tau), None


def test_threshold_mask_gradient_equals_the_originals_product_rule():
    _, ours = _grad(ThresholdMask.apply)
    _, original = _grad(lambda w, tau: w * _FloatBern.apply(w.abs(), tau))
    assert torch.allclose(ours, original)


def test_masked_gradient_option_is_the_plain_masked_gradient():
    _, grad = _grad(hard_mask)
    assert grad.tolist() == [1.0, 2.0, 0.0, -1.0]


# ----------------------------------------------------------------------------- sparse-Δ aggregation


def _global_state() -> dict[str, torch.Tensor]:
    return {
        "conv.weight": torch.full((2, 3), 10.0),
        "fc.bias": torch.zeros(1),
        "bn.running_mean": torch.zeros(1),
        "bn.num_batches_tracked": torch.tensor(7),
    }


def _two_clients() -> list[tuple[dict[str, torch.Tensor], int]]:
    a = {  # n = 1
        DELTA + "conv.weight": torch.tensor([[1.0, 2.0, 5.0], [0.0, 0.0, 0.0]]),
        MASK + "conv.weight": torch.tensor([[True, True, True], [False, False, False]]),
        DELTA + "fc.bias": torch.tensor([1.0]),
        "bn.running_mean": torch.tensor([2.0]),
        "bn.num_batches_tracked": torch.tensor(9),
    }
    b = {  # n = 3; its Δ at (0, 2) is 0 although the position is in its mask
        DELTA + "conv.weight": torch.tensor([[0.0, 4.0, 0.0], [8.0, 0.0, 0.0]]),
        MASK + "conv.weight": torch.tensor([[False, True, True], [True, False, False]]),
        DELTA + "fc.bias": torch.tensor([-1.0]),
        "bn.running_mean": torch.tensor([6.0]),
        "bn.num_batches_tracked": torch.tensor(8),
    }
    return [(a, 1), (b, 3)]


def test_sparse_delta_aggregation_by_hand():
    state = _global_state()
    apply_sparse_deltas(state, _two_clients())
    # (0,0) a only: 1·1/1 = 1; (0,1) both: (1·2 + 3·4)/4 = 3.5; (0,2) both: (1·5 + 3·0)/4 = 1.25
    # (1,0) b only: 3·8/3 = 8; (1,1), (1,2) in no mask: unchanged
    assert state["conv.weight"].tolist() == [[9.0, 6.5, 8.75], [2.0, 10.0, 10.0]]
    assert state["fc.bias"].tolist() == [0.5]  # unmasked: avg Δ = (1 − 3)/4 = −0.5
    assert state["bn.running_mean"].tolist() == [5.0]  # (1·2 + 3·6)/4
    assert int(state["bn.num_batches_tracked"]) == 9  # maximum


def test_server_learning_rate_scales_the_averaged_delta():
    state = _global_state()
    apply_sparse_deltas(state, _two_clients(), server_lr=0.5)
    assert state["conv.weight"].tolist() == [[9.5, 8.25, 9.375], [6.0, 10.0, 10.0]]
    assert state["fc.bias"].tolist() == [0.25]
    assert state["bn.running_mean"].tolist() == [5.0]  # buffers are averaged, not stepped


# ----------------------------------------------------------------------------- options


def test_registered_and_options_validated():
    assert method_class("fiarse") is Fiarse and Fiarse.supernet
    opts = Fiarse.parse_options({"sizes": "1,0.25"})
    assert opts == {"sizes": (1.0, 0.25), "server_lr": 1.0, "gradient": "tcb"}
    for bad in ({"sizes": "0,1"}, {"sizes": "1.5"}, {"server_lr": "0"}, {"gradient": "sign"}, {"size": "1"}):
        with pytest.raises(MethodError):
            Fiarse.parse_options(bad)


# ----------------------------------------------------------------------------- the method on Fashion-MNIST

BUDGETS = (2e6, 10e6, 25e6, 50e6, 100e6, 100e6)


@pytest.fixture(scope="module")
def config(fashion_mnist_dir) -> SimulationConfig:
    # Plain SGD at the original's batch size (20) and a lr between the paper's 0.1 and the recipe's 0.025, no
    # augmentation and a near-IID split: three short rounds of a dense model must show that it learns.
    return SimulationConfig.of(
        data_dir=str(fashion_mnist_dir), method="fiarse", clients=6, per_round=3, rounds=3, train_limit=1200, val_samples=500, calib_samples=200,
        test_limit=500, budgets=BUDGETS, gamma=0.0, alpha_eff=10.0, lr=0.05, batch_size=20, augment=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def setup(config):
    return build_setup(config)


def test_points_are_nominal_sizes_of_the_dense_model(setup, config):
    method = Fiarse(setup, config)
    full = count_macs(supernet_layout(setup.preset))
    assert method.full_macs == full
    points = method.points()
    # smallest size 2M/full = 0.020 -> powers of two down to 1/64
    assert [p.label for p in points] == [
        "size 0.015625",
        "size 0.03125",
        "size 0.0625",
        "size 0.125",
        "size 0.25",
        "size 0.5",
        "size 1",
    ]
    assert [p.macs for p in points] == [int(p.detail["size"] * full) for p in points]
    assert all(p.dense_macs == full for p in points)
    bn_and_bias = sum(p.numel() for p in method.model.parameters() if p.dim() == 1)
    assert points[-1].params == sum(p.numel() for p in method.model.parameters())
    assert points[2].params == method.weight_count // 16 + bn_and_bias
    assert points[method.served(30e6)].label == "size 0.25"  # 0.5·full ≈ 49.8M > 30M
    assert points[method.served(2e6)].label == "size 0.015625"


def test_sizes_must_serve_the_smallest_budget(setup, config):
    assert [p.label for p in Fiarse(setup, config.changed(method_options=(("sizes", "0.02,1"),))).points()] == [
        "size 0.02",
        "size 1",
    ]
    with pytest.raises(MethodError, match="smallest client budget"):
        Fiarse(setup, config.changed(method_options=(("sizes", "0.25,1"),)))  # 0.25·full ≈ 24.9M > 2M


def test_client_trains_only_its_global_top_k_mask(setup, config):
    method = Fiarse(setup, config)
    global_state = method.model.state_dict()
    before = {k: v.clone() for k, v in global_state.items()}
    images, labels = setup.client_data("client-001")
    # size 0.25: at initialisation every size up to 1/16 masks the whole classifier (its init scale is below the convs')
    update = method.train_client(
        0, "client-001", 0.25, global_state, images[:40], labels[:40], 0.05, client_seed(0, 0, "client-001")
    )
    assert all(torch.equal(before[k], v) for k, v in global_state.items())
    # τ from an independent sort of every conv/linear |θ|
    weights = [before[n] for n in method.masked]
    k = kept_count(method.weight_count, 0.25)
    tau = torch.cat([w.abs().flatten() for w in weights]).sort(descending=True).values[k - 1]
    kept = 0
    for name in method.masked:
        mask, delta = update.state[MASK + name], update.state[DELTA + name]
        assert torch.equal(mask, before[name].abs() >= tau)
        assert not delta[~mask].any()
        kept += int(mask.sum())
    assert kept == k
    assert any(update.state[DELTA + n].any() for n in method.masked)
    assert all(
        MASK + n not in update.state and DELTA + n in update.state
        for n, p in method.model.named_parameters()
        if p.dim() == 1
    )
    assert update.samples == 40 and update.samples_seen == 40 and update.train_macs == 3 * 40 * method.full_macs
    assert np.isfinite(update.loss)


@pytest.mark.slow
def test_short_fashion_mnist_run_learns(setup, config):
    method = Fiarse(setup, config)
    budgets = dict(zip(setup.client_ids, BUDGETS))
    for t in range(config.training.rounds):
        cohort = sample_round_cohort(setup.client_ids, config.population.per_round, config.seed, t)
        plans = method.plans(t, cohort, budgets.__getitem__)
        lr = cosine_lr(config.training.lr, t, config.training.rounds)
        updates = [
            method.train_client(
                t,
                cid,
                plans[cid],
                method.model.state_dict(),
                *setup.client_data(cid),
                lr,
                client_seed(config.seed, t, cid),
            )
            for cid in cohort
        ]
        assert all(np.isfinite(u.loss) for u in updates)
        method.aggregate(t, method.model.state_dict(), updates, plans)
    calibration = setup.calibration_images()
    largest = method.points()[-1]
    [acc] = method.evaluate(
        [largest], calibration, setup.test_set.images[: config.test_limit], setup.test_set.labels[: config.test_limit]
    )
    assert acc > 0.2, f"{largest.label}: test accuracy {acc:.3f} after {config.training.rounds} rounds"
