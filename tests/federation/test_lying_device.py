"""A provisioned device that lies (issue 35): its own bundle, TLS, every message signed with its own key, over a real
Mosquitto, beside three honest devices, against a server without data. It reports false BN statistics (10⁶, zero
variances, or means shifted by 3σ with variances x 0.25) and held-out accuracies of 100 % then 0 %. Each lie is refused or outvoted, the liar is named in the server's log (and distrusted for the served round),
and the honest devices' served models hold the honest devices' statistics (or, where no majority can tell, their own).

Agents run in this process (threads), so that one of them can be made to lie: ``answer_calibration`` and
``answer_evaluation`` are wrapped for device ``mallory`` only; everything it sends still goes through its agent, its
link and its signing key.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save
from slowagents import agents_running
from test_provision import start_provisioned

from feast_edge.agent.agent import Agent
from feast_edge.agent.config import AgentConfig
from feast_edge.agent.local_data import LocalClient
from feast_edge.cache.variants import load_cache
from feast_edge.data.images import load_fashion_mnist
from feast_edge.evaluate.bn_stats import STATISTICS_FORMAT
from feast_edge.evaluate.served_round import served_round
from feast_edge.protocol import Evaluated
from feast_edge.space.preset import load_preset
from feast_edge.transport.credentials import load_credentials
from strategies import FMNIST_TINY

pytestmark = [pytest.mark.slow, pytest.mark.broker]  # a provisioned broker, a server thread, four agents training

PRESET = load_preset(str(FMNIST_TINY))
CACHE = load_cache(PRESET)
FED = "liars"
# ann's variant is run by all four, bob's by three, cat's by cat and mallory, mallory's by mallory alone.
BUDGETS = {"ann": 2, "bob": 6, "cat": 10, "mallory": len(CACHE) - 1}


def _lie(key: str, value: torch.Tensor, kind: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Issue 35's lies about one tensor of a statistics upload: huge, zero variances, or shifted by 3σ (plausible)."""
    if kind == "huge":
        return torch.full_like(value, 1e12 if key.endswith(".var") else 1e6)
    if kind == "zero-var":
        return torch.zeros_like(value) if key.endswith(".var") else value
    if key.endswith(".var"):  # shifted
        return value * 0.25
    return value + 3 * tensors[key[: -len(".mean")] + ".var"].sqrt()


def _lying(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """mallory's agent answers every calibrate with finite false BN statistics (``kind``), and validation with 100 %
    then 0 %."""
    from feast_edge.agent import on_device

    calibration, evaluation = on_device.answer_calibration, on_device.answer_evaluation

    def answer_calibration(message, payload, data, preset, torch_device="cpu"):
        blob, examples = calibration(message, payload, data, preset, torch_device)
        if data.device_id != "mallory":
            return blob, examples
        tensors = load(blob)
        lied = {k: _lie(k, v, kind, tensors) for k, v in tensors.items()}
        return save(lied, metadata={"format": STATISTICS_FORMAT, "examples": str(examples)}), examples

    def answer_evaluation(message, payload, data, preset, torch_device="cpu", candidates=()):
        answer = evaluation(message, payload, data, preset, torch_device, candidates)
        if data.device_id != "mallory":
            return answer
        right = data.holdout if message.round == 0 else 0
        return Evaluated.of(message, [(right, data.holdout)] * len(answer.counts()), answer.calibrated_on)

    monkeypatch.setattr(on_device, "answer_calibration", answer_calibration)
    monkeypatch.setattr(on_device, "answer_evaluation", answer_evaluation)


def _clients(fashion_mnist_dir: Path) -> dict[str, LocalClient]:
    split = load_fashion_mnist(fashion_mnist_dir, "train")
    clients = {}
    for k, name in enumerate(BUDGETS):
        part = slice(250 * k, 250 * (k + 1))
        clients[name] = LocalClient(
            name, split.images[part], split.labels[part].long(), None, None, None, "own images"
        ).with_holdout(0.2)
    return clients


@pytest.mark.parametrize("kind", ["huge", "zero-var", "shifted"])
def test_a_provisioned_liar_is_outvoted_refused_and_named(
    kit,
    tmp_path: Path,
    fashion_mnist_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kind: str,
) -> None:
    caplog.set_level(logging.INFO, logger="feast_edge")
    _lying(monkeypatch, kind)
    running = start_provisioned(tmp_path / "provision", "certificate", list(BUDGETS), federation=FED)
    server = None
    try:
        config = kit.server_config(
            kit.CONFIG,
            tmp_path / "run",
            tmp_path,
            FED,
            data=None,
            rounds=2,
            per_round=4,
            min_clients=4,
            start_clients=4,
            eval_every=1,
            round_timeout=120,
            # Served by method §8's rule, so that cat and mallory are served the variants only they can tell apart
            # ("shifted": the default, validated).
            serving_rule="validated" if kind == "shifted" else "largest",
        )
        server = kit.ServerThread(config, export=True, link=load_credentials(running.done.server).link_config()).start()
        agents = [
            Agent(
                AgentConfig(
                    host=name,
                    federation=FED,
                    preset=str(FMNIST_TINY),
                    budget_macs=CACHE.entries[BUDGETS[name]].macs,
                    model_dir=str(tmp_path / "models" / name),
                    # "shifted": every device evaluates and calibrates every variant (memory allows, issue 37); the
                    # others: only what its budget serves, so that cat and mallory alone can tell cat's variant.
                    evaluate_up_to="auto" if kind == "shifted" else "serving",
                ),
                load_credentials(running.done.devices[name]).link_config(),
                [client],
            )
            for name, client in _clients(fashion_mnist_dir).items()
        ]
        with agents_running(agents):
            history = server.join(300)
        manifests = {m["device"]: m for m in server.manifests}
    finally:
        if server is not None:
            server.close()  # its link too: left open, it would keep reconnecting to the stopped broker
        running.broker.stop()
    log = caplog.text
    # Validation: four votes; mallory's 100 % in round 1 is named and cannot choose round 1 for everyone.
    first = history[0].validation
    assert first["rule"] == "median" and "mallory" in first["flagged"]
    assert "mallory's validation disagrees with the other devices" in log
    assert history[0].val_accuracy < 0.9  # the honest devices' figure, not the liar's 100 %
    # The served round: mallory's 100 % -> 0 % against the others' trend gets it distrusted (named once) and it no
    # longer votes; no honest device is ever called possibly false; the round served is the one the honest devices'
    # votes alone choose, and every manifest names it.
    assert (
        history[1].validation["distrusted"]["mallory"].startswith("round 2: its held-out accuracy went 100.0% -> 0.0%")
    )
    assert "mallory is distrusted since round 2" in log
    assert all(set(h.validation["flagged"]) <= {"mallory"} for h in history)
    honest = [
        (h.round, {**h.validation, "served": {d: f for d, f in h.validation["served"].items() if d != "mallory"}})
        for h in history
    ]
    chosen = served_round(honest).round
    assert history[-1].validation["served_round"] == chosen
    assert {m["served_round"]["round"] for m in manifests.values()} == {chosen}
    assert f"round 2: serving round {chosen}" in log
    combined = [
        line.split("device(s) (")[1].split(")")[0]
        for line in log.splitlines()
        if "BN statistics of" in line and "device(s) (" in line
    ]
    assert "refused the BN statistics of mallory" in log
    if kind == "shifted":
        # Four voters on every served variant: the liar is refused everywhere, its own variant included, and every
        # variant holds the three honest devices' statistics.
        assert all(m["calibration"] == "federated" for m in manifests.values())
        assert combined == ["ann, bob, cat"] * len({m["macs"] for m in manifests.values()})
        return
    # BN statistics: refused where three or more devices can tell, set aside where only cat and mallory can.
    for honest in ("ann", "bob"):
        assert manifests[honest]["calibration"] == "federated"
    assert "(cat, mallory) disagree" in log and manifests["cat"]["calibration"] == "device"
    # The variants served to ann and bob hold the honest devices' statistics; mallory's own (nobody else can run it)
    # holds its own lie, served to mallory alone.
    assert sorted(combined) == ["ann, bob, cat", "bob, cat", "mallory"]
