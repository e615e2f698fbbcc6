"""Server optimizers over sparse aggregation: FedAvg with a server step, FedAvgM, FedAdam, FedYogi (issue 23).

method §6 replaces every routed global position by the cohort's sample-weighted
mean ``θ̄[u]`` and leaves the others alone. Adaptive federated optimization
(Reddi et al., ICLR 2021) reads that mean as a pseudo-gradient
``Δ[u] = θ̄[u] − θ[u]`` and lets a server optimizer take the step. Here it is
applied *per position*, and only where some cohort member was routed ``u``
this round; an unrouted position keeps its value **and** its optimizer state
(momentum does not decay, a step count does not advance)::

    avg       θ ← θ + η·Δ                                              (η = 1: method §6 itself)
    momentum  b ← μ·b + Δ;  θ ← θ + η·b                                (FedAvgM, Hsu et al. 2019)
    adam      k ← k+1;  m ← β₁m + (1−β₁)Δ;  v ← β₂v + (1−β₂)Δ²
              θ ← θ + η·m̂ / (√v̂ + τ),  m̂ = m/(1−β₁ᵏ),  v̂ = v/(1−β₂ᵏ)    (FedAdam)
    yogi      as adam, with  v ← v − (1−β₂)Δ²·sign(v − Δ²)             (FedYogi)

``k`` is a per-position step count: positions of a small envelope are routed
more often than those only large clients reach, so one global round counter
would bias-correct them wrongly. With bias correction the first step of a
position is ``η·Δ/(|Δ|+τ)``, Adam's usual ``≈ η·sign(Δ)``.

The optimizer acts on the model's *parameters*. Buffers (BatchNorm running
statistics, counters) keep the aggregate itself: an Adam step on a running
variance could make it negative, and method §8 recalibrates them anyway.

``Δ`` is whatever the aggregation rule produced minus the current value, so a
robust rule (``clip``, ``trimmed-mean``, ``median``; ``feast_edge.aggregate.robust``)
composes: the rule decides the round's target, the optimizer how far to move
towards it and what to remember. ``avg`` with ``η = 1`` is never applied at
all, so it is today's aggregation bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from feast_edge.util.slicing import leading_index

StateDict = Mapping[str, torch.Tensor]
SERVER_OPTS = ("avg", "momentum", "adam", "yogi")
# Each rule's default server learning rate: 1 keeps FedAvg's and FedAvgM's scale; the adaptive rules take steps of
# about η per position, so η is a weight change (Reddi et al. tune it in 10^-2.5..10^-0.5).
DEFAULT_LR = {"avg": 1.0, "momentum": 1.0, "adam": 0.01, "yogi": 0.01}
# feast-server run's and the demo's --server-opt (the paper protocol, feast-edge simulate, stays avg): measured with
# bench/bench_convergence.py, docs/benchmarks.md "Server optimizers".
DEPLOYMENT_OPT = "avg"
STATE_NAMES = {"avg": (), "momentum": ("momentum",), "adam": ("m", "v", "steps"), "yogi": ("m", "v", "steps")}


@dataclass(frozen=True)
class ServerOpt:
    """A server optimizer and its settings (see the module docstring); ``lr=None`` takes the rule's default."""

    name: str = "avg"
    lr: float | None = None
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.99)
    tau: float = 1e-3

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        problem = opt_problem(self)
        if problem:
            raise ValueError(problem)
        if self.lr is None:
            object.__setattr__(self, "lr", DEFAULT_LR[self.name])

    @property
    def identity(self) -> bool:
        """Whether it leaves the aggregate as it is (``avg`` at η = 1: method §6 exactly)."""
        return self.name == "avg" and self.lr == 1.0

    def describe(self) -> str:
        """``"adam (lr 0.01, betas 0.9,0.99, tau 0.001)"``; plain averaging says it is method §6's."""
        if self.identity:
            return "avg (method §6's sparse mean)"
        details = {"avg": f"lr {self.lr:g}", "momentum": f"lr {self.lr:g}, momentum {self.momentum:g}"}
        adaptive = f"lr {self.lr:g}, betas {self.betas[0]:g},{self.betas[1]:g}, tau {self.tau:g}"
        return f"{self.name} ({details.get(self.name, adaptive)})"

    def settings(self) -> dict[str, Any]:
        """What a run's fingerprint records: nothing for the identity (earlier runs keep their fingerprints), else the
        rule and the settings it reads."""
        if self.identity:
            return {}
        used = {
            "avg": ("lr",),
            "momentum": ("lr", "momentum"),
            "adam": ("lr", "betas", "tau"),
            "yogi": ("lr", "betas", "tau"),
        }
        values = asdict(self)
        return {"server_optimizer": {"name": self.name, **{k: values[k] for k in used[self.name]}}}


def opt_problem(opt: ServerOpt) -> str | None:
    """Why ``opt`` is not a valid server optimizer (a one-line message naming the option), or None."""
    if opt.name not in SERVER_OPTS:
        return f"--server-opt {opt.name!r} is unknown; choose one of {', '.join(SERVER_OPTS)}"
    if opt.lr is not None and not (_real(opt.lr) and opt.lr > 0):
        return f"--server-lr {opt.lr!r} must be a positive finite number (defaults: {_defaults()})"
    if not (_real(opt.momentum) and 0 <= opt.momentum < 1):
        return f"--server-momentum {opt.momentum!r} must be in [0, 1) (FedAvgM: 0.9)"
    if len(opt.betas) != 2 or not all(_real(b) and 0 <= b < 1 for b in opt.betas):
        return f"--server-betas {','.join(map(str, opt.betas))} must be two numbers in [0, 1), e.g. 0.9,0.99"
    if not (_real(opt.tau) and opt.tau > 0):
        return f"--server-tau {opt.tau!r} must be a positive finite number (adaptivity; Reddi et al.: 1e-3)"
    return None


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _defaults() -> str:
    return ", ".join(f"{name} {lr:g}" for name, lr in DEFAULT_LR.items())


def parse_betas(text: str) -> tuple[float, ...]:
    """``"0.9,0.99"`` -> ``(0.9, 0.99)``; ValueError naming --server-betas otherwise."""
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--server-betas {text!r} must be two numbers in [0, 1), e.g. 0.9,0.99") from None


def routed_masks(global_state: StateDict, states: Iterable[StateDict], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Per tensor of ``names``: the positions some payload's leading slice covers (the union of their boxes, method §5)."""
    states = list(states)
    masks = {}
    for name in names:
        boxes = {tuple(s[name].shape) for s in states if name in s and s[name].numel() > 0}
        if not boxes:
            continue
        mask = torch.zeros(global_state[name].shape, dtype=torch.bool, device=global_state[name].device)
        for box in boxes:
            mask[leading_index(box)] = True
        masks[name] = mask
    return masks


class ServerOptimizer:
    """One run's server optimizer: its rule and its per-position state over the named parameters."""

    def __init__(self, opt: ServerOpt, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.opt = opt
        self.shapes = dict(shapes)
        self.state: dict[str, torch.Tensor] = {}
        for name, shape in self.shapes.items():
            for key in STATE_NAMES[opt.name]:
                dtype = torch.int32 if key == "steps" else torch.float32
                self.state[f"{key}/{name}"] = torch.zeros(shape, dtype=dtype)

    def snapshot(self, global_state: StateDict) -> dict[str, torch.Tensor]:
        """Copies of the parameters before aggregation writes into them."""
        return {name: global_state[name].detach().clone() for name in self.shapes}

    @torch.no_grad()
    def step(self, global_state: StateDict, before: StateDict, routed: Mapping[str, torch.Tensor]) -> None:
        """Replace the aggregate in ``global_state`` (in place) by the optimizer's step from ``before`` at routed positions."""
        o = self.opt
        for name in self.shapes:
            mask = routed.get(name)
            if mask is None:
                continue
            target, old = global_state[name], before[name]
            self._follow(name, target.device)
            delta = target.detach() - old
            if o.name == "avg":
                new = old + o.lr * delta
            elif o.name == "momentum":
                buf = self._update("momentum", name, mask, self.state[f"momentum/{name}"] * o.momentum + delta)
                new = old + o.lr * buf
            else:
                new = old + o.lr * self._adaptive(name, mask, delta)
            target.copy_(torch.where(mask, new, old))

    def _follow(self, name: str, device: torch.device) -> None:
        """Keep ``name``'s state on the device its parameter is aggregated on."""
        for key in STATE_NAMES[self.opt.name]:
            slot = f"{key}/{name}"
            if self.state[slot].device != device:
                self.state[slot] = self.state[slot].to(device)

    def _adaptive(self, name: str, mask: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Adam's or Yogi's bias-corrected direction ``m̂ / (√v̂ + τ)`` (its state updated at ``mask`` only)."""
        b1, b2 = self.opt.betas
        steps = self._update("steps", name, mask, self.state[f"steps/{name}"] + 1)
        m = self._update("m", name, mask, torch.lerp(delta, self.state[f"m/{name}"], b1))
        square = delta * delta
        v = self.state[f"v/{name}"]
        if self.opt.name == "adam":
            v = self._update("v", name, mask, torch.lerp(square, v, b2))
        else:
            v = self._update("v", name, mask, v - (1 - b2) * square * torch.sign(v - square))
        k = steps.clamp_min(1).to(torch.float64)  # unrouted-so-far positions are masked out below
        m_hat = m / (1 - torch.pow(b1, k)).to(m.dtype)
        v_hat = v / (1 - torch.pow(b2, k)).to(v.dtype)
        return m_hat / (v_hat.clamp_min(0).sqrt() + self.opt.tau)

    def _update(self, key: str, name: str, mask: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Store ``value`` as state ``key`` of ``name`` at the routed positions; the others keep theirs."""
        slot = self.state[f"{key}/{name}"]
        slot.copy_(torch.where(mask, value.to(slot.dtype), slot))
        return slot

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore the state a checkpoint stored (:attr:`state`'s names and shapes, checked)."""
        missing = sorted(set(self.state) - set(tensors))
        unexpected = sorted(set(tensors) - set(self.state))
        if missing or unexpected:
            raise ValueError(
                f"the checkpoint's server-optimizer state does not match --server-opt {self.opt.name} "
                f"({len(missing)} tensors missing, {len(unexpected)} unexpected)"
            )
        for key, tensor in tensors.items():
            if tuple(tensor.shape) != tuple(self.state[key].shape) or tensor.dtype != self.state[key].dtype:
                raise ValueError(f"server-optimizer state {key} has shape {tuple(tensor.shape)} {tensor.dtype}")
            self.state[key].copy_(tensor)
