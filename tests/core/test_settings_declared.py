"""Each setting declared once (feast_edge.settings.nested.setting): one help for every app that takes it, with an
app's own words only where the setting means more there, its bounds, and one check of what it refuses in
combination."""

from __future__ import annotations

import pytest

from feast_edge.server.config import ServerConfig, ServerError
from feast_edge.settings.nested import APPS, Help, accepted_by, bounds_of, declared_help, flat_types, help_of, setting
from feast_edge.sim.setup import SimulationConfig, SimulationError

# Settings both configurations hold that no command builds an option from (so they declare no help).
UNSHOWN = {"recipe", "probe_variants"}


def test_a_setting_of_both_apps_has_one_help_declared_once() -> None:
    sim, server = declared_help(SimulationConfig), declared_help(ServerConfig)
    both = set(flat_types(SimulationConfig)) & set(flat_types(ServerConfig))
    assert len(both) >= 40
    for key in sorted(both - UNSHOWN):
        assert sim[key] is server[key], key  # the same declaration, not two texts that happen to agree
    assert not UNSHOWN & (set(sim) | set(server))


def test_each_app_shows_the_core_sentence_and_only_its_own_words() -> None:
    sim, server = help_of(SimulationConfig, "simulation"), help_of(ServerConfig, "server")
    timeout = declared_help(ServerConfig)["round_timeout"]
    assert sim["round_timeout"] == f"{timeout.core} {timeout.simulation}" and "virtual" in sim["round_timeout"]
    assert server["round_timeout"] == f"{timeout.core} {timeout.server}" and "wall-clock" in server["round_timeout"]
    assert sim["per_round"] == server["per_round"] == declared_help(ServerConfig)["per_round"].core  # no words
    for key, declared in declared_help(ServerConfig).items():
        assert declared.core.endswith("."), key  # one whole sentence, then an app's words
        assert not declared.simulation or declared.simulation not in server[key], key
        assert key not in sim or not declared.server or declared.server not in sim[key], key


def test_bounds_and_apps_are_part_of_the_declaration() -> None:
    assert bounds_of(ServerConfig)["per_round"] == bounds_of(SimulationConfig)["per_round"] == {"min": 1}
    assert bounds_of(ServerConfig)["chunk_size"] == {"min": 1024, "max": 16 * 1024 * 1024}
    flower = set(accepted_by(ServerConfig, "flower"))
    assert {"mode", "secure_agg", "secagg_neighbours", "dp_clip", "chunk_size", "bn_rule", "recipe"}.isdisjoint(flower)
    assert {"rounds", "per_round", "val_rule", "round_timeout", "serving_rule"} <= flower
    assert accepted_by(ServerConfig, "server") == list(flat_types(ServerConfig))
    assert Help("Core.", server="More.").text("server") == "Core. More." and Help("Core.").text("server") == "Core."
    with pytest.raises(ValueError, match="apps"):
        setting(1, apps=("mqtt",))
    assert set(APPS) == {"simulation", "server", "flower"}


def test_async_rounds_with_central_dp_are_refused_by_one_check_in_both_apps() -> None:
    private = {"mode": "async", "dp_clip": 1.0, "dp_noise": 1.0}
    with pytest.raises(SimulationError) as simulation:
        SimulationConfig.of(**private)
    with pytest.raises(ServerError) as server:
        ServerConfig.of(out="x", data="/d", **private)
    assert str(simulation.value) == str(server.value)
    assert str(server.value).startswith("--mode async with central DP weighs every buffered update alike")
    SimulationConfig.of(**private, staleness="constant")
    ServerConfig.of(out="x", data="/d", **private, staleness="constant")
    ServerConfig.of(out="x", data="/d", **private, dp_mode="local")
