"""``feast-agent models`` and ``feast-agent rollback``: the model versions a device holds, and going back one.

Both read what ``feast-agent run --model-dir`` keeps (``feast_edge.agent.version_store``). ``rollback`` makes the
previous installed version current (atomically, with the same recovery as an install), then tells the server with a
``version_report`` (``rolled-back``) published as ``fetch-model`` publishes its request: the same broker and identity
options, signed with ``--credentials``. Where the broker cannot be reached the rollback still stands, and the command
says how to tell the server later (``--tell-only``).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from feast_edge.agent.identity import DeviceIdOpt, identity
from feast_edge.cli import common
from feast_edge.errors import FeastError
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.credentials import credentials_of

if TYPE_CHECKING:
    from feast_edge.agent.held_versions import HeldVersion
    from feast_edge.agent.version_store import VersionStore

console = common.make_console()

TestSplitOpt = Annotated[  # feast-agent run's: the versions' test split (local_data, install_gate)
    float,
    typer.Option(
        "--test-split",
        min=0.0,
        max=0.9,
        help="Share of each client's examples kept as a test split: never trained, never used to decide an install; "
        "each model version's accuracy on it is recorded (feast-agent models) and reported (0: none).",
    ),
]
ModelDirOpt = Annotated[
    Path, typer.Option("--model-dir", help="The folder 'feast-agent run --model-dir' keeps this device's models in.")
]


def _stores(model_dir: Path, device_id: str | None) -> list[VersionStore]:
    """The stores of ``device_id`` (None: every device with versions in ``model_dir``); FeastError naming the fix."""
    from feast_edge.agent.version_store import STATE, VersionStore

    if not model_dir.is_dir():
        raise FeastError(
            f"--model-dir {model_dir} does not exist; give the folder 'feast-agent run --model-dir' keeps the models in"
        )
    versions = model_dir / "versions"
    held = sorted(p.name for p in versions.iterdir() if (p / STATE).is_file()) if versions.is_dir() else []
    if device_id is None:
        if not held:
            raise FeastError(
                f"{model_dir} holds no model versions yet; 'feast-agent run --model-dir {model_dir}' keeps each model "
                "the server sends as a version"
            )
        return [VersionStore(model_dir, d) for d in held]
    store = VersionStore(model_dir, device_id)  # an invalid id is refused here
    if device_id not in held:
        holds = f"it holds those of {', '.join(held)}" if held else "it holds none yet"
        raise FeastError(f"{model_dir} holds no model versions of device {device_id!r} ({holds}); check --device-id")
    return [store]


def _when(at: float) -> str:
    return datetime.datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S")


def _accuracy(value: float | None, examples: int) -> str:
    return "-" if value is None else f"{100 * value:.1f}% of {examples}"


def _files(record: HeldVersion, current: int | None, previous: int | None) -> str:
    if record.seq == current:
        return "current"
    if record.seq == previous:
        return "kept (rollback)"
    return "kept" if record.files else "deleted"


def _device_view(store: VersionStore) -> dict[str, Any]:
    held = store.read()
    previous = held.previous
    running = held.running
    return {
        "device": store.device,
        "current": held.current,
        "previous": None if previous is None else previous.seq,
        "in_place": running is None or store.in_place() is not None,
        "rollback": None if held.rollback is None else vars(held.rollback),
        "versions": [
            {
                **v.to_dict(),
                "current": v.seq == held.current,
                "previous": previous is not None and v.seq == previous.seq,
            }
            for v in reversed(held.versions)
        ],
    }


def models_command(
    model_dir: ModelDirOpt,
    device_id: DeviceIdOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List the model versions each device holds: server version, round, decision, when, held-out and test accuracy, which is current."""
    from feast_edge.agent.held_versions import describe

    stores = _stores(model_dir, device_id)
    views = [_device_view(s) for s in stores]
    if as_json:
        print(json.dumps({"model_dir": str(model_dir), "devices": views}, indent=1))
        return
    for store, view in zip(stores, views):
        held = store.read()
        running, previous = held.running, held.previous
        runs = f"runs {describe(running)}" if running is not None else "runs no version"
        back = f"; rollback goes back to {describe(previous)}" if previous is not None else "; nothing to roll back to"
        lines = [f"{store.device}: {runs}{back}"]
        if not view["in_place"]:
            lines.append(
                f"  the files in {model_dir} are not the current version's (an install or rollback was cut short); "
                "the next 'feast-agent run' or 'feast-agent rollback' restores them"
            )
        lines.append(f"  {'seq':>4}  {'version':>7}  {'round':>5}  {'decision':<11}  {'when':<19}  "
                     f"{'held-out':<14}  {'test':<14}  files")  # fmt: skip
        for v in reversed(held.versions):
            version = "-" if v.version is None else str(v.version)
            rnd = "-" if v.round is None else str(v.round)
            files = _files(v, held.current, None if previous is None else previous.seq)
            lines.append(
                f"  {v.seq:04d}  {version:>7}  {rnd:>5}  {v.decision:<11}  {_when(v.at):<19}  "
                f"{_accuracy(v.holdout_accuracy, v.holdout_examples):<14}  "
                f"{_accuracy(v.test_accuracy, v.test_examples):<14}  {files}"
                + ("  (rolled back)" if v.rolled_back is not None else "")
            )
        if held.rollback is not None and not held.rollback.told:
            lines.append(
                f"  the server has not heard of the rollback of {_when(held.rollback.at)}: "
                f"feast-agent rollback --tell-only --model-dir {model_dir} --device-id {store.device} --broker URL"
            )
        console.print("\n".join(lines), soft_wrap=True, highlight=False, markup=False)


@common.mqtt_options(required=False)
def rollback_command(
    link: LinkConfig | None,
    model_dir: ModelDirOpt,
    device_id: DeviceIdOpt = None,
    federation: common.BundleFederationOpt = None,
    tell_only: Annotated[
        bool,
        typer.Option(
            "--tell-only", help="Do not roll back again: tell the server of the last rollback (it missed it)."
        ),
    ] = False,
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait for the broker.")] = 10.0,
    log_level: common.LogLevelOpt = "error",
    log_file: common.LogFileOpt = None,
) -> None:
    """Make the previous installed model version current again, and tell the server (version_report rolled-back)."""
    from feast_edge.agent.held_versions import describe

    common.setup_logging(log_level, log_file)
    device, _ = identity(link, device_id, federation)  # checks --device-id and --federation against a bundle
    store = _stores(model_dir, device)[0]
    if not tell_only:
        with store.locked():
            store.recover()
            left, back = store.rollback()
        accuracy = _accuracy(back.holdout_accuracy, back.holdout_examples)
        console.print(
            f"rolled back {device} in {model_dir}: it runs {describe(back)} again (held-out {accuracy}); "
            f"left {describe(left)}",
            soft_wrap=True,
            highlight=False,
            markup=False,
        )
    note = store.read().rollback
    if note is None:
        raise FeastError(f"{device} has not been rolled back in {model_dir}; there is nothing to tell the server")
    if note.version is None:
        console.print(
            "the version it left carries no server version: there is nothing to tell the server", markup=False
        )
        return
    bundle = credentials_of(link)
    fed = federation or (bundle.federation if bundle is not None else None) or note.federation or "feast"
    fix = (
        f"tell it with: feast-agent rollback --tell-only --model-dir {model_dir} --device-id {device} "
        f"--federation {fed} --broker URL (or --credentials DIR)"
    )
    done = "" if tell_only else "rolled back locally, but "
    if link is None:
        raise FeastError(f"{done}the server was not told (no --broker or --credentials given); {fix}")
    try:
        _tell(link, fed, device, note.version, note.running or 0, timeout)
    except FeastError as exc:
        raise FeastError(f"{done}the server was not told ({exc}); {fix}") from None
    store.mark_told()
    console.print(
        f"told the server of federation {fed}: {device} left version {note.version}, runs "
        f"{note.running or 'no version of this federation'}",
        soft_wrap=True,
        highlight=False,
        markup=False,
    )


def _tell(link_config: LinkConfig, federation: str, device: str, left: int, running: int, timeout: float) -> None:
    """Publish the ``rolled-back`` version_report on ``device``'s events topic and wait for the broker's PUBACK."""
    from feast_edge.protocol import VersionReport
    from feast_edge.transport.link import Link
    from feast_edge.transport.topics import Topics
    from feast_edge.versions.gate import ROLLED_BACK

    report = VersionReport(
        federation=federation,
        round=0,
        device=device,
        version=left,
        decision=ROLLED_BACK,
        running=running,
        reason="rolled back by hand (feast-agent rollback)",
    )
    link = Link(link_config)  # no presence: a tool, not the device's agent
    try:
        link.connect(timeout=timeout)
        link.publish(Topics(federation).events(device), report.encode(), timeout=timeout)
    finally:
        link.close()
