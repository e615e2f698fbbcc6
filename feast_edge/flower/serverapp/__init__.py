"""feast-edge's Flower ServerApp: feast-edge's own run loop, with Flower's Grid as the way a cohort's updates come back.

    main(grid, context)
      config  = run_config(context.run_config)          ServerConfig: the same settings and fingerprint as feast-server
      host    = FlowerFederation(config, grid)          RunHost: preset, cache, held data, registry, RunLoop
      loop:   clients(needed)  query each new node once (its Register), until enough are accepted (DeviceBook)
              collect(t, ...)  per cohort node a "train" Message: RoundStart (ConfigRecord), routed slice (ArrayRecord);
                               each reply checked (records.read_arrays, the update-norm bound) -> ClientUpdate,
                               or declined / rejected / incomplete with its reason; the run goes on
      validate (run config data = ""; every eval-every rounds and the last): per cohort node with a held-out split
              an "evaluate" Message (validation_records: its routed slice, the targets it may evaluate); its counts
              back -> record.validation (source "devices"), whose per-node served figures choose the served round
              (FlowerValidation; feast_edge.evaluate.served_round)
      export: each registered node's largest affordable variant (ONNX with the server's data) in out-dir/models
      personalize (run config personalize, default off): per accepted node an "evaluate" Message with its served
              variant; the node's personalization step's held-out counts back -> out-dir/personalization.json

Cohorts, plans, aggregation, server optimizer, checkpoints, resume and validation are the run loop's
(``feast_edge.run.loop``): a Flower run computes what ``feast-edge simulate`` and ``feast-server run`` compute.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from feast_edge.flower import log_to_stderr, records
from feast_edge.flower.serverapp.collector import FlowerCollector, NodeBook
from feast_edge.flower.serverapp.environment import FlowerEnvironment
from feast_edge.flower.serverapp.personalize_nodes import personalize_nodes
from feast_edge.flower.serverapp.run_config import personalize_choice, server_config
from feast_edge.flower.serverapp.validation import FlowerValidation
from feast_edge.run.loop import RoundRecord
from feast_edge.server.collect import RoundTerms
from feast_edge.server.config import ServerConfig, ServerError
from feast_edge.server.devices import DeviceBook
from feast_edge.server.host import RunHost
from feast_edge.server.waiting import WaitTimeout

log = logging.getLogger(__name__)


class FlowerFederation(RunHost):
    """A federation run whose devices are Flower SuperNodes (see the module docstring)."""

    def __init__(self, config: ServerConfig, grid: Grid) -> None:
        super().__init__(config, on_round=_print_round)
        self.devices = DeviceBook(
            self.registry,
            self.preset,
            self.cache,
            federation=config.federation,
            rounds=config.training.rounds,
            reply=lambda device, answer: self.nodes.reply(device, answer),
            max_samples=config.population.max_samples,
            max_devices=config.population.max_devices,
            shard_samples=None if self.data is None else self.data.shard_samples,
            validation=self.validation_source,
        )
        self.nodes = NodeBook(grid, self.devices, config.federation)
        terms = RoundTerms(
            self.preset,
            config.train_config(),
            config.seed,
            config.training.rounds,
            payload_dtype=records.check_flower_dtype(config.aggregation.payload_dtype),
            max_update_norm=config.aggregation.max_update_norm,
        )
        self.collector = FlowerCollector(grid, self.nodes, terms, config)
        # Without server data the cohort nodes validate on their held-out splits (the run loop calls it).
        self.validation = FlowerValidation(
            self.nodes,
            self.preset,
            self.cache,
            self.model,
            probes=config.validation.probe_variants,
            calibration=config.validation.calib_samples,
            payload_dtype=terms.payload_dtype,
            rule=config.validation.val_rule,
            max_weight_ratio=config.aggregation.max_weight_ratio,
            timeout=config.network.round_timeout,
        )
        self.compose_loop(FlowerEnvironment(self.collector, self._validate_on_nodes))

    def _validate_on_nodes(
        self, t: int, record: RoundRecord, alternative: Mapping[str, torch.Tensor] | None = None
    ) -> float | None:
        return self.validation(t, record, alternative)

    def run(self) -> list[RoundRecord]:
        """Resume if possible and run the remaining rounds; ServerError when too few nodes join."""
        if self.data is None and self.loop.validator is None:
            log.info(
                "no data in the run config and no federated validation: the last round is served; served models "
                "are calibrated on each device"
            )
        elif self.data is None:
            log.info(
                "no data in the run config: the cohort nodes validate the model on their held-out splits every %d "
                "rounds and after the last; the newest validated round is served unless the nodes' served variants "
                'regressed (docs/server.md, "The served round"); where no node holds examples out, the last '
                "round is served; served models are calibrated on each device",
                self.config.validation.eval_every,
            )
        try:
            history = self.run_rounds()
        except WaitTimeout as exc:
            raise ServerError(
                f"{exc}; stopping: {self.saved()}. Start more SuperNodes, then run again to resume"
            ) from None
        if self.data is None and history and self.loop.best.get("round") is None:
            log.info(
                "no round was validated (no cohort node with a held-out split answered: node config holdout, or "
                "run config node-holdout): the last round, %d, is served",
                history[-1].round,
            )
        return history


def _print_round(record: RoundRecord, rounds: int) -> None:
    val = "-" if record.val_accuracy is None else f"{100 * record.val_accuracy:.2f}%"
    loss = "-" if record.loss is None else f"{record.loss:.4f}"
    log.info(
        "round %d/%d: %d of %d updates, loss %s, val %s (%.1f s)",
        record.round,
        rounds,
        len(record.updated),
        len(record.cohort),
        loss,
        val,
        record.seconds,
    )


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The whole run: rounds through the SuperNodes, then each registered node's model exported (and, with
    ``personalize``, each accepted node's personalization step)."""
    log_to_stderr()
    config, export = server_config(context.run_config)
    choice = personalize_choice(context.run_config)
    federation = FlowerFederation(config, grid)
    log.info(
        "feast-edge on Flower: preset %s, %d cached variants, %d rounds of %d, server optimizer %s; run directory %s",
        federation.preset.name,
        len(federation.cache),
        config.training.rounds,
        config.population.per_round,
        federation.loop.settings.server_opt.describe(),
        config.out,
    )
    federation.run()
    if export:
        manifests = federation.export_models()
        log.info("exported %d device model(s) to %s", len(manifests), federation.out / "models")
    if choice.method != "off":
        personalize_nodes(federation, federation.nodes, choice)
    federation.registry.close()
