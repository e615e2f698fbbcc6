"""``feast-server``: run a federation over MQTT, export per-device ONNX models, serve them.

One module per command group: ``run`` (the federation), ``rundir`` (export,
serve, status of a run directory), ``provisioning`` (identities); ``shared``
holds what they have in common. User errors (unreachable broker, wrong
credentials, bad options, a foreign checkpoint) print one ``error:`` line to
stderr and exit with status 2.
"""

from __future__ import annotations

from feast_edge.cli import common
from feast_edge.server.cli import provisioning, run, rundir

app = common.make_app(
    "feast-server", "FEAST federation server: registry, rounds over MQTT, checkpoints, per-device ONNX export."
)
run.register(app)
provisioning.register(app)
rundir.register(app)


def main() -> None:
    """Console-script entry of ``feast-server``."""
    common.run_cli(app)
