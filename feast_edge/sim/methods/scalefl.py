"""ScaleFL (Ilhan, Su and Liu, CVPR 2023): four depth–width levels with early exits and self-distillation (method §9).

The global model is a ResNet-18-style stack of 8 BasicBlocks with an exit head
(GAP → Linear) after the last block of every level (network, width rule and
level search: :mod:`feast_edge.sim.methods.scalefl_net`). Levels come from
ScaleFL's compute ratios 0.061 / 0.13 / 0.25 / 1.0; on paper-cifar100 they are
(3, 0.40), (4, 0.50), (5, 0.60), (8, 1.00) (blocks, width), exits after blocks
3, 4, 5 and 8.

* Assignment: a client trains the largest level whose training network
  (backbone + its exits 1..l) fits its raw MAC budget; a client below level 1
  trains and is served level 1 anyway, as the FEAST paper does for ScaleFL
  (its 25M-MAC clients sit below ScaleFL's 35M level 1; on fmnist-small the
  1.5M floor sits below level 1's 1.91M). This favours ScaleFL slightly: such
  a device gets a model above its budget.
* Local training: the first ``blocks_l`` blocks at ``width_l`` with exits
  1..l, leading slices of every global tensor, on the shared recipe's batches
  (``feast_edge.local.cotrain.training_batches``; SGD with the recipe's momentum,
  weight decay and gradient clipping, fresh each round). Loss (ScaleFL Eq. 5
  as method §9 and the FEAST reference write it)::

      L = Σ_{i≤l} i/(l(l+1)) · [CE(z_i, ỹ) + β·τ²·KL(σ(z_l/τ) ‖ σ(z_i/τ))]

  with ỹ the recipe's Mixup/CutMix soft target, the deepest exit z_l as the
  detached teacher (its own KD term is zero), β = 0.1, τ = 3, KL averaged over
  the batch.
* Aggregation: the clients return their trained parameters (leading slices,
  the global tensors' names); every global position is the sample-weighted
  mean over the clients whose slice contains it, positions nobody trained
  (exit heads above every cohort level, deep blocks, outer channels) keep
  their value:  θ[u] = Σ_{k: u∈S_k} n_k θ_k[u] / Σ_{k: u∈S_k} n_k
  (``feast_edge.aggregate.robust.robust_aggregate`` with the run's rule, "mean" by default).
* Evaluation: each level at its deepest exit, after recomputing its BN
  statistics on the calibration images (method §8).

Choices (what and why):

* Loss weights i/(l(l+1)) sum to ½, as in method §9 and the FEAST reference the
  paper ran; ScaleFL's own code divides by l(l+1)/2 (weights sum to 1), i.e.
  gradients twice as large. Its code also uses ``KLDivLoss`` with element-wise
  mean (KL / classes) and switches KD on after a quarter of the rounds; we use
  the per-sample KL from round 0, as the reference does.
* Exit heads are GAP → Linear as in the FEAST reference (the paper's 11.27M
  parameters); ScaleFL's own heads add three conv–BN–ReLU layers. No
  HeteroFL-style Scaler: every conv is followed by BN, which cancels it.
* BN running statistics are neither sent nor averaged (the clients return
  parameters only): every evaluation recomputes them, as ScaleFL's
  ``track_running_stats=False`` implies.
* Aggregation is weighted by sample counts (method §6, FEAST reference);
  ScaleFL's own code counts clients.
* Costs: a level's operating point is what a device serves (backbone + its
  deepest exit); its assignment uses what a client trains (backbone + every
  exit up to its own). The two differ by the earlier heads (< 0.05 %).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from feast_edge.aggregate.robust import robust_aggregate
from feast_edge.evaluate.evaluation import pixel_batches
from feast_edge.evaluate.points import OperatingPoint
from feast_edge.local.cotrain import seeds, training_batches
from feast_edge.run.collect import ClientUpdate
from feast_edge.sim.methods.base import Method, MethodOption
from feast_edge.sim.methods.scalefl_net import (
    TOTAL_BLOCKS,
    DeepestExit,
    Geometry,
    Level,
    ScaleFLNet,
    build_levels,
    level_net,
    load_slices,
    search_splits,
)
from feast_edge.sim.registry import MethodError
from feast_edge.space.extract import recalibrate_bn

if TYPE_CHECKING:
    from feast_edge.sim.setup import Setup, SimulationConfig


def exit_loss(
    logits: Sequence[torch.Tensor], targets: torch.Tensor, beta: float = 0.1, tau: float = 3.0
) -> torch.Tensor:
    """ScaleFL's self-distillation loss over exits ``z_1..z_l`` (module docstring); ``targets`` are soft ``[N, classes]``."""
    depth = len(logits)
    teacher = logits[-1].detach() / tau
    p_teacher, log_teacher = F.softmax(teacher, dim=1), F.log_softmax(teacher, dim=1)
    total = logits[0].new_zeros(())
    for i, z in enumerate(logits, start=1):
        term = F.cross_entropy(z, targets)
        if i < depth:
            kl = (p_teacher * (log_teacher - F.log_softmax(z / tau, dim=1))).sum(dim=1).mean()
            term = term + beta * tau**2 * kl
        total = total + i / (depth * (depth + 1)) * term
    return total


def _finite(name: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite")
        return value

    return parse


class ScaleFL(Method):
    """ScaleFL baseline: levels of (blocks, width) with early exits, self-distillation and slice-wise averaging."""

    name = "scalefl"
    private_aggregation = True  # sparse mean of leading slices (feast_edge.privacy)
    summary = "ScaleFL (Ilhan et al. 2023): 4 depth-width levels, early exits, self-distillation"
    supernet = False
    options: ClassVar[Mapping[str, MethodOption]] = {
        "beta": MethodOption(
            _finite("beta"), 0.1, "weight β >= 0 of the exits' KL self-distillation term (paper: 0.1)"
        ),
        "tau": MethodOption(_finite("tau"), 3.0, "distillation temperature τ > 0 (paper: 3)"),
    }

    def __init__(self, setup: Setup, config: SimulationConfig) -> None:
        self.geometry = Geometry.of(setup.preset)
        self.levels: tuple[Level, ...] = build_levels(self.geometry, search_splits(self.geometry))
        super().__init__(setup, config)

    @classmethod
    def check_options(cls, values: Mapping[str, Any]) -> None:
        if values["beta"] < 0:
            raise MethodError(f"--method-option beta={values['beta']} must be >= 0 (the KL weight; paper 0.1)")
        if values["tau"] <= 0:
            raise MethodError(
                f"--method-option tau={values['tau']} must be > 0 (the distillation temperature; paper 3)"
            )

    # ------------------------------------------------------------------ model
    def build_model(self) -> nn.Module:
        exits = tuple(level.blocks for level in self.levels)
        return ScaleFLNet(self.geometry, TOTAL_BLOCKS, 1.0, exits, seed=self.config.seed)

    def model_record(self) -> dict[str, Any]:
        levels = [{"level": v.level, "blocks": v.blocks, "width": v.width} for v in self.levels]
        return {"method": self.name, **self.geometry.to_dict(), "levels": levels}

    def level_for(self, budget: float) -> int:
        """The largest level whose training network fits ``budget`` MACs; level 1 below that (the paper's fallback)."""
        fitting = [v.level for v in self.levels if v.train_macs <= budget]
        return fitting[-1] if fitting else 1

    def served(self, budget: float) -> int:
        """The largest level within ``budget`` (its deepest-exit MACs); level 1 for a budget below it, as in training."""
        fitting = [i for i, p in enumerate(self.points()) if p.macs <= budget]
        return fitting[-1] if fitting else 0

    # ------------------------------------------------------------------ rounds
    def plans(self, t: int, cohort: Sequence[str], budget: Callable[[str], float]) -> dict[str, Any]:
        return {cid: self.level_for(budget(cid)) for cid in cohort}

    def payload_params(self, plan: Any) -> int:
        return self.levels[plan - 1].train_params

    def sample_train_macs(self, plan: Any) -> int:
        return self.levels[plan - 1].train_macs

    def train_client(
        self,
        t: int,
        client: str,
        plan: Any,
        global_state: Mapping[str, torch.Tensor],
        images: torch.Tensor,
        labels: torch.Tensor,
        lr: float,
        seed: int,
    ) -> ClientUpdate:
        began = time.perf_counter()
        level = self.levels[plan - 1]
        recipe = self.config.train_config()
        device = torch.device(self.config.device)
        net = load_slices(level_net(self.geometry, level), global_state).to(device).train()
        optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=recipe.momentum, weight_decay=recipe.weight_decay)
        shuffle_gen, augment_gen = (torch.Generator().manual_seed(s) for s in seeds(seed, 2))
        bn_needs_two = self.geometry.layout(level.blocks, level.width)[-1][3] == 1
        batches = training_batches(
            images.cpu(),
            labels.cpu(),
            self.preset,
            self.geometry.classes,
            recipe,
            shuffle_gen,
            augment_gen,
            device,
            bn_needs_two,
        )
        objective, seen = 0.0, 0
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = exit_loss(net(batch.images), batch.targets, self.opts["beta"], self.opts["tau"])
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), recipe.clip_norm)
            optimizer.step()
            objective += float(loss.detach()) * len(batch)
            seen += len(batch)
        state = {name: p.detach().cpu().clone() for name, p in net.named_parameters()}
        return ClientUpdate(
            client,
            state,
            samples=int(labels.shape[0]),
            loss=objective / seen if seen else float("nan"),
            samples_seen=seen,
            train_macs=3 * seen * level.train_macs,
            compute_seconds=time.perf_counter() - began,
        )

    def aggregate(
        self,
        t: int,
        global_state: Mapping[str, torch.Tensor],
        updates: Sequence[ClientUpdate],
        plans: Mapping[str, Any],
    ) -> None:
        cfg = self.config
        robust_aggregate(
            global_state,
            [(u.state, u.samples) for u in updates],
            cfg.aggregation.rule,
            trim=cfg.aggregation.trim,
            clip_norm=cfg.aggregation.clip_norm,
            inplace=True,
        )

    # ------------------------------------------------------------------ evaluation
    def points(self) -> list[OperatingPoint]:
        return [
            OperatingPoint(v.label, v.macs, v.params, {"level": v.level, "blocks": v.blocks, "width": v.width})
            for v in self.levels
        ]

    def level_model(self, level: int) -> ScaleFLNet:
        """Level ``level``'s network with the global model's leading slices (BN statistics as stored)."""
        return load_slices(level_net(self.geometry, self.levels[level - 1]), self.model.state_dict())

    def point_network(
        self, point: OperatingPoint, calibration_images: torch.Tensor, device: str | torch.device = "cpu"
    ) -> nn.Module:
        """A level's network up to its deepest exit, BN recalibrated."""
        net = self.level_model(int(point.detail["level"])).to(device)
        recalibrate_bn(net, pixel_batches(calibration_images, self.preset, 100, device))
        return DeepestExit(net).eval()
