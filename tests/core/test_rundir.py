"""What a device reported of its models, read for people (feast_edge.report.model_words): checked, never trusted."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.personalize.fleet import OwnRow, fleet_summary
from feast_edge.report.model_words import fleet_accuracy, model_accuracy
from rundirs import TUNED, TUNED_CLASSES, TUNED_WORDS

MANIFEST = {"device": "pi", "calibration": "device", "rounds": 3}
# Anything a device can put in a JSON message.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=400),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
PERSONAL_KEYS = (
    "holdout_accuracy",
    "personal_method",
    "personal_strength",
    "personal_accuracy",
    "personal_reason",
    "personal_classes",
    "personal_task_classes",
)
HONEST = {"personal_method": "prior", "personal_strength": 0.5, "personal_accuracy": 0.9, "personal_reason": "chose"}
TUNED_CLASSES_DICT = {"personal_classes": TUNED_CLASSES, "personal_task_classes": 10}


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
    tuned = model["personal_tuned"]
    assert isinstance(tuned, str) and tuned.isprintable() and len(tuned) <= 200
    assert tuned == "" or (tuned.startswith("tuned to ") and tuned.endswith("; serve the global model for the others"))


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


def test_a_personal_model_tuned_to_fewer_classes_says_which_and_to_serve_the_global_model_for_the_others() -> None:
    model = model_accuracy(MANIFEST, TUNED["jetson-shirts"])
    assert model["personal_accuracy"] == 1.0 and model["personal_note"] == "prior τ=1"
    assert (model["personal_classes"], model["personal_task_classes"]) == (TUNED_CLASSES, 10)
    assert model["personal_tuned"] == TUNED_WORDS
    # Tuned to every class: nothing to say. A device that kept the served model tuned nothing.
    every_class = {"personal_classes": [str(k) for k in range(10)], "personal_task_classes": 10}
    every = model_accuracy(MANIFEST, {"holdout_accuracy": 0.8, **HONEST, **every_class})
    assert every["personal_tuned"] == "" and len(every["personal_classes"]) == 10
    kept = model_accuracy(
        MANIFEST,
        {"holdout_accuracy": 0.8, **HONEST, "personal_method": "", "personal_strength": None, **TUNED_CLASSES_DICT},
    )
    assert (kept["personal_tuned"], kept["personal_classes"]) == ("", None)


def test_a_long_class_list_is_shortened_and_the_words_stay_one_bounded_line() -> None:
    names = [f"class-{k}-with-a-long-name" for k in range(40)]
    model = model_accuracy(
        MANIFEST, {"holdout_accuracy": 0.8, **HONEST, "personal_classes": names[:30], "personal_task_classes": 40}
    )
    words = model["personal_tuned"]
    assert words.startswith("tuned to 30 of 40 classes: class-0-with-a-l…, ") and " and 24 more; " in words
    assert words.endswith("; serve the global model for the others") and len(words) <= 200


def test_a_report_from_before_the_classes_reads_as_it_did() -> None:
    model = model_accuracy(MANIFEST, {"holdout_accuracy": 0.8, **HONEST})
    assert (model["personal_accuracy"], model["personal_note"]) == (0.9, "prior τ=0.5")
    assert (model["personal_classes"], model["personal_task_classes"], model["personal_tuned"]) == (None, None, "")


@pytest.mark.parametrize(
    "lie",
    [
        {"personal_classes": "Shirt", "personal_task_classes": 10},
        {"personal_classes": ["Shirt", "Shirt"], "personal_task_classes": 10},
        {"personal_classes": ["Shirt", 3], "personal_task_classes": 10},
        {"personal_classes": ["a/b"], "personal_task_classes": 10},
        {"personal_classes": ["x" * 101], "personal_task_classes": 10},
        {"personal_classes": [], "personal_task_classes": 10},
        {"personal_classes": ["a", "b", "c"], "personal_task_classes": 2},
        {"personal_classes": ["a"], "personal_task_classes": True},
        {"personal_classes": ["a"], "personal_task_classes": 10**6},
        {"personal_classes": ["a"]},
        {"personal_task_classes": 10},
    ],
)
def test_classes_that_do_not_add_up_void_the_whole_personal_report(lie: dict) -> None:
    model = model_accuracy(MANIFEST, {"holdout_accuracy": 0.8, **HONEST, **lie})
    assert (model["personal_accuracy"], model["personal_classes"], model["personal_tuned"]) == (None, None, "")
    assert model["personal_note"] == "invalid report (personal_classes)"


def test_a_report_of_an_earlier_export_is_not_this_models() -> None:
    model = model_accuracy(MANIFEST, {"holdout_accuracy": 0.8, **HONEST, "model_round": 2})
    assert (model["accuracy"], model["personal_accuracy"], model["personal_note"]) == (None, None, "no report")


def test_a_server_calibrated_model_has_no_own_accuracy_to_set_a_personal_one_beside() -> None:
    manifest = {"device": "pi", "validation_accuracy": 0.6, "rounds": 3}
    model = model_accuracy(manifest, {"holdout_accuracy": 0.8, **HONEST})
    assert (model["accuracy"], model["personal_accuracy"]) == (0.6, None)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(JSON, JSON), max_size=8))
def test_the_means_are_over_the_devices_with_both_accuracies_and_each_worst_is_its_column_s_lowest(
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
        assert fleet.served is fleet.personal is fleet.worst_served_device is fleet.worst_personal_device is None
        return
    assert fleet.served == pytest.approx(sum(v[0] for v in valid) / len(valid))
    assert fleet.personal == pytest.approx(sum(v[1] for v in valid) / len(valid))
    assert fleet.worst_served == min(v[0] for v in valid) <= fleet.served
    assert fleet.worst_personal == min(v[1] for v in valid) <= fleet.personal
    # Each worst is its own column's, with the device that has it.
    named = {d: (m["accuracy"], m["personal_accuracy"]) for d, m in models}
    assert named[fleet.worst_served_device][0] == fleet.worst_served
    assert named[fleet.worst_personal_device][1] == fleet.worst_personal


def test_the_worst_served_and_the_worst_personal_accuracy_each_name_their_own_device() -> None:
    fleet = fleet_accuracy(
        [
            ("jetson-nano", {"accuracy": 0.0845, "personal_accuracy": 0.95}),
            ("laptop-cpu", {"accuracy": 0.9, "personal_accuracy": 0.8844}),
        ]
    )
    assert (fleet.worst_served_device, fleet.worst_served) == ("jetson-nano", 0.0845)
    assert (fleet.worst_personal_device, fleet.worst_personal) == ("laptop-cpu", 0.8844)
    assert fleet.worst_words() == ("jetson-nano 8.45%", "laptop-cpu 88.44%")
    assert fleet.words().endswith("; worst served jetson-nano 8.45%, worst personal laptop-cpu 88.44%")


def test_a_simulations_rows_and_a_federations_reports_give_one_and_the_same_fleet_summary() -> None:
    # The same 12 devices' own held-out figures, as personalization rows (counts) and as what devices reported.
    examples = 40
    counts = [(10 + 2 * i, 12 + 2 * i) for i in range(12)]
    rows = [OwnRow(f"d{i:02d}", 1, "prior", 1.0, examples, s, p, "", 0.1) for i, (s, p) in enumerate(counts)]
    reported = [(r.client, {"accuracy": r.served_accuracy, "personal_accuracy": r.personal_accuracy}) for r in rows]
    fleet, summary = fleet_accuracy(reported), fleet_summary(rows, "auto")
    assert (summary["served_mean"], summary["personal_mean"]) == (fleet.served, fleet.personal)
    assert (summary["served_worst_decile"], summary["personal_worst_decile"]) == (10 / examples, 12 / examples)
    assert (fleet.served_worst_decile, fleet.personal_worst_decile) == (10 / examples, 12 / examples)
    assert summary["worst_served_device"] == fleet.worst_served_device == "d00"
    assert summary["worst_personal_device"] == fleet.worst_personal_device == "d00" and summary["measured"] == 12
