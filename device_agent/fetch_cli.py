"""``feast-agent fetch-model``: download this device's model from the server (and, without server data, export it here)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from feast_edge.agent.identity import DeviceIdOpt, identity
from feast_edge.agent.threads import latency_threads
from feast_edge.cli import common
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.credentials import credentials_of
from feast_edge.transport.frames import DEFAULT_CHUNK_SIZE

if TYPE_CHECKING:
    from feast_edge.agent.local_data import LocalClient
    from feast_edge.space.preset import Preset

console = common.make_console()


def _bn_words(manifest: dict[str, Any]) -> str:
    """Where the model's BN statistics come from, in words."""
    if manifest.get("calibration") == "federated":
        return f"BN statistics of the federation's data, {manifest.get('calibration_samples')} examples; exported here"
    return f"calibrated here on {manifest.get('calibration_samples')} examples"


@common.mqtt_options()
def fetch_model_command(
    link: LinkConfig,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="ONNX file to write (its manifest goes beside it as .json).")
    ],
    device_id: DeviceIdOpt = None,
    federation: common.BundleFederationOpt = None,
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait for the server's answer.")] = 30.0,
    repeats: Annotated[int, typer.Option(min=1, help="Timed onnxruntime runs.")] = 50,
    chunk_size: common.ChunkOpt = DEFAULT_CHUNK_SIZE,
    data: Annotated[
        Optional[Path],
        typer.Option(
            "--data",
            help="This device's data, to calibrate BN on when the server holds none (its models are calibrated on the device).",
        ),
    ] = None,
    preset: Annotated[
        Optional[str],
        typer.Option(help="Preset name or .toml file (with --data; default: the one the server's model names)."),
    ] = None,
    holdout: Annotated[
        Optional[float],
        typer.Option(help="Held-out share of --data the model is tested on (default: as feast-agent run)."),
    ] = None,
    threads: int = 0,  # --threads (feast_edge.agent.cli.threaded)
    log_level: common.LogLevelOpt = "warning",
    log_file: common.LogFileOpt = None,
) -> None:
    """Download this device's ONNX model from the server, verify its SHA-256, load it in onnxruntime, print its latency."""
    from feast_edge.agent.local_data import load_clients
    from feast_edge.agent.model_files import fetch_model
    from feast_edge.space.preset import load_preset

    common.setup_logging(log_level, log_file)
    device_id, federation = identity(link, device_id, federation)
    task_preset = None if preset is None else load_preset(preset)

    def own(model_preset: Preset) -> LocalClient:  # read once the preset is known: the model's, unless --preset
        assert data is not None
        return load_clients(data, device_id, task=model_preset.task, holdout=holdout)[0]

    got = fetch_model(
        link,
        federation,
        device_id,
        out,
        timeout=timeout,
        chunk_size=chunk_size,
        repeats=repeats,
        data=None if data is None else own,
        preset=task_preset,
        threads=threads,
    )
    m, timed = got.manifest, latency_threads(threads)
    accuracy = (
        f"held-out accuracy {100 * m['holdout_accuracy']:.2f}% ({_bn_words(m)})"
        if m.get("calibration") in ("device", "federated") and m.get("holdout_accuracy") is not None
        else f"validation accuracy {100 * m['validation_accuracy']:.2f}%"
        if m.get("validation_accuracy") is not None
        else "no accuracy measured"
    )
    checked = (
        ""
        if credentials_of(link) is not None
        else " against an unauthenticated manifest: without --credentials anyone on the broker could have sent both"
    )
    console.print(
        f"saved {got.path} ({m['size']:,} bytes, sha256 {m['sha256'][:16]}… verified{checked})\n"
        f"arch {m['arch']}  {m['macs'] / 1e6:.2f}M MACs  {m['params'] / 1e6:.3f}M params  {accuracy}\n"
        f"onnxruntime latency (batch 1, CPU, {timed} thread{'' if timed == 1 else 's'}): median {got.latency['median_ms']:.3f} ms, p90 {got.latency['p90_ms']:.3f} ms",
        soft_wrap=True,
        highlight=False,
    )
