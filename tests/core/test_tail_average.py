"""The last round's candidate as the mean of the last rounds' weights (feast_edge.run.average), and a run that serves
it: best.safetensors holds the mean, checkpoint.safetensors the round's own weights, and a resumed run serves the
same mean."""

from __future__ import annotations

import pytest
import torch

from feast_edge.run.average import TailAverage, default_window, loaded, serve_average_of, split_extra
from feast_edge.run.checkpoint import load_supernet, save_supernet
from feast_edge.run.store import BEST, CHECKPOINT, PREVIOUS
from feast_edge.settings.validated import RunError
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


def test_the_window_fits_the_run_where_devices_validate_and_the_papers_selection_stays_on_server_data() -> None:
    # min(5, max(1, ceil(R / 4))): a 6-round demo averages rounds 5-6, a 20- or 100-round run the last 5.
    assert [default_window(r) for r in (1, 4, 5, 6, 8, 9, 16, 17, 20, 100)] == [1, 1, 2, 2, 2, 3, 4, 5, 5, 5]
    assert serve_average_of(None, validated_by_devices=True, rounds=6) == 2
    assert serve_average_of(None, validated_by_devices=True, rounds=20) == 5
    assert serve_average_of(None, validated_by_devices=True, rounds=100) == 5
    assert serve_average_of(None, validated_by_devices=False, rounds=20) == 1
    assert serve_average_of(3, validated_by_devices=False, rounds=20) == 3
    windows = {r: TailAverage(r, serve_average_of(None, True, r)) for r in (6, 20, 100)}
    assert {r: (w.first, w.rounds) for r, w in windows.items()} == {6: (5, 6), 20: (16, 20), 100: (96, 100)}


def test_a_gap_in_the_rounds_starts_the_mean_again() -> None:
    states = _states(6)
    average = TailAverage(rounds=6, k=4)
    average.add(3, states[2])
    average.add(5, states[4])  # round 4 never reached it (a resume without the mean)
    average.add(6, states[5])
    assert average.span == (5, 6)
    assert torch.allclose(average.mean["w"], (states[4]["w"] + states[5]["w"]) / 2, atol=1e-6)


def test_the_mean_is_a_candidate_of_the_last_round_only_and_loads_in_place_until_its_own_weights_come_back() -> None:
    model = torch.nn.Linear(3, 2)
    alias = model.state_dict()["weight"]  # what a validator holding the global state sees
    own = {k: v.clone() for k, v in model.state_dict().items()}
    average = TailAverage(rounds=2, k=2)
    average.add(1, {k: v + 1 for k, v in own.items()})
    assert average.candidate(1) is None  # not the last round, and one round averaged
    average.add(2, {k: v + 3 for k, v in own.items()})
    span, mean = average.candidate(2)
    assert span == (1, 2)
    with loaded(model, None):
        assert torch.equal(alias, own["weight"])
    with loaded(model, mean):
        assert torch.allclose(alias, own["weight"] + 2)
    assert torch.equal(alias, own["weight"]) and torch.equal(model.bias, own["bias"])
    with pytest.raises(KeyError), loaded(model, mean):
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
    assert resumed.load(ours, average.fields, path=None) is None  # the same window: nothing to say
    longer = TailAverage(rounds=8, k=3)  # the run was given more rounds: its window starts at round 6
    said = longer.load(ours, average.fields, path="run/checkpoint.safetensors")
    assert longer.span is None and not longer.mean
    assert said is not None and "the stored mean of rounds 3-5's weights was dropped" in said
    assert "this run averages rounds 6-8 (the last 3)" in said
    other_k = TailAverage(rounds=5, k=2)  # resumed with another --serve-average: rounds 4-5, not 3-5
    assert "dropped" in other_k.load(ours, average.fields, path=None) and other_k.span is None
    assert "serves the rounds' own weights" in TailAverage(rounds=5, k=1).load(ours, average.fields, path=None)


@pytest.mark.slow
def test_a_run_validates_its_own_weights_and_the_mean_on_the_same_split_serves_the_better_and_resumes_the_same(
    tmp_path, fashion_mnist_dir
) -> None:
    # Validated only after the last round: round 3's own weights and the mean of rounds 2-3 are its two candidates.
    config = tiny_config(fashion_mnist_dir, rounds=3, seed=3, eval_every=3, serve_average=2)
    full = Simulation(config, tmp_path / "full").run()
    last = full["rounds"][-1]
    candidates = last["candidates"]
    own, mean = candidates["own"]["val_accuracy"], candidates["mean"]["val_accuracy"]
    assert candidates["of"] == [2, 3] and own is not None and mean is not None
    chosen = "mean" if mean > own else "own"
    assert candidates["choice"] == chosen and last["val_accuracy"] == max(own, mean)
    words = "the mean of rounds 2-3's weights" if chosen == "mean" else "round 3's own weights"
    assert full["served_round"]["reason"].startswith(f"{words}: own {100 * own:.2f}% vs the mean of rounds 2-3 ")
    best, final, before = (load_supernet(tmp_path / "full" / f)[0].state_dict() for f in (BEST, CHECKPOINT, PREVIOUS))
    for name, tensor in best.items():
        if tensor.is_floating_point():
            expected = (before[name] + final[name]) / 2 if chosen == "mean" else final[name]
            assert torch.allclose(tensor, expected, atol=1e-6), name
    assert (full["served_round"].get("average_of") == [2, 3]) == (chosen == "mean")

    assert Simulation(config, tmp_path / "resumed").run(stop_after=2) is None  # "killed" after round 2
    resumed = Simulation(config, tmp_path / "resumed").run(resume=True)
    again = load_supernet(tmp_path / "resumed" / BEST)[0].state_dict()
    assert all(torch.equal(best[k], again[k]) for k in best)
    assert resumed["served_round"] == full["served_round"]
    assert resumed["rounds"][-1]["candidates"] == candidates


@pytest.mark.slow
def test_a_run_resumed_from_a_checkpoint_of_another_window_says_its_stored_mean_was_dropped(
    tmp_path, fashion_mnist_dir, caplog: pytest.LogCaptureFixture
) -> None:
    # A 6-round run validated by its clients averages rounds 5-6 by default; its checkpoint after round 4 is made to
    # hold the mean of rounds 2-4 that a release averaging 5 rounds (the earlier default) kept there.
    config = tiny_config(fashion_mnist_dir, rounds=6, eval_every=6, validate_on="devices", holdout=0.2)
    out = tmp_path / "run"
    assert Simulation(config, out).run(stop_after=4) is None
    model, record = load_supernet(out / CHECKPOINT)
    fields = dict(record["fields"], average={"span": [2, 4], "k": 5})
    mean = {f"average.{name}": tensor for name, tensor in model.state_dict().items()}
    save_supernet(out / CHECKPOINT, model, mean, **fields)
    with caplog.at_level("WARNING", logger="feast_edge"):
        results = Simulation(config, out).run(resume=True)
    assert "the stored mean of rounds 2-4's weights was dropped" in caplog.text
    assert "this run averages rounds 5-6 (the last 2)" in caplog.text
    assert results["rounds"][-1]["candidates"]["of"] == [5, 6]  # the window started again at round 5
