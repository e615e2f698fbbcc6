"""The Flower ServerApp's environment (feast_edge.run.environment): SuperNodes reached through Flower's Grid, in
synchronous rounds; the cohort nodes validate on their held-out splits where the run holds no data. Flower has no
asynchronous strategy and no routed secure sums, and the Flower apps offer no differential privacy: its capabilities
say so, and a run config that asks for them is refused with the reason (run_config)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from feast_edge.run.collect import Collector
from feast_edge.run.environment import Capabilities, Plain

if TYPE_CHECKING:
    from feast_edge.run.loop import Validator

FLOWER = Capabilities(
    asynchronous=(
        "buffered asynchronous rounds run in feast-edge simulate --mode async (docs/simulation.md §12) and "
        "feast-server run --mode async; a Flower ServerApp drives synchronous rounds of its Grid (Flower has no "
        "asynchronous strategy)"
    ),
    secure=(
        "secure aggregation per routed segment runs in feast-server run --secure-agg and feast-edge simulate "
        "--secure-agg (docs/security.md §10); its four stages are not built as Flower messages, and Flower's own "
        "SecAgg+ masks the full parameter vector, so routed slices would be zero-padded (4-64x the upload)"
    ),
    privacy=(
        "differential privacy runs with feast-server run over MQTT and feast-edge simulate; the Flower apps do not "
        "offer it yet (the ClientApp sends raw updates, and Flower's own DP wrappers noise a dense average, wrong for "
        "routed slices: docs/privacy.md)"
    ),
)


class FlowerEnvironment(Plain):
    """SuperNodes through a Grid (see the module docstring)."""

    capabilities = FLOWER

    def __init__(self, collector: Collector, validator: Validator) -> None:
        self._collector, self._validator = collector, validator

    def collector(self) -> Collector:
        return self._collector

    def validator(self) -> Validator | None:
        return self._validator
