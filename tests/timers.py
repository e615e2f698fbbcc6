"""Profiling's timers without the clock's noise, for tests that time variants on a loaded machine."""

from __future__ import annotations

import pytest


def noise_free(monkeypatch: pytest.MonkeyPatch, lines: dict[str, tuple[float, float]]) -> None:
    """Profiling's real timers (real ONNX files, real sessions, every forward pass run), each reporting the exact line
    ``a + b·MACs`` of its precision instead of its clock: two variants timed once each on a loaded machine can fit a
    line sloping down, and profiling then refuses the measurement (what a test of anything else must not depend on)."""
    from feast_edge.agent import profiling

    real = profiling._timers

    def timers(supernet, preset, chosen, shape, device, runtime, provider, threads, precisions, workdir):
        made, text = real(supernet, preset, chosen, shape, device, runtime, provider, threads, precisions, workdir)

        def exact(timer, macs, ab):
            return lambda n, w: (timer(n, w), ab[0] + ab[1] * macs / 1e6)[1]

        return {p: [exact(t, e.macs, lines[p]) for t, e in zip(made[p], chosen)] for p in precisions}, text

    monkeypatch.setattr(profiling, "_timers", timers)
