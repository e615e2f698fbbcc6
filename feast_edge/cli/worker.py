"""A worker process of ``feast-edge simulate --nproc N``: it trains its share of every round (feast_edge.sim.distributed).

``feast-edge simulate`` starts N-1 of these with :data:`COMMAND`; the job (the run's config) comes on stdin,
the rank in the environment. Under torchrun every process runs ``feast-edge simulate`` itself instead.
"""

from __future__ import annotations

import os
import sys

COMMAND = (sys.executable, "-m", "feast_edge.cli.worker")


def main() -> None:
    from feast_edge.errors import FeastError
    from feast_edge.sim.distributed import serve_local

    try:
        serve_local()
    except FeastError as exc:
        print(f"feast-edge simulate, process {os.environ.get('RANK', '?')}: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
