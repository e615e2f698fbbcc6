"""rounds.csv after every round and TensorBoard scalars (feast_edge/run/roundlog.py), read back with TensorBoard's own reader."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from feast_edge.run.loop import RoundRecord
from feast_edge.run.roundlog import COLUMNS, RoundLog, TensorBoardError, TensorBoardLog, write_rounds_csv


def _record(r: int, val: float | None = None) -> RoundRecord:
    return RoundRecord(
        round=r,
        lr=0.05 / r,
        cohort=["a", "b", "c"],
        updated=["a", "b"],
        rejected={"c": "bad"},
        applied=True,
        loss=1.0 / r,
        samples=100 * r,
        train_macs=10**9 * r,
        routed_params=1000,
        full_params=3000,
        seconds=2.5,
        val_accuracy=val,
    )


def test_rounds_csv_has_one_row_per_round_with_what_it_measured(tmp_path: Path) -> None:
    path = write_rounds_csv(tmp_path / "rounds.csv", [_record(1), _record(2, 0.625)])
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == COLUMNS
    assert [r["round"] for r in rows] == ["1", "2"]
    assert rows[0]["val_accuracy"] == "" and rows[1]["val_accuracy"] == "0.6250"
    assert rows[1]["updated"] == "2" and rows[1]["rejected"] == "1" and rows[1]["train_macs"] == str(2 * 10**9)


def _events(directory: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(
        str(directory)
    )  # purges what a restart marker (purge_step) says is orphaned, as TensorBoard does
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _scalars(directory: Path, tag: str) -> dict[int, float]:
    events = _events(directory, tag)
    assert len({step for step, _ in events}) == len(events), f"a round logged twice: {events}"
    return dict(events)


def test_round_log_writes_csv_and_tensorboard_after_each_round(tmp_path: Path) -> None:
    log = RoundLog(tmp_path, tensorboard=True)
    history = []
    for r in (1, 2, 3):
        history.append(_record(r, 0.5 + r / 10))
        log.write(history)
        assert (tmp_path / "rounds.csv").read_text().count("\n") == r + 1  # header + the rounds so far, at every round
    log.close()
    assert _scalars(tmp_path / "tensorboard", "validation/accuracy") == pytest.approx({1: 0.6, 2: 0.7, 3: 0.8})
    assert _scalars(tmp_path / "tensorboard", "train/loss")[2] == pytest.approx(0.5)


def test_a_resumed_run_replaces_the_tensorboard_rounds_after_its_checkpoint(tmp_path: Path) -> None:
    first = TensorBoardLog(tmp_path)
    for r in (1, 2, 3):
        first.write(_record(r, 0.1 * r))  # round 3 was logged, then the process died before its checkpoint
    first.close()
    again = TensorBoardLog(tmp_path, first_round=3)
    again.write(_record(3, 0.9))
    again.close()
    assert _scalars(tmp_path, "validation/accuracy") == pytest.approx({1: 0.1, 2: 0.2, 3: 0.9})


def test_tensorboard_without_the_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        sys.modules, "torch.utils.tensorboard", None
    )  # import fails as if tensorboard were not installed
    with pytest.raises(TensorBoardError, match=r"pip install 'feast-edge\[tensorboard\]'"):
        RoundLog(tmp_path, tensorboard=True)
