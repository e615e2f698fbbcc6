"""``feast-edge`` commands that run the method on data: routing report, partition, the end-to-end demo (simulate: ``feast_edge.cli.simulation``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from feast_edge.aggregate.server_opt import DEPLOYMENT_OPT
from feast_edge.cli.common import (
    PayloadDtypeOpt,
    make_console,
    millions,
    parse_list,
    parse_macs,
)
from feast_edge.cli.population import population_options
from feast_edge.cli.server_opt import server_opt_options
from feast_edge.cli.simulation import simulate
from feast_edge.errors import FeastError
from feast_edge.space.cost import arch_cost
from feast_edge.space.preset import load_preset

console = make_console()


def _say(text: str) -> None:
    console.print(text, soft_wrap=True, highlight=False)


def register(app: typer.Typer) -> None:
    """Add the run commands to the ``feast-edge`` app."""
    for command in (routing, simulate, partition, demo):
        app.command()(command)


def routing(
    preset: Annotated[
        str, typer.Option("--preset", "-p", help="Preset name (see 'feast-edge presets') or a .toml file.")
    ],
    cache_file: Annotated[
        Optional[Path],
        typer.Option("--cache", help="Cache JSON (default: the one beside the preset's file, else the shipped one)."),
    ] = None,
    reference_csv: Annotated[
        Optional[Path], typer.Option("--reference-csv", help="Use the paper's published cache CSV instead.")
    ] = None,
    clients: Annotated[int, typer.Option(help="Simulated clients N (Zipf budgets).")] = 100,
    zipf_s: Annotated[float, typer.Option(help="Zipf exponent of the budget ranks.")] = 1.2,
    seed: Annotated[int, typer.Option(help="Seed of the budget draw.")] = 0,
    budgets: Annotated[
        Optional[str], typer.Option(help="Comma-separated budgets to tabulate (e.g. 25M,50M,229M).")
    ] = None,
    classes: Annotated[
        Optional[int], typer.Option("--classes", "-c", min=1, help="Classifier classes (default: the preset's).")
    ] = None,
    payload_dtype: PayloadDtypeOpt = "float32",
) -> None:
    """Routed envelope sizes and the communication report for a Zipf population (method §5), in parameters and bytes."""
    import numpy as np

    from feast_edge.cache.build import read_reference_csv
    from feast_edge.cache.variants import load_cache
    from feast_edge.route.envelope import communication_report
    from feast_edge.sim.population import zipf_budgets

    p = load_preset(preset)
    n_classes = p.classes if classes is None else classes
    cache = read_reference_csv(reference_csv, p) if reference_csv is not None else load_cache(p, cache_file)
    archs = sorted((arch_cost(p, e.arch, n_classes)[0], e.arch) for e in cache.entries)
    if archs and budgets is None:
        budgets = ",".join(
            str(m) for m in np.unique(np.quantile([m for m, _ in archs], [0, 0.25, 0.5, 0.75, 1.0]).astype(int))
        )
    from feast_edge.route.payload import bytes_per_param, check_payload_dtype

    check_payload_dtype(payload_dtype)
    wire, dense = bytes_per_param(payload_dtype), bytes_per_param("float32")
    table = Table(title=f"{p.name}: routed envelope per budget ({n_classes}-class head), payloads as {payload_dtype}")
    for col in (
        "budget",
        "affordable",
        "envelope params",
        "reduction",
        f"payload MB ({payload_dtype})",
        "bytes reduction vs float32 broadcast",
    ):
        table.add_column(col, justify="right")
    for text in (budgets or "").split(","):
        if not text.strip():
            continue
        b = parse_macs(text)
        affordable = [a for m, a in archs if m <= b]
        if not affordable:
            raise FeastError(cache.below_smallest(b, "raise it"))
        report = communication_report(p, archs, [b], n_classes)
        table.add_row(
            millions(int(b)),
            str(len(affordable)),
            millions(report.payloads[0]),
            f"{report.aggregate_reduction:.1f}x",
            f"{report.payloads[0] * wire / 1e6:.2f}",
            f"{report.aggregate_reduction * dense / wire:.1f}x",
        )
    console.print(table)
    population = zipf_budgets(clients, np.random.default_rng(seed), s=zipf_s, b_min=p.budget_min, b_max=p.budget_max)
    report = communication_report(p, archs, population, n_classes)
    r = report.reductions
    console.print(
        f"{clients} clients, Zipf s={zipf_s}, budgets {millions(p.budget_min)}..{millions(p.budget_max)} MACs, seed {seed}:\n"
        f"  full supernet {millions(report.full_params)} params; mean routed payload {millions(int(report.mean_payload))} "
        f"-> aggregate reduction {report.aggregate_reduction:.2f}x\n"
        f"  per-client reduction: mean {sum(r) / len(r):.1f}x, median {report.median_reduction:.1f}x, max {max(r):.1f}x\n"
        f"  in bytes: mean routed payload {report.mean_payload * wire / 1e6:.2f} MB as {payload_dtype} vs {report.full_params * dense / 1e6:.2f} MB "
        f"float32 broadcast -> aggregate reduction {report.aggregate_reduction * dense / wire:.2f}x",
        soft_wrap=True,
    )


@population_options
def partition(
    population: dict[str, Any],
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Directory for the shard files, server.safetensors and index.json.")
    ],
) -> None:
    """Write the simulator's client shards (one file per client) and server-held splits, for feast-agent --data."""
    from feast_edge.sim.setup import SimulationConfig
    from feast_edge.sim.shards import write_partition

    config = SimulationConfig.of(**population, per_round=1)
    _say(f"loading {config.dataset} from {config.data_dir}; splitting it over {config.population.clients} clients")
    index = write_partition(config, out)
    table = Table(title=f"{index['preset']}: {len(index['clients'])} client shards in {out}")
    for col in ("client", "budget", "samples", "file"):
        table.add_column(col, justify="right" if col in ("budget", "samples") else "left")
    for c in index["clients"]:
        table.add_row(c["client_id"], millions(int(c["budget_macs"])), str(c["samples"]), c["file"])
    console.print(table)
    server = index["server"]
    console.print(
        f"server-held: {server['validation']} validation + {server['calibration']} calibration examples in {out / server['file']}",
        soft_wrap=True,
    )


@server_opt_options(DEPLOYMENT_OPT)
def demo(
    server_opt: dict[str, Any],
    broker: Annotated[
        Optional[str],
        typer.Option(help="Use this MQTT broker (mqtt://host:port) instead of starting one on a free loopback port."),
    ] = None,
    rounds: Annotated[int, typer.Option(min=1, help="Federation rounds.")] = 6,
    samples: Annotated[
        int, typer.Option(min=50, help="Training examples per device on average (split by budget, method §4 γ = 1).")
    ] = 2000,
    local_epochs: Annotated[
        int,
        typer.Option(
            "--local-epochs", min=1, help="Local epochs per round on every device (more: better models, longer rounds)."
        ),
    ] = 1,
    profiles: Annotated[
        str, typer.Option(help="Comma-separated device profiles (names in profiles/ or files), one agent each.")
    ] = "raspberry-pi-5,jetson-nano,laptop-cpu,desktop-gpu",
    data: Annotated[Path, typer.Option("--data", help="Fashion-MNIST directory.")] = Path(
        "/usr/share/datasets/fashion-mnist"
    ),
    out: Annotated[
        Path,
        typer.Option(
            "--out", "-o", help="Run directory (its partition/, server/, device-models/, logs/ are replaced)."
        ),
    ] = Path("feast-demo"),
    seed: Annotated[int, typer.Option(help="Seed of the partition and the federation.")] = 0,
    embedded_broker: Annotated[
        str,
        typer.Option(
            "--embedded-broker", help="Without --broker: auto (mosquitto if installed, else amqtt), mosquitto or amqtt."
        ),
    ] = "auto",
    dashboard: Annotated[
        str,
        typer.Option(
            "--dashboard",
            metavar="[HOST:]PORT",
            help="Where feast-server serves its live dashboard (0: a free port; 'off': none).",
        ),
    ] = "127.0.0.1:0",
    gamma: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="How strongly data follows budgets (method §4 γ: 1 the paper's proportional allocation, 0 equal shares).",
        ),
    ] = 1.0,
    server_data: Annotated[
        bool,
        typer.Option(
            "--server-data",
            help="Run the paper's server-held protocol: agents train shard files, the server validates and calibrates on its own split (default: the server holds no data; each device has its own image folder).",
        ),
    ] = False,
) -> None:
    """One command end to end: broker, feast-server and one feast-agent per device profile, rounds, ONNX per device."""
    from feast_edge.server.demo import run_demo

    run_demo(
        broker=broker,
        rounds=rounds,
        samples=samples,
        local_epochs=local_epochs,
        profiles=parse_list(profiles),
        data=data,
        out=out,
        seed=seed,
        console=console,
        embedded_broker=embedded_broker,
        dashboard=None if dashboard == "off" else dashboard,
        server_data=server_data,
        gamma=gamma,
        server_opt=server_opt,
    )
