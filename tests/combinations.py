"""Every combination of rounds (sync, async), sums (plain, secure) and privacy (none, central, local) in each of the
three environments (the simulation, ``feast-server run``, the Flower ServerApp): accepted with its run's fingerprint,
or refused with its reason.

The outcomes of the code before the one composition root were recorded in tests/data/combinations.json; the test
(tests/core/test_compose_matrix.py) builds every combination today and compares.

    python tests/combinations.py record    # this checkout's outcomes -> tests/data/combinations.json
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RECORD = HERE / "data" / "combinations.json"
OUT = "/runs/combination"  # a run directory's path (not decisive: no fingerprint records it)
DATA = "/data/fashion-mnist"  # the simulation's data directory (recorded by its fingerprint: the same both times)
HELD = "/data/partition"  # a server's --data (asynchronous rounds without it are refused: devices cannot validate)

# asynchronous releases weighted alike (what central DP needs; sqrt is refused with it, a check of its own)
MODES = {"sync": {}, "async": {"mode": "async", "staleness": "constant"}}
SUMS = {"plain": {}, "secure": {"secure_agg": True}}
PRIVACY = {
    "none": {},
    "central": {"dp_clip": 1.0, "dp_noise": 0.5},
    "local": {"dp_mode": "local", "dp_clip": 1.0, "dp_noise": 0.2},
}
ENVIRONMENTS = ("simulation", "server", "flower")


def combinations() -> list[tuple[str, str, str, dict[str, Any]]]:
    """(mode, sums, privacy, settings by key) for every combination."""
    return [
        (mode, sums, privacy, {**MODES[mode], **SUMS[sums], **PRIVACY[privacy]})
        for mode, sums, privacy in itertools.product(MODES, SUMS, PRIVACY)
    ]


def outcome(environment: str, settings: dict[str, Any]) -> dict[str, str]:
    """``{"fingerprint": ...}`` where ``environment`` accepts ``settings``, else ``{"refused": why}``."""
    from feast_edge.errors import FeastError

    try:
        return {"fingerprint": fingerprint(environment, settings)}
    except FeastError as exc:
        return {"refused": str(exc)}


def fingerprint(environment: str, settings: dict[str, Any]) -> str:
    """The fingerprint of a run of ``settings`` in ``environment`` (its configuration's, as the run records it)."""
    if environment == "simulation":
        from feast_edge.sim.config import SimulationConfig

        return SimulationConfig.of(data_dir=DATA, **settings).fingerprint()
    if environment == "server":
        from feast_edge.server.config import ServerConfig

        return server_fingerprint(ServerConfig.of(out=OUT, data=HELD, **settings))
    from feast_edge.flower.serverapp.run_config import server_config

    run_config = {"out-dir": OUT, "data": HELD, **{k.replace("_", "-"): v for k, v in settings.items()}}
    config, _ = server_config(run_config)
    return server_fingerprint(config)


def server_fingerprint(config: Any) -> str:
    """feast-server's fingerprint of ``config`` (feast_edge.server.host.RunHost.fingerprint, without building a host)."""
    from feast_edge.space.preset import load_preset

    data = {**config.decisive(), "preset_digest": load_preset(config.preset).digest}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def outcomes() -> dict[str, dict[str, str]]:
    """Every environment's outcome of every combination, keyed ``environment/mode/sums/privacy``."""
    return {
        f"{environment}/{mode}/{sums}/{privacy}": outcome(environment, settings)
        for environment in ENVIRONMENTS
        for mode, sums, privacy, settings in combinations()
    }


def main() -> None:
    if sys.argv[1:] != ["record"]:
        sys.exit(__doc__)
    import subprocess

    commit = subprocess.run(["git", "-C", str(HERE), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    RECORD.write_text(json.dumps({"commit": commit.strip(), "outcomes": outcomes()}, indent=1, sort_keys=True) + "\n")
    print(f"{RECORD}: {len(outcomes())} outcomes")


if __name__ == "__main__":
    main()
