"""The last round's two candidates over the real broker: a server without data sends its own weights and the tail mean
in one validation request, real agents test both on the same held-out examples, and the server serves the one their
figures favour, saying both steps; an agent that does not list the ``evaluate-candidates`` feature (an older agent)
is sent the round's own weights only, still validates, and the server says so.

Agents run in this process (threads) on the local Mosquitto, so that what they report can be steered: each agent's
``answer_evaluation`` reports every held-out example of the favoured candidate right (the weights they test, the
messages and the transfers are the real ones). One agent registers without the feature list, as an agent from before
it does.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from slowagents import agents_running

from feast_edge.agent import on_device, registration
from feast_edge.agent.agent import Agent, AgentConfig
from feast_edge.agent.local_data import load_clients
from feast_edge.protocol import Evaluated, Register
from feast_edge.run.loop import BEST, CHECKPOINT, PREVIOUS
from feast_edge.sim.shards import read_shard
from feast_edge.transport.broker import LinkConfig

pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.timeout(600)]

NAMES = ("client-000", "client-001", "client-002")
OLD = "client-002"  # registers without a feature list, as an agent from before protocol features


def _steered(monkeypatch: pytest.MonkeyPatch, favoured: str) -> list[str]:
    """Every agent reports the favoured candidate all right where it tests two; ``OLD`` registers without features.
    Returns the devices that were sent two candidates."""
    answer_evaluation, paired = on_device.answer_evaluation, []

    def answer(message, payload, data, preset, torch_device="cpu", candidates=()):
        got = answer_evaluation(message, payload, data, preset, torch_device, candidates)
        if not candidates:
            return got
        paired.append(data.device_id)
        counts, other = got.counts(), got.candidate_counts()[0]
        perfect = [(n, n) for _, n in counts]
        counts, other = (counts, perfect) if favoured == "mean" else (perfect, other)
        return Evaluated.of(message, counts, got.calibrated_on, [other])

    class Older(Register):
        @classmethod
        def for_client(cls, **fields):
            message = Register.for_client(**fields)
            return dataclasses.replace(message, features=()) if message.device == OLD else message

    monkeypatch.setattr(on_device, "answer_evaluation", answer)
    monkeypatch.setattr(registration, "Register", Older)
    return paired


@pytest.mark.parametrize("favoured", ["mean", "own"])
def test_agents_test_both_candidates_in_one_request_and_the_server_serves_the_one_their_figures_favour(
    kit,
    tmp_path: Path,
    partition: Path,
    federation: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    favoured: str,
) -> None:
    caplog.set_level(logging.INFO, logger="feast_edge")
    paired = _steered(monkeypatch, favoured)
    config = kit.server_config(
        kit.CONFIG, tmp_path / "run", partition, federation, data=None, rounds=3, per_round=3, min_clients=3,
        start_clients=3, eval_every=3, serve_average=2, round_timeout=120,
    )  # fmt: skip
    agents = [
        Agent(
            AgentConfig(
                host=name,
                federation=federation,
                preset=kit.CONFIG.preset,
                threads=1,
                amp="off",
                budget_macs=read_shard(partition / f"{name}.safetensors").budget_macs,
            ),
            LinkConfig(broker=kit.LOCAL),
            load_clients(partition / f"{name}.safetensors", name, holdout=0.2),
        )
        for name in NAMES
    ]
    server = kit.ServerThread(config, export=True).start()
    try:
        with agents_running(agents):
            history = server.join(400)
    finally:
        server.close()
    last = history[-1]
    candidates = last.candidates
    # One request each: the two feature-listing agents tested both, the older one the round's own weights only.
    assert sorted(paired) == sorted(set(NAMES) - {OLD})
    assert candidates["of"] == [2, 3] and candidates["voters"] == sorted(set(NAMES) - {OLD})
    assert sorted(candidates["own"]["validation"]["served"]) == sorted(NAMES)
    assert sorted(candidates["mean"]["validation"]["served"]) == sorted(set(NAMES) - {OLD})
    assert candidates["mean"]["validation"]["missing"] == [OLD]
    own, mean = (candidates[c]["validation"]["served"] for c in ("own", "mean"))
    assert all(own[d][0] == mean[d][0] and own[d][2] == mean[d][2] for d in mean)  # same variant, same examples
    assert f"round 3: {OLD} validate(s) only the round's own weights" in caplog.text
    assert "do not implement evaluate-candidates (an older feast-agent" in caplog.text
    # The favoured candidate is offered and served; best.safetensors holds its weights.
    assert candidates["choice"] == favoured and server.server.loop.best["round"] == 3
    words = "the mean of rounds 2-3's weights" if favoured == "mean" else "round 3's own weights"
    assert candidates["reason"].startswith(f"{words}: own ") and "paired over 2 device(s)" in candidates["reason"]
    assert "1 device(s) tested only the round's own weights" in candidates["reason"]
    out = tmp_path / "run"
    best, final, before = (kit.weights(out / name) for name in (BEST, CHECKPOINT, PREVIOUS))
    for name, tensor in best.items():
        if tensor.is_floating_point():
            expected = (before[name] + final[name]) / 2 if favoured == "mean" else final[name]
            assert torch.allclose(tensor, expected, atol=1e-6), name
    for manifest in server.manifests:
        served = manifest["served_round"]
        assert served["round"] == 3 and served["reason"].startswith(f"{words}: own ")
        assert served.get("average_of") == ([2, 3] if favoured == "mean" else None)
    assert f"round 3: serving {words}: own " in caplog.text
