"""``feast-edge report`` on the paper's further experiments: equal compute, γ-allocation, post-hoc extraction, optimizers.

Synthetic ``results.json`` files in the schema ``simulate`` writes (tests/rundirs.py); no simulation runs here.
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from feast_edge.report.runs import group_runs, load_run
from rundirs import CACHED, HETEROFL, simulate_results, write_run

FEAST_ACC = {"v0": 0.50, "v1": 0.60, "v2": 0.70}
HETERO_ACC = {"x0.125": 0.30, "x0.25": 0.40, "x0.5": 0.45, "x1": 0.52}


def _section(text: str, heading: str) -> str:
    return text.split(f"{heading}\n", 1)[1].split("\n#", 1)[0]


def _rows(section: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines() if line.startswith("|")
    ]


def test_matched_runs_get_an_equal_compute_table_beside_the_run_they_matched(cli, tmp_path: Path):
    feast = write_run(tmp_path / "feast", simulate_results("feast", 0, FEAST_ACC, CACHED, population=0.6))
    matched = {"run": str(feast), "run_method": "feast", "run_rounds": 4, "target_train_macs": 4 * 10**12,
               "rounds": 9, "predicted_train_macs": 5 * 10**12}  # fmt: skip
    record = simulate_results("heterofl", 0, HETERO_ACC, HETEROFL, population=0.44, matched_compute=matched)
    record["compute"]["train_macs_total"] = 5 * 10**12
    record["rounds"] = record["rounds"] * 2 + record["rounds"][:1]  # 9 rounds
    plain = write_run(tmp_path / "heterofl", simulate_results("heterofl", 0, HETERO_ACC, HETEROFL, population=0.4))
    hetero = write_run(tmp_path / "heterofl-matched", record)
    other = simulate_results("feast", 0, FEAST_ACC, CACHED, population=0.5, config={"server_opt": "adam"})
    unmatched = write_run(tmp_path / "feast-adam", other)  # nothing was matched to it: not in the table
    dirs = (feast, plain, hetero, unmatched)
    result = cli.invoke("report", *map(str, dirs), "--out", str(tmp_path / "report"))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "report" / "report.md").read_text()
    names = [g.name for g in group_runs([load_run(d) for d in dirs])]
    assert names == ["feast", "feast (server adam)", "heterofl", "heterofl (matched compute)"]
    rows = {r[0]: r for r in _rows(_section(text, "## Equal training compute"))[2:]}
    assert set(rows) == {"feast", "heterofl (matched compute)"}
    assert rows["heterofl (matched compute)"][2:5] == ["9", "5.00", "1.250"]
    assert rows["feast"][2] == "4" and rows["feast"][5] == "60.00"


def test_runs_at_two_gammas_get_the_gamma_table_and_plot(cli, tmp_path: Path):
    dirs = []
    for gamma, acc in ((0.0, {"v0": 0.60, "v1": 0.58, "v2": 0.55}), (1.0, FEAST_ACC)):
        record = simulate_results("feast", 0, acc, CACHED, population=0.5)
        record["population"]["gamma"] = gamma
        dirs.append(write_run(tmp_path / f"feast-g{gamma:g}", record))
    record = simulate_results("heterofl", 0, HETERO_ACC, HETEROFL, population=0.4)
    record["population"]["gamma"] = 0.0
    dirs.append(write_run(tmp_path / "heterofl-g0", record))  # one γ only: not paired
    result = cli.invoke("report", *map(str, dirs), "--out", str(tmp_path / "report"))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "report" / "report.md").read_text()
    rows = _rows(_section(text, "## γ-allocation"))[2:]
    assert [r[:2] for r in rows] == [["feast", "0"], ["feast", "1"]]
    assert rows[0][-1] == "-5.00" and rows[1][-1] == "+20.00"  # largest minus smallest point, in points
    assert "−4.29 → +6.17" in text
    with Image.open(tmp_path / "report" / "gamma.png") as png:
        assert png.size[0] > 300


def test_an_extraction_json_gets_its_section_and_plot(cli, tmp_path: Path):
    run = write_run(tmp_path / "feast", simulate_results("feast", 0, FEAST_ACC, CACHED, population=0.6))
    points = [
        {"target_macs": 15e6, "arch": {}, "macs": 14_000_000, "params": 1, "accuracy": 0.57, "curve": 0.54,
         "cached": False, "gap": 3.0},
        {"target_macs": 30e6, "arch": {}, "macs": 29_000_000, "params": 1, "accuracy": 0.64, "curve": 0.645,
         "cached": False, "gap": -0.5},
    ]  # fmt: skip
    (run / "extraction.json").write_text(
        json.dumps({"range": [15e6, 30e6], "points": points, "uncached": 2, "mean_abs_gap": 1.75})
    )
    result = cli.invoke("report", str(run), "--out", str(tmp_path / "report"))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "report" / "report.md").read_text()
    row = _rows(_section(text, "## Post-hoc extraction"))[2]
    assert row[1:] == ["15.00M–30.00M", "2", "2", "1.75", "-0.50 / +3.00"]
    assert (tmp_path / "report" / "extraction.png").is_file()
    # Without extraction.json or a second γ, neither section nor plot appears.
    bare = write_run(tmp_path / "bare", simulate_results("feast", 1, FEAST_ACC, CACHED, population=0.6))
    assert cli.invoke("report", str(bare), "--out", str(tmp_path / "r2")).returncode == 0
    text = (tmp_path / "r2" / "report.md").read_text()
    assert "## Post-hoc extraction" not in text and "## γ-allocation" not in text
    assert not (tmp_path / "r2" / "extraction.png").exists() and not (tmp_path / "r2" / "gamma.png").exists()


def test_a_server_optimizer_run_is_its_own_group(tmp_path: Path):
    plain = write_run(tmp_path / "a", simulate_results("feast", 0, FEAST_ACC, CACHED, population=0.6))
    adam = write_run(
        tmp_path / "b",
        simulate_results(
            "feast", 0, FEAST_ACC, CACHED, population=0.7, config={"server_opt": "adam", "server_lr": 0.01}
        ),
    )
    avg = write_run(
        tmp_path / "c",
        simulate_results("feast", 1, FEAST_ACC, CACHED, population=0.6, config={"server_opt": "avg", "server_lr": 1.0}),
    )
    groups = group_runs([load_run(d) for d in (plain, adam, avg)])
    assert [(g.name, len(g.runs)) for g in groups] == [("feast", 2), ("feast (server adam lr=0.01)", 1)]
