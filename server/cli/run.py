"""``feast-server run``: wait for devices, train the rounds over MQTT, export and push each device's ONNX model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from feast_edge.aggregate.server_opt import DEPLOYMENT_OPT
from feast_edge.aggregate.weights import DEFAULT_WEIGHT_RATIO
from feast_edge.cli import common
from feast_edge.cli.privacy import dp_options
from feast_edge.cli.server_opt import server_opt_options
from feast_edge.errors import FeastError
from feast_edge.evaluate.bn_robust import DEFAULT_BN_RULE
from feast_edge.evaluate.federated import DEFAULT_VAL_RULE
from feast_edge.report.model_words import served_variants
from feast_edge.server.cli.shared import (
    DataOpt,
    OutOpt,
    PrecisionOpt,
    ServingRuleOpt,
    check_server_bundle,
    console,
    install_signal_handlers,
    log,
)
from feast_edge.server.output import coverage_lines, coverage_table, device_models_table, models_table, print_round
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.frames import DEFAULT_CHUNK_SIZE


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


@common.mqtt_options()
@server_opt_options(DEPLOYMENT_OPT)
@dp_options()
def run(
    link: LinkConfig,
    server_opt: dict[str, Any],
    dp: dict[str, Any],
    out: OutOpt,
    preset: Annotated[str, typer.Option("--preset", "-p", help="Preset name or .toml file.")] = "fmnist-small",
    rounds: Annotated[int, typer.Option(min=1, help="Federation rounds R (also the cosine-decay horizon).")] = 10,
    per_round: Annotated[int, typer.Option("--per-round", min=1, help="Devices sampled per round M.")] = 5,
    min_clients: Annotated[
        int,
        typer.Option(
            "--min-clients",
            min=1,
            help="K: devices needed online to start a round, and valid updates needed to change the model.",
        ),
    ] = 2,
    start_clients: Annotated[
        Optional[int],
        typer.Option(
            "--start-clients", min=1, help="Devices to wait for before the first round (default: --min-clients)."
        ),
    ] = None,
    round_timeout: Annotated[
        float,
        typer.Option("--round-timeout", min=0.1, help="Seconds a round waits for updates (stragglers never block)."),
    ] = 300.0,
    seed: Annotated[int, typer.Option(help="Seed of the model init, cohorts and client seeds.")] = 0,
    data: DataOpt = None,
    federation: common.BundleFederationOpt = None,
    lr: Annotated[
        Optional[float],
        typer.Option(help="Initial SGD learning rate, decayed over --rounds (default: the preset's [train] recipe)."),
    ] = None,
    batch_size: Annotated[
        Optional[int],
        typer.Option("--batch-size", min=1, help="Local batch size (default: the preset's [train] recipe)."),
    ] = None,
    local_epochs: Annotated[
        Optional[int],
        typer.Option("--local-epochs", min=1, help="Local epochs per round (default: the preset's [train] recipe)."),
    ] = None,
    variants: Annotated[
        str,
        typer.Option(
            "--variants",
            help="FEAST's variants per batch: full, min, max, min+max or min+max+kd (the paper's ablations).",
        ),
    ] = "full",
    method: Annotated[
        Optional[str],
        typer.Option(
            "--method", hidden=True, is_eager=True, callback=_refuse_method, help="Refused: the ablation is --variants."
        ),
    ] = None,
    eval_every: Annotated[
        int,
        typer.Option(
            "--eval-every",
            min=1,
            help="Validate the model every k rounds and after the last, keeping the best round's: on --data, or "
            "without it on the held-out examples of the round's devices (feast-agent run --holdout).",
        ),
    ] = 5,
    val_samples: Annotated[
        int, typer.Option("--val-samples", min=1, help="Validation examples taken from --data (server-held data).")
    ] = 5000,
    calib_samples: Annotated[
        int,
        typer.Option(
            "--calib-samples",
            min=1,
            help="BN-calibration examples: taken from --data, or, without it, what each device recalibrates on.",
        ),
    ] = 500,
    serving_rule: ServingRuleOpt = "validated",
    bn_calibration: Annotated[
        str,
        typer.Option(
            "--bn-calibration",
            help="Without --data, where each served variant's BN statistics come from: federated (every device that "
            "can run it reports per-channel moments of its data, the server combines them) or device (each device "
            "recalibrates on its own data only).",
        ),
    ] = "federated",
    bn_rule: Annotated[
        str,
        typer.Option(
            "--bn-rule",
            help="How the devices' BN statistics are combined: screened (refuse reports far from the median of all, "
            "mix the rest; a lone pair that disagrees is not used), median (per-channel weighted median) or mixture "
            "(every report as sent: one lying device steers it). docs/security.md §9.",
        ),
    ] = DEFAULT_BN_RULE,
    val_rule: Annotated[
        str,
        typer.Option(
            "--val-rule",
            help="How the devices' held-out accuracies are combined: median (each device one vote; chooses the served "
            "round only with 3 or more devices) or pooled (all counts summed, each capped by --max-weight-ratio).",
        ),
    ] = DEFAULT_VAL_RULE,
    cache: Annotated[
        Optional[Path],
        typer.Option(help="Variant cache JSON (default: the one beside the preset's file, else the shipped one)."),
    ] = None,
    wait_timeout: Annotated[
        float,
        typer.Option(
            "--wait-timeout",
            min=0.0,
            help="Idle limit: end the run (last round checkpointed) when a round waited this long for enough devices (0: wait forever).",
        ),
    ] = 1800.0,
    max_update_norm: Annotated[
        float,
        typer.Option(
            "--max-update-norm",
            min=0.0,
            help="Reject an update that changes its routed slice by more than this L2 norm (0: no bound).",
        ),
    ] = 1e4,
    max_samples: Annotated[
        int,
        typer.Option(
            "--max-samples",
            min=1,
            help="Refuse a device that registers more training examples than this (its aggregation weight); a partition's own counts apply to its clients.",
        ),
    ] = 1_000_000,
    max_devices: Annotated[
        int,
        typer.Option(
            "--max-devices", min=1, help="Refuse registrations beyond this many devices (bounds the registry)."
        ),
    ] = 10_000,
    aggregation: Annotated[
        str,
        typer.Option(
            "--aggregation",
            help="mean (method §6), or a robust rule: clip, trimmed-mean, median (docs/security.md §5).",
        ),
    ] = "mean",
    trim: Annotated[
        float, typer.Option("--trim", help="trimmed-mean: share of the values covering a position dropped at each end.")
    ] = 0.1,
    clip_norm: Annotated[
        Optional[float],
        typer.Option("--clip-norm", help="clip: L2 bound of each update's change (default: the round's median)."),
    ] = None,
    max_weight_ratio: Annotated[
        float,
        typer.Option(
            "--max-weight-ratio",
            help="A device's self-reported sample count weighs at most this many times the round's median count; "
            "counts of a partition given as --data are never capped (0: no cap; docs/security.md §5).",
        ),
    ] = DEFAULT_WEIGHT_RATIO,
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
    precision: PrecisionOpt = "auto",
    int8_samples: common.Int8SamplesOpt = 256,
    int8_tolerance: common.Int8ToleranceOpt = 0.01,
    chunk_size: common.ChunkOpt = DEFAULT_CHUNK_SIZE,
    threads: common.ThreadsOpt = 0,
    payload_dtype: common.PayloadDtypeOpt = "float32",
    dashboard: common.DashboardOpt = None,
    dashboard_token: common.DashboardTokenOpt = None,
    tensorboard: common.TensorBoardOpt = False,
    insecure: common.InsecureOpt = False,
    log_level: common.LogLevelOpt = "info",
    log_file: common.LogFileOpt = None,
) -> None:
    """Run (or resume) a federation: wait for devices, train --rounds rounds, export ONNX per device."""
    from feast_edge.dashboard.state import DashboardState
    from feast_edge.server.app import FederationServer, ServerConfig

    common.setup_logging(log_level, log_file)
    common.check_dashboard(dashboard, dashboard_token)
    from feast_edge.util.cores import Threads

    federation = common.federation_of(link, federation)
    check_server_bundle(link)
    config = ServerConfig(
        out=str(out),
        preset=preset,
        rounds=rounds,
        per_round=per_round,
        min_clients=min_clients,
        start_clients=start_clients,
        round_timeout=round_timeout,
        seed=seed,
        lr=lr,
        batch_size=batch_size,
        epochs=local_epochs,
        variants=variants,
        eval_every=eval_every,
        data=None if data is None else str(data),
        val_samples=val_samples,
        calib_samples=calib_samples,
        bn_calibration=bn_calibration,
        serving_rule=serving_rule,
        bn_rule=bn_rule,
        val_rule=val_rule,
        cache=None if cache is None else str(cache),
        federation=federation,
        chunk_size=chunk_size,
        wait_timeout=wait_timeout,
        max_update_norm=max_update_norm,
        max_samples=max_samples,
        max_devices=max_devices,
        aggregation=aggregation,
        trim=trim,
        clip_norm=clip_norm,
        payload_dtype=payload_dtype,
        max_weight_ratio=max_weight_ratio,
        **server_opt,
        **dp,
        precision=precision,
        int8_samples=int8_samples,
        int8_tolerance=int8_tolerance,
    )
    common.check_insecure(link, insecure, "feast-server run")  # before anything is created or connects
    state = None if dashboard is None else DashboardState("federation", f"feast-server: federation {federation}")
    # --threads N fixes PyTorch's threads; 0 chooses them from the free cores before each computing step.
    server = FederationServer(config, link, on_round=print_round, dashboard=state, threads=Threads(threads, logger=log))
    web = None if state is None else common.open_dashboard(state, dashboard, dashboard_token, log.info)
    install_signal_handlers()
    common.warn_insecure(link)
    try:
        server.start()
        history = server.run(resume_previous=resume_previous, tensorboard=tensorboard)
        applied = sum(r.applied for r in history)
        log.info(
            "federation finished: %d rounds (%d aggregated); checkpoint %s",
            len(history),
            applied,
            out / "checkpoint.safetensors",
        )
        manifests: list[dict[str, Any]] = []
        if export:
            calibrate = (
                "BN recalibration, validation, ONNX"
                if data is not None
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
            if data is None and served:
                reports = server.await_device_models(manifests, served, timeout=round_timeout)
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
