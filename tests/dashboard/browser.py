"""Headless Debian Chromium driven by Selenium, for the dashboard's browser tests.

The browser is the system's (``apt-get install chromium chromium-driver``, as CI
does); nothing is downloaded. Its absence fails the tests instead of skipping
them: a dashboard nobody rendered is untested.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = Path(__file__).resolve().parents[2] / "build" / "test-artifacts"
WINDOW = (1280, 900)


def open_page(url: str) -> Any:
    """A headless Chromium (1280x900) showing ``url``; the caller quits it."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.fail(
            f"headless Chromium is not installed ({', '.join(missing)} missing): apt-get install chromium chromium-driver",
            pytrace=False,
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail(
            "selenium is not installed: pip install -e '.[dev]' (and apt-get install chromium chromium-driver)",
            pytrace=False,
        )
    options = Options()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_window_size(*WINDOW)
    driver.set_page_load_timeout(30)
    driver.get(url)
    return driver


def wait_until(driver: Any, condition: Callable[[Any], Any], timeout: float = 15.0, message: str = "") -> Any:
    """Poll ``condition(driver)`` until it is truthy (its value is returned) or ``timeout`` seconds pass (TimeoutException)."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(condition, message)


def save_screenshot(driver: Any, name: str) -> Path:
    """A PNG of the whole page (1280 wide) in build/test-artifacts/, named after the test."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{''.join(c if c.isalnum() or c in '-_.' else '_' for c in name)}.png"
    height = int(driver.execute_script("return document.documentElement.scrollHeight;") or WINDOW[1])
    driver.set_window_size(WINDOW[0], max(WINDOW[1], height + 140))  # the window's frame takes some of its height
    try:
        driver.save_screenshot(str(path))
    finally:
        driver.set_window_size(*WINDOW)
    return path


def console_errors(driver: Any) -> list[str]:
    """The browser console's errors so far (a CSP violation, a script exception, a failed request)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def points(driver: Any, chart_id: str) -> int:
    """How many points the page says the chart plots (its data-points attribute)."""
    return int(driver.find_element("id", chart_id).get_attribute("data-points") or 0)


class Browser:
    """Headless Chromium for one test; its screenshot lands in build/test-artifacts/<test>.png."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.driver: Any = None
        self.shot = False

    def open(self, url: str) -> Any:
        assert self.driver is None, "one page per test"
        self.driver = open_page(url)
        return self.driver

    def screenshot(self) -> Path:
        """Save the page as it is now (call it while the dashboard still serves)."""
        self.shot = True
        return save_screenshot(self.driver, self.name)
