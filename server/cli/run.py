"""``feast-server run``: wait for devices, train the rounds over MQTT, export and push each device's ONNX model."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from feast_edge.cli import common
from feast_edge.cli.panels import by_concern, settings_options
from feast_edge.cli.server_opt import betas
from feast_edge.errors import FeastError
from feast_edge.report.model_words import served_variants
from feast_edge.server.cli.shared import (
    OutOpt,
    check_server_bundle,
    console,
    install_signal_handlers,
    log,
)
from feast_edge.server.config import ServerConfig
from feast_edge.server.output import coverage_lines, coverage_table, device_models_table, models_table, print_round
from feast_edge.transport.broker import LinkConfig


def register(app: typer.Typer) -> None:
    """Add ``run`` to the ``feast-server`` app."""
    app.command()(run)


def _refuse_method(value: Optional[str]) -> None:
    """``--method`` was the ablation here; ``feast-edge simulate`` calls the ablation --variants and the algorithm --method."""
    from feast_edge.local.recipe import VARIANT_MODES

    if value is not None:
        ablation = value if value in VARIANT_MODES else f"MODE ({', '.join(VARIANT_MODES)})"
        raise FeastError(
            f"feast-server run has no --method; the ablation is --variants {ablation} (as in feast-edge simulate); --method there picks the training algorithm"
        )


@by_concern(ServerConfig, rest="Process and output")
@common.mqtt_options()
@settings_options(
    ServerConfig,
    "server",
    # --out and --federation are options of their own; a server takes the preset's lr schedule and augmentation.
    exclude=("out", "federation", "lr_schedule", "augment"),
    flags={"preset": ("--preset", "-p"), "epochs": ("--local-epochs",)},
    cli_types={"server_betas": str},
    parse={"server_betas": betas},
    required={"out": ""},
)
def run(
    link: LinkConfig,
    settings: dict[str, Any],
    out: OutOpt,
    federation: common.BundleFederationOpt = None,
    method: Annotated[
        Optional[str],
        typer.Option(
            "--method", hidden=True, is_eager=True, callback=_refuse_method, help="Refused: the ablation is --variants."
        ),
    ] = None,
    resume_previous: Annotated[
        bool,
        typer.Option(
            "--resume-previous",
            help="If the last checkpoint is damaged, resume from the previous good one (the damaged file is kept, renamed).",
        ),
    ] = False,
    export: Annotated[
        bool,
        typer.Option(
            "--export/--no-export", help="After the last round, export and announce every device's ONNX model."
        ),
    ] = True,
    serve: Annotated[
        bool,
        typer.Option(
            "--serve", help="Afterwards keep answering model requests (feast-agent fetch-model) until Ctrl-C."
        ),
    ] = False,
    threads: common.ThreadsOpt = 0,
    dashboard: common.DashboardOpt = None,
    dashboard_token: common.DashboardTokenOpt = None,
    tensorboard: common.TensorBoardOpt = False,
    insecure: common.InsecureOpt = False,
    log_level: common.LogLevelOpt = "info",
    log_file: common.LogFileOpt = None,
) -> None:
    """Run (or resume, or extend) a federation: wait for devices, train --rounds rounds (--continuous: until
    feast-server stop), export ONNX per device."""
    from feast_edge.dashboard.state import DashboardState
    from feast_edge.server.app import FederationServer

    common.setup_logging(log_level, log_file)
    common.check_dashboard(dashboard, dashboard_token)
    from feast_edge.util.cores import Threads

    federation = common.federation_of(link, federation)
    check_server_bundle(link)
    config = ServerConfig.of(out=str(out), federation=federation, **settings)
    common.check_insecure(link, insecure, "feast-server run")  # before anything is created or connects
    state = None if dashboard is None else DashboardState("federation", f"feast-server: federation {federation}")
    # --threads N fixes PyTorch's threads; 0 chooses them from the free cores before each computing step.
    server = FederationServer(config, link, on_round=print_round, dashboard=state, threads=Threads(threads, logger=log))
    web = None if state is None else common.open_dashboard(state, dashboard, dashboard_token, log.info)
    install_signal_handlers(first=server.request_stop)  # SIGTERM: after the round in progress (a second: at once)
    common.warn_insecure(link)
    try:
        server.start()
        history = server.run(resume_previous=resume_previous, tensorboard=tensorboard)
        applied = sum(r.applied for r in history)
        ended = server.loop.ended
        log.info(
            "federation %s: %d rounds (%d aggregated); checkpoint %s%s",
            ended or "finished",
            len(history),
            applied,
            out / "checkpoint.safetensors",
            "; run the same command to go on (a finished run: a larger --rounds, or --continuous)" if ended else "",
        )
        manifests: list[dict[str, Any]] = []
        if export:
            calibrate = (
                "BN recalibration, validation, ONNX"
                if config.data is not None
                else "weights for BN calibration on each device"
            )
            log.info(
                "exporting each device's largest affordable variant, or a smaller one better on validation (%s)",
                calibrate,
            )
            if server.live is not None:
                server.live.finished("exporting")
            with common.heartbeat(log, "still exporting"):
                manifests = server.export()
            if server.live is not None:
                server.live.models(manifests, out / "models")
            console.print(models_table(manifests, f"models for {len(manifests)} devices in {out / 'models'}"))
            served = server.announce_models(manifests)
            log.info("sent models to %d online devices%s", len(served), f": {', '.join(served)}" if served else "")
            if config.data is None and served:
                reports = server.await_device_models(manifests, served, timeout=config.network.round_timeout)
                if server.live is not None:
                    server.live.models(manifests, out / "models", reports)
                federated = any(m.get("calibration") == "federated" for m in manifests)
                title = "the devices' models, " + (
                    "BN statistics of the devices' data, combined (federated)"
                    if federated
                    else "BN calibrated on each device's own data"
                )
                console.print(device_models_table(manifests, reports, title))
            console.print(coverage_table(served_variants(manifests), "served variants: the classes each saw"))
            coverage_lines(server.devices.coverage.lines())
        server.finish(manifests)
        if server.live is not None:
            server.live.finished("finished")
        if serve:
            log.info("serving model requests (feast-agent fetch-model); Ctrl-C to stop")
            server.serve()
        else:
            server.serve(2.0)  # let receipts and nacks of the announced models settle
    except KeyboardInterrupt:
        log.info("interrupted; the last completed round is checkpointed (restart with the same --out to resume)")
        raise typer.Exit(130)
    finally:
        server.close()
        if web is not None:
            web.stop()
