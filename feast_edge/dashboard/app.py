"""The dashboard's web side: a read-only Starlette app over a :class:`DashboardState`, served by uvicorn in a thread.

Routes (GET only; anything else is 405):

    /                    the page (static/index.html)
    /static/{file}       its script, styles and the vendored uPlot
    /api/state           the snapshot as JSON
    /api/events          server-sent events: the snapshot at once and at every change, a keepalive comment every 15 s
    /models/{device}.onnx  a device's exported model, as a download
    /healthz             "ok"

Safe by default: loopback unless told otherwise, and a token required on any
other address. With a token, every route needs it: ``?token=`` (which also sets
an HttpOnly, SameSite=Strict cookie, so the page's own requests carry it),
``Authorization: Bearer`` or that cookie. Every response carries a strict
Content-Security-Policy (no inline script or style, nothing from elsewhere).
HTTP only: uvicorn runs without WebSocket support (nothing here uses it), so an
upgrade request is answered as the plain GET it also is, and logs nothing.
Starlette and uvicorn are imported only here, inside functions: the rest of the
package works without the ``dashboard`` extra.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import ipaddress
import json
import logging
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from feast_edge.dashboard.state import DashboardState
from feast_edge.errors import FeastError

STATIC = Path(__file__).resolve().parent / "static"
DEFAULT_HOST = "127.0.0.1"
COOKIE = "feast_dashboard_token"
KEEPALIVE_SECONDS = 15.0
POLL_SECONDS = 0.25  # how often an event stream looks for a new version
START_SECONDS = 15.0
CSP = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'"
SECURITY_HEADERS = (
    ("content-security-policy", CSP),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
)
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
# What uvicorn logs, at warning level, for every request that asks for an upgrade when WebSocket support is off: anyone
# who can reach the port could fill the console with it, and its advice (install a WebSocket library) is wrong here.
_UPGRADE_WARNINGS = ("Unsupported upgrade request.", "No supported WebSocket library detected.")
_BIND = re.compile(r"(?:\[(?P<v6>[^\]]+)\]|(?P<host>[A-Za-z0-9._-]+)):(?P<port>\d{1,5})|(?P<only>\d{1,5})")


class DashboardError(FeastError):
    """The dashboard cannot be served as asked (missing extra, unsafe bind, port in use, bad address)."""


def parse_bind(text: str, option: str = "--dashboard") -> tuple[str, int]:
    """``8765``, ``HOST:PORT`` or ``[::1]:PORT`` as (host, port); the host defaults to 127.0.0.1, port 0 is any free port."""
    usage = f"{option} {text!r}: expected PORT or HOST:PORT, e.g. 8765 or 0.0.0.0:8765"
    match = _BIND.fullmatch(text.strip())
    if match is None:
        raise DashboardError(usage)
    port = int(match["port"] or match["only"])
    if port > 65535:
        raise DashboardError(f"{usage} (a port is at most 65535)")
    host = match["v6"] or match["host"] or DEFAULT_HOST
    if match["v6"] is not None:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise DashboardError(f"{usage} ([{host}] is not an IPv6 address)") from None
    return host, port


def is_loopback(host: str) -> bool:
    """Only this machine can reach ``host`` (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to an address others reach


def _require_extra() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise DashboardError("the dashboard needs Starlette and uvicorn: pip install 'feast-edge[dashboard]'") from None


# ------------------------------------------------------------------ the app
class _Guard:
    """ASGI middleware: the access token (when set) on every route, and the security headers on every response."""

    def __init__(self, app: Any, token: str | None) -> None:
        self.app = app
        self.token = token

    def _granted(self, scope: dict[str, Any]) -> str | None:
        """How the request proves the token: "query", "header" or "cookie"; None when it does not."""
        from starlette.requests import Request

        request = Request(scope)
        expected = self.token.encode()
        bearer = request.headers.get("authorization", "")
        offered = {
            "query": request.query_params.get("token"),
            "header": bearer[7:].strip() if bearer[:7].lower() == "bearer " else None,
            "cookie": unquote(request.cookies.get(COOKIE, "")) or None,
        }
        for how, given in offered.items():
            if given is not None and hmac.compare_digest(given.encode(), expected):
                return how
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from starlette.datastructures import MutableHeaders
        from starlette.responses import PlainTextResponse

        how = None if self.token is None else self._granted(scope)
        api = scope["path"].startswith("/api/")

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS:
                    headers[name] = value
                if api:
                    headers["cache-control"] = "no-store"
                if how == "query":
                    headers.append(
                        "set-cookie", f"{COOKIE}={quote(self.token, safe='')}; Path=/; HttpOnly; SameSite=Strict"
                    )
            await send(message)

        if self.token is not None and how is None:
            denied = PlainTextResponse(
                "401 unauthorized: this dashboard needs its access token; open the URL it printed (with ?token=...) "
                "or send 'Authorization: Bearer TOKEN'\n",
                status_code=401,
            )
            await denied(scope, receive, send_with_headers)
            return
        await self.app(scope, receive, send_with_headers)


def create_app(state: DashboardState, token: str | None = None, stopping: threading.Event | None = None) -> Any:
    """The Starlette app over ``state``; event streams end when ``stopping`` is set."""
    _require_extra()
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    stopping = stopping if stopping is not None else threading.Event()
    files = {path.name: path for path in STATIC.iterdir() if path.is_file()}

    def static_file(name: str) -> Response:
        path = files.get(name)
        if path is None:
            return PlainTextResponse("not found\n", status_code=404)
        return FileResponse(path, media_type=MEDIA_TYPES.get(path.suffix, "text/plain; charset=utf-8"))

    async def index(request: Request) -> Response:
        return static_file("index.html")

    async def static(request: Request) -> Response:
        return static_file(request.path_params["file"])

    async def api_state(request: Request) -> Response:
        return JSONResponse(state.snapshot())

    async def events(request: Request) -> Response:
        async def stream() -> Any:
            sent, quiet_since = -1, time.monotonic()
            while not stopping.is_set():
                if state.version != sent:
                    snapshot = state.snapshot()
                    sent, quiet_since = snapshot["version"], time.monotonic()
                    yield f"data: {json.dumps(snapshot, separators=(',', ':'), allow_nan=False)}\n\n"
                elif time.monotonic() - quiet_since >= KEEPALIVE_SECONDS:
                    quiet_since = time.monotonic()
                    yield ": keepalive\n\n"
                await asyncio.sleep(POLL_SECONDS)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"x-accel-buffering": "no"})

    async def model(request: Request) -> Response:
        device = request.path_params["device"]
        path = state.model_path(device)
        if path is None or not path.is_file():
            return PlainTextResponse(f"no exported model for device {device[:200]!r}\n", status_code=404)
        return FileResponse(path, media_type="application/octet-stream", filename=f"{device}.onnx")

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok\n")

    routes = [
        Route("/", index, methods=["GET"]),
        Route("/static/{file}", static, methods=["GET"]),
        Route("/api/state", api_state, methods=["GET"]),
        Route("/api/events", events, methods=["GET"]),
        Route("/models/{device:path}.onnx", model, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
    return Starlette(routes=routes, middleware=[Middleware(_Guard, token=token)])


# ------------------------------------------------------------------ serving
class Dashboard:
    """A dashboard being served by uvicorn in a daemon thread; :meth:`stop` ends it."""

    def __init__(
        self,
        state: DashboardState,
        host: str,
        port: int,
        token: str | None,
        server: Any,
        thread: threading.Thread,
        stopping: threading.Event,
    ) -> None:
        self.state = state
        self.host = host
        self.port = port
        self._token = token
        self._server = server
        self._thread = thread
        self._stopping = stopping

    @property
    def url(self) -> str:
        """What to open in a browser (with ``?token=`` when the dashboard has one)."""
        host = socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.port}/" + (f"?token={quote(self._token, safe='')}" if self._token else "")

    def stop(self, timeout: float = 3.0) -> None:
        """End the event streams and the server; returns within about ``timeout`` seconds."""
        self._stopping.set()
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(1.0)

    def __enter__(self) -> Dashboard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _drop_upgrade_warnings(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_UPGRADE_WARNINGS)


def _listen(host: str, port: int, option: str) -> socket.socket:
    """A socket bound to (host, port); a taken port or a bad host is a one-line :class:`DashboardError`."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise DashboardError(
            f"{option} {host}:{port}: cannot resolve host {host!r} ({exc.strerror}); give an address such as 127.0.0.1"
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # a restart binds while old connections linger in TIME_WAIT
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise DashboardError(
                f"{option}: port {port} on {host} is in use; choose another port (or 0 for any free one)"
            ) from None
        if exc.errno == errno.EACCES:
            raise DashboardError(
                f"{option}: binding port {port} on {host} is not permitted; use a port above 1023"
            ) from None
        raise DashboardError(f"{option}: cannot bind {host}:{port} ({exc.strerror}); choose another address") from None
    return sock


def check_bind(
    bind: str, token: str | None, *, option: str = "--dashboard", token_option: str = "--dashboard-token"
) -> tuple[str, int]:
    """(host, port) of ``bind`` once it is known to be usable: well-formed, a token where others can reach it, the web
    packages installed. Commands call it before they start anything, so a bad option costs nothing."""
    _require_extra()
    host, port = parse_bind(bind, option)
    if not is_loopback(host) and not token:
        raise DashboardError(
            f"{option} on {host} is reachable from other machines; give {token_option} TOKEN (or bind 127.0.0.1)"
        )
    return host, port


def start_dashboard(
    state: DashboardState,
    bind: str,
    token: str | None = None,
    *,
    option: str = "--dashboard",
    token_option: str = "--dashboard-token",
) -> Dashboard:
    """Serve ``state`` on ``bind`` (see :func:`parse_bind`) in a daemon thread; returns once it accepts connections.

    ``option`` and ``token_option`` name the command-line options in error messages.
    """
    host, port = check_bind(bind, token, option=option, token_option=token_option)
    import uvicorn

    if _drop_upgrade_warnings not in logging.getLogger("uvicorn.error").filters:
        logging.getLogger("uvicorn.error").addFilter(_drop_upgrade_warnings)
    token = token or None
    sock = _listen(host, port, option)
    port = sock.getsockname()[1]  # the free port chosen for port 0
    stopping = threading.Event()
    config = uvicorn.Config(
        create_app(state, token, stopping),
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="off",
        server_header=False,
        timeout_graceful_shutdown=1,
        ws="none",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dashboard", daemon=True)
    thread.start()
    began = time.monotonic()
    while not server.started:
        if not thread.is_alive() or time.monotonic() - began > START_SECONDS:
            server.should_exit = True
            thread.join(3.0)
            sock.close()
            raise DashboardError(f"{option}: the dashboard did not start on {host}:{port}; see the log above")
        time.sleep(0.02)
    return Dashboard(state, host, port, token, server, thread, stopping)
