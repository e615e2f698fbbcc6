"""SuperFedNAS (SFN) and DeepFedNAS (DFN) transferred to FEAST's space: one subnet per client, MaxNet aggregation (method §9).

Both train the FEAST supernet, but every cohort client trains ONE subnet per
round (the paper's "standard" single-subnet loop, as the reference
``bostankhan6/FEAST`` runs them with ``train.py --subnet_dist_type
TS_all_random_constrained`` / ``TS_optimal_path`` and ``--weighted_avg_schedule
maxnet_cos_all_subnet``). Per round, tracking sandwich assignment:

    largest   the ``top_k`` (= 1) cohort clients with the fewest past "largest" assignments: their local max
              (the largest cached variant with MACs <= budget)
    smallest  of the rest, the ``bottom_k`` (= 1) with the fewest past "smallest" assignments: the global min
              (the smallest cached variant, affordable to all)
    random    everyone else: SFN draws uniformly over the whole space (d, e, w genes independent and
              uniform) and keeps the first draw with MACs <= budget; DFN draws uniformly over the client's
              affordable cached variants (DeepFedNAS' Pareto-path sampler; FEAST's cache is that path)

A random draw that equals the client's local max (or else the global min) also
counts as a "largest" ("smallest") assignment, as in the reference. The client
receives the leading slices of its subnet, trains it alone (soft-target CE on
the recipe's augmented batches, SGD with momentum, weight decay, clipping) and
returns them. MaxNet aggregation, per position ``u`` over the clients whose
subnet covers it (``M``: this round's "largest" clients, ``O``: the others)::

    a(t)  = a0 · [(1 − ρ) · ½(1 + cos(π·t/T)) + ρ]       a0 = 0.9, ρ = 0.125/0.9 (a: 0.9 → 0.125), T = rounds
    w_k   = a · n_k / Σ_{j∈M} n_j   (k ∈ M)        w_k = (1 − a) · n_k / Σ_{j∈O} n_j   (k ∈ O)
    θ[u]  = Σ_{k covers u} w_k θ_k[u] / Σ_{k covers u} w_k      (uncovered positions keep their value)

so a position only non-max clients cover is their sample-weighted mean. The
served points are FEAST's cached variants, each BN-recalibrated (method §8).

Choices (the reference transfer is the guide; where this differs, why):

* One "largest" and one "smallest" client per round: the reference's
  ``top_k_maxnet = bottom_k_maxnet = 1`` defaults (options ``top_k``,
  ``bottom_k``); "largest" is picked first, ties go to the lower client id
  (the reference takes the first client of a set of integer ids).
* The max-net client is the client *assigned* the "largest" role, as the
  reference weights ``largest_subnet_min_idx``; a random draw that happens to
  be a local max is tallied but gets no MaxNet weight.
* Local max and global min are cached variants for both methods (the reference
  SFN takes the best of 20 random draws under the budget and the space's
  smallest architecture, below the cache): the cache is the set both methods
  are evaluated on, so its ends are the sandwich's ends.
* SFN rejection sampling makes at most ``attempts`` (= 50, the reference's
  ``max_attempts``) draws; if none fits, the client trains its largest
  affordable cached variant (the reference falls back to the space's minimum).
  On fmnist-small only 2 % of the space fits 5M MACs and 0.15 % fits 3M, so
  the lowest-budget clients mostly train their local max.
* Weights: the reference multiplies a role weight by ``n_k / Σ_cohort n``
  (``a·n_max/N`` vs ``(1 − a)/(m − 1)·n_k/N``); here ``a`` and ``1 − a`` are
  split by sample count within each group, which equals the reference when the
  max-net client holds the others' mean sample count and keeps the "max-net
  gets share a" meaning otherwise.
* Horizon: the cosine runs over ``anneal·rounds`` rounds and then holds at
  ``a0·ρ``; ``anneal = 1`` by default (the reference scripts use 3200 of 4000
  rounds, i.e. ``anneal = 0.8``).
* Evaluation recalibrates BN on the server's calibration split, as FEAST's
  points are (the reference resets BN on a 10 % sample of the training data).
* Integer buffers (``num_batches_tracked``) take the maximum of the clients
  that sent them, as method §6 does (the reference skips them).
* Assignment counters are not stored: ``plans(t)`` replays rounds ``0..t−1``
  (their cohorts and draws are pure functions of ``(seed, round, client)``),
  memoised so an uninterrupted run stays O(T) and a resumed one draws the same.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import nn

from feast_edge.aggregate.sparse import check_payload
from feast_edge.cache.variants import CacheEntry
from feast_edge.evaluate.evaluation import calibrated_variant
from feast_edge.evaluate.points import OperatingPoint
from feast_edge.local.cotrain import seeds, supervised_loss, training_batches
from feast_edge.route.envelope import route_state
from feast_edge.run.cohort import sample_round_cohort
from feast_edge.run.collect import ClientUpdate
from feast_edge.sim.methods.base import Method, MethodOption
from feast_edge.sim.registry import MethodError
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost, count_params
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import Preset
from feast_edge.space.supernet import Supernet
from feast_edge.util.slicing import leading_index

if TYPE_CHECKING:  # the harness builds the methods; they only need its types
    from feast_edge.sim.setup import Setup, SimulationConfig

LARGEST, SMALLEST, RANDOM = "largest", "smallest", "random"
_DRAW = 41  # stream tag of the random-role draws (feast_edge.run.cohort uses 1 and 2)
StateDict = Mapping[str, torch.Tensor]


# ----------------------------------------------------------------------------- pure pieces
def maxnet_share(t: int, horizon: int, a0: float = 0.9, rho: float = 0.125 / 0.9) -> float:
    """MaxNet weight ``a(t) = a0·[(1 − ρ)·½(1 + cos(π·t/T)) + ρ]``, held at ``a0·ρ`` from ``t = T`` on."""
    t = min(t, horizon)
    return a0 * ((1 - rho) * 0.5 * (1 + math.cos(math.pi * t / horizon)) + rho)


@dataclass
class Tally:
    """How often each client was assigned a "largest" and a "smallest" subnet (the sandwich counters)."""

    largest: Counter[str] = field(default_factory=Counter)
    smallest: Counter[str] = field(default_factory=Counter)

    def add(self, client: str, role: str | None) -> None:
        if role == LARGEST:
            self.largest[client] += 1
        elif role == SMALLEST:
            self.smallest[client] += 1

    def copy(self) -> Tally:
        return Tally(Counter(self.largest), Counter(self.smallest))


def sandwich_roles(cohort: Sequence[str], tally: Tally, top_k: int = 1, bottom_k: int = 1) -> dict[str, str]:
    """Each cohort member's role: the ``top_k`` fewest-"largest" clients, then of the rest the ``bottom_k``
    fewest-"smallest" ones, everyone else random (ties: lower client id first)."""
    order = sorted(cohort)
    largest = sorted(order, key=lambda c: tally.largest[c])[:top_k]  # stable: id order among equal counts
    rest = [c for c in order if c not in largest]
    smallest = sorted(rest, key=lambda c: tally.smallest[c])[:bottom_k]
    return {c: LARGEST if c in largest else SMALLEST if c in smallest else RANDOM for c in order}


def tallied_role(role: str, arch: Arch, local_max: Arch, global_min: Arch) -> str | None:
    """The counter an assignment moves: its role, or for a random draw the end it happens to hit (max first)."""
    if role != RANDOM:
        return role
    return LARGEST if arch == local_max else SMALLEST if arch == global_min else None


def random_space_arch(preset: Preset, rng: np.random.Generator) -> Arch:
    """One architecture uniform over the preset's space: every d, e and w gene independent and uniform."""
    n = preset.num_stages
    ratios = preset.expansion_ratios
    return Arch(
        d=tuple(int(v) for v in rng.integers(0, preset.max_extra_blocks + 1, n)),
        e=tuple(ratios[int(i)] for i in rng.integers(0, len(ratios), n)),
        w=tuple(int(v) for v in rng.integers(0, len(preset.width_multipliers), n + 1)),
    )


def sample_affordable_arch(
    preset: Preset, budget: float, rng: np.random.Generator, attempts: int, classes: int
) -> tuple[Arch, int] | None:
    """SFN's sampler: the first of at most ``attempts`` uniform draws with MACs <= ``budget``, with its MACs; None if none fits."""
    for _ in range(attempts):
        arch = random_space_arch(preset, rng)
        macs = arch_cost(preset, arch, classes)[0]
        if macs <= budget:
            return arch, macs
    return None


def maxnet_weights(samples: Mapping[str, float], maxnet: Collection[str], share: float) -> dict[str, float]:
    """Aggregation weight per client: the max-net clients split ``share``, the others ``1 − share``, each by sample count."""
    top = {c: n for c, n in samples.items() if c in maxnet}
    rest = {c: n for c, n in samples.items() if c not in maxnet}
    weights = {c: share * n / sum(top.values()) for c, n in top.items()}
    weights.update({c: (1 - share) * n / sum(rest.values()) for c, n in rest.items()})
    return weights


@torch.no_grad()
def weighted_slice_mean(global_state: StateDict, payloads: Sequence[tuple[StateDict, float]]) -> None:
    """``θ[u] = Σ_k w_k θ_k[u] / Σ_k w_k`` over the payloads whose leading slice covers ``u``, in place.

    Every payload tensor is a leading slice of the same-named global tensor;
    positions no payload covers keep their value. Float tensors are averaged in
    float64 value/weight accumulators; integer buffers (``num_batches_tracked``)
    take the maximum of the payloads that sent them.
    """
    for state, weight in payloads:
        check_payload(global_state, state)
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"aggregation weight {weight!r} must be positive and finite")
    for name, glob in global_state.items():
        sent = [(state[name], w) for state, w in payloads if name in state]
        if not sent:
            continue
        covered = torch.zeros(glob.shape, dtype=torch.bool)
        if glob.is_floating_point():
            value = torch.zeros(glob.shape, dtype=torch.float64)
            total = torch.zeros(glob.shape, dtype=torch.float64)
            for local, w in sent:
                box = leading_index(local.shape)
                value[box] += w * local.detach().cpu().double()
                total[box] += w
                covered[box] = True
            result = value[covered] / total[covered]
        else:
            result = torch.full(glob.shape, torch.iinfo(glob.dtype).min, dtype=glob.dtype)
            for local, _ in sent:
                box = leading_index(local.shape)
                result[box] = torch.maximum(result[box], local.detach().cpu())
                covered[box] = True
            result = result[covered]
        glob[covered.to(glob.device)] = result.to(glob.device, glob.dtype)


# ----------------------------------------------------------------------------- the methods
@dataclass(frozen=True)
class SubnetPlan:
    """What one client trains this round: the subnet, why (its sandwich role) and its MACs."""

    arch: Arch
    role: str  # "largest", "smallest" or "random"
    macs: int

    def to_dict(self) -> dict[str, Any]:
        return {"arch": self.arch.to_dict(), "role": self.role, "macs": self.macs}


class _FedNAS(Method):
    """What SFN and DFN share: sandwich assignment, single-subnet training, MaxNet aggregation, cached points."""

    supernet = True
    options: ClassVar[Mapping[str, MethodOption]] = {
        "a0": MethodOption(float, 0.9, "MaxNet weight at round 0, in (0, 1)"),
        "rho_final": MethodOption(
            float, 0.125 / 0.9, "final MaxNet weight as a fraction of a0 (0.125/0.9: 0.9 -> 0.125)"
        ),
        "anneal": MethodOption(float, 1.0, "share of the rounds over which the MaxNet weight anneals, in (0, 1]"),
        "top_k": MethodOption(int, 1, "clients per round that train their local max (the max-net clients)"),
        "bottom_k": MethodOption(int, 1, "clients per round that train the global min"),
    }

    @classmethod
    def check_options(cls, values: Mapping[str, Any]) -> None:
        checks = [
            (0 < values["a0"] < 1, f"a0 = {values['a0']} must be in (0, 1)"),
            (0 < values["rho_final"] <= 1, f"rho_final = {values['rho_final']} must be in (0, 1]"),
            (0 < values["anneal"] <= 1, f"anneal = {values['anneal']} must be in (0, 1]"),
            (values["top_k"] >= 1, f"top_k = {values['top_k']} must be at least 1"),
            (values["bottom_k"] >= 0, f"bottom_k = {values['bottom_k']} must be at least 0"),
            (values.get("attempts", 1) >= 1, f"attempts = {values.get('attempts')} must be at least 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise MethodError(f"--method {cls.name}: {message}; fix the --method-option")

    def __init__(self, setup: Setup, config: SimulationConfig) -> None:
        super().__init__(setup, config)
        self.cache = setup.cache
        self.budgets = {cid: float(b) for cid, b in zip(setup.client_ids, setup.population.budgets)}
        self._memo: dict[int, Tally] = {0: Tally()}  # round r -> the counters before round r (see _remember)
        self._points: list[OperatingPoint] | None = None

    def build_model(self) -> nn.Module:
        return Supernet(self.preset, seed=self.config.seed)

    # ------------------------------------------------------------------ plans
    def draw_random(self, budget: float, rng: np.random.Generator, local_max: CacheEntry) -> tuple[Arch, int]:
        """A random-role client's subnet and its MACs (SFN: the space; DFN: the affordable cache)."""
        raise NotImplementedError

    def round_plans(
        self, t: int, cohort: Sequence[str], budget: Callable[[str], float], tally: Tally
    ) -> dict[str, SubnetPlan]:
        """Round ``t``'s plans given the counters before it; ``tally`` is advanced past round ``t``."""
        roles = sandwich_roles(cohort, tally, self.opts["top_k"], self.opts["bottom_k"])
        smallest = self.cache.smallest
        plans = {}
        for cid, role in roles.items():
            local_max = self.cache.largest_affordable(budget(cid))
            if role == LARGEST:
                arch, macs = local_max.arch, local_max.macs
            elif role == SMALLEST:
                arch, macs = smallest.arch, smallest.macs
            else:
                rng = np.random.default_rng([self.config.seed, t, _DRAW, zlib.crc32(cid.encode("utf-8"))])
                arch, macs = self.draw_random(budget(cid), rng, local_max)
            plans[cid] = SubnetPlan(arch, role, int(macs))
            tally.add(cid, tallied_role(role, arch, local_max.arch, smallest.arch))
        return plans

    def tally_before(self, t: int) -> Tally:
        """The sandwich counters before round ``t``, replayed from round 0 (memoised)."""
        r = max(k for k in self._memo if k <= t)
        tally = self._memo[r].copy()
        while r < t:
            self.round_plans(r, self.replayed_cohort(r), self.budgets.__getitem__, tally)
            r += 1
        self._remember(t, tally)
        return tally.copy()

    def _remember(self, r: int, tally: Tally) -> None:
        """Keep the counters before round ``r``, besides round 0's and the latest other one."""
        self._memo[r] = tally.copy()
        keep = {0, *sorted(self._memo)[-2:]}
        self._memo = {k: v for k, v in self._memo.items() if k in keep}

    def replayed_cohort(self, t: int) -> list[str]:
        return sample_round_cohort(self.setup.client_ids, self.config.population.per_round, self.config.seed, t)

    def plans(self, t: int, cohort: Sequence[str], budget: Callable[[str], float]) -> dict[str, SubnetPlan]:
        tally = self.tally_before(t)
        plans = self.round_plans(t, cohort, budget, tally)
        if sorted(cohort) == self.replayed_cohort(t):  # the next round's replay can start from here
            self._remember(t + 1, tally)
        return plans

    def payload_params(self, plan: SubnetPlan) -> int:
        return count_params(arch_layout(self.preset, plan.arch, self.model.classes))

    def sample_train_macs(self, plan: SubnetPlan) -> int:
        return plan.macs

    # ------------------------------------------------------------------ local training
    def train_client(
        self,
        t: int,
        client: str,
        plan: SubnetPlan,
        global_state: StateDict,
        images: torch.Tensor,
        labels: torch.Tensor,
        lr: float,
        seed: int,
    ) -> ClientUpdate:
        """Train the planned subnet alone: soft-target CE, SGD with momentum, weight decay and clipping."""
        recipe = self.config.train_config()
        layout = arch_layout(self.preset, plan.arch, self.model.classes)
        model = Supernet(self.preset, layout=layout, seed=None)
        model.load_state_dict(route_state(global_state, layout, self.preset))  # copies: global_state stays as it was
        device = torch.device(self.config.device)
        model.to(device).train()
        # Every parameter of the physical subnet is active, so plain SGD weight decay touches only the trained slice.
        optimizer = torch.optim.SGD(
            model.parameters(), lr=lr, momentum=recipe.momentum, weight_decay=recipe.weight_decay
        )
        shuffle_gen, augment_gen = (torch.Generator().manual_seed(s) for s in seeds(seed, 2))
        bn_needs_two = layout.stages[-1].resolution == 1
        seen, loss_sum, batches = 0, 0.0, 0
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
            loss = supervised_loss(model(batch.images, plan.arch), batch.targets)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_norm)
            optimizer.step()
            seen += len(batch)
            loss_sum += float(loss.detach()) * len(batch)
            batches += 1
        state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
        return ClientUpdate(
            client,
            state,
            int(labels.shape[0]),
            loss=loss_sum / seen if seen else float("nan"),
            samples_seen=seen,
            train_macs=3 * seen * plan.macs,
            variants_per_batch={"1": batches},
        )

    # ------------------------------------------------------------------ aggregation
    def share(self, t: int) -> float:
        """This round's MaxNet weight ``a(t)``."""
        horizon = max(1, round(self.opts["anneal"] * self.config.training.rounds))
        return maxnet_share(t, horizon, self.opts["a0"], self.opts["rho_final"])

    def aggregate(
        self, t: int, global_state: StateDict, updates: Sequence[ClientUpdate], plans: Mapping[str, SubnetPlan]
    ) -> None:
        if not updates:
            return
        maxnet = {cid for cid, plan in plans.items() if plan.role == LARGEST}
        weights = maxnet_weights({u.client: u.samples for u in updates}, maxnet, self.share(t))
        weighted_slice_mean(global_state, [(u.state, weights[u.client]) for u in updates])

    # ------------------------------------------------------------------ evaluation
    def points(self) -> list[OperatingPoint]:
        if self._points is None:
            self._points = [
                OperatingPoint(f"variant {i}", e.macs, e.params, e.arch.to_dict())
                for i, e in enumerate(self.cache.entries)
            ]
        return list(self._points)

    def point_network(
        self, point: OperatingPoint, calibration_images: torch.Tensor, device: str | torch.device = "cpu"
    ) -> nn.Module:
        """The cached variant extracted as a static network, BN recalibrated (method §8)."""
        return calibrated_variant(self.model, Arch.from_dict(dict(point.detail)), calibration_images, device=device)


class SuperFedNAS(_FedNAS):
    """SuperFedNAS transferred: random-role clients draw uniformly over the whole space under their budget."""

    name = "sfn"
    summary = "SuperFedNAS in FEAST's space: one random affordable subnet per client, MaxNet aggregation"
    options: ClassVar[Mapping[str, MethodOption]] = {
        **_FedNAS.options,
        "attempts": MethodOption(
            int, 50, "uniform draws per client before falling back to its largest affordable cached variant"
        ),
    }

    def draw_random(self, budget: float, rng: np.random.Generator, local_max: CacheEntry) -> tuple[Arch, int]:
        found = sample_affordable_arch(self.preset, budget, rng, self.opts["attempts"], self.cache.classes)
        return found if found is not None else (local_max.arch, local_max.macs)


class DeepFedNAS(_FedNAS):
    """DeepFedNAS transferred: random-role clients draw uniformly over their affordable cached (Pareto-path) variants."""

    name = "dfn"
    summary = "DeepFedNAS in FEAST's space: one affordable cached (Pareto-path) subnet per client, MaxNet aggregation"

    def draw_random(self, budget: float, rng: np.random.Generator, local_max: CacheEntry) -> tuple[Arch, int]:
        affordable = self.cache.affordable(budget)
        entry = affordable[int(rng.integers(len(affordable)))]
        return entry.arch, entry.macs
