"""Credentials bundles: one directory per identity, written by ``feast-server provision``, read with ``--credentials DIR``.

A bundle holds everything one identity (a device, or the server) needs to join
its federation on a provisioned broker::

    bundle.json     who (role, identity, federation), where (broker URL), how (certificate or password), peers' public keys
    ca.crt          the federation's CA: verifies the broker
    client.crt/.key the identity's TLS client certificate and key (certificate auth)
    signing.key     the identity's Ed25519 key: signs every message it publishes

The identity is the device id: the broker knows it from the certificate's CN
(or the user name), its ACL lets it publish only on its own topics, and every
message it sends is signed with its key (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from feast_edge.transport.broker import LinkConfig, parse_broker_url
from feast_edge.transport.errors import LinkError, TopicError, TransportError
from feast_edge.transport.signing import Keyring, load_private_key, public_key_from_text
from feast_edge.transport.topics import validate_id

BUNDLE_FILE = "bundle.json"
FORMAT = "feast-credentials"
VERSION = 1
ROLES = ("device", "server")
AUTHS = ("certificate", "password")
MAX_BUNDLE_BYTES = 4 * 1024 * 1024  # a server bundle lists every device's public key: ~60 bytes each


class CredentialsError(TransportError):
    """A credentials bundle is missing, incomplete or inconsistent."""


@dataclass(frozen=True)
class Credentials:
    """One identity's bundle, validated; file paths are absolute."""

    path: Path
    role: str
    identity: str
    federation: str
    broker: str
    auth: str
    ca_file: str
    signing_key: str
    peers: dict[
        str, str
    ]  # name -> base64 Ed25519 public key ("server" in a device's bundle, every device in the server's)
    cert_file: str | None = None
    key_file: str | None = None
    username: str | None = None
    password: str | None = None

    def keyring(self) -> Keyring:
        """The signing key and the peers' public keys, loaded."""
        peers = {name: public_key_from_text(text, name) for name, text in self.peers.items()}
        return Keyring(
            self.identity if self.role == "device" else "server", load_private_key(Path(self.signing_key)), peers
        )

    def link_config(self, base: LinkConfig | None = None, broker: str | None = None) -> LinkConfig:
        """``base`` (the command line's settings) with this bundle's broker, TLS files, user name and password.

        A plain ``mqtt://`` ``broker`` (a broker the federation does not
        control, without TLS) keeps the user name, password and signing keys
        and drops the TLS files: then only the signatures protect the messages.
        """
        settings, url = base or LinkConfig(), broker or self.broker
        tls = parse_broker_url(url).tls
        return dataclasses.replace(
            settings,
            broker=url,
            ca_file=self.ca_file if tls else None,
            cert_file=self.cert_file if tls else None,
            key_file=self.key_file if tls else None,
            username=self.username,
            password=self.password,
            credentials=self,
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``bundle.json`` body (file names relative to the bundle)."""
        files = {"ca": self.ca_file, "signing_key": self.signing_key, "cert": self.cert_file, "key": self.key_file}
        body = {
            "format": FORMAT,
            "version": VERSION,
            "role": self.role,
            "identity": self.identity,
            "federation": self.federation,
            "broker": self.broker,
            "auth": self.auth,
            "files": {k: Path(v).name for k, v in files.items() if v is not None},
            "peers": dict(sorted(self.peers.items())),
        }
        if self.auth == "password":
            body["username"], body["password"] = self.username, self.password
        return body


def credentials_of(link: LinkConfig | None) -> Credentials | None:
    """The provisioned identity a link was configured with (``--credentials``), if any."""
    bundle = None if link is None else link.credentials
    return bundle if isinstance(bundle, Credentials) else None


def load_credentials(path: str | Path) -> Credentials:
    """Read and check the bundle in directory ``path`` (or its ``bundle.json``); CredentialsError says what is wrong."""
    root = Path(path)
    file = root / BUNDLE_FILE if root.is_dir() else root
    root = file.parent
    fix = "give the directory feast-server provision wrote for this identity (…/devices/NAME or …/server)"
    if not file.is_file():
        raise CredentialsError(f"--credentials {path}: no {BUNDLE_FILE} there; {fix}")
    if file.stat().st_size > MAX_BUNDLE_BYTES:
        raise CredentialsError(f"--credentials {path}: {file} is over {MAX_BUNDLE_BYTES} bytes; {fix}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CredentialsError(f"--credentials {path}: {file} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CredentialsError(f"--credentials {path}: {file} is not a feast credentials bundle; {fix}")
    if data.get("version") != VERSION:
        raise CredentialsError(
            f"--credentials {path}: bundle version {data.get('version')!r} is not supported (this side reads {VERSION}); provision again"
        )

    def text(name: str, choices: tuple[str, ...] | None = None) -> str:
        value = data.get(name)
        if not isinstance(value, str) or not value or (choices is not None and value not in choices):
            expected = f"one of {', '.join(choices)}" if choices else "a non-empty string"
            raise CredentialsError(f"--credentials {path}: field {name!r} must be {expected}, got {value!r}; {fix}")
        return value

    def member(name: str, required: bool = True) -> str | None:
        entry = files.get(name)
        if entry is None and not required:
            return None
        if not isinstance(entry, str) or "/" in entry or not (root / entry).is_file():
            raise CredentialsError(
                f"--credentials {path}: the bundle's {name} file {entry!r} is missing from {root}; {fix}"
            )
        return str((root / entry).resolve())

    role, auth = text("role", ROLES), text("auth", AUTHS)
    try:
        identity, federation = (
            validate_id(text("identity"), "identity"),
            validate_id(text("federation"), "federation id"),
        )
        parse_broker_url(text("broker"))
    except (TopicError, LinkError) as exc:
        raise CredentialsError(f"--credentials {path}: {exc}") from None
    files, peers = data.get("files"), data.get("peers")
    if not isinstance(files, dict):
        raise CredentialsError(f"--credentials {path}: field 'files' must be an object; {fix}")
    if not isinstance(peers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in peers.items()):
        raise CredentialsError(f"--credentials {path}: field 'peers' must map names to public keys; {fix}")
    if role == "device" and "server" not in peers:
        raise CredentialsError(f"--credentials {path}: the bundle lacks the server's public key; {fix}")
    credentials = Credentials(
        path=root.resolve(),
        role=role,
        identity=identity,
        federation=federation,
        broker=text("broker"),
        auth=auth,
        ca_file=member("ca") or "",
        signing_key=member("signing_key") or "",
        peers=peers,
        cert_file=member("cert", auth == "certificate"),
        key_file=member("key", auth == "certificate"),
        username=text("username") if auth == "password" else None,
        password=text("password") if auth == "password" else None,
    )
    credentials.keyring()  # every key loads, or a clear error now rather than at the first message
    return credentials
