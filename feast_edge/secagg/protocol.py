"""Secure aggregation of one round, per routed segment (SecAgg, Bonawitz et al. 2017, over the segments of
feast_edge.aggregate.segments): the server learns each segment's sum over at least ``min_members`` devices and no
single device's update.

Stages (each device is a :class:`Device`; the server only routes what they send and adds what comes back):

    1 advertise   every device: two X25519 public keys, c (to seal shares) and s (to agree pair masks)
    2 share       every device: a fresh self-mask seed b[s] per segment s it is routed; the Shamir shares
                  (threshold t) of its s private key and of each b[s], one per holder that advertised (its own
                  kept), sealed (ChaCha20-Poly1305) under the key it agrees with that holder's c key
    3 mask        every device that shared (U2), per segment s whose members in U2 number at least min_members:
                  y = x + PRG(b[s]) + Σ_{v in s∩U2, v≠u} ±PRG(s_uv)  mod 2^32   (+ for u < v, - for u > v)
    4 unmask      every device that masked (U3) reveals, for each v in U2: its share of v's s key if v did not mask
                  (dropped after sharing: the server removes the pair masks the others added with v), else its
                  share of v's b[s] for each segment s with at least min_members members in U3. Never both for the
                  same device: a device asked for both refuses
    server        per segment with at least min_members members in U3: Σ y - Σ PRG(b[s]) ∓ the pair masks of dropped
                  members = Σ x over U3 (mod 2^32, exact); fewer: not revealed, the segment keeps its global value

Every rebuilt secret is checked before use: an s key against the public key its owner advertised, a b seed against
the commitment (SHA-256) its owner sent with its shares. A wrong share (a lying device, at stage 2 or 4) fails the
check; the server then tries the other subsets of t shares, so up to (revealers - t) wrong shares are outvoted, and a
secret no subset rebuilds withholds the segments that need it, with the reason (never a wrong sum, never a crash).

With k = 0 every member of a segment masks with every other one and every device of the round holds every other's
shares (t: a majority of the round). With a neighbour graph of degree k (SecAgg+, Bell et al. 2020; Setup.graph) a
member masks with its k neighbours in each segment and its shares go to its k neighbours in one graph over the round
(t: a majority of them, and more than c): key material and the server's rebuilding grow with k, not with the round.

The pair masks of two members cancel in the sum; a self-mask hides a device's y until t devices agree it masked.
Fewer than t devices (c colluders and the server among them, c < t) cannot rebuild a seed; a segment of fewer than
``min_members`` (c + 2) surviving members is never unmasked, so its sum is never one honest device's update beside c
colluders'. Shares that do not open (forged, altered) are dropped with their sender's contribution.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from feast_edge.secagg.keys import (
    SELF_SEED_BYTES,
    ShareError,
    agree,
    expand,
    join_seed,
    new_key,
    new_seed,
    public_bytes,
    seal,
    split_seed,
    unseal,
)


class SecAggError(ValueError):
    """A stage cannot go on: too few devices, or a request that would reveal a device's update."""


@dataclass(frozen=True)
class Setup:
    """What every party of a round knows: the segments (id -> members, length in values), t and min_members, and the
    neighbour graph's degree k (0: every member masks with every other one; SecAgg+ otherwise, see :meth:`graph`)."""

    context: str  # federation and round: every key and mask is bound to it
    segments: Mapping[str, tuple[tuple[str, ...], int]]
    threshold: int
    min_members: int
    degree: int = 0

    def members(self, segment: str) -> tuple[str, ...]:
        return self.segments[segment][0]

    def routed(self, device: str) -> list[str]:
        return sorted(s for s, (members, _) in self.segments.items() if device in members)

    @functools.cached_property
    def graph(self) -> dict[str, dict[str, frozenset[str]]]:
        """segment -> member -> the members it masks with (SecAgg+, Bell et al. 2020): each segment's
        :func:`circulant` graph of degree k over its members."""
        return {
            segment: circulant(members, self.degree, f"{self.context}/{segment}")
            for segment, (members, _) in self.segments.items()
        }

    @functools.cached_property
    def _holders(self) -> dict[str, frozenset[str]]:
        cohort = sorted({m for members, _ in self.segments.values() for m in members})
        return circulant(cohort, self.degree, f"{self.context}/holders")

    def neighbours(self, device: str, segment: str) -> frozenset[str]:
        return self.graph[segment].get(device, frozenset())

    def holders(self, device: str) -> tuple[str, ...] | None:
        """Who holds ``device``'s shares, itself included: its k neighbours in one circulant graph over the whole
        cohort (None with k = 0: every device of the round). Any t of them rebuild its secrets; they need not be the
        devices it masks with."""
        if not self.degree:
            return None
        return tuple(sorted(self._holders.get(device, frozenset()) | {device}))

    def threshold_of(self, device: str) -> int:
        """t for ``device``'s secrets: a majority of its holders, and more than c (the round's t with k = 0)."""
        holders = self.holders(device)
        return self.threshold if holders is None else threshold_for(len(holders), self.min_members - 2)


def circulant(members: Sequence[str], degree: int, context: str) -> dict[str, frozenset[str]]:
    """member -> its neighbours: everyone else when there are at most k + 1 members (or k = 0), else a circulant
    graph over the members in a random order drawn from ``context`` (public: every party derives it alike), each
    joined to the ⌈k/2⌉ before and after it."""
    half = (degree + 1) // 2
    if not degree or len(members) <= 2 * half + 1:
        return {m: frozenset(members) - {m} for m in members}
    order = sorted(members)
    random.Random(hashlib.sha256(f"feast-edge secagg v1 graph {context}".encode()).digest()).shuffle(order)
    n = len(order)
    return {m: frozenset(order[(i + d) % n] for d in range(-half, half + 1) if d) for i, m in enumerate(order)}


def degree_for(devices: int, asked: int = 0) -> int:
    """The neighbour graph's degree k for a round of ``devices``: ``asked`` when given, else 0 (every other member)
    up to AUTO_COMPLETE devices, 2⌈log2 n⌉ (at least 8) beyond: SecAgg+'s O(log n)."""
    if asked:
        return 0 if asked >= devices - 1 else asked
    return 0 if devices <= AUTO_COMPLETE else min(devices - 1, max(8, 2 * math.ceil(math.log2(devices))))


AUTO_COMPLETE = 16  # devices of a round up to which every member masks with every other


def commitment(seed: bytes, context: str, segment: str) -> str:
    """What a device publishes of its self-mask seed of ``segment``: a SHA-256 (hex) that checks the rebuilt seed and,
    the seed being 128 random bits, reveals nothing of it."""
    return hashlib.sha256(f"feast-edge secagg v1 commit {context}/{segment} ".encode() + seed).hexdigest()


MAX_TRIES = 256  # subsets of t shares tried to rebuild one secret when the first does not check


def rebuild(shares: Sequence[tuple[int, bytes]], threshold: int, good: Callable[[bytes], bool]) -> bytes | None:
    """The secret of ``shares`` that passes ``good``: the first t shares, else other subsets of t (at most MAX_TRIES);
    None when none does (too few shares, or too many wrong ones)."""
    unique = list({i: (i, b) for i, b in shares}.values())
    if len(unique) < threshold:
        return None
    for chosen in itertools.islice(itertools.combinations(unique, threshold), MAX_TRIES):
        try:
            secret = join_seed(list(chosen), threshold)
        except (ShareError, ValueError):
            continue
        if good(secret):
            return secret
    return None


def threshold_for(devices: int, colluders: int) -> int:
    """t: a majority of the devices, and more than the ``colluders``."""
    return max(devices // 2 + 1, colluders + 1)


@dataclass
class Device:
    """One device's side of a round (see the module docstring)."""

    name: str
    setup: Setup
    inputs: Mapping[str, np.ndarray]  # segment -> its encoded values (uint32)
    c_key: object = field(default_factory=new_key)
    s_key: object = field(default_factory=new_key)
    self_seeds: dict[str, bytes] = field(default_factory=dict)
    roster: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)  # device -> (c public, s public)
    held: dict[str, dict] = field(default_factory=dict)  # sender -> its opened shares for this device
    masked_with: tuple[str, ...] = ()  # U2, as this device masked

    def advertise(self) -> tuple[bytes, bytes]:
        return public_bytes(self.c_key), public_bytes(self.s_key)  # type: ignore[arg-type]

    def commitments(self) -> dict[str, str]:
        """After :meth:`share`: the commitment of each self-mask seed (segment -> hex), sent with the shares."""
        return {s: commitment(b, self.setup.context, s) for s, b in self.self_seeds.items()}

    def share(self, roster: Mapping[str, tuple[bytes, bytes]]) -> dict[str, bytes]:
        """Stage 2: sealed shares for every other device of ``roster`` (the devices that advertised, U1)."""
        holders, t = self.setup.holders(self.name), self.setup.threshold_of(self.name)
        order = sorted(roster) if holders is None else [h for h in holders if h in roster]
        if len(order) < t:
            raise SecAggError(f"{len(order)} of the devices that hold this device's shares advertised keys; t = {t}")
        self.roster = dict(roster)
        self.self_seeds = {s: new_seed(SELF_SEED_BYTES) for s in self.setup.routed(self.name)}
        s_private = self.s_key.private_bytes_raw()  # type: ignore[attr-defined]
        s_shares = split_seed(s_private, t, len(order))
        b_shares = {s: split_seed(b, t, len(order)) for s, b in self.self_seeds.items()}
        sealed = {}
        for k, device in enumerate(order):
            if device == self.name:  # its own share stays here (it reveals it like the others' when it survives)
                held = {"index": s_shares[k][0], "s": s_shares[k][1], "b": {s: sh[k][1] for s, sh in b_shares.items()}}
                self.held[self.name] = held
                continue
            payload = {
                "index": s_shares[k][0],
                "s": s_shares[k][1].hex(),
                "b": {s: shares[k][1].hex() for s, shares in b_shares.items()},
            }
            key = agree(self.c_key, roster[device][0], "share", self.setup.context)  # type: ignore[arg-type]
            sealed[device] = seal(key, json.dumps(payload).encode(), self._aad(self.name, device))
        return sealed

    def receive(self, sealed: Mapping[str, bytes]) -> list[str]:
        """Open the shares addressed to this device (sender -> sealed); the senders whose shares do not open."""
        bad = []
        for sender, blob in sealed.items():
            try:
                key = agree(self.c_key, self.roster[sender][0], "share", self.setup.context)  # type: ignore[arg-type]
                opened = json.loads(unseal(key, blob, self._aad(sender, self.name)))
                self.held[sender] = {
                    "index": int(opened["index"]),
                    "s": bytes.fromhex(opened["s"]),
                    "b": {s: bytes.fromhex(v) for s, v in opened["b"].items()},
                }
            except (ShareError, KeyError, ValueError, TypeError):
                bad.append(sender)
        return bad

    def mask(self, shared: Sequence[str]) -> dict[str, np.ndarray]:
        """Stage 3: the masked input of each segment with at least min_members members in U2 = ``shared``."""
        self.masked_with = tuple(sorted(shared))
        out = {}
        for s in self.setup.routed(self.name):
            members = [m for m in self.setup.members(s) if m in shared]
            if len(members) < self.setup.min_members or s not in self.inputs:
                continue
            context = f"{self.setup.context}/{s}"
            y = self.inputs[s].astype(np.uint32) + expand(self.self_seeds[s], len(self.inputs[s]), context)
            near = self.setup.neighbours(self.name, s)
            for v in members:
                if v in near:
                    pair = agree(self.s_key, self.roster[v][1], "pair", context)  # type: ignore[arg-type]
                    mask = expand(pair, len(y), context)
                    y = y + mask if self.name < v else y - mask
            out[s] = y
        return out

    def unmask(self, masked: Sequence[str]) -> dict[str, dict]:
        """Stage 4: for each device of U2, its share of the s key (it did not mask) or of the b seeds of the segments
        with at least min_members members in U3 = ``masked`` (it did)."""
        dropped = set(self.masked_with) - set(masked)
        if not set(masked) <= set(self.masked_with):
            raise SecAggError("the server names devices that masked but had not shared keys: refused")
        if len(set(masked)) < self.setup.threshold_of(self.name):
            raise SecAggError(
                f"the server names {len(set(masked))} devices that masked; fewer than t = "
                f"{self.setup.threshold_of(self.name)} "
                "would let it rebuild seeds with the shares of too few: refused"
            )
        revealed: dict[str, dict] = {}
        for owner, held in self.held.items():
            if owner not in self.masked_with:
                continue
            if owner in dropped:
                revealed[owner] = {"index": held["index"], "s": held["s"]}
            else:
                big = {
                    s: b
                    for s, b in held["b"].items()
                    if sum(m in masked for m in self.setup.members(s)) >= self.setup.min_members
                }
                revealed[owner] = {"index": held["index"], "b": big}
        return revealed

    def _aad(self, sender: str, receiver: str) -> bytes:
        return f"{self.setup.context} share {sender} -> {receiver}".encode()


def unmasked_sums(
    setup: Setup,
    roster: Mapping[str, tuple[bytes, bytes]],
    shared: Sequence[str],
    masked: Mapping[str, Mapping[str, np.ndarray]],
    revealed: Mapping[str, Mapping[str, dict]],
    commitments: Mapping[str, Mapping[str, str]],
) -> dict[str, np.ndarray | str]:
    """The server's stage 4: each segment's Σ x over the devices that masked it (uint32), or why it stays masked.

    ``roster``: the public keys of U1; ``shared``: U2; ``masked``: device -> segment -> y (U3); ``revealed``:
    device of U3 -> owner -> its share of the owner's s key or b seeds; ``commitments``: owner -> segment -> the
    commitment of its b seed (every rebuilt secret is checked, see the module docstring)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    def held_by(owner: str) -> list[tuple[int, Mapping[str, dict]]]:
        """The revealers of ``owner``'s shares, each with the index it was dealt (its place among the owner's holders
        that advertised, as Device.share deals them): a share revealed under another index is not used."""
        holders = setup.holders(owner)
        order = sorted(roster) if holders is None else [h for h in holders if h in roster]
        index = {h: k + 1 for k, h in enumerate(order)}
        return [
            (index[r], shares)
            for r, shares in revealed.items()
            if owner in shares and r in index and shares[owner].get("index") == index[r]
        ]

    def s_key_of(owner: str) -> X25519PrivateKey | None:
        shares = [(i, r[owner]["s"]) for i, r in held_by(owner) if "s" in r[owner]]

        def good(secret: bytes) -> bool:
            key = X25519PrivateKey.from_private_bytes(secret)
            return public_bytes(key) == roster[owner][1]

        secret = rebuild(shares, setup.threshold_of(owner), good)
        return None if secret is None else X25519PrivateKey.from_private_bytes(secret)

    s_keys = {owner: s_key_of(owner) for owner in sorted(set(shared) - set(masked))}
    sums: dict[str, np.ndarray | str] = {}
    for s, (members, length) in setup.segments.items():
        contributors = [m for m in members if m in masked and s in masked[m]]
        if len(contributors) < setup.min_members:
            sums[s] = (
                f"only {len(members)} {'device of the round trains' if len(members) == 1 else 'devices of the round train'}"
                " it; a sum is revealed over "
                f"at least {setup.min_members}"
                if len(members) < setup.min_members
                else f"{len(contributors)} of its {len(members)} devices masked it; at least {setup.min_members} must"
            )
            continue
        lost = [v for v in members if v in s_keys and s_keys[v] is None]
        if lost:
            sums[s] = f"the shares of {', '.join(lost)}'s key (it dropped after sharing) do not rebuild it"
            continue
        context = f"{setup.context}/{s}"
        total = np.zeros(length, dtype=np.uint32)
        for u in contributors:
            total += masked[u][s]
            shares = [(i, r[u]["b"][s]) for i, r in held_by(u) if s in r[u].get("b", {})]
            expected = commitments.get(u, {}).get(s)
            seed = rebuild(shares, setup.threshold_of(u), lambda b, u=u: commitment(b, setup.context, s) == expected)
            if seed is None:
                break
            total -= expand(seed, length, context)
        else:
            for v in (m for m in members if m in s_keys):
                for u in (c for c in contributors if v in setup.neighbours(c, s)):  # u added ±PRG(s_uv) with v,
                    # which masked nothing: take it out
                    pair = expand(agree(s_keys[v], roster[u][1], "pair", context), length, context)  # type: ignore[arg-type]
                    total = total - pair if u < v else total + pair
            sums[s] = total
            continue
        sums[s] = f"the shares of {u}'s self-mask seed do not rebuild the seed it committed to"
    return sums
