"""A device profile as a readable table: hardware, latency fit, target, memory limit, budget and the variant it serves."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from feast_edge.agent.profiling import PRECISION_WORDS
from feast_edge.budget.profile import DeviceProfile
from feast_edge.cache.variants import load_cache
from feast_edge.errors import FeastError
from feast_edge.space.preset import load_preset


def _bytes(n: Any) -> str:
    return f"{n / 2**30:.2f} GiB" if isinstance(n, (int, float)) and not isinstance(n, bool) else str(n)


def profile_table(profile: DeviceProfile, preset: str | None = None, cache: str | None = None) -> Table:
    """A readable summary: hardware, latency fit, target, memory limit, budget and the variant it serves.

    ``preset`` and ``cache``: where the timed preset and its cache are (a preset file, as ``--preset`` gave it; the
    profile records only the preset's name), for the served variant's line."""
    table = Table(title=f"device profile {profile.name}", show_header=False)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value")
    table.add_row("description", profile.description)
    table.add_row("device", profile.device)
    for key, value in profile.hardware.items():
        table.add_row(f"  {key}", _bytes(value) if key.endswith("_bytes") else str(value))
    table.add_row("preset", profile.preset)
    table.add_row("precision", PRECISION_WORDS[profile.precision])
    points = f" over {len(profile.measurements)} timed variants" if profile.measurements else " (documented, not timed)"
    table.add_row(
        "latency fit", f"{profile.latency_a_ms:.3f} ms + {profile.latency_b_ms_per_mmac:.4f} ms/MMAC × MACs{points}"
    )
    if profile.runtime:
        table.add_row("timed on", profile.runtime)
    for macs, ms in profile.measurements:
        table.add_row("  timed", f"{macs / 1e6:.2f}M MACs: {ms:.3f} ms (fit {profile.latency_ms(macs):.3f} ms)")
    for (macs, ms), error in zip(profile.holdout, profile.holdout_errors()):
        table.add_row(
            "  held out",
            f"{macs / 1e6:.2f}M MACs: {ms:.3f} ms (fit {profile.latency_ms(macs):.3f} ms, error {100 * error:.1f} %)",
        )
    table.add_row("latency target", f"{profile.latency_target_ms:g} ms")
    table.add_row("memory limit", _bytes(profile.memory_limit_bytes))
    table.add_row("budget", f"{profile.budget_macs / 1e6:.2f}M MACs ({profile.precision})")
    for other, fit in profile.alternatives.items():  # --precision auto: the precision it was chosen over
        table.add_row(
            f"  in {other}",
            f"{fit.budget_macs / 1e6:.2f}M MACs (fit {fit.latency_a_ms:.3f} ms + {fit.latency_b_ms_per_mmac:.4f} "
            f"ms/MMAC × MACs over {len(fit.measurements)} timed variants; not chosen)",
        )
    try:
        timed = load_preset(preset or profile.preset)
        entry = load_cache(timed, cache).largest_affordable(profile.budget_macs)
        served = (
            f"{entry.macs / 1e6:.2f}M MACs, {entry.params / 1e6:.3f}M params, "
            f"predicted {profile.latency_ms(entry.macs):.3f} ms: {entry.arch}"
        )
    except FeastError as exc:
        served = f"unavailable ({exc})"
    table.add_row("largest affordable", served)
    table.add_row("source", profile.source)
    return table
