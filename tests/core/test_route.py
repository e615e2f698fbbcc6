"""Routing: envelopes reproduce the paper's Table 9, nest with budgets, and carry the right slices."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.route.envelope import Envelope, route_state, sub_supernet
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from feast_edge.util.slicing import leading_slice
from strategies import TINY_PRESET, archs

PAPER = load_preset("paper-cifar100")
TINY = load_preset(str(TINY_PRESET))


@pytest.fixture(scope="module")
def reference_archs(reference_cache_csv):
    rows = csv.DictReader(reference_cache_csv.open())
    return sorted(
        (Arch(json.loads(r["d"]), json.loads(r["e"]), json.loads(r["w_indices"])) for r in rows),
        key=lambda a: arch_cost(PAPER, a)[0],
    )


def affordable(archs_sorted, budget):
    return [a for a in archs_sorted if arch_cost(PAPER, a)[0] <= budget]


@pytest.mark.parametrize(
    "budget, params_m",
    [(25e6, 0.50), (50e6, 2.41), (229e6, 10.02), (408e6, 20.61), (596e6, 35.60)],
)
def test_table9_envelope_sizes(reference_archs, budget, params_m):
    envelope = Envelope.of(affordable(reference_archs, budget))
    assert round(envelope.params(PAPER, 100) / 1e6, 2) == params_m


def test_smallest_client_reduction(reference_archs):
    full = Envelope.of([Arch.largest(PAPER)]).params(PAPER, 100)
    assert full == 55_682_916
    smallest = Envelope.of(affordable(reference_archs, 25e6)).params(PAPER, 100)
    assert round(full / smallest) == 111


@settings(max_examples=200, deadline=None)
@given(b1=st.floats(25e6, 1.5e9), b2=st.floats(25e6, 1.5e9))
def test_nested_reachability(reference_archs, b1, b2):
    lo, hi = sorted((b1, b2))
    a_lo, a_hi = affordable(reference_archs, lo), affordable(reference_archs, hi)
    assert set(a_lo) <= set(a_hi)
    if a_lo:
        assert Envelope.of(a_hi).contains(Envelope.of(a_lo))
        assert Envelope.of(a_lo).params(PAPER) <= Envelope.of(a_hi).params(PAPER)


@settings(max_examples=25, deadline=None)
@given(st.lists(archs(TINY), min_size=1, max_size=4))
def test_sub_supernet_computes_what_the_global_supernet_computes(affordable_set):
    model = Supernet(TINY, seed=2).eval()
    local = sub_supernet(model, Envelope.of(affordable_set)).eval()
    x = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for arch in affordable_set:
            assert torch.equal(local(x, arch), model(x, arch))


def test_routed_state_is_a_copy_of_leading_slices():
    model = Supernet(TINY, seed=0)
    envelope = Envelope(stem_w=1, depths=(0, 1, 0), stage_w=(2, 0, 1))
    state = route_state(model.state_dict(), envelope.layout(TINY), TINY)
    glob = model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(tensor, leading_slice(glob[name], tensor.shape))
    assert "stages.0.1.conv1.weight" not in state  # stage 1 routes one block only
    state["stem.conv.weight"].add_(1)
    assert not torch.equal(
        state["stem.conv.weight"], leading_slice(glob["stem.conv.weight"], state["stem.conv.weight"].shape)
    )


def test_empty_affordable_set_is_an_error():
    with pytest.raises(ValueError, match="can afford no cached variant"):
        Envelope.of([])


def test_communication_report(reference_archs):
    from feast_edge.route.envelope import communication_report

    archs = [(arch_cost(PAPER, a)[0], a) for a in reference_archs]
    report = communication_report(PAPER, archs, [25e6, 50e6, 596e6, 1500e6], 100)
    assert report.full_params == 55_682_916
    assert [round(p / 1e6, 2) for p in report.payloads] == [0.50, 2.41, 35.60, 35.60]
    assert report.mean_payload == pytest.approx(sum(report.payloads) / 4)
    assert report.aggregate_reduction == pytest.approx(55_682_916 / report.mean_payload)
    assert max(report.reductions) == pytest.approx(55_682_916 / 499_644)
    assert report.median_reduction == pytest.approx((55_682_916 / 2_408_044 + 55_682_916 / 35_602_596) / 2)


def test_routing_cli_prints_table9(cli, reference_cache_csv):

    result = cli.invoke(
        "routing",
        "-p",
        "paper-cifar100",
        "--reference-csv",
        str(reference_cache_csv),
        "--budgets",
        "25M,50M,229M,408M,596M",
    )
    assert result.returncode == 0, result.stderr
    for figure in ("0.50M", "2.41M", "10.02M", "20.61M", "35.60M", "55.68M params", "aggregate reduction"):
        assert figure in result.stdout
