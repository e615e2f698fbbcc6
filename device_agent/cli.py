"""``feast-agent``: profile this device, take part in a federation, fetch this device's ONNX model and use it, list
the model versions it holds and roll back one.

User errors (unreachable broker, wrong credentials, refused registration,
missing data, a budget below the smallest variant, a silent server) print one
``error:`` line to stderr and exit with status 2; SIGINT/SIGTERM end the agent
cleanly (offline presence, DISCONNECT).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from feast_edge.agent.fetch_cli import fetch_model_command
from feast_edge.agent.identity import DeviceIdOpt, identity
from feast_edge.agent.profiles_cli import profiles_command
from feast_edge.agent.threads import profile_threads, use_threads
from feast_edge.agent.versions_cli import TestSplitOpt, models_command, rollback_command
from feast_edge.cli import common, inference
from feast_edge.errors import FeastError
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.frames import DEFAULT_CHUNK_SIZE

app = common.make_app(
    "feast-agent",
    "FEAST device agent: measure this device, train in a federation over MQTT, fetch its ONNX model and use it.",
)
console = common.make_console()

log = logging.getLogger("feast_edge.agent")

F = TypeVar("F", bound=Callable[..., Any])
THREADS = typer.Option(
    "--threads",
    min=0,
    help="Threads PyTorch and onnxruntime use. 0: run chooses them from the cores free before each step (training, "
    "validation, export), profile times on every core, the others use their own default. 1 on a Raspberry Pi 4 that "
    "stops with 'Illegal instruction'.",
)


def threaded(command: F) -> F:
    """``command`` with the --threads option every computing command shares: PyTorch uses that many threads before the
    command starts, and the command receives the count as ``threads`` for the onnxruntime sessions it opens."""
    return common.option_group("threads", {"threads": (int, 0, THREADS)}, lambda given: use_threads(given["threads"]))(
        command
    )


def _preset_name(preset: str) -> str:
    """The name a preset given as a name or a .toml file declares (profiles record names)."""
    from feast_edge.space.preset import load_preset

    return load_preset(preset).name


class _Terminated(BaseException):  # not an Exception: the agent's error boundaries must not swallow a stop
    """SIGTERM: leave like Ctrl-C, but it is a requested stop, not an interruption."""


@app.command()
@common.mqtt_options()
@threaded
def run(
    link: LinkConfig,
    data: Annotated[
        Path,
        typer.Option(
            "--data",
            help="This device's images (a folder <root>/<class name>/<file>, a manifest CSV path,label, a CIFAR binary "
            "folder), a Fashion-MNIST directory, a shard file, or a partition directory (feast-edge partition).",
        ),
    ],
    profile: Annotated[
        str | None,
        typer.Option(
            "--profile",
            help="Device profile: a name (feast-agent profiles) or a .json file; gives the budget and preset.",
        ),
    ] = None,
    budget: Annotated[
        str | None,
        typer.Option("--budget", help="MAC budget, e.g. 12M (instead of --profile; shard files carry their own)."),
    ] = None,
    device: common.DeviceOpt = "auto",
    amp: common.AmpOpt = "auto",
    deterministic: common.DeterministicOpt = False,
    clients: Annotated[
        int | None,
        typer.Option(
            "--clients",
            "-k",
            min=1,
            help="Host K virtual clients in this process (ids ID-0..ID-(K-1), or a partition's).",
        ),
    ] = None,
    shard: Annotated[
        str | None,
        typer.Option(
            "--shard", help="With a Fashion-MNIST directory: use deterministic shard i/N of its training split."
        ),
    ] = None,
    offset: Annotated[
        int, typer.Option("--offset", min=0, help="With a partition directory: first client to host.")
    ] = 0,
    holdout: Annotated[
        float | None,
        typer.Option(
            "--holdout",
            min=0.0,
            max=0.9,
            help="Share of each client's examples held out, never trained (default: 0.1 of this device's own images, "
            "0 of shards and Fashion-MNIST).",
        ),
    ] = None,
    test_split: TestSplitOpt = 0.0,
    rescan: Annotated[
        float,
        typer.Option(
            "--rescan",
            min=0.0,
            help="Between rounds, list an image folder or manifest again at most every this many seconds and train on "
            "the images added (0: read it once).",
        ),
    ] = 60.0,
    preset: Annotated[
        str | None,
        typer.Option("--preset", "-p", help="Preset (default: the profile's or the shard's, else fmnist-small)."),
    ] = None,
    cache: Annotated[
        Path | None,
        typer.Option(
            "--cache", help="Variant cache JSON (default: the one beside the preset's file, else the shipped one)."
        ),
    ] = None,
    device_id: DeviceIdOpt = None,
    federation: common.BundleFederationOpt = None,
    model_dir: Annotated[
        Path | None,
        typer.Option("--model-dir", help="Save the ONNX model the server pushes after the last round here."),
    ] = None,
    personalize: Annotated[
        str,
        typer.Option(
            "--personalize",
            help="After the last round, also write a personal model beside the served one (DEVICE.personal.onnx), "
            "chosen on a selection split of this device's training data: auto (the best method, only if it beats "
            "the served model there), off, prior, head, bn, proximal, or METHOD:STRENGTH (e.g. prior:0.5).",
        ),
    ] = "auto",
    evaluate_up_to: Annotated[
        str,
        typer.Option(
            "--evaluate-up-to",
            help="Largest variant this device evaluates and BN-calibrates for the federation's validation: auto (as "
            "large as half the available memory allows; evaluation is a one-off, not serving), serving (only what "
            "its budget serves), or MACs such as 20M.",
        ),
    ] = "auto",
    stay: Annotated[
        bool,
        typer.Option(
            "--stay", help="When the federation finishes, keep waiting for the server's next run instead of exiting."
        ),
    ] = False,
    register_timeout: Annotated[
        float,
        typer.Option("--register-timeout", min=0.1, help="Seconds to wait for the server to accept the registration."),
    ] = 60.0,
    dp_clip: Annotated[
        float | None,
        typer.Option(
            "--dp-clip",
            help="Local differential privacy this device requires, whatever the server asks (with --dp-noise): clip "
            "every update to this L2 norm before it leaves; rounds of a server without --dp-mode local are declined "
            "(docs/privacy.md).",
        ),
    ] = None,
    dp_noise: Annotated[
        float | None,
        typer.Option("--dp-noise", help="Local DP: add N(0, (z·C)²) to every parameter of each clipped update."),
    ] = None,
    dp_delta: Annotated[
        float, typer.Option("--dp-delta", help="δ of the local-DP ε this device reports (below 1/its examples).")
    ] = 1e-5,
    dp_ledger: Annotated[
        Path | None,
        typer.Option(
            "--dp-ledger",
            help="JSON file that keeps every noised update this device sent, across runs, for its ε (default: "
            "$XDG_STATE_HOME/feast-edge/privacy-ledger.json, else ~/.local/state/...).",
        ),
    ] = None,
    threads: int = 0,  # --threads (threaded): PyTorch's is set; onnxruntime's goes through the config
    nice: Annotated[
        int,
        typer.Option(
            "--nice",
            min=0,
            max=19,
            help="Run at this OS niceness, so the device's own applications keep their speed (0: normal priority).",
        ),
    ] = 10,
    chunk_size: common.ChunkOpt = DEFAULT_CHUNK_SIZE,
    insecure: common.InsecureOpt = False,
    log_level: common.LogLevelOpt = "info",
    log_file: common.LogFileOpt = None,
) -> None:
    """Register with the server and train every round it routes to this device; exit 0 when the federation finishes."""
    from feast_edge.agent.agent import Agent, AgentConfig
    from feast_edge.agent.local_data import load_clients
    from feast_edge.budget.profile import load_profile, profile_summary
    from feast_edge.local.precision import resolve_amp, set_deterministic
    from feast_edge.local.torch_device import describe_device, resolve_device

    common.setup_logging(log_level, log_file)
    from feast_edge.util.priority import lower_priority

    priority = lower_priority(nice)
    device_id, federation = identity(link, device_id, federation)
    if profile is not None and budget is not None:
        raise FeastError("give either --profile or --budget, not both (a profile carries its budget)")
    torch_device = resolve_device(device)
    from feast_edge.personalize.select import Choice
    from feast_edge.privacy.local import check_device_dp, default_ledger

    choice = Choice.parse(personalize)  # an unknown setting is refused before any data is read
    check_device_dp(dp_clip, dp_noise, dp_delta)
    from feast_edge.agent.profiling import check_evaluate_up_to

    precision = resolve_amp(amp, torch_device)  # a mode this device cannot run is refused before any data is read
    loaded = None
    if profile is not None:
        loaded = load_profile(profile)
    from feast_edge.cli.progress import lazy_stage
    from feast_edge.space.preset import load_preset

    task = load_preset(preset or (loaded.preset if loaded is not None else None) or "fmnist-small").task
    with lazy_stage(console, "decoding images") as progress:
        hosted = load_clients(
            data,
            device_id,
            clients,
            shard,
            offset,
            task=task,
            holdout=holdout,
            progress=progress,
            test_split=test_split,
        )
    if link.credentials is not None and [c.device_id for c in hosted] != [device_id]:
        raise FeastError(
            f"--credentials make this agent device {device_id!r} alone, but --data/--clients give it {len(hosted)} clients "
            f"({', '.join(c.device_id for c in hosted[:3])}{', ...' if len(hosted) > 3 else ''}); give one shard and no --clients"
        )
    shard_presets = {c.preset for c in hosted if c.preset is not None}
    chosen = (
        preset
        or (loaded.preset if loaded is not None else None)
        or (next(iter(shard_presets)) if len(shard_presets) == 1 else None)
        or "fmnist-small"
    )
    if loaded is not None and loaded.preset not in (chosen, _preset_name(chosen)):
        raise FeastError(
            f"profile {loaded.name} was derived for preset {loaded.preset}, not {chosen}; re-profile with 'feast-agent profile --preset {chosen}'"
        )
    if deterministic:
        set_deterministic()
    config = AgentConfig(
        host=device_id,
        federation=federation,
        preset=chosen,
        cache=None if cache is None else str(cache),
        torch_device=torch_device,
        amp=precision.mode,
        budget_macs=common.parse_macs(budget)
        if budget is not None
        else (loaded.budget_macs if loaded is not None else None),
        profile=profile_summary(loaded) if loaded is not None else {},
        # the profile's serving precision goes with its budget; a --budget (or a shard's) is a float32 one
        precision=loaded.precision if loaded is not None and budget is None else "fp32",
        chunk_size=chunk_size,
        threads=threads,
        register_timeout=register_timeout,
        model_dir=None if model_dir is None else str(model_dir),
        personalize=str(choice),
        evaluate_up_to=check_evaluate_up_to(evaluate_up_to),
        stay=stay,
        rescan=rescan,
        dp_clip=dp_clip,
        dp_noise=dp_noise,
        dp_delta=dp_delta,
        dp_ledger=str(dp_ledger or default_ledger()),
    )
    common.check_insecure(link, insecure, "feast-agent run")
    agent = Agent(config, link, hosted)
    log.info("%s, %s; running %s", describe_device(torch_device, device), precision.describe(), priority)

    def terminate(signum: int, frame: Any) -> None:
        # Loops notice the flag within 0.2 s; a local epoch can take minutes, so training is interrupted at once.
        first = not agent.stop.is_set()
        agent.stop.set()
        stopped.append(signum)
        if agent.training or not first:
            raise _Terminated

    stopped: list[int] = []
    previous = {s: signal.signal(s, terminate) for s in (signal.SIGTERM, signal.SIGINT)}
    common.warn_insecure(link)
    try:
        agent.start()
        if agent.register():
            if not agent.finished:
                log.info(
                    "registered %s with federation %r; waiting for rounds (Ctrl-C to leave)",
                    ", ".join(agent.clients),
                    federation,
                )
            agent.run()
    except _Terminated:
        pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        agent.close()
    if stopped:
        log.info("stopped; left the federation (offline status published)")
        if stopped[0] == signal.SIGINT:
            raise typer.Exit(130)
    elif agent.finished:
        console.print(agent.summary(), soft_wrap=True, highlight=False)


@app.command()
@threaded
def profile(
    out: Annotated[Path, typer.Option("--out", "-o", help="Profile file to write (.json).")],
    preset: Annotated[
        str, typer.Option("--preset", "-p", help="Preset whose cached variants are timed.")
    ] = "fmnist-small",
    cache: Annotated[
        Path | None,
        typer.Option(
            "--cache", help="Variant cache JSON (default: the one beside the preset's file, else the shipped one)."
        ),
    ] = None,
    device: common.DeviceOpt = "auto",
    latency_target_ms: Annotated[
        float | None,
        typer.Option("--latency-target-ms", min=0.001, help="Batch-1 inference latency the served variant must meet."),
    ] = None,
    memory_fraction: Annotated[
        float,
        typer.Option("--memory-fraction", min=0.01, max=1.0, help="Share of RAM (or GPU memory) training may use."),
    ] = 0.5,
    variants: Annotated[int, typer.Option(min=2, help="Cached variants to time.")] = 6,
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per variant.")] = 20,
    name: Annotated[str | None, typer.Option(help="Profile name (default: from the host name).")] = None,
    runtime: Annotated[
        str,
        typer.Option(
            help="What times the variants: onnxruntime (what serves the exported model) or torch (PyTorch eager)."
        ),
    ] = "onnxruntime",
    provider: Annotated[
        str | None,
        typer.Option(
            help="onnxruntime execution provider: cpu, cuda or tensorrt (default: cuda on a CUDA device, else cpu)."
        ),
    ] = None,
    holdout: Annotated[
        int, typer.Option(min=0, help="Variants timed but kept out of the fit, to measure its error.")
    ] = 3,
    threads: int = 0,  # --threads (threaded)
    precision: Annotated[
        str,
        typer.Option(
            help="Precision the device is served in, timed as served: fp32, int8 (each variant quantized as the "
            "server does; onnxruntime only) or auto (time both, keep the larger budget).",
        ),
    ] = "fp32",
) -> None:
    """Measure this device: time cached variants on the serving runtime, fit latency = a + b*MACs, derive the MAC budget; write a profile."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from feast_edge.agent import profiling
    from feast_edge.agent.profile_view import profile_table
    from feast_edge.budget.profile import save_profile
    from feast_edge.util.atomic import check_writable

    check_writable(out, "device profile")
    profiling.check_profile_precision(precision, runtime)  # before the progress bar: a bad choice is one error line
    kwargs: dict[str, Any] = {
        "device": device,
        "memory_fraction": memory_fraction,
        "variants": variants,
        "repeats": repeats,
        "name": name,
        "runtime": runtime,
        "provider": provider,
        "holdout": holdout,
        "threads": profile_threads(threads),  # a declared count, recorded in the profile
        "cache_file": None if cache is None else str(cache),
        "precision": precision,
    }
    if latency_target_ms is not None:
        kwargs["latency_target_ms"] = latency_target_ms
    with Progress(
        TextColumn("[bold]timing variants"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as bar:
        timings = (variants + holdout) * (2 if precision == "auto" else 1)  # auto times each variant in both
        task = bar.add_task("variants", total=timings)
        result = profiling.profile_device(
            preset, progress=lambda done, total: bar.update(task, completed=done, total=total), **kwargs
        )
    save_profile(result, out)
    console.print(profile_table(result, preset, None if cache is None else str(cache)))
    console.print(f"wrote {out}; use it with: feast-agent run --profile {out} ...", soft_wrap=True)


# fetch-model, predict and evaluate pass --threads to their onnxruntime sessions; threaded sets PyTorch's too.
app.command("profiles")(profiles_command)
app.command("fetch-model")(threaded(fetch_model_command))
app.command("predict")(threaded(inference.predict))
app.command("evaluate")(threaded(inference.evaluate))
app.command("models")(models_command)
app.command("rollback")(rollback_command)


def main() -> None:
    """Console-script entry of ``feast-agent``."""
    common.run_cli(app)


if __name__ == "__main__":
    main()
