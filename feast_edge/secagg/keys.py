"""The cryptography of secure aggregation, all from maintained libraries: X25519 key agreement and HKDF-SHA256
(``cryptography``), masks as ChaCha20 keystreams (``cryptography``), shares sealed with ChaCha20-Poly1305
(``cryptography``), and Shamir secret sharing of seeds over GF(2^128) (PyCryptodome, one sharing per 16 bytes).

Every derived key names what it is for (``purpose``) and where (federation, round, segment), so no two masks of a
run share a keystream.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from feast_edge.errors import FeastError

SEED_BYTES = 32
SELF_SEED_BYTES = 16  # a self-mask seed: 128 bits, one Shamir sharing (a mask key is 32 bytes: two)
BLOCK = 16  # bytes per Shamir sharing (GF(2^128))
NONCE_BYTES = 12


class ShareError(ValueError):
    """A share that cannot be used: it does not open, or too few came to rebuild a seed."""


def shamir() -> Any:
    """PyCryptodome's Shamir sharing, imported when a secure round needs it: an agent without PyCryptodome runs every
    other round, and says how to install it when a federation asks for secure aggregation."""
    try:
        from Crypto.Protocol.SecretSharing import Shamir
    except ImportError:
        raise FeastError(
            "this federation runs secure aggregation (feast-server run --secure-agg), which needs PyCryptodome for "
            "Shamir secret sharing: pip install pycryptodome"
        ) from None
    return Shamir


def new_key() -> X25519PrivateKey:
    return X25519PrivateKey.generate()


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def derive(secret: bytes, purpose: str, context: str) -> bytes:
    """A 32-byte key for ``purpose`` at ``context`` from ``secret`` (HKDF-SHA256)."""
    info = f"feast-edge secagg v1 {purpose} {context}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=None, info=info).derive(secret)


def agree(private: X25519PrivateKey, peer_public: bytes, purpose: str, context: str) -> bytes:
    """The key two parties share for ``purpose`` at ``context``: X25519, then HKDF."""
    try:
        peer = X25519PublicKey.from_public_bytes(peer_public)
    except ValueError as exc:
        raise ShareError(f"not an X25519 public key: {exc}") from None
    return derive(private.exchange(peer), purpose, context)


def expand(seed: bytes, count: int, context: str) -> np.ndarray:
    """``count`` uint32 values of the ChaCha20 keystream of ``seed`` at ``context``: a mask."""
    key = derive(seed, "mask", context)
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    return np.frombuffer(stream.update(bytes(4 * count)), dtype=np.uint32).copy()


def new_seed(size: int = SEED_BYTES) -> bytes:
    return os.urandom(size)


def split_seed(seed: bytes, threshold: int, holders: int) -> list[tuple[int, bytes]]:
    """``holders`` Shamir shares of ``seed`` (a multiple of 16 bytes), any ``threshold`` of which rebuild it:
    (index, as many bytes as the seed)."""
    split = shamir().split
    blocks = [split(threshold, holders, seed[k : k + BLOCK], ssss=False) for k in range(0, len(seed), BLOCK)]
    return [(shares[0][0], b"".join(share for _, share in shares)) for shares in zip(*blocks)]


def join_seed(shares: list[tuple[int, bytes]], threshold: int) -> bytes:
    """The seed of ``shares`` (at least ``threshold`` of them); ShareError below."""
    if len({i for i, _ in shares}) < threshold:
        raise ShareError(f"{len(shares)} shares of a seed that needs {threshold}")
    chosen = shares[:threshold]
    size = len(chosen[0][1])
    combine = shamir().combine
    return b"".join(combine([(i, s[k : k + BLOCK]) for i, s in chosen], ssss=False) for k in range(0, size, BLOCK))


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, aad)


def unseal(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
    except (InvalidTag, ValueError):
        raise ShareError("a sealed share does not open (forged, altered or not for this device)") from None
