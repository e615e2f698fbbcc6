"""Chunk frames, reassembly and resends, without a broker."""

from __future__ import annotations

import hashlib
import json
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feast_edge.transport.chunks import Outbox, Reassembler, Status
from feast_edge.transport.errors import ChunkError
from feast_edge.transport.frames import (
    DEFAULT_CHUNK_SIZE,
    MAX_HEADER_BYTES,
    TransferInfo,
    chunk_count,
    decode_frame,
    describe,
    encode_frame,
    iter_frames,
)

IDS = {"federation": "lab", "round": 2, "device": "pi5"}


def frames_of(payload: bytes, chunk_size: int, **ids: object) -> tuple[TransferInfo, list[bytes]]:
    info = describe(payload, **{**IDS, **ids}, chunk_size=chunk_size)  # type: ignore[arg-type]
    return info, list(iter_frames(info, payload))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_default_chunk_size_is_one_mib() -> None:
    assert DEFAULT_CHUNK_SIZE == 1024 * 1024
    assert Outbox().chunk_size == DEFAULT_CHUNK_SIZE
    assert Reassembler().max_chunk_size == DEFAULT_CHUNK_SIZE


def test_frame_layout() -> None:
    payload = bytes(range(10))
    info, frames = frames_of(payload, 4)
    assert (info.count, info.size, info.chunk) == (3, 10, 4)
    assert info.sha256 == hashlib.sha256(payload).hexdigest()
    (length,) = struct.unpack(">I", frames[2][:4])
    header = json.loads(frames[2][4 : 4 + length])
    assert header == {**info.to_dict(), "index": 2}
    assert b": " not in frames[2][4 : 4 + length]  # compact JSON
    assert frames[2][4 + length :] == payload[8:]
    decoded, index, data = decode_frame(frames[2])
    assert (decoded, index, bytes(data)) == (info, 2, payload[8:])


def test_empty_payload_is_one_empty_chunk() -> None:
    info, frames = frames_of(b"", 8)
    assert info.count == chunk_count(0, 8) == 1
    progress = Reassembler().add(frames[0])
    assert progress.status is Status.COMPLETE and progress.payload == b""


@settings(max_examples=60, deadline=None)
@given(
    payload=st.binary(max_size=3000),
    chunk_size=st.integers(1, 700),
    seed=st.integers(0, 2**32 - 1),
    duplicates=st.integers(0, 20),
)
def test_any_permutation_with_duplicates_reassembles(
    payload: bytes, chunk_size: int, seed: int, duplicates: int
) -> None:
    info, frames = frames_of(payload, chunk_size)
    rng = random.Random(seed)
    stream = frames + [rng.choice(frames) for _ in range(duplicates)]
    rng.shuffle(stream)
    reassembler = Reassembler()
    results = [reassembler.add(frame) for frame in stream]
    complete = [r for r in results if r.status is Status.COMPLETE]
    assert len(complete) == 1
    assert complete[0].payload == payload
    # Every frame after completion is recognized as belonging to a finished transfer.
    after = results[results.index(complete[0]) + 1 :]
    assert all(r.status is Status.FINISHED for r in after)
    assert reassembler.active() == []


@settings(max_examples=60, deadline=None)
@given(count=st.integers(1, 40), data=st.data())
def test_missing_lists_exactly_the_absent_indices(count: int, data: st.DataObject) -> None:
    payload = bytes(range(256)) * count
    info, frames = frames_of(payload, 256)
    present = data.draw(st.sets(st.integers(0, count - 1), max_size=count - 1))
    reassembler = Reassembler()
    reassembler.expect(info)
    for index in present:
        reassembler.add(frames[index])
    assert reassembler.missing(info.transfer) == sorted(set(range(count)) - present)


@settings(max_examples=40, deadline=None)
@given(payload=st.binary(min_size=1, max_size=2000), chunk_size=st.integers(1, 300), data=st.data())
def test_a_corrupted_chunk_is_rejected_by_the_hash(payload: bytes, chunk_size: int, data: st.DataObject) -> None:
    info, frames = frames_of(payload, chunk_size)
    victim = data.draw(st.integers(0, info.count - 1))
    position = data.draw(st.integers(0, info.chunk_length(victim) - 1))
    corrupted = bytearray(frames[victim])
    corrupted[len(corrupted) - info.chunk_length(victim) + position] ^= 0x01
    frames[victim] = bytes(corrupted)
    reassembler = Reassembler()
    results = [reassembler.add(frame) for frame in frames]
    assert results[-1].status is Status.REJECTED and results[-1].payload is None
    assert "sha256 mismatch" in results[-1].reason
    assert reassembler.outcome(info.transfer) == (Status.REJECTED, results[-1].reason)
    # Late copies of the good chunks cannot resurrect it.
    assert reassembler.add(frames[0]).status is Status.FINISHED


@pytest.mark.parametrize(
    ("frame", "needle"),
    [
        (b"\x00\x00", "shorter than its 4-byte length prefix"),
        (struct.pack(">I", 100) + b"{}", "frame holds only 2"),
        (struct.pack(">I", MAX_HEADER_BYTES + 1), "limit is 4096"),
        (struct.pack(">I", 3) + b"{{{", "not valid JSON"),
        (struct.pack(">I", 2) + b"[]", "JSON object with an 'index'"),
    ],
)
def test_malformed_frames(frame: bytes, needle: str) -> None:
    with pytest.raises(ChunkError, match=needle):
        decode_frame(frame)


def _frame_with(header_changes: dict[str, object], data: bytes = b"abcd") -> bytes:
    info = describe(b"abcdefgh", **IDS, chunk_size=4)  # type: ignore[arg-type]
    header = json.dumps({**info.to_dict(), "index": 0, **header_changes}).encode()
    return struct.pack(">I", len(header)) + header + data


@pytest.mark.parametrize(
    ("changes", "data", "needle"),
    [
        ({"index": 2}, b"abcd", "outside 0..1"),
        ({"index": -1}, b"abcd", "non-negative integer"),
        ({"count": 3}, b"abcd", "count 3 does not match size 8"),
        ({"sha256": "xyz"}, b"abcd", "64 lowercase hex"),
        ({"device": "a/b"}, b"abcd", "topic level separator"),
        ({"chunk": 0}, b"abcd", "at least 1"),
        ({"size": "8"}, b"abcd", "non-negative integer"),
        ({}, b"abc", "carries 3 bytes, expected 4"),
    ],
)
def test_inconsistent_headers(changes: dict[str, object], data: bytes, needle: str) -> None:
    with pytest.raises(ChunkError, match=needle):
        decode_frame(_frame_with(changes, data))


def test_contradicting_chunk_of_a_known_transfer_is_refused() -> None:
    info, frames = frames_of(b"abcdefgh", 4)
    reassembler = Reassembler()
    reassembler.add(frames[0])
    forged = encode_frame(TransferInfo(**{**info.to_dict(), "round": 9}), 1, b"efgh")
    with pytest.raises(ChunkError, match="contradicts its earlier chunks"):
        reassembler.add(forged)
    assert reassembler.add(frames[1]).status is Status.COMPLETE


def test_chunk_on_another_devices_topic_is_refused() -> None:
    _, frames = frames_of(b"abc", 4)
    with pytest.raises(ChunkError, match="arrived on the topic of device 'other'"):
        Reassembler().add(frames[0], device="other")


def test_memory_limits() -> None:
    with pytest.raises(ChunkError, match="exceeds the 10-byte payload limit"):
        Reassembler(max_payload_bytes=10).add(frames_of(b"x" * 11, 4)[1][0])
    with pytest.raises(ChunkError, match="accepts at most 2"):
        Reassembler(max_chunk_size=2).add(frames_of(b"x" * 11, 4)[1][0])
    two = Reassembler(max_transfers=2)
    for _ in range(2):
        two.add(frames_of(b"x" * 8, 4)[1][0])
    with pytest.raises(ChunkError, match="2 transfers are already in progress"):
        two.add(frames_of(b"x" * 8, 4)[1][0])
    buffered = Reassembler(max_buffered_bytes=20)
    buffered.add(frames_of(b"x" * 12, 4)[1][0])
    with pytest.raises(ChunkError, match="12 bytes are already buffered"):
        buffered.add(frames_of(b"x" * 12, 4)[1][0])


def test_other_federation_is_refused() -> None:
    with pytest.raises(ChunkError, match="federation 'lab' sent to federation 'other'"):
        Reassembler(federation="other").add(frames_of(b"abc", 4)[1][0])


def test_stalled_transfers_are_reported_once_per_idle_period() -> None:
    clock = Clock()
    info, frames = frames_of(b"x" * 16, 4)
    reassembler = Reassembler(clock=clock)
    reassembler.add(frames[1])
    reassembler.add(frames[3])
    clock.now = 0.5
    assert reassembler.stalled(1.0) == []
    clock.now = 1.0
    assert reassembler.stalled(1.0) == [(info, [0, 2])]
    assert reassembler.stalled(1.0) == []  # just nacked
    clock.now = 2.0
    assert reassembler.stalled(1.0) == [(info, [0, 2])]


def test_stale_transfers_expire_and_their_late_chunks_are_ignored() -> None:
    clock = Clock()
    info, frames = frames_of(b"x" * 16, 4)
    reassembler = Reassembler(ttl=10.0, clock=clock)
    reassembler.add(frames[0])
    clock.now = 9.0
    reassembler.add(frames[1])  # activity resets the clock
    clock.now = 18.0
    assert reassembler.expire() == []
    clock.now = 19.0
    assert reassembler.expire() == [info]
    assert reassembler.active() == []
    late = reassembler.add(frames[2])
    assert late.status is Status.FINISHED and "expired after 10 s" in late.reason


def test_advance_drops_older_rounds() -> None:
    reassembler = Reassembler()
    old_info, old_frames = frames_of(b"x" * 8, 4, round=1)
    reassembler.add(old_frames[0])
    assert reassembler.advance(2) == [old_info]
    assert reassembler.add(old_frames[1]).status is Status.STALE
    assert reassembler.outcome(old_info.transfer) == (Status.REJECTED, "round ended (now round 2)")
    assert reassembler.add(frames_of(b"y" * 8, 4, round=1)[1][0]).status is Status.STALE
    assert reassembler.add(frames_of(b"z" * 4, 4, round=2)[1][0]).status is Status.COMPLETE


def test_nack_resend_completes_the_transfer() -> None:
    payload = bytes(random.Random(0).randbytes(10_000))
    outbox = Outbox(chunk_size=1000)
    info = outbox.add(payload, **IDS)  # type: ignore[arg-type]
    frames = list(outbox.frames(info.transfer))
    reassembler = Reassembler()
    for index in (0, 1, 4, 5, 9):  # the others were lost
        reassembler.add(frames[index])
    missing = reassembler.missing(info.transfer)
    assert missing == [2, 3, 6, 7, 8]
    results = [reassembler.add(frame) for frame in outbox.frames(info.transfer, missing)]
    assert results[-1].status is Status.COMPLETE and results[-1].payload == payload


def test_outbox_holds_until_released_or_expired() -> None:
    clock = Clock()
    outbox = Outbox(chunk_size=4, ttl=5.0, clock=clock)
    a = outbox.add(b"abcdefgh", **IDS)  # type: ignore[arg-type]
    clock.now = 3.0
    b = outbox.add(b"ijkl", **IDS)  # type: ignore[arg-type]
    with pytest.raises(ChunkError, match=r"indices \[7\] are outside 0..1"):
        outbox.frames(a.transfer, [7])
    assert outbox.release(a.transfer) and a.transfer not in outbox
    with pytest.raises(ChunkError, match="is not held"):
        outbox.frames(a.transfer)
    clock.now = 8.0
    assert outbox.expire() == [b] and len(outbox) == 0


def test_chunk_size_is_validated() -> None:
    with pytest.raises(ValueError, match="between 1 and"):
        Outbox(chunk_size=0)
    with pytest.raises(ValueError, match="between 1 and"):
        describe(b"x", **IDS, chunk_size=64 * 1024 * 1024)  # type: ignore[arg-type]


def test_one_mib_chunks_of_a_large_payload() -> None:
    payload = random.Random(1).randbytes(3 * DEFAULT_CHUNK_SIZE + 5)
    info, frames = frames_of(payload, DEFAULT_CHUNK_SIZE)
    assert info.count == 4 and all(len(f) < DEFAULT_CHUNK_SIZE + 400 for f in frames)
    reassembler = Reassembler()
    results = [reassembler.add(f) for f in reversed(frames)]
    assert results[-1].payload == payload


def test_an_expected_only_receiver_keeps_nothing_of_unannounced_transfers() -> None:
    """A stranger's frame declaring a gigabyte costs nothing: no transfer opens, no bookkeeping grows."""
    r = Reassembler(federation="lab", expected_only=True, max_payload_bytes=2 * 1024**3)
    huge = TransferInfo(
        federation="lab",
        round=2,
        device="pi5",
        transfer="evil",
        count=1024**2,
        size=1024**3,
        chunk=1024,
        sha256="0" * 64,
    )
    for index in (0, 17, 1024**2 - 1):
        assert (
            r.add(encode_frame(huge, index, b"x" * (1024 if index < 1024**2 - 1 else 1024))).status is Status.UNEXPECTED
        )
    assert r.active() == [] and r.missing("evil") == []
    payload = b"payload" * 500
    info = describe(payload, **IDS, chunk_size=1024)
    r.expect(info)
    for frame in iter_frames(info, payload):
        progress = r.add(frame)
    assert progress.status is Status.COMPLETE and progress.payload == payload


def test_missing_indices_follow_the_limit_not_the_declared_count() -> None:
    r = Reassembler(federation="lab", max_payload_bytes=2 * 1024**3)
    info = TransferInfo(
        federation="lab",
        round=2,
        device="pi5",
        transfer="big",
        count=1024**2,
        size=1024**3,
        chunk=1024,
        sha256="0" * 64,
    )
    r.expect(info)
    assert r.missing("big", limit=5) == [0, 1, 2, 3, 4]
    assert [len(missing) for _, missing in r.stalled(0.0, limit=4096)] == [4096]


def test_tiny_chunks_are_refused_where_a_minimum_is_set() -> None:
    r = Reassembler(federation="lab", min_chunk_size=1024)
    payload = b"z" * 5000
    with pytest.raises(ChunkError, match="chunks of at least 1024 bytes"):
        r.add(next(iter_frames(describe(payload, **IDS, chunk_size=1), payload)))
    small = describe(b"tiny", **IDS, chunk_size=8)  # a single chunk is as small as its payload: allowed
    assert r.add(next(iter_frames(small, b"tiny"))).status is Status.COMPLETE


def test_resends_are_capped_per_transfer() -> None:
    box = Outbox(chunk_size=1024, resend_factor=2.0)
    info = box.add(b"q" * 4096, **IDS)  # 4 chunks: at most 8 resent in all
    assert box.charge_resend(info.transfer, 4) and box.charge_resend(info.transfer, 4)
    assert not box.charge_resend(info.transfer, 1) and info.transfer not in box  # spent: dropped, memory released
    assert not box.charge_resend("unknown", 1)
