"""The Flower App project ``feast-edge flower new DIR`` writes: a pyproject.toml naming feast-edge's components.

The app holds no code of its own: ``[tool.flwr.app.components]`` names ``feast_edge.flower.serverapp:app`` and
``feast_edge.flower.clientapp:app``, installed with ``pip install 'feast-edge[flower]'`` where the SuperLink and
every SuperNode run. ``[tool.flwr.app.config]`` holds feast-server's settings (``flwr run --run-config`` overrides).
"""

from __future__ import annotations

import re
from pathlib import Path

from feast_edge import __version__
from feast_edge.aggregate.server_opt import DEPLOYMENT_OPT
from feast_edge.errors import FeastError

FILES = ("pyproject.toml", "README.md", ".gitignore")
RUN_DIR = "run"  # out-dir's default, inside the project (kept out of the app bundle by .gitignore)

PYPROJECT = """\
# A Flower App that runs FEAST (feast-edge {version}): `flwr run . <superlink>`; see README.md.
[project]
name = "{name}"
version = "1.0.0"
description = "FEAST on Flower: one elastic supernet, each device its largest affordable model"
# Installed where the SuperLink and every SuperNode run (pip install 'feast-edge[flower]');
# start them with FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 to use that environment as it is.
dependencies = ["feast-edge[flower]=={version}"]

[tool.flwr.app]
publisher = "feast-edge"

[tool.flwr.app.components]
serverapp = "feast_edge.flower.serverapp:app"
clientapp = "feast_edge.flower.clientapp:app"

# feast-server run's settings (option names without the dashes); `flwr run --run-config 'rounds=20'` overrides.
[tool.flwr.app.config]
out-dir = "{out}"            # the run directory: checkpoint, rounds.csv, devices.sqlite, models/ (absolute path)
preset = "{preset}"
rounds = {rounds}
per-round = {per_round}             # devices per round
min-clients = {min_clients}           # valid updates a round needs to change the model
seed = 0
eval-every = 1
data = "{data}"                    # the server's own validation data (e.g. /usr/share/datasets/fashion-mnist); "": none
server-opt = "{server_opt}"
payload-dtype = "float32"     # or float16
round-timeout = 600.0
wait-timeout = 1800.0
export = true                 # each node's largest affordable variant as ONNX in out-dir/models after the last round
personalize = "off"           # or auto, prior, head, bn, proximal, METHOD:STRENGTH: each node's personal model, counted
                              # on its held-out split -> out-dir/personalization.json
node-data = ""                # Simulation Engine only: the partition (feast-edge partition) simulated nodes read
node-holdout = 0.0            # Simulation Engine only: the share of each simulated node's shard held out
"""

README = """\
# {name}: FEAST on Flower

A Flower App written by `feast-edge flower new` (feast-edge {version}). It holds no code: the ServerApp and
ClientApp are feast-edge's (`feast_edge.flower`), installed with `pip install 'feast-edge[flower]'` where the
SuperLink and every SuperNode run. docs/flower.md in feast-edge explains each step.

## On one machine (Deployment Engine on loopback)

```bash
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1   # use the installed feast-edge, fetch nothing
flower-superlink --insecure &
flower-supernode --insecure --superlink 127.0.0.1:9092 --clientappio-api-address 127.0.0.1:9094 \\
    --node-config "data='/usr/share/datasets/fashion-mnist' shard='0/2' budget='20M'" &
flower-supernode --insecure --superlink 127.0.0.1:9092 --clientappio-api-address 127.0.0.1:9095 \\
    --node-config "data='/usr/share/datasets/fashion-mnist' shard='1/2' profile='jetson-nano'" &
flwr run . local --stream           # "local": a [superlink.local] entry in $FLWR_HOME/config.toml
```

Each SuperNode's `--node-config`: `data` (required: its own images, as `feast-agent run --data` takes them),
`profile` or `budget` (its MAC budget), optional `name`, `shard`, `offset`, `holdout`, `device`, `threads`.

## After the run

`{out}` is a feast-edge run directory: `feast-edge report {out}`, `feast-edge dashboard {out}`,
`feast-server export --out {out}`; the per-device ONNX files are in `{out}/models/`.
"""


def write_template(
    directory: Path,
    *,
    preset: str = "fmnist-small",
    rounds: int = 10,
    per_round: int = 2,
    data: str = "",
    force: bool = False,
) -> list[Path]:
    """Write the Flower App project into ``directory``; FeastError rather than overwrite (unless ``force``)."""
    directory = directory.expanduser().resolve()
    existing = [directory / f for f in FILES if (directory / f).exists()]
    if existing and not force:
        raise FeastError(f"{existing[0]} already exists; choose another directory or pass --force to overwrite")
    if per_round < 1 or rounds < 1:
        raise FeastError("--rounds and --per-round must be at least 1")
    name = re.sub(r"[^a-z0-9]+", "-", directory.name.lower()).strip("-") or "feast-flower-app"
    values = dict(
        name=name,
        version=__version__,
        out=str(directory / RUN_DIR),
        preset=preset,
        rounds=rounds,
        per_round=per_round,
        min_clients=min(2, per_round),
        data=data,
        server_opt=DEPLOYMENT_OPT,
    )
    directory.mkdir(parents=True, exist_ok=True)
    texts = {
        "pyproject.toml": PYPROJECT.format(**values),
        "README.md": README.format(**values),
        ".gitignore": f"{RUN_DIR}/\n__pycache__/\n",
    }
    written = []
    for file, text in texts.items():
        (directory / file).write_text(text, encoding="utf-8")
        written.append(directory / file)
    return written
