"""What the run loop does differently under DP, in one place: privatize each update, noise the aggregate, account ε.

    before the round -> check_next(): ε after it (refused past --dp-epsilon), its bound C_t (adaptive clipping)
    valid updates    -> privatize(): BN statistics back to global, parameters' change clipped to C_t (+ each
                        client's own noise: local; a server's devices added theirs); adaptive: the noised count of
                        unclipped updates and the next bound
                     -> the method's aggregation with weight 1 each (the uniform sparse mean)
                     -> noise(): N(0, (z_Δ·C_t)²)/n_u on every routed coordinate (central; z_Δ = z with a fixed bound)

``--dp-epsilon``: :meth:`PrivateRounds.check_next` refuses a round that would take ε past the budget, and
:func:`check_plan` a run whose planned rounds would, before anything is written.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from feast_edge.privacy.accountant import ACCOUNTANTS, Epsilon, accounted, planned_epsilon
from feast_edge.privacy.local import LocalDp, privatize
from feast_edge.privacy.mechanism import (
    COUNT,
    add_sum_noise,
    next_clip,
    noise_generator,
    noised_unclipped,
    private_update,
    routed_counts,
)
from feast_edge.privacy.settings import DpSettings, PrivacyError

StateDict = Mapping[str, torch.Tensor]


class BudgetReached(PrivacyError):
    """The next round would take ε past ``--dp-epsilon``: the run stops before it."""


class PrivateRounds:
    """One run's DP steps over the model's parameters ``params`` (module docstring)."""

    def __init__(
        self, dp: DpSettings, params: Collection[str], rounds: int | None = None, *, clients_noise: bool = False
    ) -> None:
        """``rounds``: the run's planned rounds, checked against ``--dp-epsilon`` when the first round knows its
        population (a server learns it only then). ``clients_noise``: local DP where the clients are real devices
        that clipped and noised their updates themselves (a server): their updates are taken as they come."""
        self.dp = dp
        self.params = frozenset(params)
        self.rounds = rounds
        self.clients_noise = clients_noise

    def privatize(
        self, global_state: StateDict, updates: Sequence[tuple[str, StateDict]], t: int, record: dict[str, Any]
    ) -> list[dict[str, torch.Tensor]]:
        """The ``(client, state)`` updates as they enter the aggregate, in order: clipped to the round's bound (central);
        clipped and noised by each client itself (local). Adaptive clipping adds the round's noised unclipped
        fraction and the next bound to ``record``."""
        if self.clients_noise:  # each device clipped and noised its own: only BN statistics go back to global
            return [private_update(global_state, state, self.params, math.inf)[0] for _, state in updates]
        if self.dp.mode == "local":  # what each device does before its update leaves (feast_edge.privacy.local)
            local = LocalDp(self.dp.clip, self.dp.noise, self.dp.seed)
            return [privatize(global_state, state, self.params, local, client, t) for client, state in updates]
        clip = record.get("clip", self.dp.clip)
        clipped = [private_update(global_state, state, self.params, clip) for _, state in updates]
        if self.dp.adaptive:
            norms = [norm for _, norm in clipped]
            generator = noise_generator(self.dp.seed, t, COUNT)
            unclipped = noised_unclipped(norms, clip, self.dp.count_std(), generator) if norms else None
            record["unclipped"] = unclipped
            record["next_clip"] = (
                clip if unclipped is None else next_clip(clip, unclipped, self.dp.clip_quantile, self.dp.clip_lr)
            )
        return [state for state, _ in clipped]

    def noise(self, global_state: StateDict, states: Sequence[StateDict], t: int, record: Mapping[str, Any]) -> None:
        """Central DP: the noise of every routed coordinate's sum, in place (local DP: the clients added theirs)."""
        if self.dp.mode != "central" or not states:
            return
        names = sorted(n for n in self.params if n in global_state and global_state[n].is_floating_point())
        self.noise_counts(global_state, routed_counts(global_state, states, names), t, record)

    def noise_counts(
        self, global_state: StateDict, counts: Mapping[str, torch.Tensor], t: int, record: Mapping[str, Any]
    ) -> None:
        """Central DP: the noise of the sums of ``counts`` (tensor -> updates per position), in place."""
        if self.dp.mode != "central":
            return
        std = self.dp.update_noise() * record.get("clip", self.dp.clip)
        counts = {n: counts[n] for n in sorted(counts)}  # the noise streams' order, as routed_counts gives it
        add_sum_noise(global_state, counts, std, noise_generator(self.dp.seed, t))

    def epsilon(
        self, rounds: Sequence[tuple], cohorts: Sequence[Sequence[str]], delta: float, sampled: bool = True
    ) -> Epsilon:
        """ε at ``delta`` after ``rounds`` (population, cohort size[, the largest inclusion probability of a draw that
        is not uniform]), the smaller of RDP and PLD (named). Without
        amplification by sampling (local DP; central DP over cohorts that were not sampled, such as asynchronous
        releases): one Gaussian mechanism (q = 1) per cohort the client in most ``cohorts`` was in. Who is in which
        cohort is public (the server sees who sends), and a device outside a release adds nothing to it."""
        if self.dp.mode == "local" or not sampled:
            most = max(Counter(c for cohort in cohorts for c in cohort).values(), default=0)
            return accounted([(1, 1)] * most, self.dp.noise, delta, self.dp.mode)
        return accounted(rounds, self.dp.noise, delta)

    def check_next(self, history: Sequence[Mapping[str, Any]], cohorts: Sequence[Sequence[str]], round_no: int,
                   population: int, cohort: Sequence[str], sampled: bool = True,
                   inclusion: float | None = None) -> dict[str, Any]:  # fmt: skip
        """Round ``round_no``'s DP record, or :class:`BudgetReached` when it would exceed ``--dp-epsilon``.

        ``history``: the earlier rounds' records (their δ is kept: the first round fixes it from its population).
        ``sampled``: the cohorts are uniform samples of the population (amplification by sampling); an asynchronous
        release's buffer is not, and each device is accounted over the releases it was in (:meth:`epsilon`).
        ``inclusion``: the largest probability that one device is in this cohort, where the draw is not uniform (a
        stratified secure cohort, feast_edge.run.cohort.inclusion): the round is accounted at that rate."""
        if not history and self.rounds is not None:  # the whole plan, before the first round sends anything
            try:
                check_plan(self.dp, self.rounds, population, len(cohort), sampled, inclusion)
            except PrivacyError as exc:
                raise BudgetReached(f"{exc}; nothing was sent") from None
        delta = history[0]["delta"] if history else self.dp.resolved_delta(population)
        rounds = [(h["population"], h["cohort"], h.get("inclusion")) for h in history]
        rounds.append((population, len(cohort), inclusion))
        accounted_eps = self.epsilon(rounds, [*cohorts, cohort], delta, sampled)
        eps = accounted_eps.value
        if self.dp.epsilon is not None and eps > self.dp.epsilon:
            before = history[-1]["epsilon"] if history else 0.0
            raise BudgetReached(
                f"privacy budget reached: round {round_no} would bring ε to {eps:.3g} > --dp-epsilon {self.dp.epsilon:g} "
                f"(δ = {delta:.2g}); stopped after round {round_no - 1} at ε = {before:.3g}"
            )
        entry = {
            "population": population,
            "cohort": len(cohort),
            "epsilon": eps,
            "delta": delta,
            "accountant": accounted_eps.accountant,
        }
        if not sampled:
            entry["sampled"] = False
        if inclusion is not None:
            entry["inclusion"] = inclusion
        if self.dp.adaptive:  # this round's bound: the one the last round chose (resume continues it)
            entry["clip"] = history[-1]["next_clip"] if history else self.dp.clip
        return entry


def check_plan(
    dp: DpSettings, rounds: int, population: int, cohort: int, sampled: bool = True, rate: float | None = None
) -> float:
    """ε the planned ``rounds`` reach (population and cohort size as planned); refuses a plan past ``--dp-epsilon``.
    ``sampled=False`` (asynchronous releases): planned as if one device were in every release, q = 1. ``rate``: the
    largest inclusion probability of a draw that is not uniform, planned for every round."""
    delta = dp.resolved_delta(population)
    cohort = min(cohort, population)
    drawn_from = population if sampled else cohort
    rate = rate if sampled else None
    planned = planned_epsilon(rounds, drawn_from, cohort, dp.noise, delta, dp.mode, rate)
    if dp.epsilon is None or planned <= dp.epsilon:
        return planned
    fits, above = 0, rounds  # ε grows with the rounds: the most that fit, by bisection
    while above - fits > 1:
        middle = (fits + above) // 2
        if planned_epsilon(middle, drawn_from, cohort, dp.noise, delta, dp.mode, rate) <= dp.epsilon:
            fits = middle
        else:
            above = middle
    raise PrivacyError(
        f"--dp-epsilon {dp.epsilon:g}: the planned {rounds} rounds ({cohort} of {population} clients each"
        f"{'' if sampled else ', unsampled: accounted as if one device were in every release'}"
        f"{'' if rate is None else f', stratified: a device in a cohort with probability up to {rate:.3g}'}, "
        f"--dp-noise {dp.noise:g}) reach ε = {planned:.3g} at δ = {delta:.2g}; {fits} rounds fit the budget: lower "
        "--rounds, raise --dp-noise or raise --dp-epsilon"
    )


def accountant_words(records: Sequence[Mapping[str, Any]]) -> str:
    """Which accountant gave the run's last ε; a history recorded before PLD accounting says so."""
    if not records:
        return "the smaller of " + " and ".join(ACCOUNTANTS.values())
    last = records[-1]
    if "accountant" not in last:
        return ACCOUNTANTS["rdp"] + " (recorded by an earlier feast-edge, which accounted with RDP only)"
    earlier = sum("accountant" not in r for r in records)
    note = f"; rounds 1-{earlier} recorded with RDP only, before the run was resumed" if earlier else ""
    return ACCOUNTANTS[last["accountant"]] + f", the smaller of RDP and PLD{note}"


def privacy_summary(dp: DpSettings, records: Sequence[Mapping[str, Any]], stopped: str | None) -> dict[str, Any]:
    """A run's privacy block (results.json, the run record): settings, ε at δ after its last round, and how."""
    last = records[-1] if records else {}
    sampled = all(r.get("sampled", True) for r in records)  # asynchronous releases: accounted without sampling
    exposed = None  # central DP against whoever sees the cohorts: every round at q = 1 (no amplification by sampling)
    if dp.mode == "central" and records:
        exposed = accounted([(r["cohort"], r["cohort"]) for r in records], dp.noise, last["delta"]).value
    both = None  # the last ε by each accountant, recomputed from the recorded rounds (local DP: its stored figure)
    stratified = any(r.get("inclusion") is not None for r in records)  # secure cohorts: accounted at their largest rate
    if dp.mode == "central" and records and sampled:
        rounds = [(r["population"], r["cohort"], r.get("inclusion")) for r in records]
        figures = accounted(rounds, dp.noise, last["delta"])
        both = {"rdp": figures.rdp, "pld": figures.pld}
    sampling = "uniform cohorts" if sampled else "none: each device over the releases it was in, at q = 1"
    if sampled and stratified:
        sampling = "stratified cohorts (--secure-agg): each round at its largest per-device inclusion probability"
    return {
        "mode": dp.mode,
        "clip": dp.clip,
        "noise": dp.noise,
        "delta": last.get("delta", dp.delta),
        "epsilon": last.get("epsilon", 0.0),
        "epsilon_without_sampling": exposed,  # the ε for an adversary who knows who was in each cohort
        "epsilon_by": both,  # {"rdp": ..., "pld": ...}
        "epsilon_budget": dp.epsilon,
        "rounds": len(records),
        "stopped": stopped,
        "noise_seed": dp.seed,  # None: drawn from the OS every round, so the run cannot be replayed
        "weights": "uniform",
        "sampling": sampling,
        "accountant": accountant_words(records),
        **({"adaptive_clip": adaptive_summary(dp, records)} if dp.adaptive else {}),
    }


def adaptive_summary(dp: DpSettings, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Adaptive clipping's settings and path: the target quantile, the bound of the first and last round and the
    next one, and the noise multipliers the count and the updates got (together: ``noise``)."""
    return {
        "quantile": dp.clip_quantile,
        "lr": dp.clip_lr,
        "count_std": dp.count_std(),
        "update_noise": dp.update_noise(),
        "first": records[0]["clip"] if records else dp.clip,
        "last": records[-1]["clip"] if records else dp.clip,
        "next": records[-1].get("next_clip", records[-1]["clip"]) if records else dp.clip,
    }


def privacy_line(block: Mapping[str, Any]) -> str:
    """One line for people: ``privacy: ε = 7.62 at δ = 1e-05 after 30 rounds (central, C = 1, z = 1.1) ...``."""
    seeded = "seeded noise (tests only)" if block["noise_seed"] is not None else "noise from the OS"
    adaptive = block.get("adaptive_clip")
    clip = f"clip C = {block['clip']:g}"
    if adaptive:
        clip = (
            f"adaptive clip toward the {adaptive['quantile']:g} quantile of update norms, C = "
            f"{adaptive['first']:.3g} → {adaptive['last']:.3g}"
        )
    both = block.get("epsilon_by")
    by = ""
    if both:  # the figure is the smaller; the other accountant's beside it
        shown, other = ("PLD", "RDP") if both["pld"] < both["rdp"] else ("RDP", "PLD")
        by = f" ({shown}; {other}: {both[other.lower()]:.3g})"
    text = (
        f"privacy: ε = {block['epsilon']:.3g}{by} at δ = {block['delta']:.2g} after {block['rounds']} rounds "
        f"({block['mode']} DP, {clip}, noise z = {block['noise']:g}, uniform weights, {seeded})"
    )
    exposed = block.get("epsilon_without_sampling")
    if exposed is not None:
        text += f"; ε = {exposed:.3g} against whoever sees the cohorts (no amplification by sampling)"
    return text + (f"; {block['stopped']}" if block["stopped"] else "")


def stored_privacy(config: Mapping[str, Any], history: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The privacy block of a stored run (its recorded config and round history), or None for a run without DP."""
    stored = config.get("dp")
    if not isinstance(stored, Mapping):
        return None
    dp = DpSettings(**stored)
    return privacy_summary(dp, [h["dp"] for h in history if h.get("dp")], None)


def privacy_entry(dp: Mapping[str, Any]) -> dict[str, float]:
    """A round's ε and δ for the dashboard's history entry ({} for a round without DP)."""
    return {"epsilon": float(dp["epsilon"]), "delta": float(dp["delta"])} if dp else {}
