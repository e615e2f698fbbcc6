"""The served round of a federation whose server holds no data: the newest validated round, unless its devices show
a significant regression on the variants they are served.

    each validation (every --eval-every rounds and the last), each device reports (correct, total) on its held-out
    split for the variant it is served (its largest affordable): record.validation["served"]

    incumbent  = the round served so far (none before the first validation)
    candidate  = the round just validated
    voters     = devices that tested the candidate and the incumbent on the same variant, less the distrusted ones
    regressed  = voters whose own accuracy fell by more than required_gain (2 points, and 2 standard errors of the
                 difference of two binomial accuracies on their held-out examples)
    served     = candidate, unless more than half of the voters regressed (then the incumbent stays)

A device's held-out split is fixed, so its figures of two rounds compare without keeping the incumbent's weights.
Each device judges only the variant it is served, never a probe above its budget that only stronger devices train
(and that fails on its classes). One device is one vote of several: a liar can keep serving the newest round, never
roll the fleet back alone. A device whose figures disagree with the others' in a way its class mix cannot explain,
and which moves against the others' trend between two validations (100 % then 0 %), the one before or after the
other, is distrusted from then on: it no longer votes and is named. The rule is a pure function of the run's history, so a resumed run decides the same.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from feast_edge.evaluate.coverage import SERVE_MARGIN, required_gain

INCONSISTENT = 0.3  # a device's change between validations this far (absolute) from the others' median change


@dataclass(frozen=True)
class Figure:
    """One device's held-out result on the variant it is served, in one validation."""

    variant: str
    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total


@dataclass(frozen=True)
class ServedRound:
    """The round served after a validation, why, and the devices no longer trusted (device -> why)."""

    round: int | None  # None: no round was validated
    reason: str
    distrusted: dict[str, str] = field(default_factory=dict)
    regressed: tuple[str, ...] = ()  # the voters whose served variant regressed in the last judged validation


def figures_of(validation: Mapping[str, Any]) -> dict[str, Figure]:
    """The per-device served-variant figures a round's ``validation`` record holds (none in older records)."""
    out = {}
    for device, value in (validation.get("served") or {}).items():
        variant, correct, total = value
        if total > 0:
            out[device] = Figure(str(variant), int(correct), int(total))
    return out


def distrusted_in(validations: Sequence[tuple[int, Mapping[str, Any]]]) -> dict[str, str]:
    """Devices flagged as disagreeing (what their class mix cannot explain) whose change between two validations
    differed from the other devices' median change by more than INCONSISTENT, the flag and the move in either order;
    the round where both are first known names them."""
    out: dict[str, str] = {}
    previous: dict[str, tuple[int, Figure]] = {}
    moves: dict[str, str] = {}  # device -> its first move against the others' trend, in words
    flagged_before: set[str] = set()
    for round_, validation in validations:
        figures = figures_of(validation)
        changes = {
            d: f.accuracy - previous[d][1].accuracy
            for d, f in figures.items()
            if d in previous and previous[d][1].variant == f.variant
        }
        for device, change in changes.items():
            others = [c for d, c in changes.items() if d != device and d not in out]
            if device in moves or len(others) < 2:
                continue
            trend = statistics.median(others)
            if abs(change - trend) > INCONSISTENT:
                was, now = previous[device][1].accuracy, figures[device].accuracy
                moves[device] = (
                    f"its held-out accuracy went {100 * was:.1f}% -> {100 * now:.1f}% (round {previous[device][0]} -> "
                    f"{round_}) while the other devices' moved {100 * trend:+.1f} points"
                )
        flagged_before |= set(validation.get("flagged") or {})
        for device in sorted(moves.keys() & flagged_before - out.keys()):
            out[device] = (
                f"round {round_}: {moves[device]}, and its figures disagree with theirs: it no longer votes on the "
                "served round"
            )
        previous.update({d: (round_, f) for d, f in figures.items()})
    return out


def served_round(history: Sequence[tuple[int, Mapping[str, Any]]], margin: float = SERVE_MARGIN) -> ServedRound:
    """The served round after the validations in ``history``: (1-based round, its ``validation`` record) in order,
    only rounds validated by devices (see the module docstring)."""
    distrusted = distrusted_in(history)
    incumbent: tuple[int, dict[str, Figure]] | None = None
    reason, regressed = "", ()
    for round_, validation in history:
        figures = figures_of(validation)
        if not figures:
            if incumbent is not None:
                reason = (
                    f"round {incumbent[0]}, the last round its devices validated (round {round_}: no device "
                    "reported its served variant)"
                )
            continue
        if incumbent is None:
            incumbent, regressed = (round_, figures), ()
            reason = (
                f"round {round_}: the first validated round ({len(figures)} device(s) tested their served variants)"
            )
            continue
        past = incumbent[1]
        voters = sorted(
            d for d, f in figures.items() if d not in distrusted and d in past and past[d].variant == f.variant
        )
        regressed = tuple(
            d
            for d in voters
            if past[d].accuracy - figures[d].accuracy
            > required_gain(past[d].accuracy, figures[d].accuracy, past[d].total, figures[d].total, margin)
        )
        falls = ", ".join(f"{d} {100 * past[d].accuracy:.1f}% -> {100 * figures[d].accuracy:.1f}%" for d in regressed)
        if voters and 2 * len(regressed) > len(voters):
            reason = (
                f"round {incumbent[0]} kept: round {round_} regressed on the served variants of {len(regressed)} of "
                f"{len(voters)} device(s) ({falls})"
            )
            continue
        kept = f"; regressed on {len(regressed)} of {len(voters)} only ({falls})" if regressed else ""
        reason = (
            f"round {round_}: the newest validated round, no significant regression against round {incumbent[0]} on "
            f"the served variants of {len(voters)} device(s){kept}"
            if voters
            else f"round {round_}: the newest validated round (no device tested both it and round {incumbent[0]})"
        )
        incumbent = (round_, figures)
    if incumbent is None:
        return ServedRound(None, "no round was validated by the devices", distrusted)
    return ServedRound(incumbent[0], reason, distrusted, regressed)


def best_after(validated: Sequence[tuple[int, dict[str, Any], float | None]]) -> dict[str, Any]:
    """The run loop's ``best`` after device validations ((round, validation record, its figure), the newest last):
    {"round", "val_accuracy", "reason"}, {} while none chose; stamps the newest record with the choice and why."""
    choice = served_round([(r, v) for r, v, _ in validated if v.get("source") == "devices"])
    newest = validated[-1][1]
    newest["served_round"], newest["served_reason"] = choice.round, choice.reason
    if choice.distrusted:
        newest["distrusted"] = choice.distrusted
    if choice.round is None:
        return {}
    accuracy = next(a for r, _, a in validated if r == choice.round)
    return {"round": choice.round, "val_accuracy": accuracy, "reason": choice.reason}


def served_record(rounds: int, best: Mapping[str, Any]) -> dict[str, Any]:
    """What a manifest, a table or status says of the served weights: {"round", "of", "reason"} and, where they are
    the mean of several rounds' weights, "average_of": [first, last], from a checkpoint's completed ``rounds`` and its
    ``best`` record (empty where no validation chose: the last round is served)."""
    if best.get("round") is None:
        return {
            "round": rounds,
            "of": rounds,
            "reason": f"round {rounds}: the last round (no validation chose another)",
        }
    reason = best.get("reason") or f"round {best['round']}: the best validation accuracy"
    averaged = {"average_of": [int(r) for r in best["average_of"]]} if best.get("average_of") else {}
    return {"round": int(best["round"]), "of": rounds, "reason": str(reason), **averaged}


def weights_words(served: Mapping[str, Any]) -> str:
    """``weights of round 8 of 20``, or ``the mean of the weights of rounds 16-20 of 20``, from a :func:`served_record`."""
    span = served.get("average_of")
    if isinstance(span, list) and len(span) == 2 and all(isinstance(r, int) for r in span):
        return f"the mean of the weights of rounds {span[0]}-{span[1]} of {served.get('of')}"
    return f"weights of round {served.get('round')} of {served.get('of')}"


def serve_after(best: Mapping[str, Any], history: Sequence[Any], record: Any) -> tuple[dict[str, Any], bool]:
    """The run's ``best`` (the served round and why) after ``record``, the newest of ``history`` (round records), and
    whether its weights became the served ones.

    Validated by the devices (a server without data): the newest round unless its devices' served variants regressed
    (:func:`best_after`); on server-held data: the best validation accuracy. Where the round had two candidates (its
    own weights and the tail mean, feast_edge.evaluate.candidates), the one it offers was chosen first
    (``record.candidates``); ``best`` says which (``average_of`` where it is the mean) and the reason gives both steps.
    """
    if record.validation.get("source") == "devices":
        chosen = best_after([(h.round, h.validation, h.val_accuracy) for h in history if h.validation])
        if chosen and chosen["round"] == best.get("round") and "average_of" in best:
            return dict(best), False  # the incumbent, a mean of an earlier horizon (a finished run given more rounds)
        now = bool(chosen) and chosen["round"] == record.round
        chosen = chosen or dict(best)
    elif record.val_accuracy is None or record.val_accuracy <= best.get("val_accuracy", -1.0):
        return dict(best), False  # the round's candidate (record.candidates says which) did not beat the best
    else:
        now, chosen = (
            True,
            {
                "round": record.round,
                "val_accuracy": record.val_accuracy,
                "reason": f"round {record.round}: the best validation accuracy on the server's data so far",
            },
        )
    step = (getattr(record, "candidates", None) or {}).get("reason")
    if step:  # the round's two candidates: which one was judged, and why
        if now:
            chosen["reason"] = f"{step}; {chosen['reason']}"
        else:
            chosen["reason"] = f"{chosen['reason']} (round {record.round}'s candidate: {step})"
        if record.validation.get("source") == "devices":
            record.validation["served_reason"] = chosen["reason"]
    span = getattr(record, "average_of", None)
    if now and span:
        chosen["average_of"] = list(span)
        if record.validation:  # what the round's record says it served (feast_edge.report.model_words.served_so_far)
            record.validation["served_reason"], record.validation["served_average_of"] = chosen["reason"], list(span)
    return chosen, now
