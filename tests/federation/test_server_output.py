"""What ``feast-server run`` prints at the end of a run without data: the devices' own models, served -> personal, and
the classes a personal model was tuned to."""

from __future__ import annotations

from rich.console import Console

from feast_edge.server.output import device_models_table
from rundirs import (
    FLEET,
    FLEET_OWN_ACCURACY,
    HOLDOUT_ACCURACY,
    PERSONAL,
    PERSONAL_ACCURACY,
    TUNED,
    TUNED_WORDS,
)


def _rows(manifests: list[dict], reports: dict[str, dict]) -> dict[str, list[str]]:
    """The printed table's rows by their first cell (a wrapped cell's first line)."""
    console = Console(width=200, record=True)
    console.print(device_models_table(manifests, reports, "the devices' models"))
    rows = {}
    for line in console.export_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if line.startswith("│") and cells[0] and cells[0] not in rows:
            rows[cells[0]] = cells
    return rows


def test_the_devices_models_show_own_accuracy_served_and_personal_the_mean_and_the_worst() -> None:
    reports = {
        "pi-5": {"holdout_accuracy": HOLDOUT_ACCURACY, "holdout_samples": 40, "calibrated_on": 200, **PERSONAL},
        **{name: {"holdout_samples": 40, "calibrated_on": 200, **metrics} for name, metrics in FLEET.items()},
    }
    manifests = [{"device": name, "macs": 1e6, "calibration": "device"} for name in [*reports, "silent"]]
    rows = _rows(manifests, reports)
    assert rows["pi-5"][4:6] == [f"{100 * HOLDOUT_ACCURACY:.2f}%", f"{100 * PERSONAL_ACCURACY:.2f}% (prior τ=1)"]
    # Its reason, with what rich would read as markup and a terminal escape, is printed as text.
    assert rows["cam-1"][4] == "70.00%" and rows["cam-1"][5].startswith("70.00% (served model kept: [/bold]\\x1b[31m")
    for liar, field in (
        ("liar-range", "personal_accuracy"),
        ("liar-method", "personal_method"),
        ("liar-type", "personal_accuracy"),
    ):
        assert rows[liar][4:6] == ["95.00%", f"invalid report ({field})"], liar
    assert rows["silent"][4:6] == ["no report", "no report"]
    served, personal = FLEET_OWN_ACCURACY["served"], FLEET_OWN_ACCURACY["personal"]  # the silent device adds nothing
    assert rows["mean (2 of 6 devices)"][4:6] == [f"{100 * served:.2f}%", f"{100 * personal:.2f}%"]
    assert rows["worst (each column)"][4:6] == ["cam-1 70.00%", "cam-1 70.00%"]


def test_before_any_report_the_mean_is_empty_and_no_device_is_the_worst() -> None:
    rows = _rows([{"device": "pi-5", "macs": 1e6, "calibration": "federated"}], {})
    assert rows["mean (0 of 1 device)"][4:6] == ["-", "-"]
    assert not any(name.startswith("worst") for name in rows)


def test_in_a_narrow_terminal_the_table_folds_and_cuts_nothing() -> None:
    names = ["raspberry-pi-5-kitchen", "jetson-orin-nano-door"]
    reports = {name: {"holdout_accuracy": 0.9, "holdout_samples": 40, "calibrated_on": 200} for name in names}
    manifests = [{"device": name, "macs": 1e6, "calibration": "device", "file": f"{name}.onnx"} for name in names]
    console = Console(width=70, record=True)
    console.print(device_models_table(manifests, reports, "the devices' models"))
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 70
    first_column = "".join(line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│"))
    assert first_column.startswith("".join(names))  # each name whole, folded over lines


def test_a_personal_model_tuned_to_fewer_classes_names_them_in_the_table_and_an_old_report_still_reads() -> None:
    reports = {
        "jetson-shirts": {"holdout_samples": 40, "calibrated_on": 200, **TUNED["jetson-shirts"]},
        "pi-5": {"holdout_accuracy": HOLDOUT_ACCURACY, "holdout_samples": 40, "calibrated_on": 200, **PERSONAL},
        "liar-classes": {"holdout_samples": 40, "calibrated_on": 200, **TUNED["liar-classes"]},
    }
    manifests = [{"device": name, "macs": 1e6, "calibration": "device"} for name in reports]
    console = Console(width=400, record=True)
    console.print(device_models_table(manifests, reports, "the devices' models"))
    lines = console.export_text().splitlines()
    row = {name: next(line for line in lines if line.startswith(f"│ {name} ")) for name in reports}
    assert f"100.00% (prior τ=1; {TUNED_WORDS})" in row["jetson-shirts"]
    assert f"{100 * PERSONAL_ACCURACY:.2f}% (prior τ=1) " in row["pi-5"]  # a report from before the classes
    assert "invalid report (personal_classes)" in row["liar-classes"] and "tuned to" not in row["liar-classes"]


def test_an_asynchronous_release_line_names_each_update_s_staleness(caplog) -> None:
    import logging

    from feast_edge.run.loop import RoundRecord
    from feast_edge.server.output import print_round

    caplog.set_level(logging.INFO, logger="feast_edge")
    record = RoundRecord(
        round=12, lr=0.1, cohort=["a", "pi"], updated=["a", "pi"], applied=True, staleness={"pi": 3, "a": 0}
    )
    print_round(record, 60)
    print_round(RoundRecord(round=2, lr=0.1, cohort=["a"], updated=["a"], applied=True), 5)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("release 12/60  replies 2/2  staleness a 0, pi 3  aggregated")
    assert lines[1].startswith("round 2/5  replies 1/1  aggregated")
