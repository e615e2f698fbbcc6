"""Issue 11's acceptance: a real 2-round federation (feast-server --dashboard, two feast-agent processes, the local
Mosquitto) watched in headless Chromium; the rendered DOM shows both devices online with their budgets, the round
counter reaching 2 and points on the accuracy charts. A screenshot is left in build/test-artifacts/."""

from __future__ import annotations

import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser import console_errors, open_page, points, save_screenshot, wait_until

from commands import LOCAL, agent_command, server_command, spawn
from feast_edge.sim.shards import read_index, write_partition
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.retained import clear_retained
from simconfigs import tiny_config

# A feast-server and feast-agent processes on the broker at 127.0.0.1:1883, watched in headless Chromium.
pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.browser, pytest.mark.timeout(600)]

CONFIG = tiny_config(clients=2, per_round=2, test_limit=50, seed=5)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _dashboard_url(log: Path, server: subprocess.Popen, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"dashboard: (http://\S+)", log.read_text(errors="replace"))
        if found:
            return found.group(1)
        assert server.poll() is None, f"feast-server exited:\n{log.read_text(errors='replace')[-2000:]}"
        time.sleep(0.2)
    raise AssertionError(
        f"feast-server never printed its dashboard address:\n{log.read_text(errors='replace')[-2000:]}"
    )


@pytest.fixture
def federation(tmp_path: Path, fashion_mnist_dir: Path) -> Iterator[dict[str, Any]]:
    """feast-server run --dashboard 127.0.0.1:0 --serve and two agents on the partition's two shards."""
    name = f"dash{uuid.uuid4().hex[:10]}"
    partition = tmp_path / "partition"
    write_partition(CONFIG, partition)
    clients = read_index(partition)["clients"]
    server = spawn(
        server_command(
            CONFIG, tmp_path / "server", name, partition,
            wait_timeout=120, dashboard="127.0.0.1:0", serve=True,
        ),
        tmp_path / "server.log",
    )  # fmt: skip
    processes = [server]
    try:
        url = _dashboard_url(tmp_path / "server.log", server)
        for c in clients:  # --stay: online until the test ends, however fast the tiny rounds go
            command = agent_command(
                c["client_id"], partition / c["file"], name, "--model-dir", str(tmp_path / "models"), "--stay"
            )
            processes.append(spawn(command, tmp_path / f"agent-{c['client_id']}.log"))
        yield {"url": url, "clients": clients, "server": server, "logs": tmp_path}
    finally:
        for process in reversed(processes):
            _stop(process)
        clear_retained(LinkConfig(broker=LOCAL), f"feast/{name}/#")


FLEET = """return Array.from(document.querySelectorAll('#fleet tbody tr')).map(r => ({
  device: r.dataset.device, online: r.querySelector('td.online') !== null, budget: (r.querySelector('td.budget') || {}).textContent}));"""


def _fleet(driver: Any) -> dict[str, dict[str, Any]]:
    """The fleet table as rendered now, read in one script call (the page re-renders rows as updates arrive)."""
    return {row["device"]: row for row in driver.execute_script(FLEET)}


def test_a_live_federation_shows_its_fleet_rounds_and_accuracy_in_a_real_browser(
    federation: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    driver = open_page(federation["url"])
    try:
        names = [c["client_id"] for c in federation["clients"]]
        budgets = {c["client_id"]: f"{c['budget_macs'] / 1e6:.2f}" for c in federation["clients"]}

        def both_online(d: Any) -> dict[str, dict[str, Any]] | None:
            fleet = _fleet(d)
            return fleet if all(n in fleet and fleet[n]["online"] for n in names) else None

        fleet = wait_until(driver, both_online, timeout=120, message="both devices never showed online")
        assert {name: row["budget"] for name, row in fleet.items()} == budgets
        wait_until(
            driver,
            lambda d: (
                d.find_element("id", "round-counter").text == "round 2 / 2" and points(d, "chart-validation") >= 2
            ),
            timeout=300,
            message="the round counter never reached 2 with two validated rounds",
        )
        assert points(driver, "chart-accuracy-macs") > 0
        assert driver.find_element("id", "connection").text == "live"
        assert driver.find_element("id", "validation-source").text == "(validation: on the server's data)"
        wait_until(
            driver,
            lambda d: len(d.find_elements("css selector", "#models tbody tr")) == 2,
            timeout=180,
            message="the exported models never appeared",
        )
        links = driver.execute_script(
            "return Array.from(document.querySelectorAll('#models tbody a')).map(a => a.href);"
        )
        assert len(links) == 2 and all(link.endswith(".onnx") for link in links)
        assert not console_errors(driver)
        save_screenshot(driver, request.node.name)
    finally:
        driver.quit()
    assert federation["server"].poll() is None, "feast-server --serve should still be serving"
