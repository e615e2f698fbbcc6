"""Fixtures of the dashboard tests: a filled state, a served dashboard, a browser that leaves a screenshot (a real run: ``simulation_run``, tests/conftest.py).

What test modules import lives in ``filled.py`` and ``browser.py``, not here: ``from conftest import`` finds
whichever ``conftest`` module pytest imported first (tests/federation has one too).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import Browser
from filled import fill

from feast_edge.dashboard import Dashboard, DashboardState, start_dashboard


@pytest.fixture
def filled(tmp_path: Path) -> DashboardState:
    return fill(DashboardState("federation", "lab federation"), tmp_path / "models")


@pytest.fixture
def served(filled: DashboardState) -> Iterator[Dashboard]:
    dashboard = start_dashboard(filled, "127.0.0.1:0")
    yield dashboard
    dashboard.stop()


@pytest.fixture
def browser(request: pytest.FixtureRequest) -> Iterator[Browser]:
    """A :class:`Browser`; at teardown it saves a screenshot if the test did not (a failed test leaves the page it saw) and quits."""
    opened = Browser(request.node.name)
    yield opened
    if opened.driver is not None:
        try:
            if not opened.shot:
                opened.screenshot()
        finally:
            opened.driver.quit()
