"""Sparse sample-weighted aggregation (method §6)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.aggregate.sparse import PayloadError, SparseAccumulator, aggregate, check_payload
from feast_edge.errors import FeastError
from feast_edge.space.geometry import envelope_layout
from feast_edge.space.supernet import Supernet
from feast_edge.util.slicing import leading_index


def _perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        if t.is_floating_point():
            out[name] = t + torch.randn(t.shape, generator=g)
        else:
            out[name] = t + seed + 1
    return out


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def test_full_routing_equals_fedavg(global_state):
    clients = [(_perturbed(global_state, i), n) for i, n in enumerate([50, 120, 7])]
    new = aggregate(global_state, clients)
    total = sum(n for _, n in clients)
    for name, g in global_state.items():
        if g.is_floating_point():
            fedavg = sum(s[name].double() * n for s, n in clients) / total
            torch.testing.assert_close(new[name], fedavg.to(g.dtype), rtol=0, atol=1e-6)
        else:
            assert torch.equal(new[name], torch.stack([s[name] for s, _ in clients]).amax(0))


def test_unrouted_positions_keep_their_values_exactly():
    g = {"w": torch.randn(6, 5, 3, 3), "b": torch.randn(6), "untouched": torch.randn(4)}
    clients = [({"w": torch.randn(2, 3, 3, 3), "b": torch.randn(2)}, 10), ({"w": torch.randn(4, 2, 3, 3)}, 5)]
    new = aggregate(g, clients)
    routed = torch.zeros(6, 5, 3, 3, dtype=torch.bool)
    routed[:2, :3] = True
    routed[:4, :2] = True
    assert torch.equal(new["w"][~routed], g["w"][~routed])
    assert torch.equal(new["b"][2:], g["b"][2:])
    assert torch.equal(new["untouched"], g["untouched"])
    assert new["untouched"] is not g["untouched"]


def test_weights_are_sample_counts():
    g = {"w": torch.zeros(3)}
    new = aggregate(g, [({"w": torch.zeros(3)}, 1), ({"w": torch.ones(3)}, 3)])
    torch.testing.assert_close(new["w"], torch.full((3,), 0.75))


def test_numpy_sample_counts_are_accepted():
    sizes = np.array([1, 3])  # shard sizes as a Partition reports them
    new = aggregate({"w": torch.zeros(2)}, [({"w": torch.zeros(2)}, sizes[0]), ({"w": torch.ones(2)}, sizes[1])])
    torch.testing.assert_close(new["w"], torch.full((2,), 0.75))


def test_routed_but_unchanged_position_still_enters_the_average():
    g = {"w": torch.full((4,), 2.0)}
    unchanged = {"w": g["w"].clone()}  # routed, never activated: comes back as sent
    trained = {"w": torch.full((4,), 4.0)}
    new = aggregate(g, [(unchanged, 5), (trained, 5)])
    torch.testing.assert_close(new["w"], torch.full((4,), 3.0))


def test_single_client_gets_its_slice_back_and_nothing_else_moves(preset, global_state):
    layout = envelope_layout(preset, preset.classes, 2, (0, 1, 0, 1), (3, 2, 4, 1))
    local = _perturbed(Supernet(preset, layout=layout, seed=1).state_dict(), 3)
    assert set(local) < set(global_state)  # a routed envelope drops trailing blocks
    new = aggregate(global_state, [(local, 17)])
    for name, g in global_state.items():
        if name not in local:
            assert torch.equal(new[name], g)
            continue
        idx = leading_index(local[name].shape)
        assert (
            torch.allclose(new[name][idx], local[name])
            if g.is_floating_point()
            else torch.equal(new[name][idx], local[name])
        )
        outside = torch.ones(g.shape, dtype=torch.bool)
        outside[idx] = False
        assert torch.equal(new[name][outside], g[outside])


def test_integer_buffers_take_the_maximum_and_keep_global_when_unsent():
    g = {"bn.num_batches_tracked": torch.tensor(10), "other.num_batches_tracked": torch.tensor(4)}
    new = aggregate(
        g, [({"bn.num_batches_tracked": torch.tensor(13)}, 100), ({"bn.num_batches_tracked": torch.tensor(11)}, 1)]
    )
    assert new["bn.num_batches_tracked"].item() == 13
    assert new["other.num_batches_tracked"].item() == 4
    assert new["bn.num_batches_tracked"].dtype == torch.int64


def test_bn_running_stats_are_sample_weighted_over_routed_channels():
    g = {"bn.running_var": torch.ones(4)}
    new = aggregate(g, [({"bn.running_var": torch.full((2,), 3.0)}, 1), ({"bn.running_var": torch.full((4,), 5.0)}, 1)])
    torch.testing.assert_close(new["bn.running_var"], torch.tensor([4.0, 4.0, 5.0, 5.0]))


def test_count_accumulator_is_per_position():
    acc = SparseAccumulator({"w": torch.zeros(4, 3, 3, 3)})
    acc.add({"w": torch.zeros(2, 3, 3, 3)}, 5)
    acc.add({"w": torch.zeros(4, 1, 3, 3)}, 2)
    expected = torch.zeros(4, 3, 3, 3, dtype=torch.float64)
    expected[:2] += 5
    expected[:, :1] += 2
    assert torch.equal(acc.count("w"), expected)
    assert acc.clients == 2 and acc.total_samples == 7


@pytest.mark.parametrize(
    "payload",
    [
        {"w": torch.zeros(5, 2)},  # wider than global
        {"w": torch.zeros(4)},  # wrong rank
        {"nope": torch.zeros(1)},  # unknown name
        {"w": torch.zeros(2, 2, dtype=torch.int64)},  # integer payload for a float tensor
    ],
)
def test_rejects_payloads_that_are_not_leading_slices(payload):
    g = {"w": torch.randn(4, 3), "b": torch.randn(4)}
    before = _clone(g)
    clean, rejected = SparseAccumulator(g), SparseAccumulator(g)
    for acc in (clean, rejected):
        acc.add({"b": torch.ones(2)}, 3)
    with pytest.raises(PayloadError) as err:
        rejected.add({"b": torch.full((4,), 9.0), **payload}, 3)  # its valid part must not be accumulated either
    assert isinstance(err.value, ValueError) and isinstance(err.value, FeastError)
    assert all(torch.equal(g[k], before[k]) for k in g)
    assert rejected.clients == 1
    after, reference = rejected.result(), clean.result()
    assert all(torch.equal(after[k], reference[k]) for k in g)
    with pytest.raises(PayloadError):
        aggregate(g, [({"b": torch.ones(4)}, 1), (payload, 1)])
    assert all(torch.equal(g[k], before[k]) for k in g)


@pytest.mark.parametrize("n", [0, -3, float("nan"), float("inf"), True, "5"])
def test_rejects_bad_sample_counts(n):
    with pytest.raises(PayloadError, match="sample count"):
        aggregate({"w": torch.zeros(2)}, [({"w": torch.ones(2)}, n)])


def test_result_finalizes_the_accumulator():
    g = {"w": torch.zeros(3)}
    acc = SparseAccumulator(g)
    acc.add({"w": torch.ones(2)}, 1)
    first = acc.result()
    assert acc.result() is first
    assert torch.equal(g["w"], torch.zeros(3)) and first["w"] is not g["w"]
    with pytest.raises(RuntimeError, match="new one"):
        acc.add({"w": torch.ones(2)}, 1)


def test_output_keeps_the_global_dtype():
    g = {"h": torch.zeros(4, dtype=torch.float16), "d": torch.zeros(4, dtype=torch.float64)}
    new = aggregate(g, [({"h": torch.ones(2, dtype=torch.float16), "d": torch.ones(2, dtype=torch.float64)}, 2)])
    assert new["h"].dtype == torch.float16 and new["d"].dtype == torch.float64
    assert new["h"].tolist() == [1, 1, 0, 0] and new["d"].tolist() == [1, 1, 0, 0]


def test_check_payload_names_the_tensor():
    with pytest.raises(PayloadError, match="'stem.conv.weight'.*leading slice"):
        check_payload({"stem.conv.weight": torch.zeros(8, 3, 3, 3)}, {"stem.conv.weight": torch.zeros(8, 3, 5, 5)})


def test_float32_default_matches_float64(global_state):
    clients = [(_perturbed(global_state, i), n) for i, n in enumerate([3, 30])]
    a = aggregate(global_state, clients, dtype=torch.float32)
    b = aggregate(global_state, clients, dtype=torch.float64)
    for name in global_state:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the oracle: method §6 as written


def _oracle(global_np: dict[str, np.ndarray], clients: list[tuple[dict[str, np.ndarray], int]]) -> tuple[dict, dict]:
    """Method §6 written literally, position by position and client by client, in float64: (new values, Σ n_i).

    θ_{t+1}[u] = Σ_{i: u∈U_i} n_i θ'_i[u] / Σ_{i: u∈U_i} n_i where some client routed u, θ_t[u] otherwise; an integer
    buffer takes the maximum of θ'_i[u] over the clients that routed u instead.
    """
    values, counts = {}, {}
    for name, theta_t in global_np.items():
        integer = np.issubdtype(theta_t.dtype, np.integer)
        new, count = theta_t.copy() if integer else theta_t.astype(np.float64), np.zeros(theta_t.shape)
        for u in itertools.product(*(range(n) for n in theta_t.shape)):
            routed = [
                (local[name], n)
                for local, n in clients
                if name in local and all(i < m for i, m in zip(u, local[name].shape))  # u ∈ U_i
            ]
            count[u] = sum(n for _, n in routed)
            if not routed:
                continue  # θ_{t+1}[u] = θ_t[u]
            if integer:
                new[u] = max(theta_i[u] for theta_i, _ in routed)
            else:
                new[u] = sum(n * np.float64(theta_i[u]) for theta_i, n in routed) / count[u]
        values[name], counts[name] = new, count
    return values, counts


def _assert_matches_the_oracle(got: dict[str, torch.Tensor], global_np: dict, clients: list, tol: float) -> None:
    """Averages within ``tol`` of the oracle, integer buffers equal to it, unrouted positions bit-identical to θ_t."""
    expected, counts = _oracle(global_np, clients)
    for name, theta_t in global_np.items():
        new = got[name].numpy()
        assert new.dtype == theta_t.dtype, name
        unrouted = counts[name] == 0
        assert new[unrouted].tobytes() == theta_t[unrouted].tobytes(), name
        if np.issubdtype(theta_t.dtype, np.integer):
            np.testing.assert_array_equal(new, expected[name])
        else:
            np.testing.assert_allclose(new, expected[name], rtol=tol, atol=tol)


def _array(draw, shape: tuple[int, ...], integer: bool, dtype: type = np.float64) -> np.ndarray:
    """A drawn tensor: integers (a counter buffer) or floats that float32 holds exactly."""
    size = int(np.prod(shape))
    elements = st.integers(-1000, 1000) if integer else st.floats(-10, 10, width=32)
    return np.asarray(draw(st.lists(elements, min_size=size, max_size=size)), np.int64 if integer else dtype).reshape(
        shape
    )


def _global(draw, dtype: type) -> dict[str, np.ndarray]:
    """Up to three small tensors of rank 0 to 3, some of them integer buffers."""
    shapes = draw(st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=3), min_size=1, max_size=3))
    return {f"t{i}": _array(draw, tuple(s), draw(st.booleans()), dtype) for i, s in enumerate(shapes)}


@st.composite
def _cohort(draw, dtype: type = np.float64):
    """A cohort whose payloads are arbitrary leading boxes of any of the tensors: boxes that stick out of each other."""
    global_np = _global(draw, dtype)
    clients = []
    for _ in range(draw(st.integers(1, 4))):
        local = {}
        for name, g in global_np.items():
            if draw(st.booleans()):
                shape = tuple(draw(st.integers(1, n)) for n in g.shape)
                local[name] = _array(draw, shape, g.dtype == np.int64, dtype)
        clients.append((local, draw(st.integers(1, 1000))))
    return global_np, clients


@st.composite
def _nested_cohort(draw, dtype: type = np.float64):
    """A cohort whose boxes are nested, as FEAST envelopes are (method §5), arriving in any order."""
    global_np = _global(draw, dtype)
    boxes = {name: [tuple(g.shape)] for name, g in global_np.items()}
    m = draw(st.integers(1, 5))
    for name in global_np:
        for _ in range(m - 1):  # each client's box inside the previous (larger-budget) one
            boxes[name].append(tuple(draw(st.integers(1, b)) for b in boxes[name][-1]))
    clients = []
    for i in range(m):
        local = {name: _array(draw, boxes[name][i], g.dtype == np.int64, dtype) for name, g in global_np.items()}
        clients.append((local, draw(st.integers(1, 1000))))
    return global_np, draw(st.permutations(clients))


def _torch(clients: list[tuple[dict[str, np.ndarray], int]]) -> list[tuple[dict[str, torch.Tensor], int]]:
    return [({k: torch.from_numpy(v) for k, v in local.items()}, n) for local, n in clients]


@settings(max_examples=60, deadline=None)
@given(_cohort())
def test_boxes_that_stick_out_match_the_oracle(cohort):
    global_np, clients = cohort
    torch_global, torch_clients = {k: torch.from_numpy(v) for k, v in global_np.items()}, _torch(clients)
    streamed = SparseAccumulator(torch_global, dtype=torch.float64)
    for local, n in torch_clients:
        streamed.add(local, n)
    _, counts = _oracle(global_np, clients)
    for name in global_np:
        np.testing.assert_array_equal(streamed.count(name).numpy(), counts[name])
    for got in (aggregate(torch_global, torch_clients, dtype=torch.float64), streamed.result()):
        _assert_matches_the_oracle(got, global_np, clients, tol=1e-12)
    assert all(torch.equal(torch_global[k], torch.from_numpy(v)) for k, v in global_np.items())
    _check_inplace_matches(torch_global, torch_clients)


@settings(max_examples=60, deadline=None)
@given(_nested_cohort())
def test_nested_envelopes_in_any_arrival_order_match_the_oracle(cohort):
    global_np, clients = cohort
    torch_global, torch_clients = {k: torch.from_numpy(v) for k, v in global_np.items()}, _torch(clients)
    streamed = SparseAccumulator(torch_global, dtype=torch.float64)  # arrival order: may switch paths mid-way
    for local, n in torch_clients:
        streamed.add(local, n)
    _, counts = _oracle(global_np, clients)
    for name in global_np:
        np.testing.assert_array_equal(streamed.count(name).numpy(), counts[name])
    for got in (aggregate(torch_global, torch_clients, dtype=torch.float64), streamed.result()):
        _assert_matches_the_oracle(got, global_np, clients, tol=1e-12)
    assert all(torch.equal(torch_global[k], torch.from_numpy(v)) for k, v in global_np.items())
    _check_inplace_matches(torch_global, torch_clients)


@settings(max_examples=60, deadline=None)
@given(st.one_of(_cohort(np.float32), _nested_cohort(np.float32)))
def test_float32_aggregate_matches_the_oracle(cohort):
    global_np, clients = cohort
    torch_global = {k: torch.from_numpy(v) for k, v in global_np.items()}
    _assert_matches_the_oracle(aggregate(torch_global, _torch(clients)), global_np, clients, tol=1e-4)
    _check_inplace_matches(torch_global, _torch(clients), dtype=torch.float32)


def _check_inplace_matches(global_state, clients, dtype=torch.float64):
    """In-place aggregation writes exactly what the allocating one returns into the global tensors themselves."""
    expected = aggregate(global_state, clients, dtype=dtype)
    target = _clone(global_state)
    got = aggregate(target, clients, dtype=dtype, inplace=True)
    for name in global_state:
        assert got[name] is target[name]
        assert torch.equal(got[name], expected[name]), name


def test_float32_result_does_not_depend_on_arrival_order_beyond_rounding(preset, global_state):
    clients = []
    for i, w in enumerate([0, 2, 5]):
        layout = envelope_layout(preset, preset.classes, w, (i % 2,) * preset.num_stages, (w,) * preset.num_stages)
        clients.append((_perturbed(Supernet(preset, layout=layout, seed=i).state_dict(), i), 10 + 7 * i))
    forward, backward = aggregate(global_state, clients), aggregate(global_state, clients[::-1])
    reference = aggregate(global_state, clients, dtype=torch.float64)
    for name in global_state:
        torch.testing.assert_close(forward[name], backward[name], rtol=0, atol=0)  # aggregate orders payloads itself
        torch.testing.assert_close(forward[name], reference[name], rtol=1e-5, atol=1e-5)
    acc = SparseAccumulator(global_state)  # smallest first: the explicit sums-and-counts path
    for state, n in clients:
        acc.add(state, n)
    for name, t in acc.result().items():
        torch.testing.assert_close(t, reference[name], rtol=1e-5, atol=1e-5)
    streamed = SparseAccumulator(global_state)  # largest first, payload by payload: the same arithmetic as aggregate
    for state, n in clients[::-1]:
        streamed.add(state, n)
    for name, t in streamed.result().items():
        assert torch.equal(t, forward[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inplace_on_a_model_state_dict(preset, global_state, dtype):
    clients = []
    for i, w in enumerate([9, 4, 1]):
        layout = envelope_layout(preset, preset.classes, w, (2 - i,) * preset.num_stages, (w,) * preset.num_stages)
        clients.append((_perturbed(Supernet(preset, layout=layout, seed=i).state_dict(), i), 5 + i))
    clients.append(({"stem.conv.weight": torch.ones(3, 1, 3, 3)}, 2))  # leaves the nested chain of one tensor
    model = Supernet(preset, seed=0)
    _check_inplace_matches(model.state_dict(), clients, dtype)
    expected = aggregate(global_state, clients, dtype=dtype)
    aggregate(model.state_dict(), clients, dtype=dtype, inplace=True)  # the federation loop's call
    for name, t in model.state_dict().items():
        assert torch.equal(t, expected[name]), name


def test_inplace_rejects_a_bad_payload_before_writing_anything():
    g = {"w": torch.randn(4, 3), "b": torch.randn(4)}
    before = _clone(g)
    with pytest.raises(PayloadError):
        aggregate(g, [({"w": torch.ones(4, 3), "b": torch.ones(4)}, 2), ({"w": torch.zeros(5, 3)}, 1)], inplace=True)
    assert all(torch.equal(g[k], before[k]) for k in g)
