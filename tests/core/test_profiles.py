"""The shipped device profiles (profiles/) and profile files: loading, validation, consistency (issue 4, item 3)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from feast_edge.budget.profile import (
    PATH_ENV,
    DeviceProfile,
    ProfileError,
    available_profiles,
    budgets_from_profiles,
    builtin_dir,
    derive_budget,
    fit_latency,
    load_profile,
    profile_summary,
    save_profile,
)

PROFILES_DIR = builtin_dir()
from feast_edge.cache.variants import VariantCache, load_cache
from feast_edge.sim.setup import SimulationConfig
from feast_edge.space.preset import load_preset
from feast_edge.util.atomic import OutputPathError

# The documented devices, weakest first (profiles/README.md lists them in this order).
DOCUMENTED = ["jetson-nano", "raspberry-pi-5", "jetson-orin-nano", "laptop-cpu", "jetson-agx-orin", "desktop-gpu"]
MEASURED = ["dev-2core-x86"]
SHIPPED = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


@pytest.fixture(scope="module")
def cache() -> VariantCache:
    return load_cache(load_preset("fmnist-small"))


@pytest.fixture(autouse=True)
def only_shipped_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PATH_ENV, raising=False)


def record(**changes: Any) -> dict[str, Any]:
    """A valid profile record (the shipped jetson-nano) with ``changes`` applied; a None value deletes the key."""
    data = json.loads((PROFILES_DIR / "jetson-nano.json").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    return data


def test_the_documented_and_measured_profiles_are_shipped() -> None:
    assert SHIPPED == sorted(DOCUMENTED + MEASURED)
    assert {name: path.resolve() for name, path in available_profiles().items()} == {
        n: (PROFILES_DIR / f"{n}.json").resolve() for n in SHIPPED
    }


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_is_valid_and_consistent(name: str, cache: VariantCache) -> None:
    profile = load_profile(name)
    assert profile == load_profile(str(PROFILES_DIR / f"{name}.json"))
    assert profile.name == name and profile.preset == "fmnist-small"
    assert profile.latency_a_ms > 0 and profile.latency_b_ms_per_mmac > 0
    assert cache.smallest.macs <= profile.budget_macs <= cache.largest.macs
    assert profile.budget_macs in {e.macs for e in cache.entries}
    preset = load_preset(profile.preset)
    assert profile.budget_macs == derive_budget(
        cache,
        preset,
        profile.latency_a_ms,
        profile.latency_b_ms_per_mmac,
        profile.latency_target_ms,
        profile.memory_limit_bytes,
    )
    # Files are exactly what save_profile writes (pretty, stable key order).
    assert (PROFILES_DIR / f"{name}.json").read_text() == json.dumps(profile.to_dict(), indent=2) + "\n"


@pytest.mark.parametrize("name", DOCUMENTED)
def test_documented_profile_follows_its_figures(name: str) -> None:
    profile = load_profile(name)
    hw = profile.hardware
    assert profile.source.startswith("documented, not measured: ") and profile.measurements == ()
    assert profile.latency_b_ms_per_mmac == pytest.approx(
        2e6 / (hw["peak_fp32_gflops"] * 1e9 * hw["assumed_utilisation"]) * 1e3, rel=1e-12
    )
    assert profile.latency_a_ms == hw["assumed_overhead_ms"]
    memory = hw["cuda_memory_bytes"] if profile.device == "cuda" else hw["ram_bytes"]
    assert profile.memory_limit_bytes == int(hw["memory_fraction"] * memory)


def test_documented_budgets_are_distinct_and_ordered_weakest_first(cache: VariantCache) -> None:
    budgets = [load_profile(name).budget_macs for name in DOCUMENTED]
    assert budgets == sorted(set(budgets))
    assert budgets[-1] == cache.largest.macs  # the desktop GPU affords the whole cache


def test_documented_profiles_are_what_the_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location("documented_profiles", PROFILES_DIR / "documented.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert {p.name: p for p in module.documented_profiles()} == {name: load_profile(name) for name in DOCUMENTED}


@pytest.mark.parametrize("name", MEASURED)
def test_measured_profile_is_its_own_fit(name: str) -> None:
    profile = load_profile(name)
    assert profile.source.startswith("measured on ") and len(profile.measurements) >= 2
    a, b = fit_latency(profile.measurements)
    assert (profile.latency_a_ms, profile.latency_b_ms_per_mmac) == (
        pytest.approx(a, rel=1e-12),
        pytest.approx(b, rel=1e-12),
    )
    assert profile.hardware["cores"] >= 1 and profile.hardware["ram_bytes"] > 0


# ------------------------------------------------------------------ files
def test_save_and_load_round_trip(tmp_path: Path) -> None:
    profile = load_profile("dev-2core-x86")
    path = save_profile(profile, tmp_path / "copy.json")
    assert load_profile(str(path)) == profile
    assert DeviceProfile.from_dict(profile.to_dict()) == profile


def test_save_refuses_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(OutputPathError, match="does not exist"):
        save_profile(load_profile("jetson-nano"), tmp_path / "no" / "such.json")


def test_profile_path_env_adds_and_shadows_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = DeviceProfile.from_dict(record(name="my-board", budget_macs=4922928.0))
    save_profile(mine, tmp_path / "my-board.json")
    save_profile(DeviceProfile.from_dict(record(description="my own nano")), tmp_path / "jetson-nano.json")
    monkeypatch.setenv(PATH_ENV, str(tmp_path))
    assert load_profile("my-board") == mine
    assert load_profile("jetson-nano").description == "my own nano"
    assert set(available_profiles()) == set(SHIPPED) | {"my-board"}


def test_unknown_name_lists_the_available_profiles() -> None:
    with pytest.raises(
        ProfileError,
        match="unknown device profile 'jetson-tx2'; choose one of: desktop-gpu, dev-2core-x86, jetson-agx-orin",
    ):
        load_profile("jetson-tx2")


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(str(tmp_path / "absent.json"))


def test_bad_json_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "name": "x",\n')
    with pytest.raises(ProfileError, match=r"broken.json is not valid JSON .* at line 3"):
        load_profile(str(path))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"gpu_count": 1}, "unknown field(s) 'gpu_count'"),
        ({"budget_macs": None}, "lacks the field(s) 'budget_macs'"),
        ({"latency_b_ms_per_mmac": "fast"}, "field 'latency_b_ms_per_mmac' must be a finite number"),
        ({"latency_b_ms_per_mmac": 0.0}, "field 'latency_b_ms_per_mmac' = 0.0 must be > 0"),
        ({"latency_a_ms": -1.0}, "field 'latency_a_ms' = -1.0 must be >= 0"),
        ({"latency_target_ms": True}, "field 'latency_target_ms' must be a finite number"),
        ({"memory_limit_bytes": 2.5e9}, "field 'memory_limit_bytes' must be a positive integer"),
        ({"device": "tpu"}, "field 'device' is 'tpu', expected one of cpu, cuda"),
        ({"name": "my board"}, "field 'name' 'my board' must be letters"),
        ({"hardware": []}, "field 'hardware' must be an object"),
        ({"measurements": [[1e6]]}, "field 'measurements' entry 0 must be a [MACs, ms] pair"),
        ({"format": "something-else"}, "field 'format' is 'something-else'"),
        ({"version": 2}, "field 'version' is 2, this feast-edge reads version 1"),
        ({"precision": "fp8"}, "field 'precision' is 'fp8', expected one of fp32, int8"),
        ({"precision": 8}, "field 'precision' must be a string"),
        ({"alternatives": {"fp32": {}}}, "field 'alternatives' names 'fp32'; expected another precision than 'fp32'"),
        ({"alternatives": {"fp16": {}}}, "field 'alternatives' names 'fp16'"),
        ({"alternatives": {"int8": {"budget_macs": 1.0}}}, "field 'alternatives.int8' must be an object of"),
        (
            {"alternatives": {"int8": {"latency_a_ms": 1.0, "latency_b_ms_per_mmac": -1.0, "budget_macs": 1e6}}},
            "field 'alternatives.int8' needs latency_a_ms >= 0, latency_b_ms_per_mmac > 0",
        ),
    ],
)
def test_invalid_record_names_the_field(changes: dict[str, Any], message: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(record(**changes)))
    with pytest.raises(ProfileError) as exc:
        load_profile(str(path))
    assert message in str(exc.value) and str(path) in str(exc.value)


def test_a_profile_without_a_precision_is_a_float32_one() -> None:
    data = record()
    assert "precision" not in data  # the shipped (documented) profiles predate int8 serving
    profile = DeviceProfile.from_dict(data)
    assert profile.precision == "fp32" and profile.alternatives == {}
    assert "precision" not in profile.to_dict()  # and a float32 profile is written as before


def test_an_int8_profile_with_its_float32_alternative_round_trips(tmp_path: Path) -> None:
    fp32 = {"latency_a_ms": 0.2, "latency_b_ms_per_mmac": 0.03, "budget_macs": 6e6, "measurements": [[1e6, 0.23]]}
    data = record(precision="int8", alternatives={"fp32": fp32})
    profile = DeviceProfile.from_dict(data)
    assert profile.precision == "int8" and profile.alternatives["fp32"].budget_macs == 6e6
    assert profile.alternatives["fp32"].measurements == ((1e6, 0.23),)
    path = save_profile(profile, tmp_path / "int8.json")
    assert load_profile(str(path)) == profile and json.loads(path.read_text())["precision"] == "int8"
    summary = profile_summary(profile)  # what an agent registers with: no raw timings
    assert summary["precision"] == "int8" and "measurements" not in summary["alternatives"]["fp32"]


def test_a_record_must_be_an_object() -> None:
    with pytest.raises(ProfileError, match="is a JSON list, expected an object"):
        DeviceProfile.from_dict([1, 2])


# ------------------------------------------------------------------ a population from profiles
def test_budgets_cycle_through_the_profiles() -> None:
    nano, gpu = load_profile("jetson-nano").budget_macs, load_profile("desktop-gpu").budget_macs
    budgets = budgets_from_profiles(["jetson-nano", "desktop-gpu"], 5, load_preset("fmnist-small"))
    assert budgets == (nano, gpu, nano, gpu, nano)
    assert budgets_from_profiles(["jetson-nano", str(PROFILES_DIR / "desktop-gpu.json")], 2, "fmnist-small") == (
        nano,
        gpu,
    )


def test_profile_budgets_make_a_simulation_population() -> None:
    budgets = budgets_from_profiles(DOCUMENTED, 12, "fmnist-small")
    config = SimulationConfig.of(clients=12, per_round=3, budgets=budgets)
    assert config.population.budgets == budgets and sorted(set(budgets)) == [
        load_profile(n).budget_macs for n in DOCUMENTED
    ]


def test_budgets_refuse_a_profile_of_another_preset(tmp_path: Path) -> None:
    path = save_profile(
        DeviceProfile.from_dict(record(name="cifar-board", preset="paper-cifar100")), tmp_path / "cifar-board.json"
    )
    with pytest.raises(
        ProfileError, match="profile cifar-board was derived for preset paper-cifar100, not fmnist-small"
    ):
        budgets_from_profiles(["jetson-nano", str(path)], 4, load_preset("fmnist-small"))


def test_budgets_need_profiles_and_clients() -> None:
    with pytest.raises(ProfileError, match="at least one profile"):
        budgets_from_profiles([], 4, "fmnist-small")
    with pytest.raises(ProfileError, match="--clients 0 must be at least 1"):
        budgets_from_profiles(["jetson-nano"], 0, "fmnist-small")
