"""Every cohort device ends a round in exactly one place: aggregated, rejected, declined, incomplete or missing, each
with its reason; the round record, the server's round line and the dashboard of the run directory agree (issue 21,
item 2).

Real Mosquitto, a real server thread, five devices driven through ``feast_edge.transport`` by the test, each doing
one thing.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from feast_edge.dashboard.runs import read_run
from feast_edge.dashboard.state import DashboardState
from feast_edge.protocol import Declined
from feast_edge.server.output import print_round

pytestmark = [pytest.mark.broker]

COHORT = ("honest", "rejected", "declining", "incomplete", "silent")


@pytest.mark.slow  # a federation or a real simulation of several seconds: out of the fast loop
def test_each_cohort_device_is_in_exactly_one_outcome_with_its_reason(
    kit, tmp_path: Path, federation: str, caplog: pytest.LogCaptureFixture
) -> None:
    from test_federation_failures import ScriptedDevice, scripted_server, shifted

    caplog.set_level(logging.INFO, logger="feast_edge")
    n = len(COHORT)
    server = scripted_server(kit, tmp_path, federation, 1, per_round=n, start_clients=n, round_timeout=6.0)
    devices = {name: ScriptedDevice(federation, name) for name in COHORT}
    try:
        for device in devices.values():
            assert device.register(samples=50).accepted
        rounds = {name: device.next_round() for name, device in devices.items()}
        start, manifest, state = rounds["honest"]
        devices["honest"].send(*devices["honest"].update(start, shifted(state, 0.01), manifest))
        start, manifest, state = rounds["rejected"]  # more samples than it registered: its weight is refused
        devices["rejected"].send(*devices["rejected"].update(start, shifted(state, 0.01), manifest, samples=51))
        start, _, _ = rounds["declining"]
        declined = Declined(
            federation=federation,
            round=start.round,
            device="declining",
            routed=start.transfer["transfer"],
            reason="its data loader failed: disk unreadable",
        )
        devices["declining"].link.publish(devices["declining"].topics.events("declining"), declined.encode(), timeout=5)
        start, manifest, state = rounds["incomplete"]  # announced, never a chunk
        announcement, _ = devices["incomplete"].update(start, shifted(state, 0.01), manifest)
        devices["incomplete"].send(announcement, None)
        history = server.join(60)
    finally:
        for device in devices.values():
            device.close()
        server.close()
    record = history[0]
    places = {
        "aggregated": record.updated,
        "rejected": list(record.rejected),
        "declined": list(record.declined),
        "incomplete": list(record.incomplete),
        "missing": record.missing,
        "offline": record.dropped,
    }
    assert {k: v for k, v in places.items() if v} == {
        "aggregated": ["honest"],
        "rejected": ["rejected"],
        "declined": ["declining"],
        "incomplete": ["incomplete"],
        "missing": ["silent"],
    }
    assert sorted(d for v in places.values() for d in v) == sorted(record.cohort)
    assert "claims 51 samples" in record.rejected["rejected"]
    assert record.declined["declining"] == "the device sent no update: its data loader failed: disk unreadable"
    assert "did not complete before the round's deadline" in record.incomplete["incomplete"]
    caplog.clear()
    print_round(record, 1)  # feast-server run's line per round
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("round 1/1  replies 1/5"))
    for words in ("rejected rejected", "declined declining", "incomplete incomplete", "no reply silent"):
        assert words in line, line

    # The dashboard of the finished run directory: each device's last upload says the same, with the reason.
    state = DashboardState("runs", "t")
    read_run(tmp_path).fill(state)
    uploads = {d["name"]: d["last_upload"] for d in state.snapshot()["devices"]}
    assert {name: u["status"] for name, u in uploads.items()} == {
        "honest": "accepted",
        "rejected": "rejected",
        "declining": "declined",
        "incomplete": "incomplete",
        "silent": "missing",
    }
    assert uploads["declining"]["reason"] == record.declined["declining"]
    assert uploads["incomplete"]["reason"] == record.incomplete["incomplete"]
