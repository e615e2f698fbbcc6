"""Variant cache (method §3, §4): building, JSON round trip, validation, affordable sets."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.cache.build import build_cache, cache_jobs, cache_targets, merge_entries, read_reference_csv
from feast_edge.cache.fitness import evaluate
from feast_edge.cache.variants import (
    CacheError,
    SearchJob,
    VariantCache,
    cache_path,
    load_cache,
)
from feast_edge.errors import FeastError, PresetError
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import Preset, available_presets, load_preset, load_preset_file
from strategies import BUILTIN_PRESETS, TINY_PRESET

FAST = dict(population=16, generations=8)


@pytest.fixture(scope="module")
def fmnist():
    return load_preset("fmnist-small")


@pytest.fixture(scope="module")
def small_cache(fmnist) -> VariantCache:
    targets = [(2.0e6, 0.40), (8.0e6, 0.31), (20.0e6, 0.31), (40.0e6, 0.31)]
    return build_cache(fmnist, targets, seed=3, **FAST)


def test_paper_targets_are_the_spec_segments():
    targets = cache_targets(load_preset("paper-cifar100"))
    assert len(targets) == 56
    assert [t for t, r in targets] == sorted(t for t, r in targets)
    low = [t for t, r in targets if r == 0.40]
    main = [t for t, r in targets if r == 0.31]
    assert low == [25e6, 35e6, 45e6, 55e6, 65e6, 75e6]
    assert len(main) == 50 and main[0] == 50e6 and main[-1] == 600e6
    assert main[1] == pytest.approx(61224489.79591837)  # the paper's job_target_macs


def test_cache_settings_stay_out_of_the_digest():
    preset = load_preset("paper-cifar100")
    bare = dataclasses.replace(preset, cache_segments=(), extraction_rho=())
    assert bare.digest == preset.digest and bare != preset
    assert Preset.from_dict(json.loads(json.dumps(preset.to_dict()))) == preset


@pytest.mark.parametrize(
    "section, message",
    [
        ('segments = [{ name = "a", start = 2e6, stop = 1e6, count = 3, rho0 = 0.3 }]', r"needs 0 < start <= stop"),
        ('segments = [{ name = "a", start = 1e6, stop = 2e6, count = 0, rho0 = 0.3 }]', r"count = 0 must be >= 1"),
        ('segments = [{ name = "a", start = 1e6, stop = 2e6, count = 3 }]', r"lacks the field 'rho0'"),
        ("extraction = [{ from_macs = 5e6, rho0 = 0.3 }]", r"must start at from_macs = 0"),
    ],
)
def test_bad_cache_section_names_the_field(tmp_path, section, message):
    path = tmp_path / "bad.toml"
    path.write_text(TINY_PRESET.read_text() + "\n[cache]\n" + section + "\n")
    with pytest.raises(PresetError, match=message):
        load_preset_file(path)


def test_fmnist_targets_stay_under_40m(fmnist):
    targets = cache_targets(fmnist)
    assert 20 <= len(targets) <= 30
    assert targets[0][0] == pytest.approx(1.5e6) and targets[-1][0] <= 40e6


def test_preset_without_targets_says_how_to_fix(tiny):
    with pytest.raises(CacheError, match=r"preset test-tiny defines no cache targets; add a \[cache\] section"):
        build_cache(tiny)


def test_jobs_are_sorted_and_seeded_by_rank():
    jobs = cache_jobs([(3e6, 0.3), (1e6, 0.4), (2e6, 0.3)], seed=10)
    assert [j.target for j in jobs] == [1e6, 2e6, 3e6]
    assert [j.seed for j in jobs] == [10, 11, 12]


def test_build_is_sorted_feasible_and_reproducible(fmnist, small_cache):
    macs = [e.macs for e in small_cache]
    assert macs == sorted(macs)
    for entry in small_cache:
        assert entry.macs <= entry.target and entry.rho <= entry.jobs[0].rho0
        assert (entry.macs, entry.params) == arch_cost(fmnist, entry.arch)
        assert entry.fitness == evaluate(fmnist, entry.arch).fitness
    assert small_cache.classes == fmnist.classes
    assert small_cache.search == {
        "seed": 3,
        "population": 16,
        "generations": 8,
        "tournament": 3,
        "mutation_prob": 0.3,
        "mutation_tries": 10,
    }
    again = build_cache(fmnist, [(2.0e6, 0.40), (8.0e6, 0.31), (20.0e6, 0.31), (40.0e6, 0.31)], seed=3, **FAST)
    assert again == small_cache


def test_workers_do_not_change_the_result(fmnist, small_cache):
    targets = [(2.0e6, 0.40), (8.0e6, 0.31), (20.0e6, 0.31), (40.0e6, 0.31)]
    seen = []
    parallel = build_cache(
        fmnist, targets, seed=3, workers=2, progress=lambda done, total, r: seen.append((done, total)), **FAST
    )
    assert parallel == small_cache
    assert sorted(seen) == [(1, 4), (2, 4), (3, 4), (4, 4)]


def test_same_arch_from_two_targets_is_one_entry(fmnist):
    a, b = Arch.smallest(fmnist), Arch.largest(fmnist)
    jobs = [SearchJob(200e6, 0.31, 2), SearchJob(150e6, 0.31, 1), SearchJob(2e6, 0.4, 0)]
    entries = merge_entries(fmnist, [(jobs[0], b), (jobs[1], b), (jobs[2], a)], classes=10)
    assert [e.arch for e in entries] == [a, b]
    assert entries[1].jobs == (jobs[1], jobs[0])  # both jobs recorded, sorted by target
    assert entries[1].target == 150e6 and entries[1].seed == 1


def _synonyms(preset: Preset) -> tuple[Arch, Arch]:
    """Two encodings of one network: stem width indices 0 and 1 round to the same channel count."""
    a = Arch.smallest(preset)
    b = dataclasses.replace(a, w=(1, *a.w[1:]))
    assert a != b and arch_layout(preset, a) == arch_layout(preset, b)
    return a, b


def test_two_encodings_of_one_network_are_one_entry(fmnist):
    a, b = _synonyms(fmnist)
    low, high = SearchJob(2e6, 0.4, 0), SearchJob(3e6, 0.4, 1)
    found = [(high, a), (low, b)]
    (entry,) = merge_entries(fmnist, found, classes=10)
    assert entry.arch == b  # the encoding of the earliest job (smallest target), whatever the order found
    assert entry.jobs == (low, high)
    assert merge_entries(fmnist, found[::-1], classes=10) == (entry,)


def test_a_cache_listing_one_network_twice_loads_as_one_entry(tmp_path, fmnist):
    a, b = _synonyms(fmnist)
    low, high = SearchJob(2e6, 0.4, 0), SearchJob(3e6, 0.4, 1)
    entries = [merge_entries(fmnist, [(job, arch)], classes=10)[0] for job, arch in [(low, b), (high, a)]]
    for listed in (entries, entries[::-1]):  # a file written before such encodings were merged
        path = VariantCache(fmnist.name, fmnist.digest, 10, tuple(listed), {}).save(tmp_path / "old.json")
        (entry,) = load_cache(fmnist, path).entries
        assert entry.arch == b and entry.jobs == (low, high)


def test_reference_cache_duplicate_is_merged(reference_cache_csv):
    ref = read_reference_csv(reference_cache_csv, load_preset("paper-cifar100"))
    assert len(ref) == 55 and ref.classes == 10
    (dup,) = [e for e in ref if len(e.jobs) == 2]
    assert dup.macs == 369_570_816 and [j.seed for j in dup.jobs] == [71, 72]
    assert dup.target == dup.jobs[0].target < dup.jobs[1].target
    assert ref.smallest.macs == 24_957_968 and ref.largest.macs == 595_671_072


def test_json_round_trip(tmp_path, fmnist, small_cache):
    path = small_cache.save(tmp_path / "cache.json")
    assert load_cache(fmnist, path) == small_cache


def test_foreign_preset_is_rejected_with_the_fix(tmp_path, small_cache):
    path = small_cache.save(tmp_path / "cache.json")
    with pytest.raises(
        FeastError,
        match=r"was built for preset 'fmnist-small', not 'paper-cifar100'; load the cache of preset paper-cifar100",
    ):
        load_cache(load_preset("paper-cifar100"), path)


def _user_preset(tmp_path, fmnist, stages: str = "[24, 48, 96, 192]") -> Preset:
    """A user preset (a file of its own, as 'feast-edge preset new' writes): fmnist-small renamed 'mine'."""
    text = cache_path(fmnist).parent.parent.joinpath("presets", "fmnist-small.toml").read_text()
    text = text.replace('name = "fmnist-small"', 'name = "mine"').replace("[24, 48, 96, 192]", stages)
    path = tmp_path / "mine.toml"
    path.write_text(text)
    return load_preset_file(path)


def test_user_preset_with_another_presets_cache_is_told_to_build_its_own(tmp_path, fmnist, small_cache):
    mine = _user_preset(tmp_path, fmnist)
    small_cache.save(tmp_path / "mine.cache.json")  # beside it, but fmnist-small's
    with pytest.raises(CacheError) as error:
        load_cache(mine)
    message = str(error.value)
    assert "was built for preset 'fmnist-small', not 'mine'" in message
    assert (
        f"'feast-edge cache build --preset {tmp_path / 'mine.toml'}' (it writes {tmp_path / 'mine.cache.json'})"
        in message
    )
    assert "feast_edge/caches" not in message  # a user preset never has a shipped cache


def test_user_preset_whose_definition_changed_is_told_to_rebuild_its_cache(tmp_path, fmnist, small_cache):
    record = small_cache.to_dict()
    record["preset"] = "mine"
    (tmp_path / "mine.cache.json").write_text(json.dumps(record))
    mine = _user_preset(tmp_path, fmnist, stages="[24, 48, 96, 160]")
    with pytest.raises(
        CacheError,
        match=r"another definition of preset 'mine'.*rebuild it with 'feast-edge cache build --preset .*mine\.toml'",
    ):
        load_cache(mine)


def test_changed_preset_definition_is_rejected(tmp_path, fmnist, small_cache):
    record = small_cache.to_dict()
    record["preset_digest"] = "0" * 64
    path = tmp_path / "cache.json"
    path.write_text(json.dumps(record))
    with pytest.raises(CacheError, match=r"another definition of preset 'fmnist-small'.*rebuild it"):
        load_cache(fmnist, path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r["entries"][0].update(macs=r["entries"][0]["macs"] + 1), r"the cost model gives"),
        (lambda r: r["entries"][0].update(fitness=1.0), r"fitness terms that differ"),
        (lambda r: r["entries"].reverse(), r"not sorted by MACs"),
        (lambda r: r["entries"].append(r["entries"][-1]), r"lists an architecture twice"),
        (lambda r: r["entries"][0]["arch"].update(d=[9, 9, 9, 9]), r"does not fit preset fmnist-small"),
        (lambda r: r["entries"][0].pop("jobs"), r"entry is malformed"),
        (lambda r: r.update(version=99), r"version 99"),
        (lambda r: r.update(entries=[]), r"has no entries"),
    ],
)
def test_corrupt_cache_is_rejected(tmp_path, fmnist, small_cache, edit, message):
    record = small_cache.to_dict()
    edit(record)
    path = tmp_path / "cache.json"
    path.write_text(json.dumps(record))
    with pytest.raises(CacheError, match=message):
        load_cache(fmnist, path)


def test_missing_and_invalid_files(tmp_path, fmnist):
    with pytest.raises(CacheError, match="does not exist; pass the cache file you built"):
        load_cache(fmnist, tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CacheError, match="is not valid JSON"):
        load_cache(fmnist, tmp_path / "bad.json")


def test_affordable_queries(small_cache):
    smallest = small_cache.smallest
    assert small_cache.affordable(smallest.macs - 1) == ()
    assert small_cache.affordable(smallest.macs) == (smallest,)
    assert small_cache.affordable(float("inf")) == small_cache.entries
    assert small_cache.largest_affordable(small_cache.largest.macs + 5) == small_cache.largest
    assert small_cache.largest_affordable(small_cache.entries[1].macs) == small_cache.entries[1]
    with pytest.raises(
        CacheError, match=r"below the smallest cached variant .* of preset fmnist-small; raise the budget"
    ):
        small_cache.largest_affordable(smallest.macs - 1)


@settings(max_examples=200, deadline=None)
@given(b1=st.floats(0, 50e6), b2=st.floats(0, 50e6))
def test_affordable_sets_are_nested(small_cache, b1, b2):
    lo, hi = sorted((b1, b2))
    small, large = small_cache.affordable(lo), small_cache.affordable(hi)
    assert set(small) <= set(large)
    assert all(e.macs <= lo for e in small) and all(e.macs > lo for e in large if e not in small)


@pytest.mark.parametrize("name", BUILTIN_PRESETS)
def test_shipped_cache_loads_and_covers_its_targets(name):
    preset = load_preset(name)
    if not cache_path(preset).exists():
        pytest.fail(f"no shipped cache for preset {name}: build feast_edge/caches/{name}.json with build_cache")
    cache = load_cache(preset)
    targets = cache_targets(preset)
    jobs = sorted((j.target, j.rho0) for e in cache for j in e.jobs)
    assert jobs == sorted(targets)
    assert cache.search["population"] == 256 and cache.search["generations"] == 512
    for entry in cache:
        for job in entry.jobs:
            assert entry.macs <= job.target and entry.rho <= job.rho0


def test_shipped_paper_cache_spans_the_paper_range():
    cache = load_cache(load_preset("paper-cifar100"))
    assert 24e6 <= cache.smallest.macs <= 25e6 and 570e6 <= cache.largest.macs <= 600e6
    for entry in cache:
        assert entry.macs >= 0.95 * entry.target  # each variant within 5% of its target


def test_every_builtin_preset_has_a_cache_file(monkeypatch):
    monkeypatch.delenv("FEAST_EDGE_PRESET_PATH")  # built-ins only, not the test presets (tests/conftest.py)
    assert sorted(p.stem for p in cache_path(load_preset("paper-cifar100")).parent.glob("*.json")) == sorted(
        available_presets()
    )
