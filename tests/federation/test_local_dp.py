"""Local DP on the device (feast_edge.privacy.local): what leaves a ``feast-agent`` under ``--dp-mode local`` or its
own ``--dp-clip/--dp-noise``, the round message's ``dp`` field as an attacker may send it, the device's ledger, and
the server's update bound for noised updates."""

from __future__ import annotations

import json
import math
import random
import re
import time

import pytest
import torch

from feast_edge.agent.step import Assignment, Job, Trained, train, train_state
from feast_edge.cache.variants import load_cache
from feast_edge.local.recipe import TrainConfig
from feast_edge.privacy.accountant import local_epsilon
from feast_edge.privacy.local import (
    DeviceLedger,
    LocalDp,
    check_device_dp,
    noised_norm_bound,
    parameter_names,
    privatize,
    stricter,
)
from feast_edge.privacy.private_rounds import PrivateRounds
from feast_edge.privacy.settings import DpSettings, PrivacyError
from feast_edge.protocol import RoundStart, Update
from feast_edge.route.envelope import route_state
from feast_edge.route.payload import decode, encode
from feast_edge.route.plans import plan_client
from feast_edge.server.collect import update_of
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet
from feast_edge.transport.errors import ProtocolError
from feast_edge.transport.frames import describe
from feast_edge.transport.messages import parse

PRESET = load_preset("fmnist-small")
DP = LocalDp(0.5, 0.8, seed=9)


def _round(dp: LocalDp | None) -> tuple[RoundStart, bytes, dict[str, torch.Tensor]]:
    plan = plan_client(load_cache(PRESET), 6e6)
    glob = Supernet(PRESET, seed=1).state_dict()
    routed = route_state(glob, plan.layout(PRESET, PRESET.classes), PRESET)
    blob = encode(routed, plan.manifest(PRESET, PRESET.classes, 0, "routed", "dev"))
    start = RoundStart.from_plan(
        plan, federation="lab", round=0, device="dev", instance="agent1", sent_at=time.time(), timeout=30.0,
        transfer=describe(blob, federation="lab", round=0, device="dev"), rounds=2, lr=0.05, seed=7,
        train=TrainConfig(batch_size=8), dp=dp,
    )  # fmt: skip
    return start, blob, glob


def _client():
    from feast_edge.agent.local_data import LocalClient

    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (16, 1, 28, 28), generator=generator, dtype=torch.uint8)
    labels = torch.randint(0, PRESET.classes, (16,), generator=generator)
    return LocalClient("dev", images, labels, None, None, None, "memory")


def test_the_device_sends_what_the_simulation_computes_for_it_and_nothing_of_the_raw_update(one_thread) -> None:
    start, blob, glob = _round(DP)
    assert parse(start.encode()).local_dp() == DP  # the settings survive the wire, the seed as text
    job = Job.of(Assignment.parse(start, PRESET), blob, _client(), PRESET, "cpu", "off", start.local_dp())
    sent = train(job)
    assert isinstance(sent, Trained)
    raw = train_state(job)
    _, state = decode(sent.payload, PRESET)
    # The simulation's local DP on the same update (the keys shuffled: the noise follows names, not dict order).
    shuffled = list(raw.state.items())
    random.Random(0).shuffle(shuffled)
    rounds = PrivateRounds(DpSettings(0.5, 0.8, seed=9, mode="local"), parameter_names(PRESET))
    [simulated] = rounds.privatize(glob, [("dev", dict(shuffled))], 0, {})
    assert all(torch.equal(state[k], simulated[k]) for k in state)
    params = parameter_names(PRESET)
    for name, x in state.items():  # BN statistics go back to the routed values; every parameter is noised
        if name in params:
            assert not torch.equal(x, raw.state[name])
        else:
            assert torch.equal(x, job.routed[name])


def test_clipping_happens_before_the_noise_and_the_noise_has_std_z_c() -> None:
    routed = {"w": torch.zeros(400_000), "bn.running_mean": torch.zeros(3)}
    trained = {"w": torch.full((400_000,), 1.0), "bn.running_mean": torch.ones(3)}  # norm 632: clipped to 0.5
    out = privatize(routed, trained, {"w"}, LocalDp(0.5, 2.0, seed=1), "dev", 0)
    assert out["w"].mean().item() == pytest.approx(0.5 / math.sqrt(400_000), abs=4 * 1.0 / math.sqrt(400_000))
    assert out["w"].std().item() == pytest.approx(2.0 * 0.5, rel=0.01)
    assert torch.equal(out["bn.running_mean"], routed["bn.running_mean"])
    # Unseeded noise (every real run) differs every time.
    again = privatize(routed, trained, {"w"}, LocalDp(0.5, 2.0), "dev", 0)
    assert not torch.equal(again["w"], privatize(routed, trained, {"w"}, LocalDp(0.5, 2.0), "dev", 0)["w"])


def test_the_device_applies_the_stricter_of_what_it_requires_and_what_the_server_asks() -> None:
    asked, required = LocalDp(1.0, 1.0, seed=4), LocalDp(0.5, 3.0)
    both = stricter(asked, required)
    assert both.clip == 0.5 and both.noise * both.clip == pytest.approx(1.5) and both.seed == 4
    assert stricter(asked, None) == asked and stricter(None, required) == required and stricter(None, None) is None
    loose = stricter(LocalDp(1.0, 1.0), LocalDp(2.0, 0.1))  # the device asks for less: the server's settings hold
    assert loose.clip == 1.0 and loose.noise == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("dp", "fragment"),
    [
        ({"mode": "central", "clip": 1, "noise": 1}, "field 'dp' must be local DP settings"),
        ({"mode": "local", "clip": 1, "noise": 1, "steal": True}, "field 'dp' must be local DP settings"),
        ({"mode": "local", "clip": -1, "noise": 1}, "field 'dp.clip' must be a positive finite number"),
        ({"mode": "local", "clip": 1, "noise": 0}, "field 'dp.noise' must be a positive finite number"),
        ({"mode": "local", "clip": 1, "noise": True}, "field 'dp.noise'"),
        ({"mode": "local", "clip": 1e400, "noise": 1}, "JSON constant Infinity is not allowed"),
        ({"mode": "local", "clip": 1, "noise": "1"}, "field 'dp.noise'"),
        ({"mode": "local", "clip": 1, "noise": 1, "seed": 5}, "field 'dp.seed' must be a decimal integer"),
        ({"mode": "local", "clip": 1, "noise": 1, "seed": "1" * 40}, "field 'dp.seed'"),
    ],
)
def test_a_forged_dp_field_is_refused_at_the_wire(dp: dict, fragment: str) -> None:
    start, _, _ = _round(None)
    wire = json.loads(start.encode())
    wire["dp"] = dp
    with pytest.raises(ProtocolError, match=re.escape(fragment)):
        parse(json.dumps(wire).encode())


def test_the_ledger_keeps_every_noised_update_per_device_across_runs(tmp_path) -> None:
    path = tmp_path / "state" / "ledger.json"
    ledger = DeviceLedger(path)
    assert ledger.record("cam-1", "lab", 1.0) == pytest.approx(local_epsilon([1.0], 1e-5))
    ledger.record("cam-1", "lab", 2.0)
    ledger.record("cam-2", "lab", 1.0)
    again = DeviceLedger(path)  # a restarted agent
    assert again.record("cam-1", "other", 1.0) == pytest.approx(local_epsilon([1.0, 2.0, 1.0], 1e-5))
    assert again.updates("cam-1") == 3 and again.updates("cam-2") == 1 and again.updates("cam-3") == 0
    assert again.epsilon("cam-2") < again.epsilon("cam-1")
    path.write_text("{not json")
    with pytest.raises(PrivacyError, match="is not a privacy ledger"):
        DeviceLedger(path)


@pytest.mark.parametrize(
    ("clip", "noise", "delta", "fragment"),
    [
        (1.0, None, 1e-5, "needs both --dp-clip C and --dp-noise z"),
        (None, 1.0, 1e-5, "needs both"),
        (0.0, 1.0, 1e-5, "--dp-clip 0.0 must be a positive number"),
        (1.0, -1.0, 1e-5, "--dp-noise -1.0 must be a positive number"),
        (1.0, 1.0, 1.0, "--dp-delta 1 must lie in (0, 1)"),
    ],
)
def test_bad_device_dp_settings_are_refused(clip, noise, delta, fragment) -> None:
    with pytest.raises(PrivacyError, match=re.escape(fragment)):
        check_device_dp(clip, noise, delta)


def test_feast_agent_run_refuses_half_a_dp_setting_in_one_line_before_reading_data(agent_cli, tmp_path) -> None:
    result = agent_cli.invoke(
        "run",
        "--insecure",
        "--broker",
        "mqtt://127.0.0.1:9",
        "--device-id",
        "cam-1",
        "--data",
        str(tmp_path / "none"),
        "--dp-clip",
        "1",
    )
    agent_cli.assert_user_error(result, "needs both --dp-clip C and --dp-noise z")
    assert result.returncode == 2


def test_the_server_takes_an_honest_noised_update_and_refuses_a_larger_one() -> None:
    dp = LocalDp(1.0, 1.0, seed=2)
    glob = {"w": torch.zeros(50_000), "bn.running_mean": torch.zeros(4)}
    honest = privatize(glob, {"w": torch.ones(50_000), "bn.running_mean": torch.ones(4)}, {"w"}, dp, "d", 0)
    assert math.sqrt(50_000) < noised_norm_bound(dp, 50_004) < 1.1 * math.sqrt(50_000)
    transfer = describe(b"update", federation="lab", round=0, device="d").to_dict()
    update = Update(federation="lab", round=0, device="d", transfer=transfer, routed="r", samples=10)
    accepted = update_of("d", honest, update, glob, 10.0, self_reported=False, local_dp=dp)
    assert not isinstance(accepted, str)
    refused = update_of("d", honest, update, glob, 10.0, self_reported=False)  # without local DP: far too large
    assert isinstance(refused, str) and "--max-update-norm 10" in refused
    poisoned = {"w": honest["w"] * 3, "bn.running_mean": honest["bn.running_mean"]}
    assert isinstance(update_of("d", poisoned, update, glob, 10.0, self_reported=False, local_dp=dp), str)


def test_a_board_without_dp_accounting_still_keeps_the_ledger_and_says_it_cannot_count(tmp_path, monkeypatch) -> None:
    import feast_edge.privacy.local as local

    monkeypatch.setattr(local, "accountant_available", lambda: False)
    ledger = DeviceLedger(tmp_path / "ledger.json")
    assert ledger.record("cam-1", "lab", 1.0) is None and ledger.updates("cam-1") == 1
    assert json.loads((tmp_path / "ledger.json").read_text()) == {"cam-1": {"lab": [1.0]}}
