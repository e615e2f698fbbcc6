"""FIARSE: importance-aware unstructured sub-models of one dense model (Wu et al., NeurIPS 2024; method §9).

The dense model is the FEAST supernet itself, ``Supernet(preset, seed=config.seed)``,
always run at the largest architecture of the space (max depth, max expansion,
max width): FIARSE trains "the same dense model" as FEAST (method §9). A client
with MAC budget ``b`` gets the size ``s = clip(b / full MACs, 1/256, 1)`` and
the global top-k mask of that size over ALL conv and linear weights together::

    τ = the k-th largest |θ| over every conv/linear weight,  k = ⌊s·#weights⌋
    m = 1[|θ| ≥ τ]          (BN parameters and the classifier bias are never masked)

It trains ``θ·m`` with plain SGD (no momentum, no weight decay), starting from
the global θ, and returns ``Δ = θ_sent − θ_trained`` (zero outside its mask),
the mask itself and its BN buffers. The server averages every position over
the clients whose mask holds it (sample-weighted) and takes one step::

    avg[p] = Σ_k n_k Δ_k[p] / Σ_k n_k·1[p ∈ mask_k]      θ[p] ← θ[p] − η_g·avg[p]   (η_g = 1)

A position in no cohort mask keeps its value; unmasked parameters (BN affine,
classifier bias) are in every client's "mask", so with η_g = 1 they become the
sample-weighted mean of the trained values; BN running statistics are that
mean as well, ``num_batches_tracked`` the maximum. A size is evaluated with the
global top-k mask at that size applied, BN recalibrated on the calibration
split (method §8).

Choices (what and why):

* Threshold-controlled biased gradient (TCB-GD) as the original code writes it
  (``fiarse/model/model_utils.py``): the weight is used as ``θ·Bern(|θ|, τ)``
  where ``Bern`` is the hard mask forward and ``2τ/(|θ|+τ)²·1[|θ| ≥ τ]`` backward,
  i.e. the derivative of the surrogate ``2|θ|/(|θ|+τ)`` of the step. By the
  product rule the gradient reaching θ is ``g·m·(1 + 2τ|θ|/(|θ|+τ)²)`` where
  ``g = ∂L/∂(θ·m)``; :class:`ThresholdMask` implements exactly that in one
  function (a factor between 1 and 1.5, largest at the threshold). Scaling
  ``g`` by ``2τ/(|θ|+τ)²`` alone would drop the product rule's first term.
  Caveat: the original's ``Bern.forward`` returns a *bool* tensor, which
  autograd treats as non-differentiable, so its backward never runs and the
  code as published trains with the plain masked gradient ``g·m``. Option
  ``gradient=masked`` reproduces that; the default ``tcb`` is the method as
  the paper and method §9 describe it.
* τ is fixed when the client receives the model, the mask is recomputed from
  the current |θ| at every forward pass (as the original's ``Bern(|θ|, τ)``):
  a kept weight that shrinks below τ drops out; masked weights get no gradient
  and never move. The mask the client returns is the one it was sent.
* Aggregation counts the explicit mask (the positions routed to the client,
  method §6: routing decides), where the original counts ``Δ ≠ 0``; both agree
  unless a kept weight ends exactly where it started. Weights are the sample
  counts n_k (method §9); the original averages unweighted.
* Biases are never masked (the original also masks the classifier bias; it has
  ``classes`` entries). BN keeps running statistics (the original's ``sbn`` has
  none): they only seed method §8's recalibration.
* Recipe shared with every method: ``feast_edge.local.cotrain.training_batches``
  (augmentation, batch size, epochs, same shuffling streams as FEAST), the
  harness's cosine learning rate and the recipe's gradient-norm clip (the
  original does not clip).
* k = ⌊s·#weights⌋ (at least 1), ties at τ kept, as the original's top-k.
  One mask over layers of different scales: with the supernet's initialisation
  (Kaiming-normal convs, a ±1/√fan_in classifier) every size up to 1/16 keeps
  no classifier weight at first (fmnist-small), so such a client trains only
  the classifier bias until larger clients have grown the head; the reference
  FEAST baseline (classifier init N(0, 0.01)) has the same effect.
* Evaluated sizes (option ``sizes``): default powers of two, 1, 1/2, 1/4, ...
  down to the first one at or below the smallest client's size (at most down
  to 1/256). The original's evaluation list holds every 1/2^j down to 1/256
  (its paper's sizes 1, 1/4, 1/16, 1/64 among them), the reference FEAST
  baseline evaluates 1, 1/2, ..., 1/16 and 1/64; a
  log-spaced grid covers the budget range (fmnist-small: 1.5M-100M, 8 sizes)
  evenly, and every evaluated size costs a dense forward pass, so a grid as
  dense as the 26-variant cache would multiply the test time for no gain.
  A client is then served a size at most 2× smaller than the one it trained.

Cost accounting: an unstructured mask does not reduce dense MACs. A point's
``macs`` is the nominal budget it is served at, ``s·full MACs``; its
``dense_macs`` is the full model's MACs, which is what a device computes with
dense kernels. Training compute is counted dense too: ``3·Σ n·full MACs``.
``payload_params`` is what a sparse transfer carries: the kept weights plus
every BN and bias parameter (the mask's positions, e.g. a bitmap, not counted).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.func import functional_call

from feast_edge.evaluate.evaluation import calibrated_variant
from feast_edge.evaluate.points import OperatingPoint
from feast_edge.local.cotrain import seeds, supervised_loss, training_batches
from feast_edge.run.collect import ClientUpdate
from feast_edge.sim.methods.base import Method, MethodOption, floats
from feast_edge.sim.registry import MethodError
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost
from feast_edge.space.supernet import Supernet

if TYPE_CHECKING:
    from feast_edge.sim.setup import Setup, SimulationConfig

MIN_SIZE = 1 / 256  # smallest model size (method §9, the original's smallest evaluated size)
DELTA, MASK = "delta.", "mask."  # update keys: Δ of a parameter, the mask of a masked weight


def model_size(budget: float, full_macs: int) -> float:
    """``s = clip(budget / full MACs, 1/256, 1)`` (method §9)."""
    return min(1.0, max(MIN_SIZE, budget / full_macs))


def kept_count(numel: int, size: float) -> int:
    """``k = ⌊size·numel⌋``, at least 1 (the 1e-6 absorbs float error such as 7·(3/7) = 2.9999...)."""
    return max(1, min(numel, math.floor(numel * size + 1e-6)))


def masked_names(model: nn.Module) -> list[str]:
    """The parameters FIARSE masks: every conv and linear weight (the tensors of two or more dimensions)."""
    return [name for name, p in model.named_parameters() if p.dim() >= 2]


@torch.no_grad()
def threshold(weights: Iterable[torch.Tensor], size: float) -> torch.Tensor:
    """τ: the k-th largest |θ| over all ``weights`` together (global top-k, k = ⌊size·#weights⌋)."""
    scores = torch.cat([w.detach().abs().flatten() for w in weights])
    k = kept_count(scores.numel(), size)
    return torch.kthvalue(scores, scores.numel() - k + 1).values


@torch.no_grad()
def masks(weights: Mapping[str, torch.Tensor], tau: torch.Tensor) -> dict[str, torch.Tensor]:
    """``m = 1[|θ| ≥ τ]`` per weight tensor (bool)."""
    return {name: w.detach().abs() >= tau for name, w in weights.items()}


class ThresholdMask(torch.autograd.Function):
    """``θ·1[|θ| ≥ τ]`` forward; backward ``g·m·(1 + 2τ|θ|/(|θ|+τ)²)`` (the original's ``θ·Bern(|θ|, τ)``, see module doc)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight, tau)
        return weight * (weight.abs() >= tau)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        weight, tau = ctx.saved_tensors
        a = weight.abs()
        bias = 2 * tau * a / ((a + tau) ** 2).clamp_min(torch.finfo(a.dtype).tiny)  # 0, not NaN, at a = τ = 0
        return grad * (a >= tau) * (1 + bias), None


def hard_mask(weight: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """``θ·1[|θ| ≥ τ]`` with autograd's own gradient ``g·m`` (the published code's effective rule)."""
    return weight * (weight.detach().abs() >= tau)


GRADIENTS = {"tcb": ThresholdMask.apply, "masked": hard_mask}


@torch.no_grad()
def apply_sparse_deltas(
    global_state: Mapping[str, torch.Tensor],
    updates: Sequence[tuple[Mapping[str, torch.Tensor], float]],
    server_lr: float = 1.0,
) -> None:
    """FIARSE's server step, in place on ``global_state`` (see the module docstring for the formula).

    Each update is ``(state, n)``: ``delta.<name>`` holds a parameter's Δ, ``mask.<name>``
    the positions a masked weight covered (absent: every position), ``<name>`` a buffer's
    trained value (floating: sample-weighted mean; integer: maximum).
    """
    for name, target in global_state.items():
        if any(DELTA + name in state for state, _ in updates):
            total = torch.zeros_like(target, dtype=torch.float64)
            count = torch.zeros_like(target, dtype=torch.float64)
            for state, n in updates:
                if DELTA + name not in state:
                    continue
                covered = state.get(MASK + name)
                covered = torch.ones_like(count) if covered is None else covered.to(count.device, torch.float64)
                total += n * covered * state[DELTA + name].to(count.device, torch.float64)
                count += n * covered
            avg = torch.where(count > 0, total / count.clamp_min(1e-300), 0.0)
            target.sub_((server_lr * avg).to(target.dtype))
            continue
        sent = [(state[name], n) for state, n in updates if name in state]
        if not sent:
            continue
        if target.is_floating_point():
            mean = sum(n * value.to(target.device, torch.float64) for value, n in sent) / sum(n for _, n in sent)
            target.copy_(mean.to(target.dtype))
        else:
            target.copy_(torch.stack([value.to(target.device) for value, _ in sent]).amax(dim=0))


def default_sizes(smallest: float) -> tuple[float, ...]:
    """1, 1/2, 1/4, ... down to the first size at or below ``smallest`` (never below 1/256), ascending."""
    sizes = [1.0]
    while sizes[-1] > smallest and sizes[-1] / 2 >= MIN_SIZE:
        sizes.append(sizes[-1] / 2)
    return tuple(reversed(sizes))


class Fiarse(Method):
    """FIARSE on the FEAST supernet's dense (largest) architecture; see the module docstring."""

    name = "fiarse"
    summary = "FIARSE: top-|θ| unstructured sub-models of the dense supernet, threshold-controlled biased gradient, sparse-Δ aggregation"
    supernet = True
    options: ClassVar[Mapping[str, MethodOption]] = {
        "sizes": MethodOption(
            floats,
            None,
            "comma-separated model sizes in (0, 1] evaluated and served (default: 1, 1/2, 1/4, ... down to the smallest client's size)",
        ),
        "server_lr": MethodOption(float, 1.0, "server learning rate η_g of θ ← θ − η_g·avg Δ (paper: 1)"),
        "gradient": MethodOption(
            str,
            "tcb",
            "tcb (threshold-controlled biased gradient, the paper) or masked (g·m, what the published code computes)",
        ),
    }

    @classmethod
    def check_options(cls, values: Mapping[str, Any]) -> None:
        sizes = values["sizes"]
        if sizes is not None and (not sizes or not all(0 < s <= 1 for s in sizes)):
            raise MethodError(
                f"--method-option sizes={','.join(f'{s:g}' for s in sizes)} for fiarse must list fractions in (0, 1], e.g. sizes=0.25,0.5,1"
            )
        if not (values["server_lr"] > 0 and math.isfinite(values["server_lr"])):
            raise MethodError(
                f"--method-option server_lr={values['server_lr']} for fiarse must be a positive number (paper: 1)"
            )
        if values["gradient"] not in GRADIENTS:
            raise MethodError(
                f"--method-option gradient={values['gradient']} for fiarse is unknown; choose one of {', '.join(GRADIENTS)}"
            )

    def __init__(self, setup: Setup, config: SimulationConfig) -> None:
        super().__init__(setup, config)
        self.arch = Arch.largest(self.preset)
        self.full_macs = arch_cost(self.preset, self.arch, self.model.classes)[0]
        self.masked = masked_names(self.model)
        params = dict(self.model.named_parameters())
        self.weight_count = sum(params[n].numel() for n in self.masked)
        self.free_params = sum(
            p.numel() for n, p in params.items() if n not in self.masked
        )  # BN affine, classifier bias
        low = min(float(b) for b in setup.population.budgets)
        self.sizes = tuple(sorted(set(self.opts["sizes"] or default_sizes(model_size(low, self.full_macs)))))
        if int(self.sizes[0] * self.full_macs) > low:  # fail now, not when the final test serves that client
            raise MethodError(
                f"--method-option sizes: the smallest size {self.sizes[0]:g} ({self.sizes[0] * self.full_macs / 1e6:.2f}M MACs) is above the smallest "
                f"client budget ({low / 1e6:.2f}M MACs); add a size <= {low / self.full_macs:.4g}"
            )

    def build_model(self) -> nn.Module:
        return Supernet(self.preset, seed=self.config.seed)

    # ------------------------------------------------------------------ rounds
    def plans(self, t: int, cohort: Sequence[str], budget: Callable[[str], float]) -> dict[str, float]:
        """Each member's model size ``clip(b / full MACs, 1/256, 1)``."""
        return {cid: model_size(budget(cid), self.full_macs) for cid in cohort}

    def payload_params(self, plan: float) -> int:
        """Kept weights at size ``plan`` plus every BN and bias parameter (what a sparse transfer carries)."""
        return kept_count(self.weight_count, plan) + self.free_params

    def sample_train_macs(self, plan: float) -> int:
        """The dense model's MACs: a masked weight is still multiplied (as the reported compute counts it)."""
        return self.full_macs

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
        """Plain SGD on ``θ·m`` (biased gradient), from the global θ; returns Δ, the mask and the BN buffers."""
        recipe = self.config.train_config()
        device = torch.device(self.config.device)
        model = Supernet(self.preset, seed=None)
        model.load_state_dict(global_state)  # a copy: global_state is left as it is
        model.to(device).train()
        sent = {name: p.detach().clone() for name, p in model.named_parameters()}
        weights = {name: p for name, p in model.named_parameters() if name in self.masked}
        tau = threshold(weights.values(), plan)
        mask = masks(weights, tau)
        apply_mask = GRADIENTS[self.opts["gradient"]]
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0, weight_decay=0.0)
        shuffle_gen, augment_gen = (
            torch.Generator().manual_seed(s) for s in seeds(seed, 2)
        )  # FEAST's first two streams
        bn_needs_two = model.layout.stages[-1].resolution == 1
        objective, batch_sizes = 0.0, []
        for batch in training_batches(
            images.cpu(),
            labels.cpu(),
            self.preset,
            model.classes,
            recipe,
            shuffle_gen,
            augment_gen,
            device,
            bn_needs_two,
        ):
            optimizer.zero_grad(set_to_none=True)
            masked_weights = {name: apply_mask(w, tau) for name, w in weights.items()}
            loss = supervised_loss(functional_call(model, masked_weights, (batch.images, self.arch)), batch.targets)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_norm)
            optimizer.step()
            objective += float(loss.detach()) * len(batch)
            batch_sizes.append(len(batch))
        state: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            delta = sent[name] - p.detach()
            if name in mask:
                delta = delta * mask[name]
                state[MASK + name] = mask[name].cpu()
            state[DELTA + name] = delta.cpu()
        state.update({name: b.detach().cpu().clone() for name, b in model.named_buffers()})
        seen = sum(batch_sizes)
        return ClientUpdate(
            client,
            state,
            samples=len(labels),
            loss=objective / seen if seen else float("nan"),
            samples_seen=seen,
            train_macs=3 * seen * self.full_macs,
        )

    def aggregate(
        self,
        t: int,
        global_state: Mapping[str, torch.Tensor],
        updates: Sequence[ClientUpdate],
        plans: Mapping[str, Any],
    ) -> None:
        """``θ ← θ − η_g·avg Δ`` over the masks (sample-weighted), BN buffers averaged, in place."""
        if updates:
            apply_sparse_deltas(global_state, [(u.state, u.samples) for u in updates], self.opts["server_lr"])

    def routed(
        self, global_state: Mapping[str, torch.Tensor], updates: Sequence[ClientUpdate], names: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """Per parameter: the union of the cohort's masks (a parameter sent unmasked: every position)."""
        out = {}
        for name in names:
            sent = [u.state for u in updates if DELTA + name in u.state]
            if sent:
                out[name] = torch.zeros(global_state[name].shape, dtype=torch.bool)
                for state in sent:
                    covered = state.get(MASK + name)
                    out[name] |= True if covered is None else covered.to(out[name].device).bool()
        return out

    # ------------------------------------------------------------------ evaluation
    def points(self) -> list[OperatingPoint]:
        """One point per size: nominal ``s·full MACs``, dense MACs the full model's, params kept weights + BN/bias."""
        return [
            OperatingPoint(
                f"size {s:g}",
                int(s * self.full_macs),
                self.payload_params(s),
                {"size": s, "kept_weights": kept_count(self.weight_count, s)},
                dense_macs=self.full_macs,
            )
            for s in self.sizes
        ]

    @torch.no_grad()
    def masked_model(self, size: float) -> Supernet:
        """A copy of the global model with the global top-k mask of ``size`` applied to its weights."""
        state = self.model.state_dict()
        keep = masks(
            {name: state[name] for name in self.masked}, threshold([state[name] for name in self.masked], size)
        )
        model = Supernet(self.preset, seed=None)
        model.load_state_dict({name: t * keep[name] if name in keep else t for name, t in state.items()})
        return model

    def point_network(
        self, point: OperatingPoint, calibration_images: torch.Tensor, device: str | torch.device = "cpu"
    ) -> nn.Module:
        """The dense model with the top-k mask of the point's size applied, BN recalibrated (method §8)."""
        return calibrated_variant(
            self.masked_model(float(point.detail["size"])), self.arch, calibration_images, device=device
        )
