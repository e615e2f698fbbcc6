"""float16 payloads end to end (issue 12): the server announces the dtype, agents train in float32 and answer in it,
and the MQTT federation still computes exactly what the simulator computes with the same --payload-dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from feast_edge.run.loop import CHECKPOINT
from feast_edge.sim.shards import read_index

# A float16 simulation and federation (real agent processes, the broker at 127.0.0.1:1883).
pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def half(kit) -> object:
    return kit.CONFIG.changed(payload_dtype="float16")


def test_a_float16_federation_equals_the_float16_simulation_and_halves_the_bytes(
    kit, half, partition: Path, tmp_path: Path
) -> None:
    simulated = kit.simulated_weights(half, tmp_path / "sim16")
    float32 = kit.simulated_weights(kit.CONFIG, tmp_path / "sim32")
    fed = kit.new_federation()
    out = tmp_path / "federation"
    server = kit.ServerThread(kit.server_config(half, out, partition, fed, payload_dtype="float16")).start()
    agents = []
    try:
        for entry in read_index(partition)["clients"]:
            agents.append(kit.spawn_agent(out / "logs", entry["client_id"], partition / entry["file"], fed))
        history = server.join(timeout=300)
    finally:
        codes = [kit.stop(p) for p in agents]
        server.close()
        kit.clear_retained(fed)
    assert all(code == 0 for code in codes), codes
    got = kit.weights(out / CHECKPOINT)
    assert all(torch.equal(got[k], simulated[k]) for k in got), f"differs by {kit.max_abs_diff(got, simulated)}"
    assert all(
        v.dtype == torch.float32 for v in got.values() if v.is_floating_point()
    )  # the global model stays float32
    assert kit.max_abs_diff(got, float32) > 0  # the payloads really were rounded
    for h in history:
        assert h.updated == h.cohort and not h.rejected
        assert h.routed_bytes == 2 * h.routed_params and h.full_bytes == 4 * h.full_params
