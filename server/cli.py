"""``feast-server``: run a federation over MQTT, export per-device ONNX models, serve them.

User errors (unreachable broker, wrong credentials, bad options, a foreign
checkpoint) print one ``error:`` line to stderr and exit with status 2.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from feast_edge.cli import common
from feast_edge.errors import FeastError
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.frames import DEFAULT_CHUNK_SIZE

app = common.make_app("feast-server", "FEAST federation server: registry, rounds over MQTT, checkpoints, per-device ONNX export.")
console = common.make_console()
log = logging.getLogger("feast_edge.server")

OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Run directory: checkpoints, device registry, exported models.")]
DataOpt = Annotated[
    Optional[Path],
    typer.Option("--data", help="Server-held validation/calibration data: a partition directory (feast-edge partition) or a Fashion-MNIST directory (its test split)."),
]


def _install_signal_handlers() -> None:
    """SIGTERM ends the server like Ctrl-C: the current round is abandoned, the link closes with an offline status."""

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the clean shutdown
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def print_round(record: Any, rounds: int) -> None:
    """One line per round (1-based): replies, loss, validation accuracy and what was refused."""
    replies = f"{len(record.updated)}/{len(record.cohort)}"
    state = "aggregated" if record.applied else "unchanged"
    loss = "-" if record.loss is None else f"{record.loss:.4f}"
    extra = []
    if record.rejected:
        extra.append(f"rejected {', '.join(sorted(record.rejected))}")
    if record.dropped:
        extra.append(f"offline {', '.join(record.dropped)}")
    if record.missing:
        extra.append(f"no reply {', '.join(record.missing)}")
    log.info(
        f"round {record.round}/{rounds}  replies {replies}  {state}  loss {loss}  val {_pct(record.val_accuracy)}  "
        f"{record.seconds:.1f} s" + (f"  ({'; '.join(extra)})" if extra else "")
    )


def models_table(manifests: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for col in ("device", "budget", "variant MACs", "params", "val accuracy", "file", "sha256"):
        table.add_column(col, justify="right" if col in ("budget", "variant MACs", "params", "val accuracy") else "left")
    for m in manifests:
        table.add_row(m["device"], f"{m['budget_macs'] / 1e6:.2f}M", f"{m['macs'] / 1e6:.2f}M", f"{m['params'] / 1e6:.3f}M", _pct(m["validation_accuracy"]), m["file"], m["sha256"][:12])
    return table


def _refuse_method(value: Optional[str]) -> None:
    """``--method`` was the ablation here; ``feast-edge simulate`` calls the ablation --variants and the algorithm --method."""
    from feast_edge.local.recipe import VARIANT_MODES

    if value is not None:
        ablation = value if value in VARIANT_MODES else f"MODE ({', '.join(VARIANT_MODES)})"
        raise FeastError(f"feast-server run has no --method; the ablation is --variants {ablation} (as in feast-edge simulate); --method there picks the training algorithm")


@app.command()
@common.mqtt_options()
def run(
    link: LinkConfig,
    out: OutOpt,
    preset: Annotated[str, typer.Option("--preset", "-p", help="Preset name or .toml file.")] = "fmnist-small",
    rounds: Annotated[int, typer.Option(min=1, help="Federation rounds R (also the cosine-decay horizon).")] = 10,
    per_round: Annotated[int, typer.Option("--per-round", min=1, help="Devices sampled per round M.")] = 5,
    min_clients: Annotated[int, typer.Option("--min-clients", min=1, help="K: devices needed online to start a round, and valid updates needed to change the model.")] = 2,
    start_clients: Annotated[Optional[int], typer.Option("--start-clients", min=1, help="Devices to wait for before the first round (default: --min-clients).")] = None,
    round_timeout: Annotated[float, typer.Option("--round-timeout", min=0.1, help="Seconds a round waits for updates (stragglers never block).")] = 300.0,
    seed: Annotated[int, typer.Option(help="Seed of the model init, cohorts and client seeds.")] = 0,
    data: DataOpt = None,
    federation: common.BundleFederationOpt = None,
    lr: Annotated[Optional[float], typer.Option(help="Initial SGD learning rate, decayed over --rounds (default: the preset's [train] recipe).")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", min=1, help="Local batch size (default: the preset's [train] recipe).")] = None,
    local_epochs: Annotated[Optional[int], typer.Option("--local-epochs", min=1, help="Local epochs per round (default: the preset's [train] recipe).")] = None,
    variants: Annotated[str, typer.Option("--variants", help="FEAST's variants per batch: full, min, max, min+max or min+max+kd (the paper's ablations).")] = "full",
    method: Annotated[Optional[str], typer.Option("--method", hidden=True, is_eager=True, callback=_refuse_method, help="Refused: the ablation is --variants.")] = None,
    eval_every: Annotated[int, typer.Option("--eval-every", min=1, help="Validate every k rounds (needs --data).")] = 5,
    val_samples: Annotated[int, typer.Option("--val-samples", min=1, help="Validation examples when --data is a Fashion-MNIST directory.")] = 5000,
    calib_samples: Annotated[int, typer.Option("--calib-samples", min=1, help="Calibration examples when --data is a Fashion-MNIST directory.")] = 500,
    cache: Annotated[Optional[Path], typer.Option(help="Variant cache JSON (default: the preset's shipped cache).")] = None,
    wait_timeout: Annotated[
        float, typer.Option("--wait-timeout", min=0.0, help="Idle limit: end the run (last round checkpointed) when a round waited this long for enough devices (0: wait forever).")
    ] = 1800.0,
    max_update_norm: Annotated[
        float, typer.Option("--max-update-norm", min=0.0, help="Reject an update that changes its routed slice by more than this L2 norm (0: no bound).")
    ] = 1e4,
    max_samples: Annotated[
        int, typer.Option("--max-samples", min=1, help="Refuse a device that registers more training examples than this (its aggregation weight); a partition's own counts apply to its clients.")
    ] = 1_000_000,
    max_devices: Annotated[int, typer.Option("--max-devices", min=1, help="Refuse registrations beyond this many devices (bounds the registry).")] = 10_000,
    aggregation: Annotated[str, typer.Option("--aggregation", help="mean (SPEC §6), or a robust rule: clip, trimmed-mean, median (docs/security.md §5).")] = "mean",
    trim: Annotated[float, typer.Option("--trim", help="trimmed-mean: share of the values covering a position dropped at each end.")] = 0.1,
    clip_norm: Annotated[Optional[float], typer.Option("--clip-norm", help="clip: L2 bound of each update's change (default: the round's median).")] = None,
    resume_previous: Annotated[
        bool, typer.Option("--resume-previous", help="If the last checkpoint is damaged, resume from the previous good one (the damaged file is kept, renamed).")
    ] = False,
    export: Annotated[bool, typer.Option("--export/--no-export", help="After the last round, export and announce every device's ONNX model.")] = True,
    serve: Annotated[bool, typer.Option("--serve", help="Afterwards keep answering model requests (feast-agent fetch-model) until Ctrl-C.")] = False,
    chunk_size: common.ChunkOpt = DEFAULT_CHUNK_SIZE,
    threads: common.ThreadsOpt = 0,
    payload_dtype: common.PayloadDtypeOpt = "float32",
    dashboard: common.DashboardOpt = None,
    dashboard_token: common.DashboardTokenOpt = None,
    tensorboard: common.TensorBoardOpt = False,
    log_level: common.LogLevelOpt = "info",
    log_file: common.LogFileOpt = None,
) -> None:
    """Run (or resume) a federation: wait for devices, train --rounds rounds, export ONNX per device."""
    from feast_edge.dashboard.state import DashboardState
    from feast_edge.server.app import FederationServer, ServerConfig

    common.setup_logging(log_level, log_file)
    common.check_dashboard(dashboard, dashboard_token)
    common.torch_threads(threads)
    federation = common.federation_of(link, federation)
    _server_bundle(link)
    config = ServerConfig(
        out=str(out), preset=preset, rounds=rounds, per_round=per_round, min_clients=min_clients, start_clients=start_clients,
        round_timeout=round_timeout, seed=seed, lr=lr, batch_size=batch_size, epochs=local_epochs, variants=variants, eval_every=eval_every,
        data=None if data is None else str(data), val_samples=val_samples, calib_samples=calib_samples,
        cache=None if cache is None else str(cache), federation=federation, chunk_size=chunk_size, wait_timeout=wait_timeout,
        max_update_norm=max_update_norm, max_samples=max_samples, max_devices=max_devices, aggregation=aggregation, trim=trim, clip_norm=clip_norm,
        payload_dtype=payload_dtype,
    )
    state = None if dashboard is None else DashboardState("federation", f"feast-server: federation {federation}")
    server = FederationServer(config, link, on_round=print_round, dashboard=state)
    web = None if state is None else common.open_dashboard(state, dashboard, dashboard_token, log.info)
    _install_signal_handlers()
    try:
        server.start()
        history = server.run(resume_previous=resume_previous, tensorboard=tensorboard)
        applied = sum(r.applied for r in history)
        log.info("federation finished: %d rounds (%d aggregated); checkpoint %s", len(history), applied, out / "checkpoint.safetensors")
        manifests: list[dict[str, Any]] = []
        if export and data is not None:
            log.info("exporting each device's largest affordable variant (BN recalibration, validation, ONNX)")
            if server.live is not None:
                server.live.finished("exporting")
            with common.heartbeat(log, "still exporting"):
                manifests = server.export()
            if server.live is not None:
                server.live.models(manifests, out / "models")
            console.print(models_table(manifests, f"models for {len(manifests)} devices in {out / 'models'}"))
            served = server.announce_models(manifests)
            log.info("sent models to %d online devices%s", len(served), f": {', '.join(served)}" if served else "")
        elif export:
            log.info("no --data: ONNX export skipped; run 'feast-server export --data DIR' to export")
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


def _server_bundle(link: Optional[LinkConfig]) -> None:
    bundle = None if link is None else link.credentials
    if bundle is not None and bundle.role != "server":
        raise FeastError(f"--credentials {bundle.path} is device {bundle.identity!r}'s bundle; the server takes the 'server' bundle (…/server)")


@app.command("provision")
def provision_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Provisioning directory (CA, broker configuration, server and device bundles); re-run to add devices.")],
    devices: Annotated[Optional[list[str]], typer.Option("--device", "-d", help="A device id to provision (repeat the option for each).")] = None,
    devices_file: Annotated[Optional[Path], typer.Option("--devices-file", help="A text file with one device id per line (# comments allowed).")] = None,
    federation: Annotated[str, typer.Option("--federation", help="Federation id the credentials are for.")] = "feast",
    auth: Annotated[str, typer.Option("--auth", help="How devices prove who they are to the broker: certificate (TLS client certificates) or password.")] = "certificate",
    broker_host: Annotated[Optional[list[str]], typer.Option("--broker-host", help="Name or address devices use to reach the broker (repeat; the first goes into the bundles' URL). Default: localhost, 127.0.0.1.")] = None,
    broker_port: Annotated[int, typer.Option("--broker-port", min=1, max=65535, help="The broker's TLS port.")] = 8883,
    broker_user: Annotated[Optional[str], typer.Option("--broker-user", help="System user Mosquitto runs as (its 'user' setting); default: Mosquitto's own.")] = None,
    revoke: Annotated[Optional[list[str]], typer.Option("--revoke", help="Remove a device: its bundle goes, its certificate enters the CRL (repeat).")] = None,
    days: Annotated[int, typer.Option("--days", min=1, help="Validity of the certificates issued now, in days.")] = 825,
) -> None:
    """Create identities for a federation: a CA, a broker configuration with an ACL, and one credentials bundle per device."""
    from feast_edge.server.provision import provision

    names = list(devices or [])
    if devices_file is not None:
        try:
            lines = devices_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise FeastError(f"--devices-file {devices_file}: cannot read it ({exc})") from None
        names += [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]
    if not names and not revoke and not (out / "server").is_dir():
        raise FeastError("no devices: give --device NAME (repeat it) or --devices-file FILE")
    done = provision(
        out, federation, names, auth=auth, hosts=tuple(broker_host or ("localhost", "127.0.0.1")), port=broker_port, days=days,
        broker_user=broker_user, revoke=tuple(revoke or ()),
    )
    table = Table(title=f"federation {federation!r}: {len(done.devices)} devices ({auth} authentication)")
    table.add_column("identity")
    table.add_column("bundle (--credentials)")
    table.add_column("new", justify="center")
    table.add_row("server", str(done.server), "")
    for name, path in done.devices.items():
        table.add_row(name, str(path), "yes" if name in done.added else "")
    console.print(table)
    console.print(
        f"broker: mosquitto -c {done.broker_config}\n"
        f"server: feast-server run --credentials {done.server} --out RUN_DIR ...\n"
        f"device: copy its bundle to the device, then feast-agent run --credentials BUNDLE --data ...\n"
        f"Keep {out / 'ca' / 'ca.key'} off the devices; a bundle is its device's identity (treat it like a password).",
        soft_wrap=True, highlight=False,
    )


@app.command("export")
@common.mqtt_options(broker_help="Also push each model to its device if it is online (mqtt://host:port).", required=False)
def export_command(
    link: Optional[LinkConfig],
    out: OutOpt,
    data: Annotated[Optional[Path], typer.Option("--data", help="Server-held calibration/validation data (default: the run's --data).")] = None,
    federation: Annotated[Optional[str], typer.Option("--federation", help="Federation id (default: the run's).")] = None,
    val_samples: Annotated[int, typer.Option("--val-samples", min=1)] = 5000,
    calib_samples: Annotated[int, typer.Option("--calib-samples", min=1)] = 500,
    chunk_size: common.ChunkOpt = DEFAULT_CHUNK_SIZE,
    log_level: common.LogLevelOpt = "info",
    log_file: common.LogFileOpt = None,
) -> None:
    """Export every registered device's largest affordable variant (BN-recalibrated) as ONNX + manifest."""
    from feast_edge.server.app import FederationServer, ServerConfig, ServerError

    common.setup_logging(log_level, log_file)
    config = ServerConfig.stored(
        out, data=None if data is None else str(data), federation=federation, val_samples=val_samples, calib_samples=calib_samples, chunk_size=chunk_size
    )
    if config.data is None:
        raise ServerError(f"the run in {out} had no --data; pass --data (a partition directory or Fashion-MNIST) for calibration and validation")
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


@app.command("serve")
@common.mqtt_options()
def serve_command(
    link: LinkConfig,
    out: OutOpt,
    federation: Annotated[Optional[str], typer.Option("--federation", help="Federation id (default: the run's).")] = None,
    chunk_size: common.ChunkOpt = DEFAULT_CHUNK_SIZE,
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
    _install_signal_handlers()
    try:
        server.start()
        log.info("serving the models in %s on federation %r; Ctrl-C to stop", out / "models", config.federation)
        server.serve()
    except KeyboardInterrupt:
        raise typer.Exit(0)
    finally:
        server.close()


@app.command("status")
def status_command(
    out: OutOpt,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (for scripts) instead of lines and a table.")] = False,
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


def main() -> None:
    """Console-script entry of ``feast-server``."""
    common.run_cli(app)


if __name__ == "__main__":
    main()
