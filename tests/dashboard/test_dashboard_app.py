"""The web side, served for real (uvicorn in its thread) and asked over HTTP: routes, token, headers, downloads, events, binding."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from filled import MODEL_BYTES

from feast_edge.dashboard import Dashboard, DashboardError, DashboardState, parse_bind, start_dashboard
from feast_edge.dashboard.app import CSP

ROUTES = ("/", "/static/dashboard.js", "/api/state", "/api/events", "/models/pi-5.onnx", "/healthz")
PAGE_ROUTES = (
    "/",
    "/static/dashboard.js",
    "/static/dashboard.css",
    "/static/uPlot.iife.min.js",
    "/api/state",
    "/models/pi-5.onnx",
    "/healthz",
)


def base(dashboard: Dashboard) -> str:
    return f"http://127.0.0.1:{dashboard.port}"


def first_event(url: str, **kwargs: object) -> dict:
    """The snapshot carried by the first ``data:`` event of the stream at ``url``."""
    with httpx.stream("GET", url, timeout=10.0, **kwargs) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[len("data: ") :])
    raise AssertionError("the event stream ended without an event")


def test_page_static_files_and_state(served: Dashboard, filled: DashboardState) -> None:
    url = base(served)
    page = httpx.get(url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for section in (
        'id="fleet"',
        'id="round-counter"',
        'id="round"',
        'id="learned"',
        'id="traffic"',
        'id="models"',
        'id="chart-accuracy-macs"',
    ):
        assert section in page.text
    script = httpx.get(url + "/static/dashboard.js")
    assert (
        script.status_code == 200
        and script.headers["content-type"].startswith("text/javascript")
        and "EventSource" in script.text
    )
    assert httpx.get(url + "/static/uPlot.iife.min.js").text.startswith(
        "/*! https://github.com/leeoniya/uPlot (v1.6.32)"
    )
    assert "MIT" in httpx.get(url + "/static/uPlot.LICENSE").text
    assert httpx.get(url + "/static/nothing.js").status_code == 404
    assert httpx.get(url + "/static/..%2Fapp.py").status_code == 404
    state = httpx.get(url + "/api/state")
    assert state.status_code == 200 and state.headers["cache-control"] == "no-store"
    snapshot = state.json()
    assert snapshot["version"] == filled.version and snapshot["kind"] == "federation"
    assert [d["name"] for d in snapshot["devices"]] == ["jetson", "pi-5"]
    assert httpx.get(url + "/healthz").text == "ok\n"


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_every_route_is_read_only(served: Dashboard, method: str) -> None:
    for route in ROUTES:
        assert httpx.request(method, base(served) + route).status_code == 405, route


def test_every_response_carries_the_security_headers(served: Dashboard) -> None:
    for route in (*PAGE_ROUTES, "/missing", "/models/nobody.onnx"):
        headers = httpx.get(base(served) + route).headers
        assert headers["content-security-policy"] == CSP, route
        assert headers["x-content-type-options"] == "nosniff" and headers["referrer-policy"] == "no-referrer", route
    assert "script-src 'self'" in CSP and "unsafe-inline" not in CSP


WEBSOCKET_UPGRADE = {
    "Connection": "Upgrade",
    "Upgrade": "websocket",
    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
    "Sec-WebSocket-Version": "13",
}


def test_an_upgrade_request_is_a_plain_request_behind_the_token_and_logs_nothing(
    filled: DashboardState, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("DEBUG"), start_dashboard(filled, "127.0.0.1:0", token="s3cret") as dashboard:
        url = base(dashboard)
        denied = httpx.get(url + "/api/state", headers=WEBSOCKET_UPGRADE)
        assert denied.status_code == 401 and denied.headers["content-security-policy"] == CSP
        answered = httpx.get(url + "/api/state", headers={**WEBSOCKET_UPGRADE, "Authorization": "Bearer s3cret"})
        assert answered.status_code == 200 and answered.json()["kind"] == "federation"
        assert (
            httpx.get(url + "/ws", headers={**WEBSOCKET_UPGRADE, "Authorization": "Bearer s3cret"}).status_code == 404
        )
    assert [r.getMessage() for r in caplog.records if r.name.startswith("uvicorn") and r.levelname != "DEBUG"] == []


def test_model_download_and_unknown_devices(served: Dashboard, filled: DashboardState, tmp_path: Path) -> None:
    url = base(served)
    download = httpx.get(url + "/models/pi-5.onnx")
    assert download.status_code == 200 and download.content == MODEL_BYTES
    assert download.headers["content-type"] == "application/octet-stream"
    assert download.headers["content-disposition"].startswith("attachment")
    assert httpx.get(url + "/models/jetson.onnx").status_code == 404  # a device without an exported model
    assert httpx.get(url + "/models/..%2F..%2Fetc%2Fpasswd.onnx").status_code == 404
    odd = "cam 1/β"
    (tmp_path / "odd.onnx").write_bytes(b"odd")
    filled.set_models([{"device": odd, "file": "odd.onnx", "sha256": "00"}], tmp_path)
    [model] = httpx.get(url + "/api/state").json()["models"]
    assert httpx.get(f"{url}/{model['url']}").content == b"odd"
    (tmp_path / "odd.onnx").unlink()
    assert httpx.get(f"{url}/{model['url']}").status_code == 404  # listed, but the file is gone


def test_events_send_the_snapshot_at_once_and_at_each_change(served: Dashboard, filled: DashboardState) -> None:
    first = first_event(base(served) + "/api/events")
    assert first["version"] == filled.version and first["title"] == "lab federation"
    assert [d["name"] for d in first["devices"]] == ["jetson", "pi-5"]
    with httpx.stream("GET", base(served) + "/api/events", timeout=10.0) as response:
        lines = response.iter_lines()
        versions = []
        for line in lines:
            if line.startswith("data: "):
                versions.append(json.loads(line[6:])["version"])
                if len(versions) == 1:
                    filled.end_round({"round": 3, "val_accuracy": 0.6})
                else:
                    break
    assert versions[1] > versions[0]


def test_a_token_guards_every_route(filled: DashboardState) -> None:
    with start_dashboard(filled, "127.0.0.1:0", token="s3cret/+") as dashboard:
        url = base(dashboard)
        assert dashboard.url == f"http://127.0.0.1:{dashboard.port}/?token=s3cret%2F%2B"
        for route in ROUTES:
            denied = httpx.get(url + route)
            assert denied.status_code == 401 and "access token" in denied.text, route
            assert denied.headers["content-security-policy"] == CSP
            assert httpx.get(url + route, params={"token": "wrong"}).status_code == 401, route
            assert httpx.get(url + route, headers={"Authorization": "Bearer wrong"}).status_code == 401, route
        opened = httpx.get(url + "/", params={"token": "s3cret/+"})
        assert opened.status_code == 200
        cookie = opened.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        with httpx.Client(base_url=url) as browser:  # the page's own requests: the cookie alone
            browser.get("/", params={"token": "s3cret/+"})
            assert browser.get("/api/state").status_code == 200
            assert browser.get("/models/pi-5.onnx").content == MODEL_BYTES
        assert httpx.get(url + "/api/state", headers={"Authorization": "Bearer s3cret/+"}).status_code == 200
        assert first_event(url + "/api/events", headers={"Authorization": "Bearer s3cret/+"})["kind"] == "federation"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8765", ("127.0.0.1", 8765)),
        ("0", ("127.0.0.1", 0)),
        ("0.0.0.0:8765", ("0.0.0.0", 8765)),
        ("localhost:80", ("localhost", 80)),
        ("[::1]:9000", ("::1", 9000)),
        (" 127.0.0.2:1 ", ("127.0.0.2", 1)),
    ],
)
def test_parse_bind(text: str, expected: tuple[str, int]) -> None:
    assert parse_bind(text) == expected


@pytest.mark.parametrize("text", ["x:y", "", "host:", ":8765", "8765:host", "70000", "[::zz]:80", "::1:80", "a b:1"])
def test_parse_bind_refuses(text: str) -> None:
    with pytest.raises(
        DashboardError, match=r"^--dashboard .*: expected PORT or HOST:PORT, e\.g\. 8765 or 0\.0\.0\.0:8765"
    ):
        parse_bind(text)


def test_parse_bind_names_the_option() -> None:
    with pytest.raises(DashboardError) as refused:
        parse_bind("x:y")
    assert str(refused.value) == "--dashboard 'x:y': expected PORT or HOST:PORT, e.g. 8765 or 0.0.0.0:8765"
    with pytest.raises(DashboardError, match="^--bind 'x:y': "):
        parse_bind("x:y", option="--bind")


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20", "lab-server.example"])
def test_a_reachable_address_needs_a_token(filled: DashboardState, host: str) -> None:
    with pytest.raises(DashboardError) as refused:
        start_dashboard(filled, f"{host}:0")
    assert (
        str(refused.value)
        == f"--dashboard on {host} is reachable from other machines; give --dashboard-token TOKEN (or bind 127.0.0.1)"
    )


def test_a_taken_port_is_a_clear_error(filled: DashboardState) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            DashboardError, match=f"^--dashboard: port {port} on 127.0.0.1 is in use; choose another port"
        ):
            start_dashboard(filled, f"127.0.0.1:{port}")


def test_missing_extra_names_it(filled: DashboardState, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "uvicorn", None)  # as if feast-edge[dashboard] were not installed
    with pytest.raises(DashboardError) as refused:
        start_dashboard(filled, "127.0.0.1:0")
    assert str(refused.value) == "the dashboard needs Starlette and uvicorn: pip install 'feast-edge[dashboard]'"


def test_stop_returns_quickly_with_a_stream_open(filled: DashboardState) -> None:
    dashboard = start_dashboard(filled, "127.0.0.1:0")
    connected, ended = threading.Event(), threading.Event()

    def listen() -> None:
        try:
            with httpx.stream("GET", base(dashboard) + "/api/events", timeout=30.0) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        connected.set()
        except httpx.HTTPError:
            pass
        ended.set()

    client = threading.Thread(target=listen, daemon=True)
    client.start()
    assert connected.wait(10.0)
    began = time.monotonic()
    dashboard.stop()
    assert time.monotonic() - began < 3.5
    assert ended.wait(5.0), "the event stream stayed open after stop()"
    with pytest.raises(httpx.ConnectError):
        httpx.get(base(dashboard) + "/healthz")
