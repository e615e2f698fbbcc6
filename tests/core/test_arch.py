"""Arch: parsing, canonical forms, validation errors that name field, value and range."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from feast_edge.errors import ArchError
from feast_edge.space.arch import Arch
from feast_edge.space.preset import load_preset
from strategies import archs

PAPER = load_preset("paper-cifar100")
JSON = '{"d":[3,7,6,7],"e":[0.18,0.18,0.1,0.1],"w":[2,0,0,0,0]}'


def test_parse_json_and_text_agree():
    a = Arch.parse(JSON)
    assert a == Arch((3, 7, 6, 7), (0.18, 0.18, 0.1, 0.1), (2, 0, 0, 0, 0))
    assert Arch.parse("d=[3,7,6,7] e=[0.18,0.18,0.1,0.1] w=[2,0,0,0,0]") == a
    assert Arch.parse("d=3,7,6,7 e=0.18,0.18,0.1,0.1 w=2,0,0,0,0") == a
    assert a.text == "d=[3,7,6,7] e=[0.18,0.18,0.1,0.1] w=[2,0,0,0,0]"
    assert a.to_json() == JSON


@settings(max_examples=100, deadline=None)
@given(archs(PAPER))
def test_text_and_json_round_trip(a):
    assert Arch.parse(a.text) == a
    assert Arch.parse(a.to_json()) == a
    assert a.validated(PAPER) == a
    assert hash(Arch.parse(a.text)) == hash(a)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            '{"d":[3,7,6,9],"e":[0.18,0.18,0.1,0.1],"w":[2,0,0,0,0]}',
            r"d\[3\] = 9 is out of range; preset paper-cifar100 allows 0\.\.8",
        ),
        (
            '{"d":[3,7,6,7],"e":[0.18,0.18,0.1,0.3],"w":[2,0,0,0,0]}',
            r"e\[3\] = 0\.3 is not an allowed expansion ratio; .*allows \{0\.1, 0\.14, 0\.18, 0\.22, 0\.25\}",
        ),
        (
            '{"d":[3,7,6,7],"e":[0.18,0.18,0.1,0.1],"w":[2,0,0,0,10]}',
            r"w\[4\] = 10 is out of range; .*width indices 0\.\.9",
        ),
        ('{"d":[3,7,6],"e":[0.18,0.18,0.1,0.1],"w":[2,0,0,0,0]}', r"'d' has 3 entries; preset paper-cifar100 needs 4"),
        (
            '{"d":[3,7,6,7],"e":[0.18,0.18,0.1,0.1],"w":[2,0,0,0]}',
            r"'w' has 4 entries; .* needs 5 \(stem \+ one per stage\)",
        ),
        ('{"d":[3,7,6,7],"e":[0.18,0.18,0.1,0.1]}', r"lacks the field\(s\) w"),
        ('{"d":[3,7,6,7],"e":[0.18,0.18,0.1,0.1],"w":[2,0,0,0,0],"x":1}', r"unknown field\(s\) x"),
        ('{"d":[3,7,6,7.5],"e":[0.18,0.18,0.1,0.1],"w":[2,0,0,0,0]}', r"d\[3\] = 7\.5 must be an integer"),
        ('{"d":[3,7,6,7],"e":[0.18,0.18,0.1,0.1],"w":[2,0,0,0,0]', r"not valid JSON"),
        ("d=[3,7] w=[1]", r"cannot parse arch"),
    ],
)
def test_bad_arch_names_field_value_and_range(text, message):
    with pytest.raises(ArchError, match=message):
        Arch.parse(text).validated(PAPER)


def test_validation_snaps_expansion_to_preset_values():
    a = Arch((0, 0, 0, 0), (0.1000000001, 0.14, 0.18, 0.22), (0,) * 5).validated(PAPER)
    assert a.e[0] == 0.10


def test_largest_and_smallest_are_valid(tiny):
    for p in (PAPER, tiny):
        assert Arch.largest(p).validated(p) == Arch.largest(p)
        assert Arch.smallest(p).validated(p) == Arch.smallest(p)
