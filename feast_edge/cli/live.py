"""``feast-edge simulate --dashboard``: the simulated federation on the same page as a real one.

The simulated clients are the fleet (each with its budget, shard and served
point); each round's cohort moves through routed -> training -> uploading ->
aggregated as the method trains it in this process; traffic counts the routed
parameters (bytes in the payload dtype) against a float32 full-supernet broadcast; at the end, the
test accuracy of every served point and the population accuracy.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from feast_edge.privacy.private_rounds import privacy_entry
from feast_edge.report.model_words import served_so_far, served_words
from feast_edge.route.payload import bytes_per_param
from feast_edge.run.clock import clock_entry
from feast_edge.run.loop import RoundRecord


class SimulationLive:
    """Feeds a ``DashboardState`` from a ``feast_edge.sim.simulate.Simulation`` (call :meth:`attach` before ``run``)."""

    def __init__(self, state: Any, sim: Any) -> None:
        self.state, self.sim = state, sim
        self._down: dict[str, int] = {}
        cfg, setup, method = sim.config, sim.setup, sim.method
        state.set_run(
            preset=cfg.preset,
            method=cfg.method,
            rounds_total=cfg.training.rounds,
            rounds_done=len(sim.history),
            status="running",
            started=time.time(),
        )
        points = method.points()
        for client, budget, size in zip(setup.client_ids, setup.population.budgets, setup.population.sizes):
            point = points[method.served(float(budget))]
            state.set_device(
                client,
                profile=None,
                hardware="simulated",
                budget_macs=int(budget),
                samples=int(size),
                online=True,
                last_seen=time.time(),
                rounds=0,
                variant={"label": point.label, "macs": point.macs, "params": point.params},
            )

    def attach(self) -> None:
        self.sim.environment.in_process.on_start = self.round_started  # under every wrapper (secure sums)
        self.sim.method.on_client = self.client_state

    def round_started(self, t: int, cohort: Sequence[str], plans: Mapping[str, Any]) -> None:
        params = {c: self.sim.method.payload_params(plans[c]) for c in cohort}
        self._down = {c: p * bytes_per_param(self.sim.config.aggregation.payload_dtype) for c, p in params.items()}
        self.state.start_round(t + 1, list(cohort), None)
        for client, size in self._down.items():
            self.state.set_device(client, envelope={"params": params[client], "bytes": size}, last_seen=time.time())

    def client_state(self, client: str, state: str) -> None:
        self.state.member(client, state, *((1, 1) if state == "uploading" else (None, None)))

    def round_finished(self, record: RoundRecord) -> None:
        for client in record.updated:
            self.state.member(client, "aggregated")
            self.state.set_device(
                client,
                rounds=sum(client in h.updated for h in self.sim.history),
                last_upload={"round": record.round, "status": "accepted", "reason": None},
            )
        for client, reason in record.rejected.items():
            self.state.member(client, "rejected", reason=reason)
        down = sum(self._down.values())
        self.state.end_round(
            {
                "round": record.round,
                "loss": record.loss,
                "val_accuracy": record.val_accuracy,
                "population_accuracy": None,
                "bytes_down": down,
                "bytes_up": down,
                "broadcast_bytes": record.full_bytes,
                "train_macs": record.train_macs,
                "seconds": record.seconds,
                "devices": {c: {"down": b, "up": b} for c, b in self._down.items()},
                **privacy_entry(record.dp),
                **clock_entry(record.clock, record.staleness),
            }
        )
        if record.val_accuracy is not None and self.sim.method.validated:
            self.state.set_variants([dict(v) for v in self.sim.method.validated])
        self.state.set_served(served_so_far(record.validation))
        self.state.set_run(rounds_done=record.round)

    def finished(self, results: Mapping[str, Any] | None) -> None:
        """The final test of every point (accuracy vs MACs) and the population accuracy; ``None``: the run stopped early."""
        if results is None:
            self.state.set_run(status="stopped")
            return
        self.state.set_variants(
            [
                {
                    "label": v["label"],
                    "macs": v["macs"],
                    "params": v["params"],
                    "val_accuracy": None,
                    "test_accuracy": v["test_accuracy"],
                }
                for v in results["variants"]
            ]
        )
        self.state.set_population(results["population_accuracy"])
        self.state.set_served(served_words([{"served_round": results.get("served_round")}]))
        self.state.set_run(status="finished")
