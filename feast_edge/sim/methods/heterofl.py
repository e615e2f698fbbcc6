"""HeteroFL (Diao et al., ICLR 2021) as a harness baseline: width tiers of one ResNet-18, count-normalised averaging (method §9).

Mechanics, as the original code (``src/models/resnet.py``, ``src/fed.py``) does them:

* **Model.** One global pre-activation ResNet-18 (:mod:`feast_edge.sim.methods.resnet18`), BatchNorm without
  running statistics. A *tier* is a width ratio ``r`` of it, at full depth; the defaults are the paper's
  ``{1, 1/2, 1/4, 1/8, 1/16}`` (option ``tiers``). Tiers are HeteroFL's own ratios of its own network, not
  FEAST's width multipliers (which act on a different, elastic network).
* **Plan.** A client trains the largest tier whose MACs fit its raw budget (method §4: affordability uses the
  raw budget). A budget below the smallest tier is an error (raise ``--budget-min``).
* **Payload.** The top-left slice of every global tensor, under the same name: convs
  ``[:ceil(r·out), :ceil(r·in)]`` (image input channels never sliced), classifier ``[:, :ceil(r·in)]``
  (classes never sliced), 1-D tensors ``[:ceil(r·n)]``. It is exactly the ratio-``r`` network's state dict.
* **Local training.** The ratio-``r`` network with the Scaler (``x / r`` before every BN, training only) and
  batch-statistics BN; plain cross-entropy on the recipe's augmented batches (``training_batches``), SGD with
  the recipe's momentum, weight decay and gradient clipping at the harness's learning rate; fresh optimizer
  state every round. The client returns its whole trained slice.
* **Aggregation** (method §6 over leading slices; untouched positions keep their value)::

      θ[p] = Σ_k n_k θ_k[p] / Σ_k n_k·1[p ∈ S_k]     (some client's slice S_k holds p)
      θ[p] = θ[p]                                      (otherwise)

  i.e. :func:`feast_edge.aggregate.robust.robust_aggregate` with the run's ``--aggregation`` rule ("mean" by default).
* **Evaluation.** Per tier: the ratio-``r`` network with running statistics, its BN statistics recomputed on
  the calibration images (reset + cumulative average, ``recalibrate_bn``: the original's "static BN"
  ``stats`` pass), then top-1 accuracy. :meth:`points` are the tiers; a device is served its tier's network.

Choices (where this departs from, or had to pin down, the original):

* **Network scale.** Widths ``(w, 2w, 4w, 8w)`` with ``w`` the largest multiple of 8 whose full network fits the
  preset's ``budget_cap`` (:func:`~feast_edge.sim.methods.resnet18.hidden_for_budget`): this gives the paper's
  ``[64, 128, 256, 512]`` (555.47M MACs) on paper-cifar100/-cinic10/-tinyimagenet, ``[16, 32, 64, 128]``
  (28.57M MACs) on fmnist-small.
* **Sample-weighted counts** ``n_k`` (method §6/§9) where the original counts each client once, and no
  label-split restriction of the classifier rows nor logit masking (the original's ``cfg['mask']``): every
  method of the harness shares the same loss recipe and aggregation weights.
* **Recipe.** The harness's (augmentation, batch size, epochs, SGD momentum/weight decay/clip, cosine lr)
  instead of the original's own schedule, so that only the method differs between baselines.
* **Evaluation network at Scaler rate 1.** ``recalibrate_bn`` runs in training mode; with a Scaler of rate
  ``r`` the statistics would be of ``x / r`` while evaluation sees ``x``. The original's ``stats`` builds its
  model at the global rate (1) too. Note that BN right after the Scaler normalizes the scale away, so the
  Scaler changes training only through BN's ε.
* **Init.** PyTorch's default init plus the original's ``init_param`` (unit BN weight, zero biases), drawn
  inside ``torch.random.fork_rng`` from ``config.seed``; no other random draw outside ``(seed, t, client)``.
* ``ceil(r·c)`` is taken after rounding ``r·c`` to 1e-9, so a ratio like 0.1 does not round 3.0000000000000004 up to 4.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from feast_edge.aggregate.robust import robust_aggregate
from feast_edge.evaluate.evaluation import pixel_batches
from feast_edge.evaluate.points import OperatingPoint
from feast_edge.local.cotrain import seeds, training_batches
from feast_edge.run.collect import ClientUpdate
from feast_edge.sim.methods.base import Method, MethodOption, floats
from feast_edge.sim.methods.resnet18 import (
    ResNet18,
    ResNetShape,
    build_network,
    hidden_for_budget,
    init_heterofl,
    last_side,
    leading_state,
    resnet_cost,
    tensor_shapes,
)
from feast_edge.sim.registry import MethodError
from feast_edge.space.extract import recalibrate_bn
from feast_edge.space.preset import Preset

if TYPE_CHECKING:
    from feast_edge.sim.setup import Setup, SimulationConfig

PAPER_TIERS = (1.0, 0.5, 0.25, 0.125, 0.0625)


def heterofl_shape(preset: Preset) -> ResNetShape:
    """The global network of ``preset``: ResNet-18 widths scaled so the full network fits ``budget_cap`` MACs."""
    hidden = hidden_for_budget(
        preset.in_channels, preset.input_size, preset.classes, preset.stem_stride, preset.budget_cap
    )
    return ResNetShape(preset.in_channels, preset.input_size, preset.classes, hidden, preset.stem_stride)


def tier_label(ratio: float) -> str:
    """``"tier 1/4"`` for 0.25, ``"tier 1"`` for 1.0."""
    return f"tier {Fraction(ratio).limit_denominator(1024)}"


class HeteroFL(Method):
    name = "heterofl"
    private_aggregation = True  # sparse mean of leading slices (feast_edge.privacy)
    summary = "HeteroFL: width tiers of one ResNet-18, top-left-slice payloads, count-normalised averaging, static BN"
    supernet = False
    options: ClassVar[Mapping[str, MethodOption]] = {
        "tiers": MethodOption(
            floats, PAPER_TIERS, "width ratios r in (0, 1], comma-separated (default 1,0.5,0.25,0.125,0.0625)"
        ),
    }

    def __init__(self, setup: Setup, config: SimulationConfig) -> None:
        super().__init__(setup, config)
        low = min(float(b) for b in setup.population.budgets)
        self.tier_for(low)  # fail at start, not in the round that first samples the poorest client

    @classmethod
    def check_options(cls, values: Mapping[str, Any]) -> None:
        tiers = values["tiers"]
        if not tiers or any(not 0 < r <= 1 for r in tiers) or len(set(tiers)) != len(tiers):
            raise MethodError(
                f"--method-option tiers={','.join(map(str, tiers))} must list distinct width ratios in (0, 1], e.g. 1,0.5,0.25,0.125,0.0625"
            )

    # ------------------------------------------------------------------ model
    def build_model(self) -> ResNet18:
        self.shape = heterofl_shape(self.preset)
        costs = {float(r): resnet_cost(self.shape, r) for r in self.opts["tiers"]}
        self.tiers = tuple(sorted(costs, key=lambda r: costs[r][0]))  # ascending MACs
        self.costs = costs
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed)
            model = ResNet18(self.shape)
            init_heterofl(model)
        return model

    def model_record(self) -> dict[str, Any]:
        return {"method": self.name, "network": "preact-resnet18", **self.shape.to_dict(), "tiers": list(self.tiers)}

    # ------------------------------------------------------------------ rounds
    def tier_for(self, budget: float) -> float:
        """The largest tier whose MACs fit ``budget``; a one-line MethodError below the smallest tier."""
        fitting = [r for r in self.tiers if self.costs[r][0] <= budget]
        if not fitting:
            smallest = self.tiers[0]
            raise MethodError(
                f"heterofl: a client budget of {budget / 1e6:.3f}M MACs is below the smallest tier ({tier_label(smallest)}: "
                f"{self.costs[smallest][0] / 1e6:.3f}M MACs); raise --budget-min to at least {self.costs[smallest][0]}"
            )
        return fitting[-1]

    def plans(self, t: int, cohort: Sequence[str], budget: Callable[[str], float]) -> dict[str, float]:
        return {c: self.tier_for(budget(c)) for c in cohort}

    def payload_params(self, plan: float) -> int:
        return resnet_cost(self.shape, plan)[1]

    def sample_train_macs(self, plan: float) -> int:
        return resnet_cost(self.shape, plan)[0]

    def payload(self, ratio: float, global_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What a client of tier ``ratio`` receives: copies of the top-left slices, under the global names."""
        return leading_state(global_state, tensor_shapes(self.shape, ratio))

    def train_client(
        self,
        t: int,
        client: str,
        plan: float,
        global_state: Mapping[str, torch.Tensor],
        images: torch.Tensor,
        labels: torch.Tensor,
        lr: float,
        seed: int,
    ) -> ClientUpdate:
        ratio, train = float(plan), self.config.train_config()
        device = torch.device(self.config.device)
        net = build_network(self.shape, ratio, self.payload(ratio, global_state), device=device)
        # The first two of FEAST's streams (seeds(seed, 3)): the same shuffles and augmentations as a FEAST client.
        shuffle_gen, augment_gen = (torch.Generator().manual_seed(s) for s in seeds(seed, 2))
        optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=train.momentum, weight_decay=train.weight_decay)
        net.train()
        loss_sum, seen = 0.0, 0
        batches = training_batches(
            images.cpu(),
            labels.cpu(),
            self.preset,
            self.preset.classes,
            train,
            shuffle_gen,
            augment_gen,
            device,
            bn_needs_two=last_side(self.shape) == 1,
        )
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(batch.images), batch.targets)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), train.clip_norm)
            optimizer.step()
            loss_sum += float(loss.detach()) * len(batch)
            seen += len(batch)
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in net.state_dict().items()}
        return ClientUpdate(
            client,
            state,
            int(labels.shape[0]),
            loss=loss_sum / seen if seen else float("nan"),
            samples_seen=seen,
            train_macs=3
            * seen
            * resnet_cost(self.shape, ratio)[0],  # method §7's proxy: forward + backward ≈ 3 × forward
        )

    def aggregate(
        self,
        t: int,
        global_state: Mapping[str, torch.Tensor],
        updates: Sequence[ClientUpdate],
        plans: Mapping[str, Any],
    ) -> None:
        if not updates:
            return
        c = self.config
        robust_aggregate(
            global_state,
            [(u.state, u.samples) for u in updates],
            c.aggregation.rule,
            trim=c.aggregation.trim,
            clip_norm=c.aggregation.clip_norm,
            inplace=True,
        )

    # ------------------------------------------------------------------ evaluation
    def points(self) -> list[OperatingPoint]:
        return [OperatingPoint(tier_label(r), self.costs[r][0], self.costs[r][1], {"ratio": r}) for r in self.tiers]

    def tier_network(
        self, ratio: float, calibration_images: torch.Tensor, device: str | torch.device = "cpu"
    ) -> ResNet18:
        """The network a device of tier ``ratio`` runs: its slices, Scaler rate 1, BN statistics recomputed (eval mode)."""
        net = build_network(
            self.shape, ratio, self.model.state_dict(), scale=False, track_running_stats=True, device=device
        )
        recalibrate_bn(net, pixel_batches(calibration_images, self.preset, 100, device))
        return net

    def point_network(
        self, point: OperatingPoint, calibration_images: torch.Tensor, device: str | torch.device = "cpu"
    ) -> ResNet18:
        return self.tier_network(float(point.detail["ratio"]), calibration_images, device)
