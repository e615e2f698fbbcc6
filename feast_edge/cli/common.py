"""What the three console scripts share: the error exit, logging, MAC parsing, MQTT and device options.

* :func:`run_cli` turns a user error (:class:`FeastError`) into one ``error:``
  line on stderr and exit status 2, Ctrl-C into status 130, never a traceback.
* :func:`setup_logging`: each status line once on the console (stderr, a short
  time stamp, ``warning:`` / ``error:`` prefixes), and with ``--log-file`` every
  record at debug level, with full time stamps and logger names, in that file.
* :func:`mqtt_options` adds the broker connection options (``--broker``,
  credentials, TLS) to a command, which receives them as one
  :class:`~feast_edge.transport.link.LinkConfig` (``feast_edge.cli.population``
  does the same for the data and client-population options of ``simulate``
  and ``partition``; ``feast_edge.cli.progress.Stage`` shows a long step).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import typer
from rich.console import Console

from feast_edge.budget.derive import parse_macs  # noqa: F401 (re-exported: the options parse MAC counts with it)
from feast_edge.errors import FeastError
from feast_edge.local.torch_device import DEVICE_CHOICES
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.credentials import credentials_of, load_credentials

F = TypeVar("F", bound=Callable[..., Any])

# Libraries that log at info level about their own work; a user wants our lines, not theirs.
_QUIET = ("feast_edge.transport.link.paho", "onnx_ir", "onnxscript", "torch.onnx", "amqtt", "transitions")
LEVELS = ("debug", "info", "warning", "error")


def make_console(stderr: bool = False) -> Console:
    """A rich console; outside a terminal (logs, pipes) wide enough that tables are not wrapped at 80 columns."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr) if stream.isatty() else Console(stderr=stderr, width=200)


def make_app(name: str, help: str) -> typer.Typer:
    """A typer app as every console script configures it."""
    return typer.Typer(name=name, help=help, no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)


def run_cli(application: typer.Typer) -> None:
    """Run a typer app as a console script: user errors become one ``error:`` line and exit status 2."""
    try:
        application()
    except FeastError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def millions(n: float) -> str:
    """``12,345,678`` as ``12.35M``."""
    return f"{n / 1e6:,.2f}M"


def parse_list(text: str | None) -> list[str]:
    """A comma-separated option as a list of its non-empty, stripped items."""
    return [item.strip() for item in (text or "").split(",") if item.strip()]


class _ConsoleFormatter(logging.Formatter):
    """``HH:MM:SS message``, with ``warning:`` / ``error:`` before anything above info."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = self.formatTime(record, "%H:%M:%S")
        prefix = "" if record.levelno <= logging.INFO else f"{record.levelname.lower()}: "
        text = f"{stamp} {prefix}{record.getMessage()}"
        if record.exc_info and record.levelno >= logging.ERROR:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(level: str = "info", log_file: Path | None = None) -> None:
    """Console at ``level`` (each line once); with ``log_file``, every record at debug level in that file too."""
    numeric = getattr(logging, level.upper(), None) if level.lower() in LEVELS else None
    if not isinstance(numeric, int):
        raise FeastError(f"--log-level {level!r} is not one of {', '.join(LEVELS)}")
    handlers: list[logging.Handler] = []
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(numeric)
    console.setFormatter(_ConsoleFormatter())
    handlers.append(console)
    if log_file is not None:
        try:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            file_handler = logging.FileHandler(log_file, encoding="utf-8")
        except OSError as exc:
            raise FeastError(
                f"--log-file {log_file}: cannot open it for writing ({exc.strerror}); choose a writable path"
            ) from None
        file_handler.setLevel(logging.DEBUG)
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
        handlers.append(file_handler)
    logging.basicConfig(level=logging.DEBUG if log_file is not None else numeric, handlers=handlers, force=True)
    for noisy in _QUIET:
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))


@contextmanager
def heartbeat(logger: logging.Logger, text: str, every: float = 10.0) -> Iterator[None]:
    """Log ``text (N s)`` every ``every`` seconds while the block runs, so a long step is never silent."""
    began, done = time.monotonic(), threading.Event()

    def beat() -> None:
        while not done.wait(every):
            logger.info("%s (%.0f s)", text, time.monotonic() - began)

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


# --- options shared by several commands -----------------------------------------------------------

DEFAULT_FEDERATION = "feast"
FederationOpt = Annotated[
    str,
    typer.Option("--federation", help="Federation id (topic prefix feast/<id>/); server and agents must use the same."),
]
# Commands that take --credentials: the bundle names the federation, so the option has no default of its own.
BundleFederationOpt = Annotated[
    str | None,
    typer.Option(
        "--federation",
        help="Federation id (topic prefix feast/<id>/; default: the --credentials bundle's, else 'feast').",
    ),
]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="Console detail: debug, info, warning or error.")]
LogFileOpt = Annotated[
    Path | None,
    typer.Option("--log-file", help="Also write every log record (debug level, time-stamped) to this file."),
]
DeviceOpt = Annotated[
    str, typer.Option("--device", help=f"Where PyTorch runs: {DEVICE_CHOICES} (auto: CUDA when present, else CPU).")
]
AmpOpt = Annotated[
    str,
    typer.Option(
        "--amp",
        help="Mixed precision of local training: auto (bf16 on GPUs that have it, else fp16 with a gradient scaler; "
        "on the CPU bf16 where it has native bfloat16, AVX512-BF16/AMX or Arm BF16, else float32), off, bf16 or fp16.",
    ),
]
DeterministicOpt = Annotated[
    bool,
    typer.Option(
        "--deterministic",
        help="Deterministic PyTorch kernels: bit-reproducible training on CUDA too, at a speed cost (the CPU already is).",
    ),
]
ChunkOpt = Annotated[
    int,
    typer.Option(
        "--chunk-size",
        min=1024,
        max=16 * 1024 * 1024,
        help="Chunk size in bytes for model payloads, and the largest chunk accepted.",
    ),
]
ThreadsOpt = Annotated[
    int,
    typer.Option(
        "--threads", min=0, help="PyTorch intra-op threads (0: chosen from the cores free before each computing step)."
    ),
]
DashboardOpt = Annotated[
    str | None,
    typer.Option(
        "--dashboard",
        metavar="[HOST:]PORT",
        help="Serve a live web dashboard on PORT (127.0.0.1 unless HOST is given; 0: a free port). Needs feast-edge[dashboard].",
    ),
]
DashboardTokenOpt = Annotated[
    str | None,
    typer.Option(
        "--dashboard-token",
        envvar="FEAST_DASHBOARD_TOKEN",
        help="Access token the dashboard requires (or $FEAST_DASHBOARD_TOKEN); required off loopback.",
    ),
]
PayloadDtypeOpt = Annotated[
    str,
    typer.Option(
        "--payload-dtype",
        help="Payloads on the wire, both directions: float32, float16 or bfloat16 (aggregation and the model stay float32).",
    ),
]
PresetOpt = Annotated[
    str, typer.Option("--preset", "-p", help="Preset name (see 'feast-edge presets') or a .toml file.")
]
ArchOpt = Annotated[
    str,
    typer.Option(
        "--arch",
        "-a",
        help='Architecture as JSON {"d":[..],"e":[..],"w":[..]} or text "d=[..] e=[..] w=[..]".',
    ),
]
Int8SamplesOpt = Annotated[
    int, typer.Option("--int8-samples", min=1, help="Images that set an int8 file's activation ranges.")
]
Int8ToleranceOpt = Annotated[
    float,
    typer.Option(
        "--int8-tolerance",
        help="Accuracy an int8 file may lose against float32 on held-out data (0.01 = 1 point); past it, the float32 "
        "file is kept.",
    ),
]
TensorBoardOpt = Annotated[
    bool,
    typer.Option(
        "--tensorboard",
        help="Also write per-round metrics as TensorBoard event files in RUN_DIR/tensorboard (needs the tensorboard package).",
    ),
]


def check_dashboard(bind: str | None, token: str | None) -> None:
    """Refuse a bad ``--dashboard`` / ``--dashboard-token`` (DashboardError, one line) before a command starts its work."""
    if bind is not None:
        from feast_edge.dashboard.app import check_bind

        check_bind(bind, token)


def open_dashboard(state: Any, bind: str, token: str | None, say: Callable[[str], None]) -> Any:
    """Start the web dashboard of ``state`` on ``bind`` and say its address; DashboardError (a user error) when it cannot."""
    from feast_edge.dashboard.app import start_dashboard

    dashboard = start_dashboard(state, bind, token)
    say(f"dashboard: {dashboard.url}")
    return dashboard


_MQTT_OPTIONS = {
    "username": (Optional[str], None, typer.Option("--username", help="MQTT user name.")),
    "password": (
        Optional[str],
        None,
        typer.Option("--password", help="MQTT password (or $FEAST_MQTT_PASSWORD).", envvar="FEAST_MQTT_PASSWORD"),
    ),
    "ca_file": (
        Optional[str],
        None,
        typer.Option("--ca-file", help="TLS: CA bundle that signed the broker's certificate."),
    ),
    "cert_file": (Optional[str], None, typer.Option("--cert-file", help="TLS: client certificate (mutual TLS).")),
    "key_file": (Optional[str], None, typer.Option("--key-file", help="TLS: client key.")),
    "tls_insecure": (
        bool,
        False,
        typer.Option("--tls-insecure", help="TLS without verifying the broker's certificate (tests only)."),
    ),
}


def mqtt_options(
    broker_help: str = "MQTT broker URL: mqtt://host:port or mqtts://host:port (TLS).", required: bool = True
) -> Callable[[F], F]:
    """Give a typer command the broker options; it receives them as ``link: LinkConfig`` (None when not required and absent).

    The decorated function declares a ``link`` parameter (and no broker
    options); the options appear in ``--help`` after the command's own. With
    ``--credentials`` the broker, TLS files, user name and signing keys come
    from the bundle (``--broker`` still overrides the bundle's broker URL).
    """
    options = {
        "broker": (
            Optional[str],
            None,
            typer.Option(
                "--broker", "-b", help=broker_help + (" Required unless --credentials gives it." if required else "")
            ),
        ),
        "credentials": (
            Optional[Path],
            None,
            typer.Option(
                "--credentials",
                help="Credentials bundle from 'feast-server provision' (a directory): identity, broker, TLS, signing keys.",
            ),
        ),
        **_MQTT_OPTIONS,
    }

    def build(values: dict[str, Any]) -> LinkConfig | None:
        url, bundle = values.pop("broker"), values.pop("credentials")
        if bundle is not None:
            given = [
                f"--{name.replace('_', '-')}"
                for name in ("username", "password", "ca_file", "cert_file", "key_file")
                if values[name]
            ]
            if given:
                raise FeastError(
                    f"{', '.join(given)} conflict with --credentials, which carries the identity; drop them"
                )
            return load_credentials(bundle).link_config(LinkConfig(**values), broker=url)
        if url is None and required:
            raise FeastError(
                "no broker: give --broker mqtt://host:port, or --credentials with a bundle from feast-server provision"
            )
        return None if url is None else LinkConfig(broker=url, **values)

    return option_group("link", options, build, panel="Broker")


InsecureOpt = Annotated[
    bool,
    typer.Option(
        "--insecure",
        help="Run without --credentials: no identities, no signatures (anyone on the broker can take part). Refused "
        "without this flag.",
    ),
]

STRANGER = (
    "anyone who can reach the broker can register as a device, read every routed slice of the model, forge updates "
    "and receipts, and answer fetch-model with another model"
)


def check_insecure(link: LinkConfig | None, insecure: bool, command: str) -> None:
    """Without a credentials bundle, ``command`` runs only with ``--insecure`` (FeastError otherwise)."""
    if credentials_of(link) is None and not insecure:
        where = link.broker if link is not None else "the broker"
        raise FeastError(
            f"{command} without --credentials is unauthenticated: {STRANGER} on {where}; give --credentials BUNDLE "
            "(feast-server provision writes them), or --insecure to run so anyway"
        )


def warn_insecure(link: LinkConfig | None) -> None:
    """Once every input is checked, just before connecting: one warning line when the run is unauthenticated."""
    if credentials_of(link) is None:
        where = link.broker if link is not None else "the broker"
        logging.getLogger("feast_edge").warning("--insecure: no credentials, no signatures: %s (%s)", STRANGER, where)


def federation_of(link: LinkConfig | None, federation: str | None) -> str:
    """The federation id: --federation, else the credentials bundle's, else 'feast'; a bundle for another federation is an error."""
    bundle = credentials_of(link)
    if bundle is not None and federation is not None and federation != bundle.federation:
        raise FeastError(
            f"--federation {federation} differs from the credentials bundle's federation {bundle.federation!r}; drop --federation"
        )
    return federation or (bundle.federation if bundle is not None else DEFAULT_FEDERATION)


def option_group(
    target: str,
    options: dict[str, tuple[Any, Any, Any]],
    build: Callable[[dict[str, Any]], Any],
    panel: str | None = None,
) -> Callable[[F], F]:
    """Add ``options`` (name -> (type, default, typer.Option)) to a command, which receives ``build(their values)`` as
    ``target``; ``panel``: the ``--help`` panel they are shown in."""
    for _, _, option in options.values():
        option.rich_help_panel = option.rich_help_panel or panel

    def decorate(func: F) -> F:
        signature = inspect.signature(func, eval_str=True)
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for name, p in signature.parameters.items() if name != target
        ]
        added = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, option])
            for name, (kind, default, option) in options.items()
        ]
        # Required options first: a parameter without a default may not follow one with a default.
        params = sorted(own + added, key=lambda p: p.default is not inspect.Parameter.empty)

        @functools.wraps(func)
        def wrapper(**kwargs: Any) -> Any:
            kwargs[target] = build({name: kwargs.pop(name) for name in options})
            return func(**kwargs)

        wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper  # type: ignore[return-value]

    return decorate
