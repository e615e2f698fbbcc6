"""Settings nested by concern (feast_edge.settings): one declaration per setting, the flat form runs stored before
nesting, and fingerprints that did not move."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from feast_edge.server.config import ServerConfig, ServerError
from feast_edge.settings import Aggregation, Privacy, Training, Validation, flat, flat_types
from feast_edge.settings.nested import concern_fields
from feast_edge.sim.setup import SimulationConfig, SimulationError

# SimulationConfig.fingerprint() of these settings, computed by the code before settings were nested (commit ab578d1):
# a run directory written then resumes only while its fingerprint is the same.
FINGERPRINTS = {
    (): "5da016212a91ec9b3cf438d16bd688b455afdffc9e1ffca4ef3a179fea20fa0f",
    (("dp_clip", 1.0), ("dp_noise", 0.5), ("dp_seed", 7)): (
        "52b517b1db7c1e3c410328849c82145e2d1a4bb7ca06a18236627a8da57d5aea"
    ),
    (("dp_clip", 1.0), ("dp_noise", 0.5), ("dp_clip_quantile", 0.5)): (
        "e65be3eb4ba8e27103e6e2955223b21182592282b5e8f59ac55564fd6e9a31d7"
    ),
    (
        ("aggregation", "trimmed-mean"),
        ("trim", 0.2),
    ): "38e48869a023781aaa0ca28f3d382d22c67de051f9f94a111d4e51cb2a43c106",
    (("server_opt", "adam"), ("server_lr", 0.01)): "21eea16c393ca86d7bae31d5e2052c0165c44900b060b20dede60fea5a088fb3",
    (("holdout", 0.1), ("personalize", "auto")): "54cb41e8fea4a91dd1156ea6b28e1c01b23165b96dc355e9892c657072404ab3",
    (
        ("lr", 0.1),
        ("batch_size", 16),
        ("epochs", 2),
        ("augment", "none"),
        ("lr_schedule", "constant"),
        ("recipe", (("mixup_alpha", 0.2),)),
    ): "fa5467b32e7b005828b7dae0ff2d77041dcc7a0f85018b1f118a658dd830544a",
}


@pytest.mark.parametrize("settings", list(FINGERPRINTS), ids=lambda s: ",".join(k for k, _ in s) or "defaults")
def test_a_simulation_keeps_the_fingerprint_it_had_before_settings_were_nested(settings: tuple) -> None:
    assert SimulationConfig.of(**dict(settings)).fingerprint() == FINGERPRINTS[settings]


def test_a_server_keeps_its_stored_settings() -> None:
    # What feast-server run stores (its fingerprint's source), key by key as before nesting.
    config = ServerConfig.of(out="x", per_round=3, min_clients=3, rounds=4, variants="min", lr=0.1)
    decisive = config.decisive()
    assert {k: decisive[k] for k in ("rounds", "per_round", "min_clients", "method", "lr", "federation")} == {
        "rounds": 4,
        "per_round": 3,
        "min_clients": 3,
        "method": "min",
        "lr": 0.1,
        "federation": "feast",
    }
    # a deployment's own defaults: self-reported counts capped at 8 medians; plain averaging records no optimizer
    assert decisive["max_weight_ratio"] == 8.0 and "server_optimizer" not in decisive


@pytest.mark.parametrize("config", [SimulationConfig.of(), ServerConfig.of(out="x")], ids=["simulation", "server"])
def test_every_key_is_declared_once_and_the_flat_form_round_trips(config) -> None:
    keys = Counter(key for key in flat_types(type(config)))
    assert max(keys.values()) == 1
    values = flat(config)
    assert set(values) == set(keys)
    assert type(config).of(**values) == config


def test_the_two_apps_share_the_concerns_not_copies_of_their_fields() -> None:
    sim, server = concern_fields(SimulationConfig), concern_fields(ServerConfig)
    for name, shared in (("training", Training), ("privacy", Privacy)):
        assert sim[name] is server[name] is shared
    assert issubclass(sim["aggregation"], Aggregation) and issubclass(server["aggregation"], Aggregation)
    assert issubclass(sim["validation"], Validation) and issubclass(server["validation"], Validation)
    plain = {f.name for f in dataclasses.fields(SimulationConfig)} - set(sim)
    plain_server = {f.name for f in dataclasses.fields(ServerConfig)} - set(server)
    assert plain & plain_server == {"preset", "seed", "cache"}


def test_settings_are_read_by_concern_and_changed_by_key() -> None:
    config = SimulationConfig.of(per_round=3, clients=5, dp_clip=1.0, dp_noise=0.5, aggregation="mean", epochs=2)
    assert (config.population.per_round, config.privacy.dp_clip, config.training.epochs) == (3, 1.0, 2)
    changed = config.changed(rounds=7, seed=4)
    assert (changed.training.rounds, changed.seed, changed.population.per_round) == (7, 4, 3)
    assert config.training.rounds == 30  # frozen: the original is untouched


def test_a_bad_setting_is_refused_with_the_app_error_naming_its_option() -> None:
    with pytest.raises(SimulationError, match="--per-round 9 must be between 1 and --clients"):
        SimulationConfig.of(per_round=9, clients=4)
    with pytest.raises(SimulationError, match="--dp-clip"):
        SimulationConfig.of(dp_noise=1.0)
    with pytest.raises(ServerError, match="--per-round 1 must be at least --min-clients 2"):
        ServerConfig.of(out="x", per_round=1)
    with pytest.raises(ServerError, match="--round-timeout"):
        ServerConfig.of(out="x").changed(round_timeout=0)
    with pytest.raises(TypeError, match="no setting clients"):
        ServerConfig.of(out="x", clients=3)  # a simulation's setting, not a server's
