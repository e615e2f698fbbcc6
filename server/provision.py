"""``feast-server provision``: identities, a broker configuration that enforces them, and one bundle per device.

For a federation and a list of devices it writes, under one directory::

    ca/ca.crt, ca/ca.key         the federation's CA (keep ca.key on the server machine, offline if you can)
    ca/revoked.json              serial numbers of revoked client certificates (``--revoke``)
    broker/                      for Mosquitto: mosquitto.conf, acl, passwd (password auth), crl.pem, broker.crt/.key, ca.crt
    server/                      the server's credentials bundle (feast-server run --credentials …/server)
    devices/NAME/                one bundle per device (feast-agent run --credentials …/devices/NAME)

Each identity gets a TLS client certificate whose CN is its name (or a user
name and a random password), and an Ed25519 signing key. The ACL lets a device
publish only on its own topics and read only its own downlinks and the
server's presence; the server identity may use the whole federation;
anonymous clients are refused. Running it again keeps every existing key,
certificate and password and adds what is new, so devices can join later.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import json
import re
import secrets
from base64 import b64encode
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from feast_edge.errors import FeastError
from feast_edge.transport.credentials import AUTHS, BUNDLE_FILE, Credentials, load_credentials
from feast_edge.transport.errors import TopicError
from feast_edge.transport.signing import SERVER, load_private_key, public_key_text, write_private_key
from feast_edge.transport.topics import PREFIX, Topics, validate_id

SERVER_NAME = "feast-server"  # the server's broker identity (certificate CN / user name)
PBKDF2_ITERATIONS = 101  # what mosquitto_passwd writes; the passwords are 192-bit random tokens, not words
CA_DAYS = 3650


class ProvisionError(FeastError):
    """The provisioning request cannot be carried out as given."""


@dataclass(frozen=True)
class Provisioned:
    """What ``provision`` wrote."""

    root: Path
    server: Path
    devices: dict[str, Path]
    broker_config: Path
    added: list[str]


def provision(
    root: Path,
    federation: str,
    devices: list[str],
    *,
    auth: str = "certificate",
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
    port: int = 8883,
    days: int = 825,
    broker_user: str | None = None,
    revoke: tuple[str, ...] = (),
    bind: str | None = None,
) -> Provisioned:
    """Write (or extend) the provisioning directory ``root``; see the module docstring."""
    try:
        validate_id(federation, "federation id")
        for name in [*devices, *revoke]:
            validate_id(name, "device id")
    except TopicError as exc:
        raise ProvisionError(str(exc)) from None
    if auth not in AUTHS:
        raise ProvisionError(f"--auth {auth!r} is not one of {', '.join(AUTHS)}")
    if SERVER_NAME in devices or SERVER in devices:
        raise ProvisionError(f"{SERVER_NAME!r} and {SERVER!r} name the server; give the device another id")
    if not hosts:
        raise ProvisionError("give at least one --broker-host (the name or address devices use to reach the broker)")
    if bind is not None and not _listen_address(bind):
        raise ProvisionError(
            f"--listen {bind[:80]!r} is not an IP address or host name; give e.g. 127.0.0.1, 192.168.1.10, 0.0.0.0 "
            "or broker.lab.example"
        )
    root.mkdir(parents=True, exist_ok=True)
    existing = _existing(root, federation, auth)
    revoked_serials = _revoke(root, revoke)
    known = sorted((set(existing) | set(devices)) - set(revoke))
    broker_url = f"mqtts://{hosts[0]}:{port}"
    ca_key, ca_cert = _ca(root / "ca", federation)
    _broker_files(root / "broker", ca_key, ca_cert, hosts, days)
    server_key = _identity(root / "server", SERVER_NAME, ca_key, ca_cert, auth, days)
    paths = {}
    for name in known:
        _identity(root / "devices" / name, name, ca_key, ca_cert, auth, days)
        paths[name] = root / "devices" / name
    device_keys = {
        name: public_key_text(load_private_key(path / "signing.key").public_key()) for name, path in paths.items()
    }
    server_public = public_key_text(server_key.public_key())
    _write_bundle(root / "server", "server", SERVER_NAME, federation, broker_url, auth, device_keys)
    for name, path in paths.items():
        _write_bundle(path, "device", name, federation, broker_url, auth, {SERVER: server_public})
    listener = f"{port} {bind}" if bind else str(port)
    config = _broker_config(
        root / "broker",
        federation,
        auth,
        listener,
        broker_user,
        [SERVER_NAME, *known],
        ca_key,
        ca_cert,
        revoked_serials,
    )
    return Provisioned(root, root / "server", paths, config, sorted(set(known) - set(existing)))


def _listen_address(text: str) -> bool:
    """Whether ``text`` is an IP address or a DNS host name (it goes into the broker's configuration as it is)."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return len(text) <= 253 and re.fullmatch(_HOSTNAME, text) is not None


_HOSTNAME = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"


# --- keys and certificates ----------------------------------------------------------------------


def _existing(root: Path, federation: str, auth: str) -> list[str]:
    """Devices already provisioned in ``root``; ProvisionError when it belongs to another federation or auth mode."""
    server = root / "server" / BUNDLE_FILE
    if server.is_file():
        current = load_credentials(server)
        if current.federation != federation:
            raise ProvisionError(
                f"{root} provisions federation {current.federation!r}, not {federation!r}; use another directory"
            )
        if current.auth != auth:
            raise ProvisionError(
                f"{root} was provisioned with --auth {current.auth}; keep it, or use another directory"
            )
    devices = root / "devices"
    return sorted(p.name for p in devices.iterdir() if (p / "signing.key").is_file()) if devices.is_dir() else []


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _ec_key(path: Path) -> ec.EllipticCurvePrivateKey:
    if path.is_file():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey), f"{path} is not an EC key"
        return key
    key = ec.generate_private_key(ec.SECP256R1())
    path.touch(mode=0o600)
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return key


def _ca(folder: Path, federation: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    folder.mkdir(parents=True, exist_ok=True)
    key, cert_path = _ec_key(folder / "ca.key"), folder / "ca.crt"
    if cert_path.is_file():
        return key, x509.load_pem_x509_certificate(cert_path.read_bytes())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"feast-edge CA for federation {federation}"))
        .issuer_name(_name(f"feast-edge CA for federation {federation}"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def _leaf(
    key: ec.EllipticCurvePrivateKey,
    name: str,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    days: int,
    *,
    usage: x509.ObjectIdentifier,
    hosts: tuple[str, ...] = (),
) -> x509.Certificate:
    now = _now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _broker_files(
    folder: Path, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, hosts: tuple[str, ...], days: int
) -> None:
    """The broker's key and a certificate for ``hosts`` (issued again on every run, so new host names take effect)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = _ec_key(folder / "broker.key")
    (folder / "broker.crt").write_bytes(
        _pem(_leaf(key, hosts[0], ca_key, ca_cert, days, usage=ExtendedKeyUsageOID.SERVER_AUTH, hosts=hosts))
    )
    (folder / "ca.crt").write_bytes(_pem(ca_cert))


def _identity(
    folder: Path, name: str, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, auth: str, days: int
) -> Ed25519PrivateKey:
    """Create what ``name`` lacks: signing key, client certificate (certificate auth) or password; returns the signing key."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    signing = folder / "signing.key"
    if not signing.is_file():
        write_private_key(Ed25519PrivateKey.generate(), signing)
    (folder / "ca.crt").write_bytes(_pem(ca_cert))
    if auth == "certificate" and not (folder / "client.crt").is_file():
        key = _ec_key(folder / "client.key")
        (folder / "client.crt").write_bytes(
            _pem(_leaf(key, name, ca_key, ca_cert, days, usage=ExtendedKeyUsageOID.CLIENT_AUTH))
        )
    if auth == "password" and not (folder / "password").is_file():
        (folder / "password").touch(mode=0o600)
        (folder / "password").write_text(secrets.token_urlsafe(24))
    return load_private_key(signing)


def _write_bundle(
    folder: Path, role: str, identity: str, federation: str, broker: str, auth: str, peers: dict[str, str]
) -> None:
    password = (folder / "password").read_text().strip() if auth == "password" else None
    bundle = Credentials(
        path=folder,
        role=role,
        identity=identity,
        federation=federation,
        broker=broker,
        auth=auth,
        ca_file=str(folder / "ca.crt"),
        signing_key=str(folder / "signing.key"),
        peers=peers,
        cert_file=str(folder / "client.crt") if auth == "certificate" else None,
        key_file=str(folder / "client.key") if auth == "certificate" else None,
        username=identity if password else None,
        password=password,
    )
    path = folder / BUNDLE_FILE
    path.touch(mode=0o600)
    path.write_text(json.dumps(bundle.to_dict(), indent=2) + "\n")


def _revoke(root: Path, names: tuple[str, ...]) -> list[int]:
    """Remove the named devices' bundles; remember their certificates' serial numbers for the CRL. Returns every revoked serial."""
    record = root / "ca" / "revoked.json"
    serials: list[int] = json.loads(record.read_text()) if record.is_file() else []
    for name in names:
        folder = root / "devices" / name
        if not folder.is_dir():
            raise ProvisionError(f"--revoke {name}: no device {name!r} is provisioned in {root}")
        cert = folder / "client.crt"
        if cert.is_file():
            serials.append(x509.load_pem_x509_certificate(cert.read_bytes()).serial_number)
        for file in folder.iterdir():
            file.unlink()
        folder.rmdir()
    if names:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(sorted(set(serials))))
    return serials


# --- the broker -----------------------------------------------------------------------------------


def acl_text(federation: str, devices: list[str], server: str = SERVER_NAME) -> str:
    """The Mosquitto ACL: the server identity on the whole federation, every other identity on its own topics only."""
    t, me = (
        Topics(federation),
        "%u",
    )  # Mosquitto substitutes the authenticated user name (the certificate's CN with use_identity_as_username)
    root = f"{PREFIX}/{federation}"
    own = [
        ("readwrite", f"{root}/status/{me}"),
        ("write", f"{root}/register/{me}"),
        ("write", f"{root}/events/{me}"),
        ("write", f"{root}/xfer/up/{me}"),
        ("write", f"{root}/xfer/nack/down/{me}"),
        ("read", f"{root}/ctrl/{me}"),
        ("read", f"{root}/xfer/down/{me}"),
        ("read", f"{root}/xfer/nack/up/{me}"),
    ]
    lines = [
        f"# feast-edge federation {federation!r}: written by feast-server provision",
        "# The server identity may use the whole federation.",
        f"user {server}",
        f"topic readwrite {t.all}",
        "",
        "# Each device reads the server's presence.",
        *(line for name in devices for line in (f"user {name}", f"topic read {t.server_status}")),
        "",
        "# Every identity (a device: its user name is its device id) its own topics only.",
        *(f"pattern {access} {topic}" for access, topic in own),
    ]
    return "\n".join(lines) + "\n"


def emqx_acl_text(federation: str, server: str = SERVER_NAME) -> str:
    """The same ACL for EMQX 5's file authorizer (``acl.conf``), with ``${username}`` in place of Mosquitto's ``%u``."""
    t, me = Topics(federation), "${username}"
    root = f"{PREFIX}/{federation}"
    publish = [
        f"{root}/status/{me}",
        f"{root}/register/{me}",
        f"{root}/events/{me}",
        f"{root}/xfer/up/{me}",
        f"{root}/xfer/nack/down/{me}",
    ]
    subscribe = [
        f"{root}/status/{me}",
        f"{root}/ctrl/{me}",
        f"{root}/xfer/down/{me}",
        f"{root}/xfer/nack/up/{me}",
        t.server_status,
    ]

    def quoted(topics: list[str]) -> str:
        return ", ".join(f'"{topic}"' for topic in topics)

    return (
        f"%% feast-edge federation {federation!r} for EMQX 5 (authorization source 'file'), written by feast-server provision.\n"
        f'{{allow, {{user, "{server}"}}, all, ["{t.all}"]}}.\n'
        f"{{allow, all, publish, [{quoted(publish)}]}}.\n"
        f"{{allow, all, subscribe, [{quoted(subscribe)}]}}.\n"
        f'{{deny, all, all, ["{t.all}"]}}.\n'
    )


def password_line(user: str, password: str, salt: bytes | None = None) -> str:
    """One Mosquitto 2 password-file line (PBKDF2-SHA512, the ``$7$`` format mosquitto_passwd writes)."""
    salt = secrets.token_bytes(12) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, PBKDF2_ITERATIONS)
    return f"{user}:$7${PBKDF2_ITERATIONS}${b64encode(salt).decode()}${b64encode(digest).decode()}"


def _broker_config(
    folder: Path,
    federation: str,
    auth: str,
    listener: str,
    user: str | None,
    identities: list[str],
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    revoked: list[int],
) -> Path:
    (folder / "acl").write_text(acl_text(federation, [name for name in identities if name != SERVER_NAME]))
    (folder / "emqx-acl.conf").write_text(emqx_acl_text(federation))
    crl = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(_now())
        .next_update(_now() + datetime.timedelta(days=CA_DAYS))
    )
    for serial in revoked:
        crl = crl.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(_now()).build()
        )
    (folder / "crl.pem").write_bytes(crl.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    root = folder.parent
    lines = [
        f"# Mosquitto 2 configuration for feast-edge federation {federation!r}, written by feast-server provision.",
        "# Start it with: mosquitto -c " + str(folder / "mosquitto.conf"),
        *([f"user {user}"] if user else []),
        "per_listener_settings false",
        "allow_anonymous false",
        f"acl_file {folder / 'acl'}",
        "# The largest chunk feast-edge sends (--chunk-size, at most 16 MiB) and its header.",
        "max_packet_size 17825792",
        "",
        f"listener {listener}",
        f"cafile {folder / 'ca.crt'}",
        f"certfile {folder / 'broker.crt'}",
        f"keyfile {folder / 'broker.key'}",
        "tls_version tlsv1.2",
    ]
    if auth == "certificate":
        lines += ["require_certificate true", "use_identity_as_username true", f"crlfile {folder / 'crl.pem'}"]
    else:
        passwords = [password_line(name, _password(root, name)) for name in identities]
        passwd = folder / "passwd"
        passwd.touch(mode=0o600)
        passwd.write_text("\n".join(passwords) + "\n")
        lines.append(f"password_file {passwd}")
    path = folder / "mosquitto.conf"
    path.write_text("\n".join(lines) + "\n")
    return path


def _password(root: Path, name: str) -> str:
    folder = root / "server" if name == SERVER_NAME else root / "devices" / name
    return (folder / "password").read_text().strip()
