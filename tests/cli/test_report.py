"""``feast-edge report``: grouped seeds, gaps to the centralized reference, plots, HTML escaping and the one-line input errors.

The run directories are synthetic ``results.json`` files in the schema
``feast-edge simulate`` writes; no simulation runs here.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

import pytest
from PIL import Image

from feast_edge.report.runs import group_runs, load_run
from rundirs import (
    CACHED,
    FLEET_OWN_ACCURACY,
    HELD_OUT,
    HETEROFL,
    HOLDOUT_ACCURACY,
    PERSONAL_ACCURACY,
    TUNED,
    TUNED_WORDS,
    add_personal_fleet,
    federation_run,
)
from rundirs import simulate_results as _results
from rundirs import write_run as _write

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FEAST = [
    ({"v0": 0.50, "v1": 0.60, "v2": 0.70}, 0.60),  # seed 0: per-variant accuracies, population accuracy
    ({"v0": 0.53, "v1": 0.62, "v2": 0.73}, 0.63),  # seed 1
]
CENTRAL = ({"v0": 0.55, "v1": 0.66, "v2": 0.77}, 0.68)
BASELINE = ({"x0.125": 0.30, "x0.25": 0.40, "x0.5": 0.45, "x1": 0.52}, 0.44)


@pytest.fixture
def runs(tmp_path: Path) -> list[Path]:
    """FEAST seeds 0 and 1, the centralized reference, HeteroFL (other variants than the cache)."""
    dirs = [
        _write(tmp_path / f"feast-{seed}", _results("feast", seed, acc, CACHED, population=pop))
        for seed, (acc, pop) in enumerate(FEAST)
    ]
    dirs.append(_write(tmp_path / "central", _results("centralized", 0, CENTRAL[0], CACHED, population=CENTRAL[1])))
    dirs.append(_write(tmp_path / "heterofl", _results("heterofl", 0, BASELINE[0], HETEROFL, population=BASELINE[1])))
    return dirs


def _pm(values: list[float]) -> str:
    return f"{100 * statistics.mean(values):.2f} ± {100 * statistics.stdev(values):.2f}"


def _section(text: str, heading: str) -> str:
    """The lines of a Markdown section, up to the next heading."""
    return text.split(f"{heading}\n", 1)[1].split("\n#", 1)[0]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _row_or_none(section: str, first: str) -> list[str] | None:
    return next(
        (_cells(line) for line in section.splitlines() if line.startswith("|") and _cells(line)[0] == first), None
    )


def _row(section: str, first: str) -> list[str]:
    row = _row_or_none(section, first)
    assert row is not None, f"no row {first!r} in\n{section}"
    return row


def test_markdown_report_groups_seeds_and_measures_gaps_to_the_centralized_run(
    cli, runs: list[Path], tmp_path: Path
) -> None:
    result = cli.invoke("report", *map(str, runs), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = tmp_path / "report" / "report.md"  # the default --out
    assert f"wrote {Path('report') / 'report.md'}" in result.stdout
    text = report.read_text(encoding="utf-8")
    assert "warning:" not in text and not result.stderr.strip()

    summary = _section(text, "## Summary")
    methods = [_cells(line)[0] for line in summary.splitlines() if line.startswith("|")][2:]
    assert methods == ["feast", "centralized", "heterofl"]
    feast = _row(summary, "feast")
    populations = [pop for _, pop in FEAST]
    assert feast[1:4] == [
        "2",
        _pm(populations),
        f"{100 * (CENTRAL[1] - statistics.mean(populations)):.2f}",
    ]  # seeds, mean ± std, gap
    assert feast[4] == _pm([acc["v2"] for acc, _ in FEAST])  # largest point
    assert feast[5] == _pm([0.40, 0.41])  # best validation
    assert feast[6:] == ["8M", "2M", "4.00", "2.5"]  # params sent, per round, TMAC, seconds per round
    assert _row(summary, "centralized")[1:4] == ["1", f"{100 * CENTRAL[1]:.2f}", "ref."]
    assert _row(summary, "heterofl")[3] == f"{100 * (CENTRAL[1] - BASELINE[1]):.2f}"

    feast_variants = _section(text, "### feast")
    assert "same variant (same label)" in feast_variants
    for i, label in enumerate(CACHED):
        mean = statistics.mean(acc[label] for acc, _ in FEAST)
        assert _row(feast_variants, str(i))[1:] == [
            label,
            f"{CACHED[label][0] / 1e6:.2f}",
            f"{CACHED[label][1] / 1e6:.3f}",
            _pm([acc[label] for acc, _ in FEAST]),
            f"{100 * (CENTRAL[0][label] - mean):.2f}",
        ]
    # HeteroFL's tiers are not cached variants: each is compared with the largest centralized point of no more MACs.
    heterofl = _section(text, "### heterofl")
    assert "largest point with MACs ≤ this point's MACs" in heterofl
    expected = {"x0.125": None, "x0.25": "v0", "x0.5": "v1", "x1": "v2"}
    for i, (label, ref) in enumerate(expected.items()):
        gap = "—" if ref is None else f"{100 * (CENTRAL[0][ref] - BASELINE[0][label]):.2f}"
        row = _row(heterofl, str(i))
        assert [row[1], row[4], row[5]] == [label, f"{100 * BASELINE[0][label]:.2f}", gap]

    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(links) == 4
    for name in links:
        png = report.parent / name
        assert png.is_file() and png.stat().st_size > 0, name
        assert png.read_bytes()[:8] == PNG_SIGNATURE
        assert f"wrote {Path('report') / name}" in result.stdout
        with Image.open(png) as image:
            assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_a_report_of_federations_says_where_each_validated_and_calibrated(cli, tiny, tmp_path: Path) -> None:
    own = federation_run(tmp_path / "own", tiny, federated=True)
    held = federation_run(tmp_path / "held", tiny, federated=False)
    out = tmp_path / "out"
    result = cli.invoke("report", str(own), str(held), "--out", str(out))
    assert result.returncode == 0, result.stderr
    text = (out / "report.md").read_text(encoding="utf-8")
    assert text.startswith(f"# feast-edge report: {tiny.name}\n")
    federations = _section(text, "## Federations")
    assert _row(federations, str(own))[1:] == [
        "lab",
        f"federated, on 2 devices' held-out data ({HELD_OUT} examples)",
        "2/3",
        "2",
        "40.00",
    ]
    assert _row(federations, str(held))[2] == "on the server's data"
    mine = _section(text, f"### {own}")
    assert (
        f"validation: federated, on 2 devices' held-out data ({HELD_OUT} examples); "
        "BN calibration: on each device, on its own data; served: round 2: the newest validated round (a test's words)"
        in mine
    )
    assert _row(mine, "pi-5")[1:] == [
        "calibrated on the device; held-out accuracy on its own data (40 examples)",
        "1.23",
        f"{100 * HOLDOUT_ACCURACY:.2f}",
        f"{100 * PERSONAL_ACCURACY:.2f}",
        "prior τ=1",
    ]
    theirs = _section(text, f"### {held}")
    assert "validation: on the server's data; BN calibration: on the server's data" in theirs
    # A model the server calibrated and validated: no own accuracy of the device, so no personal one beside it.
    assert _row(theirs, "pi-5")[1:] == ["validation, on the server's data", "1.23", "40.00", "—", "no report"]
    assert not _row_or_none(theirs, "mean") and "own held-out accuracy" not in theirs
    assert "## Summary" not in text and not list(out.glob("*.png"))  # no simulation: no method table, no plots


def test_a_federation_report_shows_each_devices_own_accuracy_served_and_personal_the_mean_and_the_worst(
    cli, tiny, tmp_path: Path
) -> None:
    run = add_personal_fleet(federation_run(tmp_path / "own", tiny, federated=True), tiny)
    result = cli.invoke("report", str(run), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    mine = _section((tmp_path / "out" / "report.md").read_text(encoding="utf-8"), f"### {run}")
    assert _row(mine, "pi-5")[3:] == [f"{100 * HOLDOUT_ACCURACY:.2f}", f"{100 * PERSONAL_ACCURACY:.2f}", "prior τ=1"]
    kept = _row(mine, "cam-1")
    assert kept[3:5] == ["70.00", "70.00"]
    # The device's reason, cut for the table and made printable: no escape byte, no line break reaches the report.
    assert kept[5].startswith("served model kept: [/bold]\\x1b[31m no method") and kept[5].endswith("…")
    # Each lie is shown as an invalid report, never as a number.
    for liar, field in (
        ("liar-range", "personal_accuracy"),
        ("liar-method", "personal_method"),
        ("liar-type", "personal_accuracy"),
    ):
        assert _row(mine, liar)[3:] == ["95.00", "—", f"invalid report ({field})"], liar
    # The means are over pi-5 and cam-1 only: the liars' plausible 95% served accuracy stays out of both columns.
    served, personal = FLEET_OWN_ACCURACY["served"], FLEET_OWN_ACCURACY["personal"]
    assert _row(mine, "mean")[1:5] == [
        "own held-out, 2 of 5 devices",
        "",
        f"{100 * served:.2f}",
        f"{100 * personal:.2f}",
    ]
    assert _row(mine, "worst (each column)")[3:5] == ["cam-1 70.00", "cam-1 70.00"]
    assert (
        f"own held-out accuracy, served -> personal: mean {100 * served:.2f}% -> {100 * personal:.2f}% over 2 of 5 "
        "devices; worst served cam-1 70.00%, worst personal cam-1 70.00%"
    ) in mine


def test_a_federation_report_shows_each_served_variants_rule_and_class_coverage(cli, tiny, tmp_path: Path) -> None:
    run = federation_run(tmp_path / "own", tiny, federated=True)
    result = cli.invoke("report", str(run), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    mine = _section((tmp_path / "out" / "report.md").read_text(encoding="utf-8"), f"### {run}")
    assert _row(mine, "1.23") == [
        "1.23",
        "pi-5",
        "smaller: better on validation: 90.0% vs 60.0% for the 5.50M variant",
        "3 of 4 (missing d)",
        "all 4",
        "-",
    ]


def test_a_federation_beside_simulations_gets_its_own_section(cli, runs: list[Path], tiny, tmp_path: Path) -> None:
    own = federation_run(tmp_path / "own", tiny, federated=True)
    result = cli.invoke("report", str(runs[0]), str(own), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert "## Summary" in text and f"federated, on 2 devices' held-out data ({HELD_OUT} examples)" in text


def test_html_report_escapes_every_text_and_embeds_the_plots(cli, tmp_path: Path) -> None:
    evil = "<script>alert(1)</script>"
    points = {**CACHED, evil: (30_000_000, 300_000)}
    run = _write(tmp_path / "run", _results("feast", 0, {"v0": 0.5, evil: 0.6}, points, population=0.55))
    out = tmp_path / "html"
    result = cli.invoke("report", str(run), "--out", str(out), "--format", "html", "--title", "<b>bold</b> & co")
    assert result.returncode == 0, result.stderr
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "<script" not in page and "<b>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<title>&lt;b&gt;bold&lt;/b&gt; &amp; co</title>" in page
    assert page.count('src="data:image/png;base64,') == 4
    assert not re.search(r'src="(?!data:)', page)


def test_mismatched_presets_and_populations_are_warned_about(cli, runs: list[Path], tmp_path: Path) -> None:
    other = _write(
        tmp_path / "other",
        _results("heterofl", 1, BASELINE[0], HETEROFL, population=0.4, budgets=[1e6, 2e6], preset="cifar-other"),
    )
    out = tmp_path / "out"
    result = cli.invoke("report", *map(str, runs), str(other), "--out", str(out))
    assert result.returncode == 0, result.stderr
    text = (out / "report.md").read_text(encoding="utf-8")
    population = (
        f"warning: the runs do not share one client population (the budgets of {other} differ from those of {runs[0]})"
    )
    lines = text.splitlines()
    assert any(line.startswith(f"> {population}") for line in lines)
    assert any(
        line.startswith("> warning: the runs use different presets (cifar-other, fmnist-small)") for line in lines
    )
    assert population in result.stderr


def test_a_missing_run_directory_is_a_one_line_error(cli, tmp_path: Path) -> None:
    missing = tmp_path / "never-ran"
    result = cli.invoke("report", str(missing), "--out", str(tmp_path / "out"))
    cli.assert_user_error(
        result, f"run directory {missing} does not exist; run feast-edge simulate --out {missing} to completion first"
    )
    assert not (tmp_path / "out").exists()


def test_a_run_without_results_is_a_one_line_error(cli, tmp_path: Path) -> None:
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    result = cli.invoke("report", str(unfinished), "--out", str(tmp_path / "out"))
    cli.assert_user_error(
        result,
        f"run directory {unfinished} holds no results.json; run feast-edge simulate --out {unfinished} to completion first",
    )


def test_an_unknown_format_is_a_one_line_error(cli, runs: list[Path], tmp_path: Path) -> None:
    result = cli.invoke("report", str(runs[0]), "--out", str(tmp_path / "out"), "--format", "pdf")
    cli.assert_user_error(result, "--format 'pdf' is not one of markdown, html")


def test_malformed_results_are_a_one_line_error(cli, runs: list[Path], tmp_path: Path) -> None:
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "results.json").write_text('{"method": "feast", "variants": [')
    result = cli.invoke("report", str(runs[0]), str(torn), "--out", str(tmp_path / "out"))
    cli.assert_user_error(result, f"cannot read {torn / 'results.json'} (")
    assert f"run feast-edge simulate --out {torn} to completion first" in result.stderr


@pytest.mark.parametrize(
    "drop, named",
    [
        (("communication", "routed_params_total"), "lacks communication.routed_params_total"),
        (("population_accuracy",), "lacks population_accuracy"),
    ],
)
def test_results_missing_a_key_are_a_one_line_error(cli, tmp_path: Path, drop: tuple[str, ...], named: str) -> None:
    record = _results("feast", 0, FEAST[0][0], CACHED, population=0.6)
    parent = record
    for key in drop[:-1]:
        parent = parent[key]
    del parent[drop[-1]]
    run = _write(tmp_path / "run", record)
    result = cli.invoke("report", str(run), "--out", str(tmp_path / "out"))
    cli.assert_user_error(
        result, f"{run / 'results.json'} {named}; run feast-edge simulate --out {run} to completion first"
    )


def test_without_matplotlib_the_error_says_how_to_install_it(
    cli, runs: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(
        sys.modules, "matplotlib", None
    )  # 'import matplotlib' raises ImportError, as on an install without the extra
    result = cli.invoke("report", str(runs[0]), "--out", str(tmp_path / "out"))
    cli.assert_user_error(result, "feast-edge report needs matplotlib: pip install 'feast-edge[report]'")


def test_ablations_and_options_are_groups_of_their_own(tmp_path: Path) -> None:
    """Seeds group together; FEAST's variants switch and any method option make a separate group."""
    records = [
        ("heterofl", 0, {"method_options": [["tiers", "4"]]}),
        ("feast", 1, {"variants": "min"}),
        ("centralized", 0, {}),
        ("feast", 0, {}),
        ("feast", 1, {}),
        ("mystery", 0, {}),
    ]
    runs = [
        load_run(_write(tmp_path / f"run-{i}", _results(m, seed, FEAST[0][0], CACHED, population=0.6, config=config)))
        for i, (m, seed, config) in enumerate(records)
    ]
    groups = group_runs(runs)
    assert [g.name for g in groups] == ["feast", "feast (variants=min)", "centralized", "heterofl (tiers=4)", "mystery"]
    assert [r.seed for r in groups[0].runs] == [0, 1]


def test_a_federation_report_names_the_classes_a_personal_model_was_tuned_to(cli, tiny, tmp_path: Path) -> None:
    run = add_personal_fleet(federation_run(tmp_path / "own", tiny, federated=True), tiny, TUNED)
    result = cli.invoke("report", str(run), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    mine = _section((tmp_path / "out" / "report.md").read_text(encoding="utf-8"), f"### {run}")
    assert _row(mine, "jetson-shirts")[3:] == ["50.00", "100.00", f"prior τ=1; {TUNED_WORDS}"]
    assert _row(mine, "pi-5")[5] == "prior τ=1"  # a report from before the classes reads as it did
    assert _row(mine, "liar-classes")[4:] == ["—", "invalid report (personal_classes)"]
