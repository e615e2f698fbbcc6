"""What a device reported of its models, read for people (feast_edge.run.rundir): checked, never trusted."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.run.rundir import fleet_accuracy, model_accuracy

MANIFEST = {"device": "pi", "calibration": "device", "rounds": 3}
# Anything a device can put in a JSON message.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=400),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
PERSONAL_KEYS = ("holdout_accuracy", "personal_method", "personal_strength", "personal_accuracy", "personal_reason")
HONEST = {"personal_method": "prior", "personal_strength": 0.5, "personal_accuracy": 0.9, "personal_reason": "chose"}


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({}, optional={key: JSON for key in PERSONAL_KEYS}))
def test_any_report_reads_as_bounded_accuracies_and_one_printable_line(report: dict) -> None:
    model = model_accuracy(MANIFEST, report)
    for key in ("accuracy", "personal_accuracy"):
        assert model[key] is None or (isinstance(model[key], float) and 0 <= model[key] <= 1)
    assert model["personal_method"] in (None, "", "prior", "head", "bn", "proximal")
    note = model["personal_note"]
    assert isinstance(note, str) and note.isprintable() and len(note) <= 80
    assert model["personal_reason"] is None or model["personal_reason"].isprintable()


@pytest.mark.parametrize(
    ("lie", "field"),
    [
        ({"personal_accuracy": 7.5}, "personal_accuracy"),
        ({"personal_accuracy": -0.1}, "personal_accuracy"),
        ({"personal_accuracy": math.nan}, "personal_accuracy"),
        ({"personal_accuracy": "0.9"}, "personal_accuracy"),
        ({"personal_accuracy": True}, "personal_accuracy"),
        ({"personal_method": "m" * 5000}, "personal_method"),
        ({"personal_method": ["prior"]}, "personal_method"),
        ({"personal_strength": "strong"}, "personal_strength"),
        ({"personal_strength": 1e9}, "personal_strength"),
    ],
)
def test_one_lie_voids_the_whole_personal_report(lie: dict, field: str) -> None:
    model = model_accuracy(MANIFEST, {"holdout_accuracy": 0.8, **HONEST, **lie})
    assert model["accuracy"] == 0.8  # the served model's own accuracy is another report
    assert (model["personal_accuracy"], model["personal_method"], model["personal_strength"]) == (None, None, None)
    assert model["personal_note"] == f"invalid report ({field})"


def test_a_report_of_an_earlier_export_is_not_this_models() -> None:
    model = model_accuracy(MANIFEST, {"holdout_accuracy": 0.8, **HONEST, "model_round": 2})
    assert (model["accuracy"], model["personal_accuracy"], model["personal_note"]) == (None, None, "no report")


def test_a_server_calibrated_model_has_no_own_accuracy_to_set_a_personal_one_beside() -> None:
    manifest = {"device": "pi", "validation_accuracy": 0.6, "rounds": 3}
    model = model_accuracy(manifest, {"holdout_accuracy": 0.8, **HONEST})
    assert (model["accuracy"], model["personal_accuracy"]) == (0.6, None)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(JSON, JSON), max_size=8))
def test_the_means_are_over_the_devices_with_both_accuracies_and_the_worst_is_the_lowest_personal(
    pairs: list[tuple],
) -> None:
    models = [
        (f"d{i}", {"accuracy": served, "personal_accuracy": personal}) for i, (served, personal) in enumerate(pairs)
    ]
    fleet = fleet_accuracy(models)
    valid = [
        (m["accuracy"], m["personal_accuracy"])
        for _, m in models
        if all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1
            for v in (m["accuracy"], m["personal_accuracy"])
        )
    ]
    assert (fleet.devices, fleet.counted) == (len(models), len(valid))
    if not valid:
        assert fleet.served is fleet.personal is fleet.worst is None
        return
    assert fleet.served == pytest.approx(sum(v[0] for v in valid) / len(valid))
    assert fleet.personal == pytest.approx(sum(v[1] for v in valid) / len(valid))
    assert fleet.worst_personal == min(v[1] for v in valid) <= fleet.personal
