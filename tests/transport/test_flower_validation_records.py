"""A Flower validation request and its answer (feast_edge.flower.validation_records): they round-trip, they are told
apart from the personalization step's evaluate Message, and impossible or malformed answers are refused.

Real Flower records (flwr.app), built as an attacker would: more results than targets, totals above the held-out split
the node registered, negative or non-integer numbers, oversized lists, answers for another device, round or slice.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from flwr.app import Array, ConfigRecord, RecordDict

from feast_edge import __version__
from feast_edge.cache.variants import load_cache
from feast_edge.errors import PayloadError
from feast_edge.flower import records, validation_records
from feast_edge.personalize.select import Choice
from feast_edge.protocol import MAX_PROBES, Declined, Evaluate, Evaluated
from feast_edge.route.envelope import route_state
from feast_edge.route.plans import plan_client
from feast_edge.space.extract import extract
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from feast_edge.transport.errors import ProtocolError

PRESET = load_preset("fmnist-small")
HOLDOUT = 20  # the held-out examples the node registered


@pytest.fixture(scope="module")
def asked() -> dict:
    """A 6M-MAC device's validation request about two of its affordable variants, with its routed slice."""
    plan = plan_client(load_cache(PRESET), 6e6)
    state = route_state(Supernet(PRESET, seed=0).state_dict(), plan.layout(PRESET, PRESET.classes), PRESET)
    info = records.describe(state, federation="feast", round=4, device="client-000", kind="routed")
    archs = [plan.affordable[0], plan.affordable[-1]]
    request = Evaluate.for_plan(
        plan,
        archs,
        federation="feast",
        round=4,
        device="client-000",
        instance="100",
        transfer=info,
        timeout=30.0,
        calibration=50,
    )
    return {"plan": plan, "state": state, "archs": archs, "request": request}


def test_a_request_round_trips_with_its_routed_slice(asked: dict) -> None:
    content = validation_records.validation_content(asked["request"], asked["state"])
    assert validation_records.is_validation(content)
    assert content.config_records[records.FEAST]["feast_edge"] == __version__
    got = validation_records.read_validation(content, PRESET)
    assert got.request == asked["request"] and got.targets == asked["archs"]
    assert list(got.routed) == list(asked["state"])
    assert all(torch.equal(got.routed[k], asked["state"][k]) for k in got.routed)


def test_a_personalization_message_is_not_a_validation(asked: dict) -> None:
    arch = asked["archs"][0]
    served = records.ServedVariant(
        federation="feast",
        device="client-000",
        arch=arch,
        choice=Choice.parse("auto"),
        calibration="device",
        calibration_samples=10,
        seed=0,
        rounds=1,
    )
    content = served.content(extract(Supernet(PRESET, seed=0), arch))
    assert not validation_records.is_validation(content)
    records.ServedVariant.read(content, PRESET)  # and it still reads as the personalization step's request


def test_a_request_whose_arrays_are_not_what_it_routes_is_refused(asked: dict) -> None:
    content = validation_records.validation_content(asked["request"], asked["state"])
    content.array_records[records.ROUTED]["attacker.weight"] = Array(torch.zeros(3).numpy())
    with pytest.raises(PayloadError, match="do not match the envelope"):
        validation_records.read_validation(content, PRESET)
    bare = RecordDict({records.FEAST: content.config_records[records.FEAST]})
    with pytest.raises(ProtocolError, match='no routed slice \\(ArrayRecord "routed"\\)'):
        validation_records.read_validation(bare, PRESET)


def test_the_counts_round_trip_in_the_requests_order(asked: dict) -> None:
    got = validation_records.read_validation(
        validation_records.validation_content(asked["request"], asked["state"]), PRESET
    )
    answer = got.answer([(3, HOLDOUT), (17, HOLDOUT)], 50)
    read = validation_records.read_counts(answer, asked["request"], HOLDOUT)
    assert read.counts() == [(3, HOLDOUT), (17, HOLDOUT)] and read.candidate_counts() == []


def _with_candidate(asked: dict) -> tuple[Evaluate, dict[str, torch.Tensor]]:
    """The request with a second candidate model (another supernet's routed slice, as the tail mean would be)."""
    other = route_state(Supernet(PRESET, seed=1).state_dict(), asked["plan"].layout(PRESET, PRESET.classes), PRESET)
    info = records.describe(other, federation="feast", round=4, device="client-000", kind="routed")
    return replace(asked["request"], candidates=(info.to_dict(),)), other


def test_a_second_candidate_travels_beside_the_first_and_its_counts_come_back_paired(asked: dict) -> None:
    request, other = _with_candidate(asked)
    got = validation_records.read_validation(
        validation_records.validation_content(request, asked["state"], [other]), PRESET
    )
    assert len(got.candidates) == 1 and all(torch.equal(got.candidates[0][k], other[k]) for k in other)
    answer = got.answer([(3, HOLDOUT), (17, HOLDOUT)], 50, [[(4, HOLDOUT), (16, HOLDOUT)]])
    read = validation_records.read_counts(answer, request, HOLDOUT)
    assert read.candidate_counts() == [[(4, HOLDOUT), (16, HOLDOUT)]]
    with pytest.raises(ProtocolError, match='carries no ArrayRecord "candidate-1"'):
        validation_records.read_validation(validation_records.validation_content(request, asked["state"]), PRESET)
    swapped = validation_records.validation_content(request, asked["state"], [asked["state"]])
    with pytest.raises(PayloadError, match="do not match their transfer"):
        validation_records.read_validation(swapped, PRESET)  # the arrays are not the candidate it describes
    unpaired = got.answer([(3, HOLDOUT), (17, HOLDOUT)], 50, [[(4, HOLDOUT - 1), (16, HOLDOUT)]])
    with pytest.raises(ProtocolError, match="tested a further candidate on other examples than the first"):
        validation_records.read_counts(unpaired, request, HOLDOUT)
    with pytest.raises(ProtocolError, match="it answers for 0 further candidate"):
        validation_records.read_counts(got.answer([(3, HOLDOUT), (17, HOLDOUT)], 50), request, HOLDOUT)


def test_a_declined_answer_is_read_as_such(asked: dict) -> None:
    declined = Declined(federation="feast", round=4, device="client-000", routed="validation", reason="no holdout")
    got = validation_records.read_counts(validation_records.counts_content(declined), asked["request"], HOLDOUT)
    assert isinstance(got, Declined) and got.reason == "no holdout"


def _answer(asked: dict, **changes: object) -> RecordDict:
    """An Evaluated answer to the request as JSON, with ``changes`` to its fields (as a node could send anything)."""
    request = asked["request"]
    body = Evaluated.of(request, [(3, HOLDOUT), (17, HOLDOUT)], 50).to_dict()
    body.update(changes)
    return RecordDict({records.FEAST: ConfigRecord({"message": json.dumps(body)})})


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"results": [3, 20, 17, 20, 1, 20]}, "it answers 3 results for 2 targets"),
        ({"results": [3, 20]}, "it answers 1 results for 2 targets"),
        ({"results": [3, 21, 17, 20]}, f"it counts more examples than the {HOLDOUT} it registered as held out"),
        ({"results": [-1, 20, 17, 20]}, r"must be in \[0, 2\^53\], got -1"),
        ({"results": [3, 20, 17, -20]}, r"must be in \[0, 2\^53\], got -20"),
        ({"results": [3.5, 20, 17, 20]}, "must be an integer, got float"),
        ({"results": [True, 20, 17, 20]}, "must be an integer, got bool"),
        ({"results": ["3", 20, 17, 20]}, "must be an integer, got str"),
        ({"results": [21, 20, 17, 20]}, "correct <= total"),
        ({"results": [3, 20, 17]}, "pairs"),
        ({"results": [0, 1] * (MAX_PROBES + 1)}, f"at most {MAX_PROBES}"),
        ({"results": 3}, "must be a list of integers"),
        ({"device": "client-001"}, "its counts answer 'client-001' round 5"),
        ({"round": 3}, "its counts answer 'client-000' round 4"),
        ({"routed": "routed-0000000000000000"}, "not this request"),
    ],
    ids=[
        "more-results",
        "fewer-results",
        "above-holdout",
        "negative-correct",
        "negative-total",
        "float",
        "bool",
        "string",
        "correct-above-total",
        "odd",
        "oversized",
        "not-a-list",
        "other-device",
        "other-round",
        "other-slice",
    ],
)
def test_impossible_or_malformed_counts_are_refused(asked: dict, changes: dict, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        validation_records.read_counts(_answer(asked, **changes), asked["request"], HOLDOUT)


def test_an_oversized_or_missing_answer_is_refused(asked: dict) -> None:
    huge = _answer(asked, results=[0, 1] * 20_000)
    with pytest.raises(ProtocolError, match="exceeds the 65536-byte limit"):
        validation_records.read_counts(huge, asked["request"], HOLDOUT)
    with pytest.raises(ProtocolError, match="carries no feast-edge message"):
        validation_records.read_counts(RecordDict({}), asked["request"], HOLDOUT)
    with pytest.raises(ProtocolError, match="expected Evaluated, Declined"):
        register = RecordDict({records.FEAST: ConfigRecord({"message": json.dumps({**asked["request"].to_dict()})})})
        validation_records.read_counts(register, asked["request"], HOLDOUT)
