"""The last round's candidate as the mean of the last rounds' weights (feast_edge.run.average), and a run that serves
it: best.safetensors holds the mean, checkpoint.safetensors the round's own weights, and a resumed run serves the
same mean."""

from __future__ import annotations

import pytest
import torch

from feast_edge.run.average import TailAverage, serve_average_of, split_extra
from feast_edge.run.checkpoint import load_supernet
from feast_edge.run.settings import RunError
from feast_edge.run.store import BEST, CHECKPOINT, PREVIOUS
from feast_edge.sim.simulate import Simulation
from simconfigs import tiny_config


def _states(rounds: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g), "n": torch.tensor(r, dtype=torch.long)}
        for r in range(1, rounds + 1)
    ]


def test_the_mean_covers_the_last_k_rounds_and_keeps_integer_tensors_of_the_last() -> None:
    states = _states(7)
    average = TailAverage(rounds=7, k=3)
    for r, state in enumerate(states, start=1):
        average.add(r, state)
    assert average.span == (5, 7) and average.count == 3
    for name in ("w", "b"):
        expected = torch.stack([s[name] for s in states[4:]]).mean(0)
        assert torch.allclose(average.mean[name], expected, atol=1e-6)
        assert not torch.allclose(average.mean[name], states[-1][name])
    assert average.mean["n"].item() == 7
    assert average.stands_in(7) and not average.stands_in(6)


def test_one_round_or_a_window_of_one_is_the_rounds_own_weights() -> None:
    for k, rounds in ((1, 5), (5, 1)):
        average = TailAverage(rounds=rounds, k=k)
        for r, state in enumerate(_states(rounds), start=1):
            average.add(r, state)
        assert not average.stands_in(rounds)
    with pytest.raises(RunError, match="--serve-average 0 must be at least 1"):
        TailAverage(rounds=5, k=0)


def test_the_default_averages_where_devices_validate_and_keeps_the_papers_selection_on_server_data() -> None:
    assert serve_average_of(None, validated_by_devices=True) == 5
    assert serve_average_of(None, validated_by_devices=False) == 1
    assert serve_average_of(3, validated_by_devices=False) == 3


def test_a_gap_in_the_rounds_starts_the_mean_again() -> None:
    states = _states(6)
    average = TailAverage(rounds=6, k=4)
    average.add(3, states[2])
    average.add(5, states[4])  # round 4 never reached it (a resume without the mean)
    average.add(6, states[5])
    assert average.span == (5, 6)
    assert torch.allclose(average.mean["w"], (states[4]["w"] + states[5]["w"]) / 2, atol=1e-6)


def test_the_mean_stands_in_the_model_in_place_only_while_validated_and_its_own_weights_come_back() -> None:
    model = torch.nn.Linear(3, 2)
    alias = model.state_dict()["weight"]  # what a validator holding the global state sees
    own = {k: v.clone() for k, v in model.state_dict().items()}
    average = TailAverage(rounds=2, k=2)
    average.add(1, {k: v + 1 for k, v in own.items()})
    average.add(2, {k: v + 3 for k, v in own.items()})
    with average.standing_in(model, 2, validated=False) as span:
        assert span is None and torch.equal(alias, own["weight"])
    with average.standing_in(model, 2, validated=True) as span:
        assert span == (1, 2) and torch.allclose(alias, own["weight"] + 2)
    assert torch.equal(alias, own["weight"]) and torch.equal(model.bias, own["bias"])
    with pytest.raises(KeyError), average.standing_in(model, 2, validated=True):
        raise KeyError("a validation that failed")
    assert torch.equal(alias, own["weight"])


def test_a_checkpoint_keeps_the_mean_and_a_run_of_other_rounds_drops_it() -> None:
    states = _states(5)
    average = TailAverage(rounds=5, k=3)
    for r in (1, 2, 3, 4):
        average.add(r, states[r - 1])
    extra = {"server_opt.m.w": torch.zeros(1), **average.state}
    released, ours = split_extra(extra)
    assert set(released) == {"server_opt.m.w"} and set(ours) == {"average.w", "average.b", "average.n"}
    resumed = TailAverage(rounds=5, k=3)
    resumed.load(ours, average.fields, path=None)
    resumed.add(5, states[4])
    average.add(5, states[4])
    assert resumed.span == average.span == (3, 5)
    assert all(torch.equal(resumed.mean[k], average.mean[k]) for k in average.mean)
    longer = TailAverage(rounds=8, k=3)  # the run was given more rounds: its window starts at round 6
    longer.load(ours, average.fields, path=None)
    assert longer.span is None and not longer.mean


@pytest.mark.slow
def test_a_run_serves_the_mean_of_its_last_rounds_and_a_resumed_run_the_same_mean(tmp_path, fashion_mnist_dir) -> None:
    # Validated only after the last round, so the mean of rounds 2-3 is the one candidate and is served.
    config = tiny_config(fashion_mnist_dir, rounds=3, seed=3, eval_every=3, serve_average=2)
    full = Simulation(config, tmp_path / "full").run()
    assert full["served_round"]["average_of"] == [2, 3] and full["rounds"][-1]["average_of"] == [2, 3]
    assert "served as the mean of rounds 2-3's weights" in full["served_round"]["reason"]
    best, last, before = (load_supernet(tmp_path / "full" / f)[0].state_dict() for f in (BEST, CHECKPOINT, PREVIOUS))
    for name, tensor in best.items():
        if tensor.is_floating_point():
            assert torch.allclose(tensor, (before[name] + last[name]) / 2, atol=1e-6), name
    assert any(not torch.equal(best[k], last[k]) for k in best if best[k].is_floating_point())

    assert Simulation(config, tmp_path / "resumed").run(stop_after=2) is None  # "killed" after round 2
    resumed = Simulation(config, tmp_path / "resumed").run(resume=True)
    again = load_supernet(tmp_path / "resumed" / BEST)[0].state_dict()
    assert all(torch.equal(best[k], again[k]) for k in best)
    assert resumed["served_round"] == full["served_round"]
