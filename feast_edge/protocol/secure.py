"""Secure aggregation's stages as messages (feast_edge.secagg.protocol over MQTT; docs/protocol.md §8).

A secure round starts as any round (RoundStart, whose ``secure`` field holds :class:`SecureBlock`'s terms and the
cohort's envelopes: every device derives the same segments from them), then::

    device -> server  SecAggKeys     on receipt of the round: its two X25519 public keys (stage 1, advertise)
    server -> device  SecAggRoster   the keys of every device that advertised in time (U1)
    device -> server  SecAggShares   its sealed Shamir shares, one per other device of U1, and its seed commitments
    server -> device  SecAggBox      the shares addressed to it, and who shared (U2)
    device -> server  Update         after training: the masked upload (a transfer), as a plain round's update
    server -> device  SecAggUnmask   who masked (U3): reveal your shares
    device -> server  SecAggReveal   its shares of each U2 device's s key (dropped) or b seeds (masked)

Every message names the routed transfer of the round it belongs to, and is bounded here before any use: at most
MAX_SECURE_COHORT devices, keys of 32 bytes, sealed shares of at most MAX_SEALED bytes, share values of 16 or 32
bytes.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any

from feast_edge.protocol.limits import MAX_EXAMPLES
from feast_edge.route.envelope import Envelope
from feast_edge.secagg.fixed import BITS
from feast_edge.transport.errors import ProtocolError, TopicError
from feast_edge.transport.messages import MAX_INT, Message, check_ids, message_kind
from feast_edge.transport.topics import validate_id

MAX_SECURE_COHORT = 256  # devices of one secure round (a roster of 256 key pairs is about 36 KiB)
MAX_HOLDERS = 64  # devices one device's shares go to: its sealed shares travel in one 64 KiB message
MAX_SEGMENTS = 64  # segments one device is routed (one self-mask seed each)
MAX_SEALED = 4096  # bytes of one sealed share (12 nonce + 16 tag + its JSON: an s-key share and a b share per segment)
KEY_HEX = 64  # an X25519 public key, or an s-key share, in hex
SEED_HEX = 32  # a b-seed share (or a segment id's hex twice)
_HEX = re.compile(r"[0-9a-f]*")


def _hex(name: str, value: Any, length: int) -> bytes:
    if not isinstance(value, str) or len(value) != length or not _HEX.fullmatch(value):
        raise ProtocolError(f"{name} must be {length} lowercase hex characters")
    return bytes.fromhex(value)


def _device(name: str, value: Any) -> str:
    try:
        return validate_id(value, name)
    except TopicError as exc:
        raise ProtocolError(str(exc)) from None


def _devices(name: str, values: Any) -> None:
    if not 1 <= len(values) <= MAX_SECURE_COHORT or len(set(values)) != len(values):
        raise ProtocolError(f"field {name!r} must name 1 to {MAX_SECURE_COHORT} distinct devices")
    for v in values:
        _device(f"{name} entry", v)


def _segment(value: Any) -> str:
    if not isinstance(value, str) or len(value) != 16 or not _HEX.fullmatch(value):
        raise ProtocolError("a segment id must be 16 lowercase hex characters")
    return value


@dataclass(frozen=True)
class SecureBlock:
    """A secure round's terms, as RoundStart's ``secure`` field carries them (on the wire, a ``clip`` of 0 means no
    DP, as the first agents read it)."""

    colluders: int
    threshold: int
    bound: float
    frac: int
    cohort: dict[str, Envelope]  # every cohort device's routed envelope: the segments follow from them
    counts: dict[str, int]  # every cohort device's aggregation count (registered, capped): weight = count / max
    degree: int = 0  # k of the neighbour graph (0: every member masks with every other; Setup.graph)
    clip: float | None = None  # central DP: the L2 bound each device clips its parameters' change to, weight 1

    def weight(self, device: str) -> float:
        return 1.0 if self.clip is not None else self.counts[device] / max(self.counts.values())

    def wire(self) -> dict[str, Any]:
        return {
            "colluders": self.colluders,
            "threshold": self.threshold,
            "bound": self.bound,
            "frac": self.frac,
            "cohort": {d: e.to_dict() for d, e in sorted(self.cohort.items())},
            "counts": dict(sorted(self.counts.items())),
            "degree": self.degree,
            "clip": 0.0 if self.clip is None else self.clip,
        }

    @classmethod
    def of_wire(cls, value: dict[str, Any]) -> SecureBlock:
        """The terms of a ``secure`` field (ProtocolError when malformed)."""
        if set(value) != {"colluders", "threshold", "bound", "frac", "cohort", "counts", "degree", "clip"}:
            raise ProtocolError(
                "field 'secure' must hold colluders, threshold, bound, frac, cohort, counts, degree and clip"
            )
        clip = value["clip"]
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 <= clip < 2**20:
            raise ProtocolError("field 'secure.clip' must be a number in [0, 2^20) (0: no DP)")
        ints = {k: value[k] for k in ("colluders", "threshold", "frac", "degree")}
        for k, v in ints.items():
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_INT:
                raise ProtocolError(f"field 'secure.{k}' must be a non-negative integer")
        bound = value["bound"]
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 < bound < 2**20:
            raise ProtocolError("field 'secure.bound' must be a number in (0, 2^20)")
        cohort = value["cohort"]
        if not isinstance(cohort, dict):
            raise ProtocolError("field 'secure.cohort' must map devices to envelopes")
        _devices("secure.cohort", list(cohort))
        if not 1 <= ints["threshold"] <= len(cohort) or not 8 <= ints["frac"] < BITS:
            raise ProtocolError("field 'secure' has a threshold or frac outside its range")
        counts = value["counts"]
        if not isinstance(counts, dict) or set(counts) != set(cohort):
            raise ProtocolError("field 'secure.counts' must give a count for each cohort device")
        for device, n in counts.items():
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_EXAMPLES:
                raise ProtocolError(f"field 'secure.counts' must give {device} a count of 1 to {MAX_EXAMPLES}")
        envelopes = {}
        for device, data in cohort.items():
            try:
                envelopes[device] = Envelope.from_dict(data)
            except (KeyError, TypeError, ValueError):
                raise ProtocolError(f"field 'secure.cohort' has a malformed envelope for {device}") from None
        if ints["degree"] >= len(cohort):
            raise ProtocolError("field 'secure.degree' must be below the cohort's size (0: every other device)")
        return cls(
            ints["colluders"],
            ints["threshold"],
            float(bound),
            ints["frac"],
            envelopes,
            dict(counts),
            ints["degree"],
            None if clip == 0 else float(clip),
        )


@dataclass(frozen=True, kw_only=True)
class _Stage(Message):
    """A stage message of the secure round whose routed transfer (RoundStart's) is ``routed``."""

    routed: str

    def check(self) -> None:
        check_ids(self, "routed")


@message_kind("secagg_keys")
@dataclass(frozen=True, kw_only=True)
class SecAggKeys(_Stage):
    """Device -> server on ``events/{device}``: stage 1, its public keys (hex): ``c`` seals shares, ``s`` agrees masks."""

    routed: str
    c_key: str
    s_key: str

    def check(self) -> None:
        super().check()
        _hex("field 'c_key'", self.c_key, KEY_HEX)
        _hex("field 's_key'", self.s_key, KEY_HEX)

    def keys(self) -> tuple[bytes, bytes]:
        return bytes.fromhex(self.c_key), bytes.fromhex(self.s_key)


@message_kind("secagg_roster")
@dataclass(frozen=True, kw_only=True)
class SecAggRoster(_Stage):
    """Server -> device on ``ctrl/{device}``: the public keys of every device that advertised (U1): device -> [c, s]."""

    routed: str
    keys: dict[str, Any]

    def check(self) -> None:
        super().check()
        _devices("keys", list(self.keys))
        for device, pair in self.keys.items():
            if not isinstance(pair, list) or len(pair) != 2:
                raise ProtocolError(f"field 'keys' must map {device} to its two public keys")
            _hex("a roster key", pair[0], KEY_HEX)
            _hex("a roster key", pair[1], KEY_HEX)

    def roster(self) -> dict[str, tuple[bytes, bytes]]:
        return {d: (bytes.fromhex(c), bytes.fromhex(s)) for d, (c, s) in self.keys.items()}


def _sealed(name: str, shares: dict[str, Any]) -> dict[str, bytes]:
    _devices(name, list(shares)) if shares else None
    out = {}
    for device, blob in shares.items():
        if not isinstance(blob, str) or len(blob) > 4 * MAX_SEALED // 3 + 4:
            raise ProtocolError(f"field {name!r}: the share for {device} must be base64 of at most {MAX_SEALED} bytes")
        try:
            out[device] = base64.b64decode(blob, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError(f"field {name!r}: the share for {device} is not base64") from None
    return out


def sealed_wire(shares: dict[str, bytes]) -> dict[str, str]:
    return {d: base64.b64encode(b).decode() for d, b in sorted(shares.items())}


@message_kind("secagg_shares")
@dataclass(frozen=True, kw_only=True)
class SecAggShares(_Stage):
    """Device -> server: stage 2, its sealed shares (recipient -> base64) and its self-mask seeds' commitments
    (segment -> SHA-256 hex)."""

    routed: str
    shares: dict[str, Any]
    commitments: dict[str, Any]

    def check(self) -> None:
        super().check()
        _sealed("shares", self.shares)
        if len(self.shares) > MAX_HOLDERS:
            raise ProtocolError(f"field 'shares' seals shares for more than {MAX_HOLDERS} devices")
        if len(self.commitments) > MAX_SEGMENTS:
            raise ProtocolError(f"field 'commitments' names more than {MAX_SEGMENTS} segments")
        for segment, digest in self.commitments.items():
            _segment(segment)
            _hex("a commitment", digest, KEY_HEX)

    def sealed(self) -> dict[str, bytes]:
        return _sealed("shares", self.shares)


@message_kind("secagg_box")
@dataclass(frozen=True, kw_only=True)
class SecAggBox(_Stage):
    """Server -> device: the shares addressed to it (sender -> base64) and the devices that shared (U2)."""

    routed: str
    shared: tuple[str, ...]
    shares: dict[str, Any]

    def check(self) -> None:
        super().check()
        _devices("shared", self.shared)
        _sealed("shares", self.shares)
        if not set(self.shares) <= set(self.shared):
            raise ProtocolError("field 'shares' names a sender that is not in 'shared'")

    def sealed(self) -> dict[str, bytes]:
        return _sealed("shares", self.shares)


@message_kind("secagg_unmask")
@dataclass(frozen=True, kw_only=True)
class SecAggUnmask(_Stage):
    """Server -> device: the devices whose masked upload arrived (U3); reveal the shares that unmask their sum."""

    routed: str
    masked: tuple[str, ...]

    def check(self) -> None:
        super().check()
        _devices("masked", self.masked)


@message_kind("secagg_reveal")
@dataclass(frozen=True, kw_only=True)
class SecAggReveal(_Stage):
    """Device -> server: stage 4, owner -> {"index", "s": hex} (owner dropped) or {"index", "b": {segment: hex}}."""

    shares: dict[str, Any]

    def check(self) -> None:
        super().check()
        self.opened()

    def opened(self) -> dict[str, dict[str, Any]]:
        """The revealed shares as bytes: owner -> {"index": i, "s": bytes} or {"index": i, "b": {segment: bytes}}."""
        if len(self.shares) > MAX_SECURE_COHORT:
            raise ProtocolError(f"field 'shares' names more than {MAX_SECURE_COHORT} devices")
        out: dict[str, dict[str, Any]] = {}
        for owner, share in self.shares.items():
            _device("an owner in 'shares'", owner)
            if not isinstance(share, dict) or len(share) != 2 or "index" not in share:
                raise ProtocolError(f"the share of {owner} must hold an index and either 's' or 'b'")
            index = share["index"]
            if isinstance(index, bool) or not isinstance(index, int) or not 1 <= index <= 255:
                raise ProtocolError(f"the share index of {owner} must be 1-255")
            if "s" in share:
                out[owner] = {"index": index, "s": _hex("an s-key share", share["s"], KEY_HEX)}
            elif "b" in share and isinstance(share["b"], dict) and len(share["b"]) <= MAX_SEGMENTS:
                seeds = {_segment(k): _hex("a seed share", v, SEED_HEX) for k, v in share["b"].items()}
                out[owner] = {"index": index, "b": seeds}
            else:
                raise ProtocolError(f"the share of {owner} must hold 's' or at most {MAX_SEGMENTS} 'b' shares")
        return out

    @staticmethod
    def wire(revealed: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """``Device.unmask``'s answer (bytes) as the ``shares`` field."""
        out: dict[str, Any] = {}
        for owner, share in revealed.items():
            if "s" in share:
                out[owner] = {"index": share["index"], "s": share["s"].hex()}
            else:
                out[owner] = {"index": share["index"], "b": {k: v.hex() for k, v in share["b"].items()}}
        return out
