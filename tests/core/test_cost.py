"""Cost model: method §2 test vectors, the published cache as oracle, and a hook counter cross-check."""

from __future__ import annotations

import csv
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost, cost_breakdown, count_params
from feast_edge.space.counting import measure_macs, measure_params
from feast_edge.space.geometry import arch_layout, make_divisible, supernet_layout
from feast_edge.space.preset import load_preset
from feast_edge.space.static import StaticResNet
from strategies import all_presets, archs

PAPER = load_preset("paper-cifar100")


@pytest.mark.parametrize(
    "d, e, w, classes, macs, params",
    [
        ([3, 7, 6, 7], [0.18, 0.18, 0.1, 0.1], [2, 0, 0, 0, 0], 10, 24_957_968, 327_522),
        ([8, 8, 8, 8], [0.18, 0.1, 0.1, 0.1], [9, 4, 6, 7, 6], 10, 595_671_072, 11_782_122),
        ([8, 8, 8, 8], [0.25] * 4, [9] * 5, 100, 2_677_837_824, 55_682_916),
    ],
)
def test_spec_test_vectors(d, e, w, classes, macs, params):
    assert arch_cost(PAPER, Arch(d, e, w), classes) == (macs, params)


def test_full_supernet_params():
    assert count_params(supernet_layout(PAPER)) == 55_682_916


def test_reference_cache_all_rows(reference_cache_csv):
    rows = list(csv.DictReader(reference_cache_csv.open()))
    assert len(rows) == 56
    for row in rows:
        arch = Arch(json.loads(row["d"]), json.loads(row["e"]), json.loads(row["w_indices"]))
        assert arch_cost(PAPER, arch, 10) == (int(row["macs"]), int(row["params"])), row


def test_make_divisible_spec_rule():
    assert make_divisible(19.2) == 24  # 16 < 0.9 * 19.2, so one more step
    assert make_divisible(12.8) == 16
    assert make_divisible(2.88) == 8  # floor of one divisor
    assert make_divisible(64.0) == 64


def test_breakdown_sums_to_total():
    layout = arch_layout(PAPER, Arch((3, 7, 6, 7), (0.18, 0.18, 0.1, 0.1), (2, 0, 0, 0, 0)), 10)
    parts = cost_breakdown(layout)
    assert [p.part for p in parts] == ["stem", "stage 1", "stage 2", "stage 3", "stage 4", "classifier"]
    assert sum(p.macs for p in parts) == 24_957_968


@pytest.mark.parametrize("preset", all_presets(), ids=lambda p: p.name)
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_hook_counter_agrees_with_analytic_model(preset, data):
    arch = data.draw(archs(preset))
    classes = data.draw(st.sampled_from([preset.classes, 10, 3]))
    layout = arch_layout(preset, arch, classes)
    model = StaticResNet(layout)
    shape = (preset.in_channels, preset.input_size, preset.input_size)
    assert measure_macs(model, shape) == sum(p.macs for p in cost_breakdown(layout))
    assert measure_params(model) == count_params(layout)
