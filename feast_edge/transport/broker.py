"""Where the broker is and how to connect to it: broker URLs, connection settings, TLS (docs/protocol.md §1)."""

from __future__ import annotations

import logging
import socket
import ssl
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from paho.mqtt.enums import MQTTProtocolVersion

from feast_edge.transport.errors import BrokerAuthError, BrokerTlsError, BrokerUnreachableError, LinkError
from feast_edge.transport.signing import Keyring

log = logging.getLogger(__name__)

DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}
PROTOCOLS = {
    "3.1.1": MQTTProtocolVersion.MQTTv311,
    "311": MQTTProtocolVersion.MQTTv311,
    "5": MQTTProtocolVersion.MQTTv5,
}


@dataclass(frozen=True)
class BrokerAddress:
    """Where the broker listens and whether the connection uses TLS."""

    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = None

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_broker_url(url: str) -> BrokerAddress:
    """Parse ``mqtt://[user[:password]@]host[:port]`` or ``mqtts://...``; a bare ``host[:port]`` means mqtt://."""
    text = url.strip()
    parts = urlsplit(text if "://" in text else f"mqtt://{text}")
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise LinkError(
            f"broker URL {url!r} has scheme {parts.scheme!r}; use mqtt://host:port or mqtts://host:port (TLS); check --broker"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise LinkError(f"broker URL {url!r} must not have a path or query; use {scheme}://host:port; check --broker")
    try:
        port = parts.port or DEFAULT_PORTS[scheme]
    except ValueError:
        raise LinkError(
            f"broker URL {url!r} has an invalid port; use {scheme}://host:port with 1 <= port <= 65535; check --broker"
        ) from None
    if not parts.hostname:
        raise LinkError(f"broker URL {url!r} names no host; use {scheme}://host:port; check --broker")
    return BrokerAddress(
        host=parts.hostname,
        port=port,
        tls=scheme == "mqtts",
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
    )


class Signer(Protocol):
    """What a link needs of a provisioned identity (``feast_edge.transport.credentials.Credentials`` is one): its keys."""

    def keyring(self) -> Keyring:
        """The signing key and the peers' public keys."""


@dataclass(frozen=True)
class LinkConfig:
    """Connection settings; the CLI flags of feast-server and feast-agent map one to one onto these fields."""

    broker: str = "mqtt://127.0.0.1:1883"
    client_id: str = ""  # empty: a random 'feast-...' id
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None  # TLS: CA bundle to verify the broker; None uses the system's
    cert_file: str | None = None  # TLS: client certificate (mutual TLS)
    key_file: str | None = None  # TLS: client key, if not inside cert_file
    tls_insecure: bool = False  # TLS without verifying the broker's certificate: for tests only
    protocol: str = "3.1.1"  # or "5"
    keepalive: int = 30
    clean_session: bool = True
    reconnect_min_delay: float = 1.0
    reconnect_max_delay: float = 30.0
    max_inflight: int = 32  # QoS 1 messages on the wire awaiting PUBACK
    inbox_size: int = 10000
    credentials: Signer | None = field(
        default=None, repr=False
    )  # a provisioned identity: signs and verifies every message


def tls_context(config: LinkConfig) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=config.ca_file)
    except (FileNotFoundError, ssl.SSLError) as exc:
        raise BrokerTlsError(f"cannot load CA file {config.ca_file!r}: {exc}; check --ca-file") from None
    if config.cert_file:
        try:
            context.load_cert_chain(config.cert_file, config.key_file)
        except (FileNotFoundError, ssl.SSLError) as exc:
            raise BrokerTlsError(
                f"cannot load client certificate {config.cert_file!r} / key {config.key_file!r}: {exc}; check --cert-file/--key-file"
            ) from None
    elif config.key_file:
        raise BrokerTlsError("--key-file was given without --cert-file; mutual TLS needs both")
    if config.tls_insecure:
        log.warning("TLS certificate verification is disabled (tls_insecure); use it for tests only")
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


_CREDENTIAL_CODES = {134, 135, 140}  # CONNACK: bad user name or password, not authorized, bad authentication method


def connection_error(exc: OSError, address: BrokerAddress, timeout: float) -> LinkError:
    """Why a connection to ``address`` failed at the socket or TLS level, and how to fix it."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return BrokerTlsError(
            f"TLS handshake with MQTT broker at {address} failed: {exc.verify_message or exc}; "
            f"check --ca-file (it must hold the CA that signed the broker's certificate for {address.host!r})"
        )
    if isinstance(exc, (ssl.SSLError, ConnectionResetError)):
        if not address.tls:
            return BrokerUnreachableError(f"cannot reach MQTT broker at {address}: {exc}; check --broker")
        reason = getattr(exc, "reason", None) or exc.strerror or exc
        return BrokerTlsError(
            f"TLS handshake with MQTT broker at {address} failed: {reason}; is {address} a TLS listener? "
            f"(a plain MQTT port needs mqtt://); check --broker and --cert-file/--key-file"
        )
    if isinstance(exc, ConnectionRefusedError):
        return BrokerUnreachableError(
            f"cannot reach MQTT broker at {address}: connection refused; is the broker running? check --broker"
        )
    if isinstance(exc, socket.gaierror):
        return BrokerUnreachableError(
            f"cannot resolve MQTT broker host {address.host!r}: {exc.strerror}; check --broker"
        )
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return BrokerUnreachableError(
            f"cannot reach MQTT broker at {address}: no answer within {timeout:g} s; is the host up and the port open? check --broker"
        )
    return BrokerUnreachableError(f"cannot reach MQTT broker at {address}: {exc.strerror or exc}; check --broker")


def refusal(reason_code: Any, address: BrokerAddress, username: str | None) -> LinkError:
    """The error for a CONNACK that refused the connection (``reason_code``: paho's ReasonCode)."""
    name = str(reason_code)
    if reason_code.value in _CREDENTIAL_CODES:
        user = username or address.username
        who = f"user {user!r}" if user else "a client without a username"
        return BrokerAuthError(
            f"MQTT broker at {address} rejected the credentials of {who} ({name}); check --username/--password"
        )
    return LinkError(f"MQTT broker at {address} refused the connection: {name}; check the broker's log and --client-id")
