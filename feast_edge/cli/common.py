"""What the three console scripts share: the error exit, logging, MAC parsing, MQTT and device options.

* :func:`run_cli` turns a user error (:class:`FeastError`) into one ``error:``
  line on stderr and exit status 2, Ctrl-C into status 130, never a traceback.
* :func:`setup_logging`: each status line once on the console (stderr, a short
  time stamp, ``warning:`` / ``error:`` prefixes), and with ``--log-file`` every
  record at debug level, with full time stamps and logger names, in that file.
* :func:`mqtt_options` adds the broker connection options (``--broker``,
  credentials, TLS) to a command, which receives them as one
  :class:`~feast_edge.transport.link.LinkConfig`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import typer
from rich.console import Console

from feast_edge.errors import FeastError
from feast_edge.runtime import DEVICE_CHOICES
from feast_edge.transport.chunks import DEFAULT_CHUNK_SIZE
from feast_edge.transport.link import LinkConfig

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


def parse_macs(text: str) -> float:
    """MAC counts as ``25000000``, ``25e6``, ``25M``, ``1.5G`` or ``800K``."""
    raw = text.strip().replace("_", "").replace(",", "")
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(raw[-1:].upper(), 1.0)
    number = raw[:-1] if scale != 1.0 else raw
    try:
        value = float(number) * scale
    except ValueError:
        raise FeastError(f"cannot read {text!r} as a MAC count; write e.g. 25000000, 25e6 or 25M") from None
    if not value > 0 or value != value or value == float("inf"):
        raise FeastError(f"MAC count {text!r} must be a positive finite number")
    return value


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
            raise FeastError(f"--log-file {log_file}: cannot open it for writing ({exc.strerror}); choose a writable path") from None
        file_handler.setLevel(logging.DEBUG)
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
        handlers.append(file_handler)
    logging.basicConfig(level=logging.DEBUG if log_file is not None else numeric, handlers=handlers, force=True)
    for noisy in _QUIET:
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))


def torch_threads(threads: int) -> None:
    """``--threads N`` (0 keeps PyTorch's default)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


# --- options shared by several commands -----------------------------------------------------------

FederationOpt = Annotated[str, typer.Option("--federation", help="Federation id (topic prefix feast/<id>/); server and agents must use the same.")]
LogLevelOpt = Annotated[str, typer.Option("--log-level", help="Console detail: debug, info, warning or error.")]
LogFileOpt = Annotated[Optional[Path], typer.Option("--log-file", help="Also write every log record (debug level, time-stamped) to this file.")]
DeviceOpt = Annotated[str, typer.Option("--device", help=f"Where PyTorch runs: {DEVICE_CHOICES} (auto: CUDA when present, else CPU).")]
ChunkOpt = Annotated[
    int, typer.Option("--chunk-size", min=1024, max=16 * 1024 * 1024, help="Chunk size in bytes for model payloads, and the largest chunk accepted.")
]
ThreadsOpt = Annotated[int, typer.Option("--threads", min=0, help="PyTorch intra-op threads (0: PyTorch's default).")]

_MQTT_OPTIONS = {
    "username": (Optional[str], None, typer.Option("--username", help="MQTT user name.")),
    "password": (Optional[str], None, typer.Option("--password", help="MQTT password (or $FEAST_MQTT_PASSWORD).", envvar="FEAST_MQTT_PASSWORD")),
    "ca_file": (Optional[str], None, typer.Option("--ca-file", help="TLS: CA bundle that signed the broker's certificate.")),
    "cert_file": (Optional[str], None, typer.Option("--cert-file", help="TLS: client certificate (mutual TLS).")),
    "key_file": (Optional[str], None, typer.Option("--key-file", help="TLS: client key.")),
    "tls_insecure": (bool, False, typer.Option("--tls-insecure", help="TLS without verifying the broker's certificate (tests only).")),
}


def mqtt_options(broker_help: str = "MQTT broker URL: mqtt://host:port or mqtts://host:port (TLS).", required: bool = True) -> Callable[[F], F]:
    """Give a typer command the broker options; it receives them as ``link: LinkConfig`` (None when not required and absent).

    The decorated function declares a ``link`` parameter (and no broker
    options); the options appear in ``--help`` after the command's own.
    """

    def decorate(func: F) -> F:
        signature = inspect.signature(func, eval_str=True)
        own = [p for name, p in signature.parameters.items() if name != "link"]
        broker_type = str if required else Optional[str]
        added = [
            inspect.Parameter(
                "broker",
                inspect.Parameter.KEYWORD_ONLY,
                default=inspect.Parameter.empty if required else None,
                annotation=Annotated[broker_type, typer.Option("--broker", "-b", help=broker_help)],
            )
        ]
        for name, (kind, default, option) in _MQTT_OPTIONS.items():
            added.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, option]))
        # Required options first: a parameter without a default may not follow one with a default.
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        params = sorted(params + added, key=lambda p: p.default is not inspect.Parameter.empty)

        @functools.wraps(func)
        def wrapper(**kwargs: Any) -> Any:
            options = {name: kwargs.pop(name) for name in _MQTT_OPTIONS}
            broker = kwargs.pop("broker")
            kwargs["link"] = None if broker is None else LinkConfig(broker=broker, **options)
            return func(**kwargs)

        wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper  # type: ignore[return-value]

    return decorate
