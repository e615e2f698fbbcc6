"""The ``feast-server`` commands on a run directory: ``export`` the models, ``serve`` them, ``status``, ``stop``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer

from feast_edge.cli import common
from feast_edge.errors import FeastError
from feast_edge.server.cli.shared import (
    CalibSamplesOpt,
    ChunkOpt,
    Int8SamplesOpt,
    Int8ToleranceOpt,
    OutOpt,
    PrecisionOpt,
    ServingRuleOpt,
    ValSamplesOpt,
    console,
    install_signal_handlers,
    log,
)
from feast_edge.server.output import models_table
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.frames import DEFAULT_CHUNK_SIZE


def register(app: typer.Typer) -> None:
    """Add ``export``, ``serve``, ``status`` and ``stop`` to the ``feast-server`` app."""
    app.command("export")(export_command)
    app.command("serve")(serve_command)
    app.command("status")(status_command)
    app.command("stop")(stop_command)


def stop_command(
    out: OutOpt,
    reason: Annotated[
        str, typer.Option("--reason", help="Words for the server's log (e.g. who stops it and why).")
    ] = "",
) -> None:
    """End the run in --out after its round in progress: checkpointed, models exported and pushed, agents told it
    finished (those without --stay exit). Resume it later with the same command, or extend it (--rounds, --continuous)."""
    from feast_edge.run.store import CHECKPOINT
    from feast_edge.server.stopping import request_stop

    if not out.is_dir():
        raise FeastError(f"--out {out} is not a run directory; give the --out of the feast-server run to stop")
    if not (out / CHECKPOINT).is_file() and not (out / "devices.sqlite").is_file():
        raise FeastError(
            f"--out {out} holds no federation run (no checkpoint, no device registry); give the --out of the feast-server run to stop"
        )
    path = request_stop(out, reason)
    console.print(
        f"stop requested ({path}): the server ends after its round in progress (a wait for devices ends at once); "
        "its log says when"
    )


@common.mqtt_options(
    broker_help="Also push each model to its device if it is online (mqtt://host:port).", required=False
)
def export_command(
    link: Optional[LinkConfig],
    out: OutOpt,
    data: Annotated[
        Optional[Path],
        typer.Option("--data", help="Server-held calibration/validation data (default: the run's --data)."),
    ] = None,
    federation: Annotated[
        Optional[str], typer.Option("--federation", help="Federation id (default: the run's).")
    ] = None,
    val_samples: ValSamplesOpt = 5000,
    calib_samples: CalibSamplesOpt = 500,
    precision: PrecisionOpt = "auto",
    int8_samples: Int8SamplesOpt = 256,
    int8_tolerance: Int8ToleranceOpt = 0.01,
    serving_rule: ServingRuleOpt = "validated",
    chunk_size: ChunkOpt = DEFAULT_CHUNK_SIZE,
    log_level: common.LogLevelOpt = "info",
    log_file: common.LogFileOpt = None,
) -> None:
    """Export every registered device's largest affordable variant: BN-recalibrated ONNX + manifest with --data, else its weights for the device to calibrate."""
    from feast_edge.server.app import FederationServer, ServerConfig

    common.setup_logging(log_level, log_file)
    config = ServerConfig.stored(
        out,
        data=None if data is None else str(data),
        federation=federation,
        val_samples=val_samples,
        calib_samples=calib_samples,
        precision=precision,
        int8_samples=int8_samples,
        int8_tolerance=int8_tolerance,
        chunk_size=chunk_size,
        serving_rule=serving_rule,
    )
    if config.data is None:
        log.info(
            "the run in %s had no --data: each device gets its variant's weights and calibrates BN on its own data "
            "(pass --data to calibrate and validate on server-held data instead)",
            out,
        )
    server = FederationServer(config, link or LinkConfig())
    try:
        with common.heartbeat(log, "still exporting"):
            manifests = server.export()
        console.print(models_table(manifests, f"models for {len(manifests)} devices in {out / 'models'}"))
        if link is not None:
            server.start()
            server.pump(1.0)  # retained presences tell who is online
            served = server.announce_models(manifests)
            log.info("sent models to %d online devices%s", len(served), f": {', '.join(served)}" if served else "")
            server.serve(2.0)
    finally:
        server.close()


@common.mqtt_options()
def serve_command(
    link: LinkConfig,
    out: OutOpt,
    federation: Annotated[
        Optional[str], typer.Option("--federation", help="Federation id (default: the run's).")
    ] = None,
    chunk_size: ChunkOpt = DEFAULT_CHUNK_SIZE,
    log_level: common.LogLevelOpt = "info",
    log_file: common.LogFileOpt = None,
) -> None:
    """Answer 'feast-agent fetch-model' requests with the models exported in --out, until Ctrl-C."""
    from feast_edge.server.app import FederationServer, ServerConfig

    common.setup_logging(log_level, log_file)
    # Serving sends files that were exported already: no server-held data to load.
    config = dataclasses.replace(ServerConfig.stored(out, federation=federation, chunk_size=chunk_size), data=None)
    server = FederationServer(config, link)
    server.devices.finished = True  # no rounds here: agents that register are told the federation is over
    install_signal_handlers()
    try:
        server.start()
        log.info("serving the models in %s on federation %r; Ctrl-C to stop", out / "models", config.federation)
        server.serve()
    except KeyboardInterrupt:
        raise typer.Exit(0)
    finally:
        server.close()


def status_command(
    out: OutOpt,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (for scripts) instead of lines and a table.")
    ] = False,
) -> None:
    """Where the run in --out stands: devices (online, last seen, rounds taken part in), rounds completed, best accuracy."""
    import json

    from feast_edge.server.status import read_status, status_lines, status_table

    status = read_status(out)
    if as_json:
        typer.echo(json.dumps(status))
        return
    for line in status_lines(status):
        console.print(line, soft_wrap=True, highlight=False)
    console.print(status_table(status))
    if status["coverage"]:
        from feast_edge.server.output import coverage_table

        console.print(coverage_table(status["coverage"], "served variants: the classes each saw"))
