"""A provisioned-or-not device that registers a million examples and returns all zeros cannot erase the slice it was
routed: feast-server run caps its self-reported weight at --max-weight-ratio × the round's lower-median count by
default, and the aggregate is exactly the capped weighted mean (issue 21, item 3). With the cap off it is erased.

Real Mosquitto, a real server thread, three devices driven through ``feast_edge.transport`` by the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from feast_edge.aggregate.robust import aggregate_updates
from feast_edge.aggregate.weights import DEFAULT_WEIGHT_RATIO
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet

pytestmark = [pytest.mark.broker]

PRESET = load_preset("fmnist-small")
HONEST = {"honest-a": 0.01, "honest-b": -0.02}


def _attacked_round(kit, out: Path, federation: str, **options: float) -> tuple[object, dict, dict]:
    from test_federation_failures import ScriptedDevice, scripted_server, shifted

    server = scripted_server(
        kit, out, federation, 1, per_round=3, min_clients=2, start_clients=3, round_timeout=30.0, **options
    )
    devices = {name: ScriptedDevice(federation, name) for name in [*HONEST, "mallory"]}
    sent = {}
    try:
        for name, device in devices.items():
            assert device.register(samples=1_000_000 if name == "mallory" else 23).accepted
        for name, device in devices.items():
            start, manifest, state = device.next_round()
            if name == "mallory":
                sent[name] = {k: torch.zeros_like(v) if v.is_floating_point() else v for k, v in state.items()}
                device.send(*device.update(start, sent[name], manifest, samples=1_000_000))
            else:
                sent[name] = shifted(state, HONEST[name])
                device.send(*device.update(start, sent[name], manifest, samples=23))
        history = server.join(60)
    finally:
        for device in devices.values():
            device.close()
        server.close()
    return history[0], sent, kit.weights(out / "checkpoint.safetensors")


def test_a_million_claimed_examples_weigh_as_a_few_median_devices_and_cannot_erase_the_slice(
    kit, tmp_path: Path, federation: str
) -> None:
    initial = Supernet(PRESET, seed=0).state_dict()
    record, sent, capped = _attacked_round(kit, tmp_path / "capped", federation)
    cap = int(DEFAULT_WEIGHT_RATIO * 23)
    assert record.applied and record.capped == {"mallory": [1_000_000, cap]} and record.samples == 23 + 23 + cap
    weights = {"honest-a": 23, "honest-b": 23, "mallory": cap}
    expected = aggregate_updates(initial, [(d, s, weights[d]) for d, s in sent.items()])
    assert all(torch.equal(capped[k], expected[k]) for k in expected)

    record, sent, uncapped = _attacked_round(kit, tmp_path / "open", federation + "-o", max_weight_ratio=0.0)
    assert record.applied and record.capped == {}

    def change(state: dict) -> float:
        """Relative L2 change of the slice all three were routed (1.0: erased)."""
        keys = [k for k in sent["mallory"] if sent["mallory"][k].is_floating_point() and sent["mallory"][k].numel()]
        moved = sum(
            (
                state[k][tuple(slice(0, n) for n in sent["mallory"][k].shape)].double()
                - initial[k][tuple(slice(0, n) for n in sent["mallory"][k].shape)].double()
            )
            .pow(2)
            .sum()
            for k in keys
        )
        size = sum(initial[k][tuple(slice(0, n) for n in sent["mallory"][k].shape)].double().pow(2).sum() for k in keys)
        return float((moved / size).sqrt())

    # Mallory's share: r·23 / (r·23 + 46) with the cap (8: 184 / 230), 1e6 / (1e6 + 46) without: the slice moves that
    # share of the way to zero (the honest shifts aside), or all of it.
    share = cap / (cap + 46)
    assert change(uncapped) > 0.99 and change(capped) < share + 0.05
