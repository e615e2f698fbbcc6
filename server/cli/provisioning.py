"""``feast-server provision``: a CA, a broker configuration with an ACL, and a credentials bundle per device."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from feast_edge.errors import FeastError
from feast_edge.server.cli.shared import console


def register(app: typer.Typer) -> None:
    """Add ``provision`` to the ``feast-server`` app."""
    app.command("provision")(provision_command)


def provision_command(
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Provisioning directory (CA, broker configuration, server and device bundles); re-run to add devices.",
        ),
    ],
    devices: Annotated[
        Optional[list[str]],
        typer.Option("--device", "-d", help="A device id to provision (repeat the option for each)."),
    ] = None,
    devices_file: Annotated[
        Optional[Path],
        typer.Option("--devices-file", help="A text file with one device id per line (# comments allowed)."),
    ] = None,
    federation: Annotated[str, typer.Option("--federation", help="Federation id the credentials are for.")] = "feast",
    auth: Annotated[
        str,
        typer.Option(
            "--auth",
            help="How devices prove who they are to the broker: certificate (TLS client certificates) or password.",
        ),
    ] = "certificate",
    broker_host: Annotated[
        Optional[list[str]],
        typer.Option(
            "--broker-host",
            help="Name or address devices use to reach the broker (repeat; the first goes into the bundles' URL). Default: localhost, 127.0.0.1.",
        ),
    ] = None,
    broker_port: Annotated[int, typer.Option("--broker-port", min=1, max=65535, help="The broker's TLS port.")] = 8883,
    listen: Annotated[
        Optional[str],
        typer.Option(
            "--listen",
            help="Address the generated broker configuration listens on (e.g. 127.0.0.1 for this machine only, or "
            "one interface's address); default: every interface.",
        ),
    ] = None,
    broker_user: Annotated[
        Optional[str],
        typer.Option(
            "--broker-user",
            help="System user Mosquitto runs as (its 'user' setting); default: Mosquitto's own, which cannot read the "
            'broker key this writes when Mosquitto starts as root: give the files\' owner, e.g. "$(id -un)".',
        ),
    ] = None,
    revoke: Annotated[
        Optional[list[str]],
        typer.Option("--revoke", help="Remove a device: its bundle goes, its certificate enters the CRL (repeat)."),
    ] = None,
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
        out,
        federation,
        names,
        auth=auth,
        hosts=tuple(broker_host or ("localhost", "127.0.0.1")),
        port=broker_port,
        days=days,
        broker_user=broker_user,
        revoke=tuple(revoke or ()),
        bind=listen,
    )
    table = Table(title=f"federation {federation!r}: {len(done.devices)} devices ({auth} authentication)")
    table.add_column("identity", overflow="fold")
    table.add_column("bundle (--credentials)", overflow="fold")
    table.add_column("new", justify="center")
    table.add_row("server", str(done.server), "")
    for name, path in done.devices.items():
        table.add_row(name, str(path), "yes" if name in done.added else "")
    console.print(table)
    console.print(
        f"broker: mosquitto -c {done.broker_config} (TLS on {listen or 'every interface'}, port {broker_port})"
        + (
            ""
            if broker_user
            else "; started as root it runs as user mosquitto, which cannot read the broker key: "
            'provision again with --broker-user "$(id -un)" or give mosquitto read access'
        )
        + "\n"
        f"server: feast-server run --credentials {done.server} --out RUN_DIR ...\n"
        f"device: copy its bundle to the device, then feast-agent run --credentials BUNDLE --data ...\n"
        f"Keep {out / 'ca' / 'ca.key'} off the devices; a bundle is its device's identity (treat it like a password).",
        soft_wrap=True,
        highlight=False,
    )
