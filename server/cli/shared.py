"""What the ``feast-server`` commands share: the run-directory options, the console, SIGTERM, the server's bundle."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from feast_edge.cli import common
from feast_edge.errors import FeastError
from feast_edge.server.config import ServerConfig
from feast_edge.settings.nested import bounds_of, help_of
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.credentials import credentials_of

console = common.make_console()
log = logging.getLogger("feast_edge.server")

OutOpt = Annotated[
    Path, typer.Option("--out", "-o", help="Run directory: checkpoints, device registry, exported models.")
]


def install_signal_handlers(first: Callable[[], None] | None = None) -> None:
    """SIGTERM ends the server like Ctrl-C: the current round is abandoned, the link closes with an offline status.
    With ``first`` (feast-server run), the first SIGTERM calls it instead (the run ends after its round in progress,
    server.stopping) and a second one ends the server like Ctrl-C."""

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the clean shutdown
        raise KeyboardInterrupt

    def gently(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, stop)
        assert first is not None
        first()

    if first is not None:
        signal.signal(signal.SIGTERM, gently)
        return

    signal.signal(signal.SIGTERM, stop)


def check_server_bundle(link: Optional[LinkConfig]) -> None:
    bundle = credentials_of(link)
    if bundle is not None and bundle.role != "server":
        raise FeastError(
            f"--credentials {bundle.path} is device {bundle.identity!r}'s bundle; the server takes the 'server' bundle (…/server)"
        )


_HELP, _BOUNDS = help_of(ServerConfig, "server"), bounds_of(ServerConfig)


def _setting(key: str, kind: type) -> Any:
    """The option of the run's setting ``key`` for a command on its run directory: its declared help and bounds."""
    return Annotated[kind, typer.Option(f"--{key.replace('_', '-')}", help=_HELP[key], **_BOUNDS.get(key, {}))]


# feast-server export's and serve's options for the run's settings (they change what the run stored).
ServingRuleOpt = _setting("serving_rule", str)
PrecisionOpt = _setting("precision", str)
Int8SamplesOpt = _setting("int8_samples", int)
Int8ToleranceOpt = _setting("int8_tolerance", float)
ChunkOpt = _setting("chunk_size", int)
ValSamplesOpt = _setting("val_samples", int)
CalibSamplesOpt = _setting("calib_samples", int)
