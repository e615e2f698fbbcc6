"""Transport errors: each one names the problem and, where the user can act, how to fix it."""

from feast_edge.errors import FeastError


class TransportError(FeastError):
    """Base class of every error raised by feast_edge.transport."""


class TopicError(TransportError, ValueError):
    """An id cannot be used in a topic name, or a topic is not one of the federation's."""


class ProtocolError(TransportError, ValueError):
    """A message or chunk from the wire is malformed, oversize or inconsistent; the receiver drops it."""


class ChunkError(ProtocolError):
    """A chunk frame is malformed, inconsistent with its transfer, or over a receiver limit."""


class LinkError(TransportError, ConnectionError):
    """The broker cannot be reached, refused the connection, or stopped acknowledging."""


class BrokerUnreachableError(LinkError):
    """No MQTT connection could be opened to the broker (refused, unresolvable, timed out)."""


class BrokerAuthError(LinkError):
    """The broker answered CONNACK with 'bad user name or password' or 'not authorized'."""


class BrokerTlsError(LinkError):
    """The TLS handshake with the broker failed (certificate, key or protocol mismatch)."""
