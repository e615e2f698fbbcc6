"""One secure-sums wrapper (feast_edge.run.sums.Summed) whose transport the environment gives: the simulation's masks
in process, the server's over MQTT. The server's transport opens a round's stages (the events route their messages to
it only while the round is open) and says "no DP clip" as None, as the simulation's does."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from feast_edge.local.recipe import TrainConfig
from feast_edge.privacy.settings import DpSettings
from feast_edge.protocol import SecAggKeys
from feast_edge.protocol.secure import SecureBlock
from feast_edge.route.envelope import Envelope
from feast_edge.route.plans import ClientPlan
from feast_edge.run.sums import Summed
from feast_edge.secagg.collector import InProcessSecureSums
from feast_edge.server.app import FederationServer, ServerConfig
from feast_edge.server.collect import DeviceCollector, PlainUploads, RoundTerms
from feast_edge.server.config import SecureRounds
from feast_edge.server.events import Events
from feast_edge.server.secure import MaskedUploads, MqttSecureSums, mqtt_secure_sums
from feast_edge.sim.simulate import Simulation
from feast_edge.space.arch import Arch
from feast_edge.space.preset import load_preset
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.topics import Topics
from simconfigs import tiny_config

PRESET = load_preset("fmnist-small")
FEDERATION = "lab"
NAMES = ("a", "b", "c")
KEY = "11" * 32  # a well-formed public key (hex); the server only stores it


def _routed(device: str) -> str:
    return f"routed-{device}"


def _secure_round(tmp_path: Path, dp: DpSettings | None) -> tuple[Summed, Events, list[str]]:
    """A server's secure sums over a device collector whose exchange and registry are stand-ins; what it publishes."""
    topics = Topics(FEDERATION)
    registry = SimpleNamespace(get=lambda device: SimpleNamespace(samples={"a": 100, "b": 50, "c": 25}[device]))
    devices = SimpleNamespace(registry=registry, shard_samples={})
    exchange = SimpleNamespace(topics=topics, routed_of=_routed, give_up=lambda device, why: None)
    terms = RoundTerms(PRESET, TrainConfig(), seed=0, rounds=1)
    events = Events(topics, devices)  # type: ignore[arg-type]
    published: list[str] = []
    summed = mqtt_secure_sums(
        DeviceCollector(exchange, devices, terms),  # type: ignore[arg-type]
        SecureRounds(secure_agg=True, colluders=1),
        dp,
        publish=lambda topic, payload: published.append(topic),
        events=events,
        out=tmp_path,
    )
    return summed, events, published


def _open(summed: Summed) -> None:
    arch = Arch.smallest(PRESET)
    plans = {n: ClientPlan((arch,), arch, Envelope.of([arch])) for n in NAMES}
    summed.transport.open(0, NAMES, plans, {})


def _keys(device: str) -> SecAggKeys:
    return SecAggKeys(federation=FEDERATION, round=0, device=device, routed=_routed(device), c_key=KEY, s_key=KEY)


def test_the_events_route_a_secure_round_s_stage_messages_to_it_only_while_it_is_open(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="feast_edge.server.events")
    summed, events, published = _secure_round(tmp_path, None)
    collector = summed.inner
    assert isinstance(collector, DeviceCollector) and isinstance(collector.uploads, MaskedUploads)
    _open(summed)
    stages = collector.uploads.stages
    assert stages is not None and stages.stage == "keys"
    for device in NAMES:
        events.inbox.put("events", _keys(device))
    events.pump(0)
    assert set(stages.keys) == set(NAMES) and stages.stage == "shares"  # every key in: the roster went out
    assert sorted(published) == sorted(Topics(FEDERATION).ctrl(n) for n in NAMES)
    summed.transport.close()
    events.inbox.put("events", _keys("a"))
    events.pump(0)
    assert "secagg_keys from a: no secure round is in flight" in caplog.text
    _open(summed)  # the next round opens its own stages: the closed round's routing is gone
    assert collector.uploads.stages is not stages
    summed.transport.close()


def test_one_secure_round_is_routed_at_a_time(tmp_path) -> None:
    summed, events, _ = _secure_round(tmp_path, None)
    in_flight = SimpleNamespace(on_message=print, tick=lambda: None)
    with events.secure_round(in_flight), pytest.raises(RuntimeError, match="already in flight"):  # type: ignore[arg-type]
        _open(summed)


@pytest.mark.parametrize(
    ("dp", "clip", "weight"),
    [(None, None, 0.5), (DpSettings(0.5, 0.8, mode="local"), None, 0.5), (DpSettings(0.5, 0.8), 0.5, 1.0)],
    ids=["no-dp", "local-dp", "central-dp"],
)
def test_the_round_terms_say_no_clip_as_none_and_the_wire_keeps_its_zero(tmp_path, dp, clip, weight) -> None:
    summed, _, _ = _secure_round(tmp_path, dp)
    assert isinstance(summed.transport, MqttSecureSums) and summed.transport.clip == clip
    _open(summed)
    block = summed.inner.uploads.round_extra()["secure"]
    assert isinstance(block, SecureBlock) and block.clip == clip and block.weight("b") == weight
    assert block.wire()["clip"] == (clip or 0.0)  # what the first agents read: 0 is no DP
    assert SecureBlock.of_wire(block.wire()) == block
    summed.transport.close()


def test_a_plain_device_collector_decodes_plain_uploads(tmp_path) -> None:
    terms = RoundTerms(PRESET, TrainConfig(), seed=0, rounds=1)
    collector = DeviceCollector(None, SimpleNamespace(shard_samples={}), terms)  # type: ignore[arg-type]
    assert isinstance(collector.uploads, PlainUploads) and collector.uploads.round_extra() == {}


def test_the_simulation_and_the_server_build_the_same_wrapper_with_their_own_transport(
    kit, tmp_path: Path, federation: str, fashion_mnist_dir: Path
) -> None:
    secure = {"secure_agg": True, "colluders": 1, "per_round": 3, "clients": 3}
    simulated = Simulation(tiny_config(fashion_mnist_dir, rounds=1, **secure), tmp_path / "sim").collector
    config = ServerConfig.of(
        out=str(tmp_path / "server"), federation=federation, preset=kit.CONFIG.preset, rounds=1, per_round=3,
        min_clients=3, start_clients=3, secure_agg=True, colluders=1,
    )  # fmt: skip
    server = FederationServer(config, LinkConfig(broker=kit.LOCAL))
    server.start(timeout=5)
    try:
        deployed = server.collector
    finally:
        server.close()
    assert type(simulated) is type(deployed) is Summed
    assert isinstance(simulated.transport, InProcessSecureSums) and isinstance(deployed.transport, MqttSecureSums)
