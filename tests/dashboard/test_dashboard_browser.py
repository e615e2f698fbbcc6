"""The page as a viewer sees it: rendered by headless Chromium from a served state, a hostile fleet, and ``feast-edge dashboard`` on a real run.

Each test leaves a screenshot in build/test-artifacts/ (the ``browser`` fixture).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from browser import Browser, console_errors, points, wait_until
from filled import fill
from rundirs import federation_run

from feast_edge.dashboard import Dashboard, DashboardState, start_dashboard
from feast_edge.dashboard.runs import load_runs
from feast_edge.space.preset import Preset

CHARTS = ("chart-accuracy-macs", "chart-validation", "chart-traffic", "chart-compute")
HOSTILE = "<img src=x onerror=\"document.title='pwned'\"><script>document.title='pwned'</script>"


def rows(driver: Any, table: str) -> list[Any]:
    return driver.find_elements("css selector", f"{table} tbody tr")


def test_a_filled_state_renders_and_updates_live(
    served: Dashboard, filled: DashboardState, browser: Browser, tmp_path: Path
) -> None:
    driver = browser.open(served.url)
    wait_until(driver, lambda d: len(rows(d, "#fleet")) == 2, message="the fleet's two devices never appeared")
    assert driver.find_element("id", "round-counter").text == "round 3 / 5"
    assert driver.find_element("id", "connection").text == "live"
    jetson, pi = rows(driver, "#fleet")
    assert jetson.get_attribute("data-device") == "jetson" and pi.get_attribute("data-device") == "pi-5"
    assert (
        pi.find_element("css selector", "td.budget").text == "6.60"
        and jetson.find_element("css selector", "td.budget").text == "2.79"
    )
    assert [row.find_element("css selector", "td.precision").text for row in (pi, jetson)] == ["int8", "fp32"]
    # The served version each device runs and its own held-out accuracy on it; none yet on the jetson.
    assert [row.find_element("css selector", "td.version").text for row in (pi, jetson)] == ["3, own 81.3%", "–"]
    assert pi.find_element("css selector", "td.version").get_attribute("title").startswith("since ")
    assert pi.find_elements("css selector", "td.online") and jetson.find_elements("css selector", "td.offline")
    assert "late (after the deadline)" in jetson.text
    member = driver.find_element("css selector", '#round-members tr[data-device="pi-5"]')
    assert "downloading" in member.text and "3/8 chunks" in member.text
    assert member.find_element("css selector", "progress").get_attribute("value") == "3"
    assert driver.find_element("id", "round-left").text.endswith("s left")
    assert driver.find_element("id", "population-accuracy").text == "45.00 %"
    for chart in CHARTS:
        assert points(driver, chart) > 0, chart
    assert points(driver, "chart-accuracy-macs") == 4 and points(driver, "chart-validation") == 2
    assert driver.find_elements("css selector", "#chart-validation canvas"), "uPlot drew no canvas"
    link = driver.find_element("css selector", '#models tr[data-device="pi-5"] a')
    assert link.get_attribute("href") == served.url + "models/pi-5.onnx"
    assert driver.find_element("css selector", "#models td.sha").get_attribute("title") == "ab" * 32
    # The round whose weights are served is named in the header, with the rule's reason: not always the last round.
    assert driver.find_element("id", "served-round").text == (
        "served: weights of round 2 of 3: round 2: round 3 regressed on 2 of 2 devices"
    )

    assert not driver.find_element("id", "privacy").is_displayed()  # no round under DP yet
    assert not driver.find_element("id", "timing").is_displayed()  # a federation runs in real time

    driver.execute_script("window.notReloaded = true;")
    filled.member("pi-5", "aggregated")
    filled.end_round(
        {
            "round": 3,
            "val_accuracy": 0.7,
            "bytes_down": 1,
            "bytes_up": 1,
            "broadcast_bytes": 2,
            "train_macs": 5,
            "epsilon": 4.591,
            "delta": 1e-5,
            "clock": 42.4,
            "staleness_mean": 0.5,
            "staleness_max": 2,
        }  # fmt: skip
    )
    wait_until(driver, lambda d: d.find_element("id", "privacy").is_displayed(), message="ε was never shown")
    assert driver.find_element("id", "privacy-epsilon").text == "ε = 4.59 at δ = 1e-5 after round 3"
    # A simulated step on the virtual clock: the time, the staleness, accuracy against time.
    assert driver.find_element("id", "timing").text.startswith(
        "Virtual clock: 42 s after step 3 · staleness of released updates: mean 0.50, max 2"
    )
    assert points(driver, "chart-time") == 1
    # An asynchronous federation: the buffer, who trains from which version, and each update's staleness.
    assert not driver.find_element("id", "round-buffer").is_displayed()
    filled.set_run(buffer={"held": 1, "size": 2, "in_flight": {"jetson": 1, "pi-5": 3}})
    filled.set_device("jetson", last_upload={"round": 3, "status": "accepted", "reason": None, "staleness": 2})
    wait_until(driver, lambda d: d.find_element("id", "round-buffer").is_displayed(), message="no buffer line")
    assert driver.find_element("id", "round-buffer").text == (
        "buffer 1/2 updates · training: jetson (version 1), pi-5 (version 3)"
    )
    wait_until(
        driver, lambda d: "staleness 2" in d.find_element("css selector", '#fleet tr[data-device="jetson"]').text
    )
    # Secure aggregation: the stage of the round in flight, through LiveView.secure_stage's state.
    assert not driver.find_element("id", "round-secure").is_displayed()
    filled.set_run(secure={"round": 3, "stage": "unmask", "detail": "5 masked updates in"})
    wait_until(driver, lambda d: d.find_element("id", "round-secure").is_displayed(), message="no secure stage")
    assert driver.find_element("id", "round-secure").text == (
        "secure aggregation, round 3: unmask · 5 masked updates in"
    )
    filled.set_device("jetson", online=True)
    wait_until(
        driver,
        lambda d: points(d, "chart-validation") == 3,
        message="the third round never reached the validation chart",
    )
    wait_until(driver, lambda d: d.find_elements("css selector", '#fleet tr[data-device="jetson"] td.online'))
    assert "aggregated" in driver.find_element("css selector", '#round-members tr[data-device="pi-5"]').text
    # A server without data: federated validation, and a model the device calibrated and measured itself.
    filled.set_run(validation="validation: federated, on 2 devices' held-out data (60 examples)")
    jetson_model = {
        "device": "jetson",
        "macs": 2_700_000,
        "rounds": 3,
        "calibration": "device",
        "file": "j.safetensors",
        # A smaller variant than its largest affordable, trained on 7 of 10 classes (issue 37).
        "serving_rule": "better on validation: 91.0% vs 68.8% for the 7.06M variant",
        "coverage": {
            "trained": {"classes": list("abcdefg"), "missing": ["h", "i", "j"], "devices": ["jetson"]},
            "validated": {"classes": list("abcdefghij"), "missing": [], "devices": ["jetson", "liar"]},
        },
    }
    personal = {
        "personal_method": "bn",
        "personal_strength": 1,
        "personal_accuracy": 0.875,
        "personal_reason": "chose bn",
        # tuned to the 7 classes the device holds (issue 53): the page says so, and to serve the global model for the rest
        "personal_classes": list("abcdefg"),
        "personal_task_classes": 10,
    }
    liar = {**jetson_model, "device": "liar"}  # its personal accuracy is a lie: shown as such, kept out of the means
    pi = {**jetson_model, "device": "pi-5"}  # the lowest served accuracy, and a personal model above jetson's
    filled.set_models(
        [jetson_model, liar, pi],
        tmp_path / "models",
        {
            "jetson": {"holdout_accuracy": 0.8125, "model_round": 3, **personal},
            "liar": {"holdout_accuracy": 0.5, "model_round": 3, **personal, "personal_accuracy": 7.5},
            "pi-5": {"holdout_accuracy": 0.5625, "model_round": 3, **personal, "personal_accuracy": 0.9375},
        },
    )
    wait_until(driver, lambda d: "federated" in d.find_element("id", "validation-source").text)
    assert driver.find_element("id", "validation-source").text == (
        "(validation: federated, on 2 devices' held-out data (60 examples))"
    )
    model = driver.find_element("css selector", '#models tr[data-device="jetson"]')
    assert model.find_element("css selector", "td.accuracy").text == "81.25"
    # Its personal model: the device's own accuracy of it and how it was made (the device's reason as a tooltip).
    assert model.find_element("css selector", "td.personal").text == "87.50"
    note = model.find_element("css selector", "td.personal-note")
    assert note.get_attribute("title") == "chose bn"
    assert (
        note.text
        == "bn 1 epoch; tuned to 7 of 10 classes: a, b, c, d, e, f and 1 more; serve the global model for the others"
    )
    liar_row = driver.find_element("css selector", '#models tr[data-device="liar"]')
    assert liar_row.find_element("css selector", "td.personal").text == "–"
    assert liar_row.find_element("css selector", "td.personal-note").text == "invalid report (personal_accuracy)"
    # Below the models: the mean over the devices that reported both (the liar is not one), and the worst of each
    # column with its own device: pi-5's served model, jetson's personal one.
    mean = driver.find_element("css selector", "#own-accuracy tr.own-mean")
    assert [mean.find_element("css selector", f"td.{c}").text for c in ("variant", "accuracy", "personal")] == [
        "2 of 3 devices",
        "68.75",
        "90.63",
    ]
    worst = driver.find_element("css selector", "#own-accuracy tr.own-worst")
    assert [worst.find_element("css selector", f"td.{c}").text for c in ("accuracy", "measured", "personal")] == [
        "pi-5 56.25",
        "the lowest of each column, with its device",
        "jetson 87.50",
    ]
    assert model.find_element("css selector", "td.chosen-by").text == (
        "smaller: better on validation: 91.0% vs 68.8% for the 7.06M variant"
    )
    coverage = model.find_element("css selector", "td.coverage")
    assert coverage.text == "7 of 10 (missing h, i, j)" and coverage.get_attribute("title") == "validated on all 10"
    assert liar_row.find_element("css selector", "td.coverage").text == "7 of 10 (missing h, i, j)"
    # The footer's cells line up under the header's columns.
    header = driver.find_elements("css selector", "#models thead th")
    assert (
        len(mean.find_elements("css selector", "td")) == len(header) == len(model.find_elements("css selector", "td"))
    )
    assert "calibrated on the device" in model.find_element("css selector", "td.measured").text
    assert model.find_element("css selector", "td.download").text == "on the device" and not model.find_elements(
        "css selector", "a"
    )
    assert driver.execute_script("return window.notReloaded === true;")
    assert console_errors(driver) == []
    browser.screenshot()


def test_the_page_polls_when_events_are_blocked(served: Dashboard, filled: DashboardState, browser: Browser) -> None:
    driver = browser.open(served.url)
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd(
        "Network.setBlockedURLs", {"urls": ["*api/events*"]}
    )  # as a proxy that buffers or drops event streams
    driver.refresh()
    wait_until(driver, lambda d: len(rows(d, "#fleet")) == 2 and d.find_element("id", "connection").text == "live")
    assert "polling" in driver.find_element("id", "connection").get_attribute("title")
    filled.set_device("newcomer", online=True)
    wait_until(
        driver,
        lambda d: len(rows(d, "#fleet")) == 3,
        timeout=10.0,
        message="polling api/state never brought the new device",
    )
    browser.screenshot()


def test_hostile_strings_stay_text(tmp_path: Path, browser: Browser) -> None:
    state = fill(DashboardState("federation", HOSTILE), tmp_path / "models")
    state.set_run(message=HOSTILE)
    state.set_device(
        HOSTILE,
        profile=HOSTILE,
        hardware=HOSTILE,
        online=True,
        variant={"label": HOSTILE, "macs": 1},
        last_upload={"round": 1, "status": "rejected", "reason": HOSTILE},
    )
    state.start_round(4, [HOSTILE, "pi-5"], None)
    state.member(HOSTILE, "rejected", reason=HOSTILE)
    state.end_round({"round": 4, "val_accuracy": 0.5, "devices": {HOSTILE: {"down": 1, "up": 1}}})
    (tmp_path / "models" / "h.onnx").write_bytes(b"h")
    own = {"label": HOSTILE, "sha256": HOSTILE, "calibration": "device", "file": "h.variant.safetensors"}
    state.set_models(
        [{"device": HOSTILE, "label": HOSTILE, "sha256": HOSTILE, "file": "h.onnx"}, {**own, "device": "pi-5"}],
        tmp_path / "models",
        {
            "pi-5": {
                "holdout_accuracy": 0.5,
                "personal_method": "",
                "personal_accuracy": 0.5,
                "personal_reason": HOSTILE,
            }
        },
    )
    state.add_run(
        {
            "name": HOSTILE,
            "method": HOSTILE,
            "variants": [{"macs": 1e6, "test_accuracy": 0.5}],
            "history": [{"round": 1, "val_accuracy": 0.5}],
        }
    )
    with start_dashboard(state, "127.0.0.1:0") as dashboard:
        driver = browser.open(dashboard.url)
        wait_until(driver, lambda d: len(rows(d, "#fleet")) == 3)
        wait_until(driver, lambda d: points(d, "chart-accuracy-macs") == 1)
        time.sleep(0.5)  # an injected handler would have run by now
        assert driver.title != "pwned" and driver.title == "feast-edge: " + HOSTILE
        cell = driver.find_element("css selector", "#fleet td.device")
        assert cell.text == HOSTILE and cell.find_elements("css selector", "*") == []
        for section in ("#fleet", "#round", "#traffic", "#models", "#learned", "header"):
            assert driver.find_elements("css selector", f"{section} script, {section} img") == [], section
        assert HOSTILE in driver.find_element("css selector", "#round-members").text
        assert HOSTILE in driver.find_element("css selector", "#traffic-devices").text
        assert HOSTILE in driver.find_element("css selector", "#models").text
        assert driver.find_element("css selector", '#models tr[data-device="pi-5"] td.personal-note').get_attribute(
            "title"
        ) == HOSTILE.replace("\n", "\\n")  # the device's reason, whole (printable), as a tooltip
        assert HOSTILE in driver.find_element("css selector", "#chart-accuracy-macs").text  # the chart legend
        assert len(driver.find_elements("css selector", "script")) == 2  # uPlot and dashboard.js, nothing injected
        assert driver.find_element("id", "run-message").text == HOSTILE
        assert console_errors(driver) == []
        browser.screenshot()


def test_a_finished_run_without_server_data_says_it_finished_why_it_has_no_points_and_its_whole_served_reason(
    tmp_path: Path, tiny: Preset, browser: Browser
) -> None:
    out = federation_run(tmp_path / "fed", tiny, federated=True, rounds=2)  # 2 of 2 rounds: finished
    falls = ", ".join(f"camera-{i:02d} 91.2% -> 88.7%" for i in range(4))
    reason = (
        "round 2: the newest validated round, no significant regression against round 1 on the served variants of "
        f"40 device(s); regressed on 4 of 40 only ({falls})"
    )
    index = json.loads((out / "models" / "index.json").read_text())
    index["models"][0]["served_round"] = {"round": 2, "of": 2, "reason": reason}
    (out / "models" / "index.json").write_text(json.dumps(index))
    with start_dashboard(load_runs([out]), "127.0.0.1:0") as dashboard:
        driver = browser.open(dashboard.url)
        wait_until(driver, lambda d: points(d, "chart-validation") == 2, message="the rounds never reached the chart")
        # Nothing is in flight because the run is over, and the page says so with its last round.
        assert driver.find_element("id", "round-title").text == (
            "The run finished after round 2 of 2: no round in flight."
        )
        # No accuracy-vs-MACs points: the server held no data; the page says why and where the devices' figures are.
        empty = driver.find_element("css selector", "#chart-accuracy-macs .chart-empty").text
        assert empty.startswith(
            "The server holds no data, so it tested no variant: the devices validated on their own held-out data."
        ), empty
        assert "validation accuracy per round is in the chart beside" in empty and "Models table below" in empty
        # The served reason, longer than the header's line: cut between words, whole in the tooltip.
        served = driver.find_element("id", "served-round")
        whole, shown = f"served: weights of round 2 of 2: {reason}", served.text
        assert len(whole) > 200 and served.get_attribute("title") == whole
        assert shown.endswith("…") and len(shown) <= 160 and whole.startswith(shown[:-1])
        assert whole[len(shown) - 1] in " ,;:", shown  # the cut falls between two words
        # Round axes count whole rounds.
        for chart in ("chart-validation", "chart-traffic", "chart-compute"):
            ticks = (driver.find_element("id", chart).get_attribute("data-x-ticks") or "").split()
            assert ticks and all(t.isdigit() for t in ticks) and {"1", "2"} <= set(ticks), (chart, ticks)
        assert console_errors(driver) == []
        browser.screenshot()


def _read_url(process: subprocess.Popen[str], timeout: float) -> str:
    """The URL ``feast-edge dashboard`` prints once it serves."""
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline, seen = time.monotonic() + timeout, ""
    while time.monotonic() < deadline and process.poll() is None:
        if selector.select(timeout=0.5):
            line = process.stdout.readline()
            seen += line
            if "http://" in line:
                return line[line.index("http://") :].split()[0]
    raise AssertionError(
        f"feast-edge dashboard printed no URL within {timeout:.0f} s: {seen!r} {process.stderr.read() if process.poll() is not None else ''}"
    )


def test_feast_edge_dashboard_serves_a_real_run(simulation_run: Path, browser: Browser) -> None:
    variants = json.loads((simulation_run / "results.json").read_text())["variants"]
    process = subprocess.Popen(
        [sys.executable, "-m", "feast_edge.cli", "dashboard", str(simulation_run), "--bind", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        # Ctrl-C as a terminal delivers it: a pytest started in the background (`cmd &`, nohup) ignores SIGINT, and a
        # child inherits that, so the SIGINT below would never reach the dashboard.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        url = _read_url(process, 60.0)
        driver = browser.open(url)
        wait_until(
            driver,
            lambda d: points(d, "chart-accuracy-macs") == len(variants),
            message="the variants never reached the accuracy chart",
        )
        assert len(variants) > 1
        assert driver.find_element("id", "title").text.startswith(f"{simulation_run.name}: feast, seed 0")
        assert (
            driver.find_element("id", "round-counter").text == "round 2 / 2"
        )  # the shared run: 2 clients, 2 rounds, validated each round
        assert [r.get_attribute("data-device") for r in rows(driver, "#fleet")] == ["client-000", "client-001"]
        served_round = json.loads((simulation_run / "results.json").read_text())["served_round"]
        assert driver.find_element("id", "served-round").text == (
            f"served: weights of round {served_round['round']} of 2: {served_round['reason']}"
        )
        assert (
            points(driver, "chart-validation") == 2 and points(driver, "chart-traffic") == 3 * 2
        )  # down, up, broadcast per round
        assert console_errors(driver) == []
        browser.screenshot()
    finally:
        process.send_signal(signal.SIGINT)
        try:
            out, err = process.communicate(timeout=30)  # a clean exit is the point, not its speed (a loaded CI machine)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
    assert process.returncode == 0, err
    assert "stopped" in out and "Traceback" not in err
