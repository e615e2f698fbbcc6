"""Secure aggregation over a real Mosquitto (feast-server run --secure-agg; server.secure, agent.secure_round): real
agents key, share, mask and unmask; the server's unmasked sums equal the plain sums of the inputs the devices encoded,
when devices drop after masking, and the server never holds one device's update."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from slowagents import agents_running

import feast_edge.agent.secure_round as agent_side
import feast_edge.server.secure as server_side
from feast_edge.agent.agent import Agent, AgentConfig
from feast_edge.agent.local_data import load_clients
from feast_edge.server.status import read_status
from feast_edge.sim.shards import write_partition
from feast_edge.transport.broker import LinkConfig
from simconfigs import tiny_config

pytestmark = [pytest.mark.broker]

SIX = tiny_config(clients=6, per_round=6, train_limit=360, test_limit=60, probe_variants=2, seed=5)


@pytest.fixture(scope="module")
def six(tmp_path_factory: pytest.TempPathFactory, fashion_mnist_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("six")
    write_partition(SIX, out)
    return out


def _agents(kit, partition: Path, federation: str, names: list[str]) -> list[Agent]:
    return [
        Agent(
            AgentConfig(host=n, federation=federation, preset=SIX.preset, threads=1, amp="off"),
            LinkConfig(broker=kit.LOCAL),
            load_clients(partition / f"{n}.safetensors", n),
        )
        for n in names
    ]


def test_six_agents_with_two_dropping_after_masking_release_the_survivors_exact_sums_and_never_one_update(
    kit, tmp_path: Path, six: Path, federation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [f"client-{i:03d}" for i in range(6)]
    dropping = set(names[1:3])  # 2 of 6 (33 %) mask, upload, and go away before the unmask request
    encoded: dict[str, dict[str, np.ndarray]] = {}  # what each device encoded, read from its party (test only)
    unmasked: list[dict] = []
    real_upload, real_reveal, real_sums = (
        agent_side.SecureRounds.masked_upload,
        agent_side.SecureRounds._reveal,
        server_side.unmasked_sums,
    )

    def upload(self, start, base, state, deadline, abandon):
        blob = real_upload(self, start, base, state, deadline, abandon)
        party = self._parties[start.transfer["transfer"]]
        encoded[start.device] = dict(party.device.inputs)
        return blob

    def reveal(self, party, request):
        if party.start.device in dropping:
            self.stop.set()  # the agent stops: offline, no shares
            return
        real_reveal(self, party, request)

    def sums(*args):
        unmasked.append(real_sums(*args))
        return unmasked[-1]

    monkeypatch.setattr(agent_side.SecureRounds, "masked_upload", upload)
    monkeypatch.setattr(agent_side.SecureRounds, "_reveal", reveal)
    monkeypatch.setattr(server_side, "unmasked_sums", sums)
    config = kit.server_config(
        SIX, tmp_path, six, federation, secure_agg=True, colluders=1, secagg_timeout=20, rounds=1, per_round=6,
        min_clients=4, start_clients=6, eval_every=1, round_timeout=240,
    )  # fmt: skip
    server = kit.ServerThread(config).start()
    try:
        with agents_running(_agents(kit, six, federation, names)):
            history = server.join(300)
    finally:
        server.close()
    record = history[0]
    assert record.applied and sorted(record.cohort) == names, record
    assert not record.rejected and not record.incomplete, record
    (sums,) = unmasked
    released = {s: v for s, v in sums.items() if not isinstance(v, str)}
    assert released, sums  # the segments of at least c + 2 = 3 members were unmasked
    for segment, total in released.items():
        contributors = [d for d in names if segment in encoded.get(d, {})]
        assert len(contributors) >= 3 and dropping & set(contributors) or len(contributors) >= 3
        expected = np.zeros_like(total)
        for d in contributors:
            expected += encoded[d][segment]
        assert np.array_equal(total, expected), segment  # exact: the pair masks cancel, the self-masks came off
    withheld = {s: v for s, v in sums.items() if isinstance(v, str)}
    assert all("at least 3 must" in why for why in withheld.values()), withheld
    assert len(record.withheld) == len(withheld)
    stage = read_status(tmp_path)["secure"]
    assert stage["stage"] == "done" and stage["round"] == 1, stage
    assert "4 of 6 devices revealed shares" in stage["detail"], stage
