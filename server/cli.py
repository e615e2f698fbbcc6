"""``feast-server``: run a federation over MQTT, export per-device ONNX models, serve them.

User errors (unreachable broker, wrong credentials, bad options, a foreign
checkpoint) print one ``error:`` line to stderr and exit with status 2.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from feast_edge.cli.common import (
    ChunkOpt,
    FederationOpt,
    LogFileOpt,
    LogLevelOpt,
    ThreadsOpt,
    make_app,
    make_console,
    mqtt_options,
    run_cli,
    setup_logging,
    torch_threads,
)
from feast_edge.errors import FeastError
from feast_edge.transport.chunks import DEFAULT_CHUNK_SIZE
from feast_edge.transport.link import LinkConfig

app = make_app("feast-server", "FEAST federation server: registry, rounds over MQTT, checkpoints, per-device ONNX export.")
console = make_console()
err_console = make_console(stderr=True)

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
    """One line per round: replies, loss, validation accuracy and what was refused."""
    replies = f"{len(record.updated)}/{len(record.cohort)}"
    state = "aggregated" if record.applied else "[yellow]unchanged[/yellow]"
    loss = "-" if record.loss is None else f"{record.loss:.4f}"
    extra = []
    if record.rejected:
        extra.append(f"rejected {', '.join(sorted(record.rejected))}")
    if record.dropped:
        extra.append(f"offline {', '.join(record.dropped)}")
    if record.missing:
        extra.append(f"no reply {', '.join(record.missing)}")
    console.print(
        f"[bold]round {record.round + 1}/{rounds}[/bold]  replies {replies}  {state}  loss {loss}  val {_pct(record.val_accuracy)}  "
        f"{record.seconds:.1f} s" + (f"  ({'; '.join(extra)})" if extra else ""),
        soft_wrap=True,
    )


def models_table(manifests: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for col in ("device", "budget", "variant MACs", "params", "val accuracy", "file", "sha256"):
        table.add_column(col, justify="right" if col in ("budget", "variant MACs", "params", "val accuracy") else "left")
    for m in manifests:
        table.add_row(m["device"], f"{m['budget_macs'] / 1e6:.2f}M", f"{m['macs'] / 1e6:.2f}M", f"{m['params'] / 1e6:.3f}M", _pct(m["validation_accuracy"]), m["file"], m["sha256"][:12])
    return table


@app.command()
@mqtt_options()
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
    federation: FederationOpt = "feast",
    lr: Annotated[float, typer.Option(help="Initial SGD learning rate (cosine-decayed over --rounds).")] = 0.025,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Local batch size.")] = 64,
    method: Annotated[str, typer.Option(help="full, min, max, min+max or min+max+kd (SPEC §7 ablations).")] = "full",
    eval_every: Annotated[int, typer.Option("--eval-every", min=1, help="Validate every k rounds (needs --data).")] = 5,
    val_samples: Annotated[int, typer.Option("--val-samples", min=1, help="Validation examples when --data is a Fashion-MNIST directory.")] = 5000,
    calib_samples: Annotated[int, typer.Option("--calib-samples", min=1, help="Calibration examples when --data is a Fashion-MNIST directory.")] = 500,
    cache: Annotated[Optional[Path], typer.Option(help="Variant cache JSON (default: the preset's shipped cache).")] = None,
    wait_timeout: Annotated[Optional[float], typer.Option("--wait-timeout", min=0.1, help="Give up if not enough devices are online after this many seconds (default: wait).")] = None,
    export: Annotated[bool, typer.Option("--export/--no-export", help="After the last round, export and announce every device's ONNX model.")] = True,
    serve: Annotated[bool, typer.Option("--serve", help="Afterwards keep answering model requests (feast-agent fetch-model) until Ctrl-C.")] = False,
    chunk_size: ChunkOpt = DEFAULT_CHUNK_SIZE,
    threads: ThreadsOpt = 0,
    log_level: LogLevelOpt = "info",
    log_file: LogFileOpt = None,
) -> None:
    """Run (or resume) a federation: wait for devices, train --rounds rounds, export ONNX per device."""
    from feast_edge.server.federation import FederationServer, ServerConfig

    setup_logging(log_level, log_file)
    torch_threads(threads)
    config = ServerConfig(
        out=str(out), preset=preset, rounds=rounds, per_round=per_round, min_clients=min_clients, start_clients=start_clients,
        round_timeout=round_timeout, seed=seed, lr=lr, batch_size=batch_size, method=method, eval_every=eval_every,
        data=None if data is None else str(data), val_samples=val_samples, calib_samples=calib_samples,
        cache=None if cache is None else str(cache), federation=federation, chunk_size=chunk_size, wait_timeout=wait_timeout,
    )
    server = FederationServer(
        config, link,
        on_round=print_round, on_status=lambda text: console.print(text, soft_wrap=True, highlight=False),
    )
    _install_signal_handlers()
    try:
        server.start()
        history = server.run()
        applied = sum(r.applied for r in history)
        console.print(f"federation finished: {len(history)} rounds ({applied} aggregated); checkpoint {out / 'checkpoint.safetensors'}", soft_wrap=True)
        if export and data is not None:
            manifests = server.export()
            console.print(models_table(manifests, f"models for {len(manifests)} devices in {out / 'models'}"))
            served = server.announce_models(manifests)
            console.print(f"announced to {len(served)} online devices" + (f": {', '.join(served)}" if served else ""), soft_wrap=True)
        elif export:
            console.print("no --data: ONNX export skipped; run 'feast-server export --data DIR' to export", soft_wrap=True)
        if serve:
            console.print("serving model requests; Ctrl-C to stop", soft_wrap=True)
            server.serve()
        else:
            server.serve(2.0)  # let receipts and nacks of the announced models settle
    except KeyboardInterrupt:
        err_console.print("interrupted; the last completed round is checkpointed (restart with the same --out to resume)")
        raise typer.Exit(130)
    finally:
        server.close()


@app.command("export")
@mqtt_options(broker_help="Also push each model to its device if it is online (mqtt://host:port).", required=False)
def export_command(
    link: Optional[LinkConfig],
    out: OutOpt,
    data: Annotated[Optional[Path], typer.Option("--data", help="Server-held calibration/validation data (default: the run's --data).")] = None,
    federation: Annotated[Optional[str], typer.Option("--federation", help="Federation id (default: the run's).")] = None,
    val_samples: Annotated[int, typer.Option("--val-samples", min=1)] = 5000,
    calib_samples: Annotated[int, typer.Option("--calib-samples", min=1)] = 500,
    chunk_size: ChunkOpt = DEFAULT_CHUNK_SIZE,
    log_level: LogLevelOpt = "info",
    log_file: LogFileOpt = None,
) -> None:
    """Export every registered device's largest affordable variant (BN-recalibrated) as ONNX + manifest."""
    from feast_edge.checkpoint import read_record
    from feast_edge.server.federation import CHECKPOINT, FederationServer, ServerConfig, ServerError

    setup_logging(log_level, log_file)
    path = out / CHECKPOINT
    if not path.is_file():
        raise ServerError(f"no federation checkpoint at {path}; point --out at a directory written by feast-server run")
    fields = read_record(path).get("fields", {})
    stored = fields.get("config", {})
    data_path = data if data is not None else fields.get("data")
    if data_path is None:
        raise ServerError(f"the run in {out} had no --data; pass --data (a partition directory or Fashion-MNIST) for calibration and validation")
    config = ServerConfig(
        out=str(out), preset=str(stored.get("preset", "fmnist-small")), data=str(data_path), val_samples=val_samples, calib_samples=calib_samples,
        cache=stored.get("cache"), federation=federation or str(stored.get("federation", "feast")), chunk_size=chunk_size,
        rounds=int(stored.get("rounds", 1)), per_round=int(stored.get("per_round", 1)), min_clients=int(stored.get("min_clients", 1)),
    )
    server = FederationServer(config, link or LinkConfig(), on_status=lambda t: console.print(t, soft_wrap=True))
    try:
        manifests = server.export()
        console.print(models_table(manifests, f"models for {len(manifests)} devices in {out / 'models'}"))
        if link is not None:
            server.start()
            server.pump(1.0)  # retained presences tell who is online
            served = server.announce_models(manifests)
            console.print(f"announced to {len(served)} online devices" + (f": {', '.join(served)}" if served else ""), soft_wrap=True)
            server.serve(2.0)
    finally:
        server.close()


@app.command("serve")
@mqtt_options()
def serve_command(
    link: LinkConfig,
    out: OutOpt,
    preset: Annotated[str, typer.Option("--preset", "-p", help="Preset of the federation.")] = "fmnist-small",
    federation: FederationOpt = "feast",
    chunk_size: ChunkOpt = DEFAULT_CHUNK_SIZE,
    log_level: LogLevelOpt = "info",
    log_file: LogFileOpt = None,
) -> None:
    """Answer 'feast-agent fetch-model' requests with the models exported in --out, until Ctrl-C."""
    from feast_edge.server.federation import FederationServer, ServerConfig

    setup_logging(log_level, log_file)
    config = ServerConfig(out=str(out), preset=preset, federation=federation, chunk_size=chunk_size, rounds=1, per_round=1, min_clients=1)
    server = FederationServer(config, link)
    _install_signal_handlers()
    try:
        server.start()
        console.print(f"serving the models in {out / 'models'} on federation {federation!r}; Ctrl-C to stop", soft_wrap=True)
        server.serve()
    except KeyboardInterrupt:
        raise typer.Exit(0)
    finally:
        server.close()


@app.command()
def devices(out: OutOpt) -> None:
    """List the device registry of a run directory."""
    from feast_edge.server.federation import REGISTRY
    from feast_edge.server.registry import Registry

    path = out / REGISTRY
    if not path.is_file():
        raise FeastError(f"no device registry at {path}; point --out at a directory written by feast-server run")
    registry = Registry(path)
    table = Table(title=f"devices registered in {path}")
    for col in ("device", "host", "budget", "samples", "status", "rounds", "profile"):
        table.add_column(col, justify="right" if col in ("budget", "samples", "rounds") else "left")
    for d in registry.devices():
        table.add_row(d.device_id, d.host, f"{d.budget_macs / 1e6:.2f}M", str(d.samples), d.status, str(d.rounds), str(d.profile.get("name", "-")))
    registry.close()
    console.print(table)


def main() -> None:
    """Console-script entry of ``feast-server``."""
    run_cli(app)


if __name__ == "__main__":
    main()
