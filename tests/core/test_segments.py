"""Method §6 from per-segment sums (feast_edge.aggregate.segments), and the run loop fed sums instead of updates."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.aggregate.segments import apply_sums, plain_sums, segments_of
from feast_edge.aggregate.sparse import aggregate
from feast_edge.errors import PayloadError
from feast_edge.run.collect import ClientUpdate, Collected
from feast_edge.run.sums import ClearSums, Summed
from feast_edge.settings.validated import RunError
from feast_edge.sim.simulate import Simulation
from simconfigs import tiny_config

SHAPES = {"w": (6, 5, 3), "b": (6,), "n": ()}


def _state(seed: int, shapes=SHAPES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {name: torch.randn(shape, generator=g, dtype=torch.float64) for name, shape in shapes.items()}
    state["count"] = torch.tensor(seed, dtype=torch.long)
    return state


def _routed(global_state: dict, boxes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """A client's trained slices: the leading box of each tensor, perturbed; its integer counter moved on."""
    state = _state(seed)
    out = {name: state[name][tuple(slice(0, b) for b in box)].clone() for name, box in boxes.items()}
    out["count"] = global_state["count"] + seed
    return out


def _positions(cells) -> set[tuple[int, ...]]:
    return {u for cell in cells for u in itertools.product(*(range(a, b) for a, b in cell))}


def test_nested_boxes_make_shells_with_the_members_that_route_them() -> None:
    routed = {"small": {"w": (2, 2, 1)}, "mid": {"w": (4, 3, 2)}, "large": {"w": (6, 5, 3)}, "twin": {"w": (4, 3, 2)}}
    segments = {s.members: s.cells["w"] for s in segments_of({"w": torch.zeros(6, 5, 3)}, routed)}
    assert set(segments) == {("large",), ("large", "mid", "twin"), ("large", "mid", "small", "twin")}
    # each shell's positions: in its outer box and not in the next box inside it; together every routed position once
    assert _positions(segments[("large", "mid", "small", "twin")]) == set(
        itertools.product(range(2), range(2), range(1))
    )
    middle = set(itertools.product(range(4), range(3), range(2))) - set(itertools.product(range(2), range(2), range(1)))
    assert _positions(segments[("large", "mid", "twin")]) == middle
    assert sum(len(_positions(c)) for c in segments.values()) == 6 * 5 * 3
    assert max(len(c) for c in segments.values()) <= 3  # a shell is at most one cell per dimension


def test_boxes_that_do_not_nest_split_on_the_grid_of_their_edges() -> None:
    routed = {"wide": {"w": (2, 5)}, "tall": {"w": (4, 2)}}
    segments = {s.members: _positions(s.cells["w"]) for s in segments_of({"w": torch.zeros(4, 5)}, routed)}
    assert segments[("tall", "wide")] == set(itertools.product(range(2), range(2)))
    assert segments[("wide",)] == set(itertools.product(range(2), range(2, 5)))
    assert segments[("tall",)] == set(itertools.product(range(2, 4), range(2)))
    assert (3, 4) not in set().union(*segments.values())  # routed to nobody: no segment


box = st.tuples(st.integers(1, 6), st.integers(1, 5), st.integers(1, 3))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(box, st.integers(1, 6), st.floats(1, 500)), min_size=1, max_size=5), st.booleans())
def test_sums_released_equal_the_sparse_aggregate(clients, nest) -> None:
    global_state = _state(0)
    if nest:  # FEAST's envelopes: each box inside the one before
        boxes = sorted((b for b, _, _ in clients), key=lambda b: -b[0] * b[1] * b[2])
        clients = [(tuple(min(x, y) for x, y in zip(b, boxes[0])), b6, n) for (b, b6, n) in clients]
    updates = [
        (f"c{i}", _routed(global_state, {"w": w, "b": (b,), "n": ()}, seed=i + 1), n)
        for i, (w, b, n) in enumerate(clients)
    ]
    expected = aggregate(global_state, [(s, n) for _, s, n in updates], dtype=torch.float64)
    released = {name: t.clone() for name, t in global_state.items()}
    apply_sums(released, plain_sums(global_state, updates))
    for name in global_state:
        if torch.is_floating_point(global_state[name]):
            torch.testing.assert_close(released[name], expected[name], rtol=1e-12, atol=1e-12)
        else:
            assert torch.equal(released[name], expected[name]), name


def test_positions_no_client_routed_keep_their_bytes() -> None:
    global_state = _state(0)
    released = {name: t.clone() for name, t in global_state.items()}
    apply_sums(released, plain_sums(global_state, [("a", _routed(global_state, {"w": (2, 1, 1)}, 3), 10.0)]))
    assert torch.equal(released["w"][2:], global_state["w"][2:]) and torch.equal(released["b"], global_state["b"])


class _Fixed:
    """A collector whose every round returns ``updates`` as given (the order included)."""

    def __init__(self, updates: list[ClientUpdate]) -> None:
        self.updates = updates

    def collect(self, t, cohort, plans, global_state, lr) -> Collected:
        return Collected(list(self.updates), missing=["gone"])


class _Recorded(ClearSums):
    """Sums in the clear that record the transport calls the wrapper makes."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def open(self, t, cohort, plans, global_state) -> None:
        self.calls.append("open")

    def sums(self, t, got, global_state) -> Collected:
        self.calls.append("sums")
        return super().sums(t, got, global_state)

    def close(self) -> None:
        self.calls.append("close")


def test_a_round_summed_in_the_clear_is_the_plain_sums_of_its_updates_in_client_order_keeping_what_they_reported():
    global_state = _state(0)
    b, a = _routed(global_state, {"w": (3, 2, 1), "b": (3,)}, 1), _routed(global_state, {"w": (6, 5, 3)}, 2)
    updates = [ClientUpdate("b", b, 3, loss=0.5), ClientUpdate("a", a, 5, loss=0.25)]
    transport = _Recorded()
    got = Summed(_Fixed(updates), transport).collect(0, ["a", "b"], {}, global_state, 0.1)
    assert transport.calls == ["open", "sums", "close"]
    assert [(u.client, u.samples, u.loss, u.state) for u in got.updates] == [("a", 5, 0.25, {}), ("b", 3, 0.5, {})]
    assert got.missing == ["gone"] and got.withheld == {}
    released, expected = ({n: t.clone() for n, t in global_state.items()} for _ in range(2))
    apply_sums(released, got.sums)
    apply_sums(expected, plain_sums(global_state, [("a", a, 5), ("b", b, 3)]))  # what the sums in the clear are
    for name, tensor in expected.items():
        assert torch.equal(released[name], tensor), name


def test_a_summed_round_checks_every_payload_and_closes_its_transport_however_it_ends() -> None:
    global_state = _state(0)
    transport = _Recorded()
    wrong = ClientUpdate("a", {"w": torch.zeros(7, 1, 1, dtype=torch.float64)}, 1)  # not a leading slice of (6, 5, 3)
    with pytest.raises(PayloadError, match="not a leading slice"):
        Summed(_Fixed([wrong]), transport).collect(0, ["a"], {}, global_state, 0.1)
    assert transport.calls == ["open", "close"]


def test_a_round_fed_sums_releases_the_model_the_round_fed_updates_does(fashion_mnist_dir, tmp_path) -> None:
    # One round: the same updates, released from their sums (float64, then float32) or folded one by one (float32).
    # (Over more rounds the tiny preset's training amplifies a last-bit difference, so rounds are compared one at a
    # time.)
    config = tiny_config(fashion_mnist_dir, rounds=1, seed=5)
    plain = Simulation(config, tmp_path / "updates")
    plain.run()
    summed = Simulation(config, tmp_path / "sums")
    summed.loop.run(Summed(summed.collector, ClearSums()))  # the loop, through sums in the clear
    [ours_record], [their_record] = summed.loop.history, plain.loop.history
    assert ours_record.applied and ours_record.updated == their_record.updated == ours_record.cohort
    assert (ours_record.samples, ours_record.loss) == (their_record.samples, their_record.loss)
    ours, theirs = summed.model.state_dict(), plain.model.state_dict()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("changes", "named"),
    [({"aggregation": "median", "per_round": 3}, "--aggregation median"), ({"server_opt": "adam"}, "ServerStepStage")],
)
def test_a_release_that_needs_single_updates_refuses_sums(fashion_mnist_dir, tmp_path, changes, named) -> None:
    sim = Simulation(tiny_config(fashion_mnist_dir, rounds=1, **changes), tmp_path)
    with pytest.raises(RunError, match=named):
        sim.loop.run(Summed(sim.collector, ClearSums()))
