"""Local multi-variant co-training: one client, one round (method §7).

Per mini-batch the client trains its largest affordable variant ``a_max`` on
the supervised loss and uses its detached softmax as the teacher of the
globally smallest cached variant ``a_min`` and of one random intermediate
variant ``a_rand``; each variant's loss is back-propagated on its own (so only
one graph is alive at a time) and the gradients accumulate into a single SGD
step. The paper's ablations are switches of :class:`TrainConfig`.

The model is trained in place; only the leading slices of the variants that
were trained change (weights, and BN running statistics; weight decay is
restricted to those slices as well). Only the scalar BN ``num_batches_tracked``
counters move as a whole.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from feast_edge.local.augment import MixedBatch
from feast_edge.local.batches import seeds, training_batches
from feast_edge.local.precision import PLAIN, PLAIN_STEP, GradientStep, Precision, resolve_amp
from feast_edge.local.recipe import TrainConfig, TrainError
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost
from feast_edge.space.static import StaticResNet
from feast_edge.space.supernet import Supernet
from feast_edge.util.slicing import leading_index


@dataclass(frozen=True)
class VariantPlan:
    """The client's ``a_min``, ``a_max`` and intermediate set ``A_int`` with their MACs (method §7)."""

    a_min: Arch
    a_max: Arch
    intermediate: tuple[Arch, ...]
    macs: dict[Arch, int] = field(compare=False)


@dataclass(frozen=True)
class LocalResult:
    """What one client-round of local training reports back (method §6, §7)."""

    num_samples: int  # local data-set size n_i, the aggregation weight
    samples_seen: int  # samples trained on over all epochs
    num_batches: int
    mean_loss: float  # sample-weighted mean of the per-batch objective (sum of the back-propagated losses)
    role_losses: dict[str, float]  # sample-weighted mean L_sup per role: "max", "min", "rand"
    variants_per_batch: dict[int, int]  # {variants trained in a batch (1/2/3): number of batches}
    arch_batches: dict[Arch, int]  # batches each variant was trained on
    train_macs: int  # 3 · Σ_batches n_batch · Σ_{a∈V} MAC(a)
    lr: float


def stayed_finite(state: Mapping[str, torch.Tensor], loss: float) -> bool:
    """True when local training stayed finite: its loss and every floating-point tensor it returns (else it diverged)."""
    return math.isfinite(loss) and all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())


def plan_variants(model: Supernet, affordable: Sequence[Arch], global_min: Arch) -> VariantPlan:
    """``a_max`` = largest affordable by MACs, ``A_int`` = affordable strictly between ``a_min`` and ``a_max`` (method §7)."""
    if not affordable:
        raise TrainError(
            "the client's affordable set is empty; every client can afford at least the globally smallest cached variant"
        )
    macs = {a: arch_cost(model.preset, a, model.classes)[0] for a in (global_min, *affordable)}
    for a in macs:
        model.active_layout(a)  # raises ArchError if the variant was not routed to this client
    ordered = sorted(dict.fromkeys(affordable), key=lambda a: macs[a])
    a_max = ordered[-1]
    low, high = macs[global_min], macs[a_max]
    if low > high:
        raise TrainError(
            f"global_min ({low / 1e6:.2f}M MACs) is larger than the client's largest affordable variant ({high / 1e6:.2f}M MACs); "
            "pass the globally smallest cached variant as global_min"
        )
    intermediate = tuple(a for a in ordered if low < macs[a] < high)
    return VariantPlan(global_min, a_max, intermediate, macs)


def batch_variants(plan: VariantPlan, mode: str, generator: torch.Generator) -> list[tuple[str, Arch]]:
    """``(role, arch)`` pairs trained on one batch, teacher first; draws ``a_rand ~ U(A_int)`` in ``full`` mode."""
    if mode == "min" or plan.a_max == plan.a_min:
        return [("min", plan.a_min)]
    if mode == "max":
        return [("max", plan.a_max)]
    chosen = [("max", plan.a_max), ("min", plan.a_min)]
    if mode == "full" and plan.intermediate:
        pick = int(torch.randint(len(plan.intermediate), (1,), generator=generator))
        chosen.append(("rand", plan.intermediate[pick]))
    return chosen


def supervised_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``L_sup``: CE with the mixed soft target, i.e. ``λ·CE(z, y_a) + (1−λ)·CE(z, y_b)`` (method §7)."""
    return F.cross_entropy(logits, targets)


def kd_loss(logits: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``KD(z, p̂) = −Σ_c p̂_c log softmax(z/T)_c`` scaled by ``T²`` (the identity at the paper's T = 1)."""
    return F.cross_entropy(logits / temperature, teacher) * temperature**2


def compute_proxy(batch_sizes: Sequence[int], variant_sets: Sequence[Sequence[Arch]], macs: dict[Arch, int]) -> int:
    """Training-compute proxy ``3 · Σ_batches n_batch · Σ_{a∈V} MAC(a)`` (method §7)."""
    return 3 * sum(n * sum(macs[a] for a in archs) for n, archs in zip(batch_sizes, variant_sets))


def slice_shapes(model: Supernet, arch: Arch) -> dict[str, tuple[int, ...]]:
    """Shape of the leading slice ``arch`` activates in each parameter it uses (shared state-dict names)."""
    with torch.device("meta"):
        static = StaticResNet(model.active_layout(arch))
    return {name: tuple(p.shape) for name, p in static.named_parameters()}


def _decay_mask(
    shape: tuple[int, ...], shapes: list[tuple[int, ...]], device: torch.device
) -> tuple[slice, ...] | torch.Tensor:
    """The union of leading slices: one slice if a shape covers the others, else a boolean mask."""
    cover = tuple(max(s[i] for s in shapes) for i in range(len(shape)))
    if cover in shapes:
        return leading_index(cover)
    mask = torch.zeros(shape, dtype=torch.bool, device=device)
    for s in shapes:
        mask[leading_index(s)] = True
    return mask


@torch.no_grad()
def add_masked_weight_decay(
    params: dict[str, nn.Parameter], shapes: list[dict[str, tuple[int, ...]]], weight_decay: float
) -> None:
    """Add ``wd·θ`` to the gradient on the union of the trained slices only.

    Plain SGD weight decay would also shrink the parts of a tensor that no
    trained variant activated; restricting it keeps every un-trained position
    bit-identical (with zero gradient and zero decay its momentum stays zero).
    """
    if weight_decay == 0:
        return
    for name, p in params.items():
        used = [s[name] for s in shapes if name in s]
        if p.grad is None or not used:
            continue
        region = _decay_mask(tuple(p.shape), used, p.device)
        if isinstance(region, torch.Tensor):
            p.grad.add_(p * region, alpha=weight_decay)
        else:
            p.grad[region].add_(p[region], alpha=weight_decay)


def _forward_backward(
    model: Supernet,
    batch: MixedBatch,
    variants: list[tuple[str, Arch]],
    config: TrainConfig,
    precision: Precision,
    grad: GradientStep,
    logit_scale: torch.Tensor | None = None,
) -> tuple[float, dict[str, float]]:
    """Forward/backward every variant of one batch, teacher first; returns the objective and each role's L_sup.

    ``logit_scale`` (``[classes]``, or None): the restricted softmax's factor per class (:func:`absent_class_scale`).
    """
    x, targets = batch.images, batch.targets
    total, role_sup = 0.0, {}
    teacher = None
    for role, arch in variants:
        with precision.autocast():  # forward and losses in the AMP dtype (autocast keeps the losses float32)
            logits = model(x, arch)
            if logit_scale is not None:
                logits = logits * logit_scale
            sup = supervised_loss(logits, targets)
            if role == "max" or len(variants) == 1 or not config.uses_kd:
                loss = sup
            else:
                rho = config.kd_weight
                loss = (1 - rho) * sup + rho * kd_loss(logits, teacher, config.temperature)
        grad.backward(loss)  # one graph alive at a time; gradients accumulate across variants
        if role == "max":
            teacher = F.softmax(logits.detach().float() / config.temperature, dim=1)
        total += float(loss.detach())
        role_sup[role] = float(sup.detach())
    return total, role_sup


class ShapeCache(dict):
    """``arch -> slice_shapes(model, arch)``, filled on first use."""

    def __init__(self, model: Supernet) -> None:
        super().__init__()
        self.model = model

    def __missing__(self, arch: Arch) -> dict[str, tuple[int, ...]]:
        self[arch] = shapes = slice_shapes(self.model, arch)
        return shapes


def cotrain_step(
    model: Supernet,
    optimizer: torch.optim.Optimizer,
    batch: MixedBatch,
    variants: list[tuple[str, Arch]],
    config: TrainConfig,
    shapes: ShapeCache,
    precision: Precision = PLAIN,
    grad: GradientStep = PLAIN_STEP,
    logit_scale: torch.Tensor | None = None,
) -> tuple[float, dict[str, float]]:
    """One method §7 step: zero grads, every variant's loss backward, clip to ``clip_norm``, masked decay, SGD step.

    ``optimizer`` must be built without weight decay; the decay is added here on the trained slices only.
    ``precision``/``grad`` (feast_edge.local.precision) run the passes under autocast and the step through a gradient
    scaler; the defaults are plain float32. Returns the batch objective and each role's L_sup.
    """
    optimizer.zero_grad(set_to_none=True)
    loss, role_sup = _forward_backward(model, batch, variants, config, precision, grad, logit_scale)
    params = dict(model.named_parameters())
    grad.step(
        optimizer,
        params.values(),
        config.clip_norm,
        lambda: add_masked_weight_decay(params, [shapes[a] for _, a in variants], config.weight_decay),
    )
    return loss, role_sup


def absent_class_scale(labels: torch.Tensor, classes: int, scale: float) -> torch.Tensor | None:
    """The restricted softmax's factor per class (FedRS): 1 for the classes in ``labels``, ``scale`` for the others;
    None where it changes nothing (``scale`` 1, or every class present)."""
    present = torch.bincount(labels.long(), minlength=classes)[:classes] > 0
    if scale == 1.0 or bool(present.all()):
        return None
    return torch.where(present, torch.tensor(1.0), torch.tensor(float(scale)))


def make_optimizer(model: nn.Module, config: TrainConfig, lr: float) -> torch.optim.SGD:
    """Fresh local SGD with momentum (method §7); weight decay is left to :func:`add_masked_weight_decay`."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=config.momentum, weight_decay=0.0)


def _check_data(model: Supernet, images: torch.Tensor, labels: torch.Tensor) -> None:
    lay = model.layout
    want = (lay.in_channels, lay.input_size, lay.input_size)
    if images.dtype != torch.uint8 or images.dim() != 4 or tuple(images.shape[1:]) != want:
        raise TrainError(
            f"local images must be uint8 [N, {want[0]}, {want[1]}, {want[2]}] for preset {model.preset.name}, got {images.dtype} {tuple(images.shape)}"
        )
    if labels.shape != (images.shape[0],) or labels.dtype != torch.int64:
        raise TrainError(f"labels must be int64 [{images.shape[0]}], got {labels.dtype} {tuple(labels.shape)}")
    if images.shape[0] == 0:
        raise TrainError("the client has no local samples; give it at least one")
    if int(labels.min()) < 0 or int(labels.max()) >= model.classes:
        raise TrainError(f"labels must lie in 0..{model.classes - 1} (the model has {model.classes} classes)")


@dataclass
class _RoundLog:
    """Per-batch bookkeeping of one client-round, folded into a LocalResult at the end."""

    sizes: list[int] = field(default_factory=list)
    variant_sets: list[list[Arch]] = field(default_factory=list)
    objective: float = 0.0
    role_sums: Counter[str] = field(default_factory=Counter)
    role_counts: Counter[str] = field(default_factory=Counter)

    def add(self, n: int, variants: list[tuple[str, Arch]], loss: float, role_sup: dict[str, float]) -> None:
        self.sizes.append(n)
        self.variant_sets.append([a for _, a in variants])
        self.objective += loss * n
        for role, value in role_sup.items():
            self.role_sums[role] += value * n
            self.role_counts[role] += n

    def result(self, num_samples: int, macs: dict[Arch, int], lr: float) -> LocalResult:
        seen = sum(self.sizes)
        return LocalResult(
            num_samples=num_samples,
            samples_seen=seen,
            num_batches=len(self.sizes),
            mean_loss=self.objective / seen if seen else float("nan"),
            role_losses={role: self.role_sums[role] / self.role_counts[role] for role in self.role_counts},
            variants_per_batch=dict(Counter(len(archs) for archs in self.variant_sets)),
            arch_batches=dict(Counter(a for archs in self.variant_sets for a in archs)),
            train_macs=compute_proxy(self.sizes, self.variant_sets, macs),
            lr=lr,
        )


def local_train(
    model: Supernet,
    images_uint8: torch.Tensor,
    labels: torch.Tensor,
    affordable: Sequence[Arch],
    global_min: Arch,
    config: TrainConfig = TrainConfig(),
    lr: float | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    amp: str = "off",
    between_steps: Callable[[], None] | None = None,
) -> LocalResult:
    """One client-round of multi-variant co-training, in place on ``model`` (method §7).

    Args:
        model: the client's (routed) supernet; moved to ``device`` and trained in place.
        images_uint8: local images, uint8 ``[N, C, H, W]`` (augmented where the model trains).
        labels: int64 ``[N]``.
        affordable: the client's affordable cached variants (any order; sorted by MACs here).
        global_min: the globally smallest cached variant ``a_min``.
        config: hyper-parameters and the ablation switch.
        lr: this round's learning rate (see :func:`cosine_lr`); ``config.lr`` if None.
        seed: seeds shuffling, augmentation and the ``a_rand`` draws; same seed, same result.
        device: where the forward/backward passes run (``"cpu"``, ``"cuda"``, ...).
        amp: mixed precision of the passes (feast_edge.local.precision.AMP_MODES; ``off``: float32).
        between_steps: called after every step (an agent re-chooses its threads there; it changes no value).
    """
    lr = config.lr if lr is None else lr
    images_uint8, labels = images_uint8.cpu(), labels.cpu()
    _check_data(model, images_uint8, labels)
    plan = plan_variants(model, affordable, global_min)
    device = torch.device(device)
    precision = resolve_amp(amp, device)
    model.to(device)
    shuffle_gen, augment_gen, variant_gen = (torch.Generator().manual_seed(s) for s in seeds(seed, 3))
    optimizer = make_optimizer(model, config, lr)  # fresh optimizer state every round (method §7)
    grad = precision.scaler()
    shapes = ShapeCache(model)
    bn_needs_two = model.layout.stages[-1].resolution == 1
    logit_scale = absent_class_scale(labels, model.classes, config.absent_logit_scale)
    logit_scale = None if logit_scale is None else logit_scale.to(device)
    log = _RoundLog()
    was_training = model.training
    model.train()
    try:
        for batch in training_batches(
            images_uint8, labels, model.preset, model.classes, config, shuffle_gen, augment_gen, device, bn_needs_two
        ):
            variants = batch_variants(plan, config.variants, variant_gen)
            loss, role_sup = cotrain_step(
                model, optimizer, batch, variants, config, shapes, precision, grad, logit_scale
            )
            log.add(len(batch), variants, loss, role_sup)
            if between_steps is not None:
                between_steps()
    finally:
        model.train(was_training)
    return log.result(len(labels), plan.macs, lr)
