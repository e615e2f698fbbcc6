"""What every training method of the simulation harness provides (FEAST, the centralized reference, the baselines).

The harness (``feast_edge.sim.simulate``) owns everything the methods must share so
a comparison is fair: the data, the server-held validation and calibration
splits, the client population (budgets, partition), the cohort of every round
(``feast_edge.run.cohort.sample_round_cohort``), the learning-rate schedule,
the client seeds, checkpoints and resume (``feast_edge.run.loop.RunLoop``) and the
final test. A method decides only what differs between methods:

    model                      the global model it trains (an ``nn.Module``)
    plans(t, cohort, budget)   what each cohort member trains this round (a tier, a subnet, a mask size, ...)
    payload_params(plan)       parameters sent to that client (one direction)
    train_client(...)          the client's local training -> a ClientUpdate (any tensors: state, Δ, masks)
    aggregate(...)             folds the round's valid updates into the global model, in place
    points()                   the operating points it serves, sorted by MACs
    evaluate(...)              each point's accuracy, after that point's own BN recalibration (method §8)

A client is served the largest point whose MACs fit its budget; population
accuracy is the mean over clients of that point's test accuracy (method §8).

Determinism: everything a method draws in round ``t`` must come from
``(config.seed, t)`` and the client id (``client_seed``), never from state
kept between rounds, so a resumed run ends bit-identical to an uninterrupted
one. State a method needs across rounds (e.g. SuperFedNAS's assignment
counters) is recomputed from earlier rounds' plans, which are themselves pure
functions of ``(seed, round)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import nn

from feast_edge.aggregate.server_opt import routed_masks
from feast_edge.evaluate.points import ServedPoints
from feast_edge.route.payload import on_the_wire
from feast_edge.run.cohort import client_seed
from feast_edge.sim.registry import MethodError

if TYPE_CHECKING:  # the harness imports the methods; methods only need its types
    from feast_edge.run.collect import ClientUpdate
    from feast_edge.sim.setup import Setup, SimulationConfig


@dataclass(frozen=True)
class MethodOption:
    """One ``--method-option KEY=VALUE`` a method takes: its parser, default and help (``required``: no default)."""

    parse: Callable[[str], Any]
    default: Any
    help: str
    required: bool = False


def floats(text: str) -> tuple[float, ...]:
    """``"0.25,0.5,1"`` -> ``(0.25, 0.5, 1.0)`` (a method-option parser)."""
    return tuple(float(v) for v in text.split(",") if v.strip())


class Method(ServedPoints):
    """Base class of a harness method; see the module docstring for the contract."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line for --help and reports
    supernet: ClassVar[bool] = True  # the model is a full feast_edge.space.supernet.Supernet (checkpointed as one)
    averaging: ClassVar[bool] = True  # its aggregation is a (sparse) average, so a server optimizer can step from it
    private_aggregation: ClassVar[bool] = False  # the uniform mean of routed slices, so DP's per-coordinate noise fits
    options: ClassVar[Mapping[str, MethodOption]] = {}

    def __init__(self, setup: Setup, config: SimulationConfig) -> None:
        self.setup = setup
        self.config = config
        self.preset = setup.preset
        self.opts = self.parse_options(dict(config.method_options))
        self.model: nn.Module = self.build_model()
        self.validated: list[
            dict[str, Any]
        ] = []  # the latest validation, per probe point (label, macs, params, val_accuracy)
        self.on_client: Callable[[str, str], None] | None = (
            None  # told (client, "training" | "uploading") around each local update
        )

    @classmethod
    def parse_options(cls, given: Mapping[str, str]) -> dict[str, Any]:
        """Validated option values (defaults filled in); a one-line MethodError for an unknown, missing or malformed one."""
        unknown = sorted(set(given) - set(cls.options))
        if unknown:
            takes = ", ".join(f"{k} ({o.help})" for k, o in cls.options.items()) or "none"
            raise MethodError(f"--method {cls.name} takes no option {', '.join(unknown)}; its options: {takes}")
        values = {}
        for key, opt in cls.options.items():
            if key not in given:
                if opt.required:
                    raise MethodError(f"--method {cls.name} needs --method-option {key}=... ({opt.help})")
                values[key] = opt.default
                continue
            try:
                values[key] = opt.parse(given[key])
            except (TypeError, ValueError) as exc:
                raise MethodError(
                    f"--method-option {key}={given[key]!r} for {cls.name} is malformed ({exc}); {opt.help}"
                ) from None
        cls.check_options(values)
        return values

    @classmethod
    def check_options(cls, values: Mapping[str, Any]) -> None:
        """Raise MethodError when option values are out of range (override per method)."""

    # ------------------------------------------------------------------ model
    def build_model(self) -> nn.Module:
        """The global model, initialised from ``config.seed``."""
        raise NotImplementedError

    def model_record(self) -> dict[str, Any]:
        """JSON description of the model's architecture, stored with non-supernet checkpoints and checked on resume."""
        return {"method": self.name}

    # ------------------------------------------------------------------ rounds
    def plans(self, t: int, cohort: Sequence[str], budget: Callable[[str], float]) -> dict[str, Any]:
        """Round ``t``: what each cohort member trains (a pure function of the config, ``t`` and the cohort)."""
        raise NotImplementedError

    def payload_params(self, plan: Any) -> int:
        """Parameters sent to a client with this plan (one direction; the update comes back the same size)."""
        raise NotImplementedError

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
        """One client's local training on uint8 ``images``; must not modify ``global_state``."""
        raise NotImplementedError

    def aggregate(
        self,
        t: int,
        global_state: Mapping[str, torch.Tensor],
        updates: Sequence[ClientUpdate],
        plans: Mapping[str, Any],
    ) -> None:
        """Fold the valid updates (client-id order) into ``global_state`` in place (it aliases the model's tensors)."""
        raise NotImplementedError

    def routed(
        self, global_state: Mapping[str, torch.Tensor], updates: Sequence[ClientUpdate], names: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """Per tensor of ``names``: the positions the updates covered (default: the union of their leading slices)."""
        return routed_masks(global_state, [u.state for u in updates], names)

    def full_params(self) -> int:
        """Parameters of the whole global model (what broadcasting it to one client would send)."""
        return sum(p.numel() for p in self.model.parameters())

    def sample_train_macs(self, plan: Any) -> int | None:
        """Forward MACs of one trained sample under ``plan`` (the compute proxy is 3× that per sample and epoch); None
        where it is only known after training (FEAST draws its variants per batch)."""
        return None

    def train_cost(self, plan: Any) -> float:
        """Relative cost of one local training sample under ``plan`` (balances a cohort over processes, ``--nproc``)."""
        return float(self.payload_params(plan))

    def delivered(self, global_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What a routed payload in the wire's dtype delivers (slicing commutes with the cast)."""
        return on_the_wire(global_state, self.config.aggregation.payload_dtype)

    def train_one(
        self, t: int, client: str, plan: Any, delivered: Mapping[str, torch.Tensor], lr: float
    ) -> ClientUpdate:
        """One cohort member's :meth:`train_client` on its own shard, its update passed through safetensors as on the wire."""
        images, labels = self.setup.client_data(client, t)
        began = time.perf_counter()
        if self.on_client is not None:
            self.on_client(client, "training")
        update = self.train_client(
            t, client, plan, delivered, images, labels, lr, client_seed(self.config.seed, t, client)
        )
        wire = self.config.aggregation.payload_dtype
        update.state = (
            on_the_wire(load_tensors(save_tensors({k: v.contiguous() for k, v in update.state.items()})), wire)
            if update.state
            else {}
        )
        update.compute_seconds = time.perf_counter() - began
        if self.on_client is not None:
            self.on_client(client, "uploading")
        return update

    def collect(
        self,
        t: int,
        cohort: Sequence[str],
        plans: Mapping[str, Any],
        global_state: Mapping[str, torch.Tensor],
        lr: float,
    ) -> list[ClientUpdate]:
        """Every cohort member's :meth:`train_one`, in cohort order (a method that overrides this cannot be spread over processes)."""
        delivered = self.delivered(global_state)
        return [self.train_one(t, client, plans[client], delivered, lr) for client in cohort]

    # ------------------------------------------------------------------ evaluation
    def served(self, budget: float) -> int:
        """Index in :meth:`points` of the largest point with MACs <= ``budget`` (method §8)."""
        try:
            return super().served(budget)
        except ValueError:
            smallest = self.points()[0].macs
            raise MethodError(
                f"{self.name}: a budget of {budget / 1e6:.2f}M MACs is below its smallest model ({smallest / 1e6:.2f}M MACs); raise --budget-min"
            ) from None
