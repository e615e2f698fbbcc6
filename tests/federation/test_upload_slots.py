"""One upload slot per device per round: a registered cohort device that floods its own topic with announcements of
fresh uploads (each correctly formed, naming the round and its routed transfer, no chunks) takes one slot, and the
other devices' updates are aggregated in that round exactly as without it (issue 21, item 1).

Real Mosquitto, a real server thread, devices driven through ``feast_edge.transport`` by the test.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from feast_edge.protocol import Update
from feast_edge.run.checkpoint import load_supernet
from feast_edge.space.preset import load_preset
from feast_edge.transport.frames import describe

pytestmark = [pytest.mark.broker]

PRESET = load_preset("fmnist-small")


def _round(kit, out: Path, federation: str, flood: int) -> tuple[list, dict[str, torch.Tensor]]:
    """One round with two honest devices and ``mallory``, who announces ``flood`` uploads (0: stays silent)."""
    from test_federation_failures import ScriptedDevice, scripted_server, shifted

    # start_clients: all three in round 1's cohort, however late mallory registers
    server = scripted_server(kit, out, federation, 1, per_round=3, min_clients=2, start_clients=3, round_timeout=8.0)
    devices = {name: ScriptedDevice(federation, name) for name in ("honest-a", "honest-b", "mallory")}
    try:
        for device in devices.values():
            assert device.register().accepted
        rounds = {name: device.next_round() for name, device in devices.items()}
        start, _, routed = rounds["mallory"]
        mallory = devices["mallory"]
        for i in range(flood):  # fresh transfer ids, every one within the size bound, never a chunk
            info = describe(uuid.uuid4().bytes, federation=federation, round=start.round, device="mallory")
            announcement = Update(
                federation=federation,
                round=start.round,
                device="mallory",
                transfer=info.to_dict(),
                routed=start.transfer["transfer"],
                samples=50,
            )
            mallory.link.publish(mallory.topics.events("mallory"), announcement.encode(), timeout=5)
        for delta, name in ((0.01, "honest-a"), (-0.02, "honest-b")):
            start, manifest, state = rounds[name]
            devices[name].send(*devices[name].update(start, shifted(state, delta), manifest))
        history = server.join(60)
    finally:
        for device in devices.values():
            device.close()
        server.close()
    model, _ = load_supernet(out / "checkpoint.safetensors", PRESET)
    return history, model.state_dict()


@pytest.mark.slow  # a federation of real agent processes (make test-fast leaves it out)
def test_a_flood_of_announcements_takes_one_slot_and_honest_updates_count_bit_identically(
    kit, tmp_path: Path, federation: str
) -> None:
    quiet_history, quiet = _round(kit, tmp_path / "quiet", federation, flood=0)
    flooded_history, flooded = _round(kit, tmp_path / "flooded", federation + "-f", flood=300)
    for history in (quiet_history, flooded_history):
        assert history[0].applied and sorted(history[0].updated) == ["honest-a", "honest-b"]
    # Every cohort device is in exactly one place: silent mallory is missing; flooding mallory's one claimed upload
    # never completed, so her update is incomplete, with that reason (her other 299 announcements were only counted).
    assert quiet_history[0].missing == ["mallory"] and quiet_history[0].incomplete == {}
    assert flooded_history[0].missing == [] and list(flooded_history[0].incomplete) == ["mallory"]
    assert flooded_history[0].rejected == {} and flooded_history[0].declined == {}
    assert "did not complete before the round's deadline" in flooded_history[0].incomplete["mallory"]
    assert len(flooded_history[0].ignored) <= 101
    assert quiet.keys() == flooded.keys() and all(torch.equal(quiet[k], flooded[k]) for k in quiet)
