"""Who a device agent's command speaks as: its ``--device-id`` option, or the identity of its credentials bundle."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from feast_edge.cli import common
from feast_edge.errors import FeastError
from feast_edge.transport.broker import LinkConfig
from feast_edge.transport.credentials import credentials_of

DeviceIdOpt = Annotated[
    Optional[str],
    typer.Option(
        "--device-id",
        "-d",
        help="This device's id (1-64 of A-Z a-z 0-9 . _ -); with --credentials, the bundle's identity.",
    ),
]


def identity(link: Optional[LinkConfig], device_id: Optional[str], federation: Optional[str]) -> tuple[str, str]:
    """The device id and federation: from the credentials bundle when given (the options may only repeat them), else the options."""
    bundle = credentials_of(link)
    if bundle is None:
        if device_id is None:
            raise FeastError(
                "give --device-id NAME (or --credentials with a device bundle from feast-server provision)"
            )
        return device_id, common.federation_of(link, federation)
    if bundle.role != "device":
        raise FeastError(f"--credentials {bundle.path} is the server's bundle; a device takes its own (…/devices/NAME)")
    if device_id is not None and device_id != bundle.identity:
        raise FeastError(
            f"--device-id {device_id} differs from the credentials bundle's identity {bundle.identity!r}; drop --device-id"
        )
    return bundle.identity, common.federation_of(link, federation)
