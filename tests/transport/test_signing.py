"""Signed messages: who must sign what, and that nothing unsigned, re-addressed or altered verifies."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from feast_edge.transport.signing import MAGIC, SERVER, Keyring, SignatureError, signer_of
from feast_edge.transport.topics import Topics

T = Topics("lab")
SERVER_KEY, JET_KEY, PI_KEY = (Ed25519PrivateKey.generate() for _ in range(3))
SERVER_RING = Keyring(SERVER, SERVER_KEY, {"jet": JET_KEY.public_key(), "pi": PI_KEY.public_key()})
JET_RING = Keyring("jet", JET_KEY, {SERVER: SERVER_KEY.public_key()})
PI_RING = Keyring("pi", PI_KEY, {SERVER: SERVER_KEY.public_key()})


def test_the_topic_names_the_signer() -> None:
    assert signer_of(T.ctrl("jet")) == SERVER
    assert signer_of(T.server_status) == SERVER
    assert signer_of(T.nack("up", "jet")) == SERVER  # the server's receipts for an upload
    for topic in (T.status("jet"), T.register("jet"), T.events("jet"), T.nack("down", "jet")):
        assert signer_of(topic) == "jet"
    assert (
        signer_of(T.xfer("down", "jet")) is None and signer_of(T.xfer("up", "jet")) is None
    )  # frames: covered by the signed SHA-256
    with pytest.raises(SignatureError):
        signer_of("other/topic")


@given(body=st.binary(min_size=1, max_size=2048))
def test_a_device_message_verifies_on_its_own_topic_only(body: bytes) -> None:
    sealed = JET_RING.seal(T.events("jet"), body)
    assert sealed.startswith(MAGIC) and sealed.endswith(body)
    assert SERVER_RING.open(T.events("jet"), sealed) == body
    for elsewhere in (T.events("pi"), T.register("jet"), Topics("other").events("jet")):
        with pytest.raises(SignatureError):
            SERVER_RING.open(elsewhere, sealed)  # replayed on another device's (or federation's) topic


def test_altered_unsigned_and_unknown_messages_are_refused() -> None:
    topic = T.register("jet")
    sealed = bytearray(JET_RING.seal(topic, b'{"v":1}'))
    sealed[-1] ^= 1
    cases = {
        "altered": bytes(sealed),
        "unsigned": b'{"v":1,"kind":"register"}',
        "truncated": MAGIC + b"x" * 10,
        "signed by another device": PI_RING.seal(T.register("pi"), b'{"v":1}'),
    }
    for what, data in cases.items():
        with pytest.raises(SignatureError):
            SERVER_RING.open(topic, data)
    stranger = Keyring("ghost", Ed25519PrivateKey.generate())
    with pytest.raises(SignatureError, match="not provisioned"):
        SERVER_RING.open(T.events("ghost"), stranger.seal(T.events("ghost"), b"{}"))


def test_a_device_cannot_speak_for_the_server() -> None:
    forged = Keyring(SERVER, JET_KEY).seal(
        T.ctrl("pi"), b'{"kind":"registered","accepted":false}'
    )  # jet's key, server's name
    with pytest.raises(SignatureError):
        PI_RING.open(T.ctrl("pi"), forged)
    assert PI_RING.open(T.ctrl("pi"), SERVER_RING.seal(T.ctrl("pi"), b"ok")) == b"ok"


def test_frames_and_cleared_retained_messages_pass_unchanged() -> None:
    frame = b"\x00\x00\x00\x10frame"
    assert JET_RING.seal(T.xfer("up", "jet"), frame) == frame
    assert SERVER_RING.open(T.xfer("up", "jet"), frame) == frame
    assert JET_RING.seal(T.status("jet"), b"") == b"" and SERVER_RING.open(T.status("jet"), b"") == b""
