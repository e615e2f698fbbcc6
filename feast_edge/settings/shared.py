"""The help of the settings that both configurations declare, each in a place of its own: a plain field of
``SimulationConfig`` and of ``ServerConfig``, or a field of each app's own concern (``--round-timeout``: the virtual
clock's in a simulation, the network's on a server). Written once here, so that both commands say the same."""

from __future__ import annotations

from feast_edge.settings.nested import Help

PRESET = Help("Preset name or .toml file.")
SEED = Help(
    "Seed of every random choice.",
    simulation="It draws the data's split, the budgets, the partition and (in simulate) training.",
    server="It draws the model's initialization, the cohorts and the devices' own seeds.",
)
CACHE = Help("Variant cache JSON (default: the one beside the preset's file, else the shipped one).")
ROUND_TIMEOUT = Help(
    "Seconds a synchronous round waits for updates; later ones are dropped, so stragglers never block.",
    simulation="In a simulation, virtual seconds on its clock (0: wait for the slowest).",
    server="On a server, wall-clock seconds.",
)
CANARY = Help(
    "Share of the devices a new served version goes to first, at least one per budget tier; the others get it only "
    "if these canaries do not regress (0: every device at once).",
    simulation="In a simulation, with --versions.",
    server='On a server, with --continuous (docs/server.md, "Versions, canaries and installs").',
)
