"""Which of a validated round's candidates is offered to the served-round rule: its own weights or the tail mean.

    candidates  the round's own weights and, where one exists (feast_edge.run.average), the mean of the last K
                rounds' weights, validated on the same held-out examples: each device tests both on its served
                variant (or the server both on its split)
    voters      devices with both figures on the same variant and the same examples, less the distrusted ones
                (feast_edge.evaluate.served_round)
    d_i         voter i's paired difference: its accuracy with the mean less its accuracy with the round's own
    with three or more voters, each d_i is clipped to the range of the other voters' differences, so one device
    alone cannot choose: a liar beside two honest devices moves the choice only where they disagree
    chosen      the mean where the mean of the (clipped) d_i is above 0, else the round's own weights (ties: own)

On the server's split (``--data``) both are scored on the same examples and the higher wins (ties: own). The chosen
candidate is then judged against the incumbent by the served-round rule (feast_edge.evaluate.served_round), and both
steps go in the round record (``RoundRecord.candidates``) and the served reason. Pure functions of the record, so a
resumed run decides the same.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from feast_edge.evaluate.served_round import Figure, distrusted_in, figures_of

OWN, MEAN = "own", "mean"


@dataclass(frozen=True)
class Choice:
    """The candidate a round offers, why, and on whose figures."""

    candidate: str  # OWN or MEAN
    reason: str
    voters: tuple[str, ...] = ()
    own: float | None = None  # the voters' mean accuracy with the round's own weights (the server's, on its split)
    mean: float | None = None  # the same with the tail mean


def _words(candidate: str, round_: int, span: Sequence[int]) -> str:
    if candidate == MEAN:
        return f"the mean of rounds {span[0]}-{span[1]}'s weights"
    return f"round {round_}'s own weights"


def clipped_differences(differences: Mapping[str, float]) -> dict[str, float]:
    """Each difference clipped to the range of the others' (three or more voters; fewer: as they are)."""
    if len(differences) < 3:
        return dict(differences)
    out = {}
    for device, d in differences.items():
        others = [v for k, v in differences.items() if k != device]
        out[device] = min(max(d, min(others)), max(others))
    return out


def on_devices(
    round_: int,
    span: Sequence[int],
    own: Mapping[str, Figure],
    mean: Mapping[str, Figure],
    distrusted: Collection[str] = (),
) -> Choice:
    """Step one on the devices' figures of each candidate on their served variants (see the module docstring)."""
    voters = tuple(
        sorted(
            d
            for d, f in own.items()
            if d in mean
            and d not in distrusted
            and mean[d].variant == f.variant
            and mean[d].total == f.total
            and f.total > 0
        )
    )
    only_own = sorted(set(own) - set(mean))
    unpaired = f"; {len(only_own)} device(s) tested only the round's own weights" if only_own else ""
    if not voters:
        return Choice(
            OWN,
            f"{_words(OWN, round_, span)} (no device tested both it and the mean of rounds {span[0]}-{span[1]} on "
            f"the same examples{unpaired})",
        )
    differences = {d: mean[d].accuracy - own[d].accuracy for d in voters}
    clipped = clipped_differences(differences)
    score = statistics.fmean(clipped.values())
    chosen = MEAN if score > 1e-12 else OWN
    own_mean = statistics.fmean(own[d].accuracy for d in voters)
    mean_mean = statistics.fmean(mean[d].accuracy for d in voters)
    held = ""
    if (statistics.fmean(differences.values()) > 1e-12) != (chosen == MEAN):  # the bound decided: say whose claim
        bounded = sorted(voters, key=lambda d: abs(clipped[d] - differences[d]), reverse=True)[0]
        held = (
            f"; {bounded}'s difference {100 * differences[bounded]:+.1f} points bounded to "
            f"{100 * clipped[bounded]:+.1f} by the others' (one device alone cannot choose)"
        )
    reason = (
        f"{_words(chosen, round_, span)}: own {100 * own_mean:.1f}% vs the mean of rounds {span[0]}-{span[1]} "
        f"{100 * mean_mean:.1f}%, paired over {len(voters)} device(s){held}{unpaired}"
    )
    return Choice(chosen, reason, voters, own_mean, mean_mean)


def on_server(round_: int, span: Sequence[int], own: float | None, mean: float | None) -> Choice:
    """Step one on the server's split: the higher of the two scores on the same examples (ties: the round's own)."""
    if own is None or mean is None:
        return Choice(OWN, f"{_words(OWN, round_, span)} (the mean of rounds {span[0]}-{span[1]} was not validated)")
    chosen = MEAN if mean > own + 1e-12 else OWN
    reason = (
        f"{_words(chosen, round_, span)}: own {100 * own:.2f}% vs the mean of rounds {span[0]}-{span[1]} "
        f"{100 * mean:.2f}% on the server's validation split"
    )
    return Choice(chosen, reason, (), own, mean)


def choose_candidate(history: Sequence[Any], record: Any) -> Choice | None:
    """Step one for ``record`` (the newest round record of ``history``), applied to it: where it holds a tail mean's
    validation (``record.candidates["mean"]``), the chosen candidate's figure and validation become the round's
    (``val_accuracy``, ``validation``; ``average_of`` names the mean's rounds where it was chosen) and
    ``record.candidates`` says which and why. None where the round had one candidate."""
    candidates = record.candidates
    if not candidates or "mean" not in candidates or "choice" in candidates:
        return None
    span = candidates["of"]
    own_figure, own_validation = record.val_accuracy, record.validation
    mean = candidates["mean"]
    if own_validation.get("source") == "devices":
        validations = [(h.round, h.validation) for h in history if h.validation.get("source") == "devices"]
        choice = on_devices(
            record.round,
            span,
            figures_of(own_validation),
            figures_of(mean.get("validation") or {}),
            distrusted_in(validations),
        )
    else:
        choice = on_server(record.round, span, own_figure, mean.get("val_accuracy"))
    candidates["own"] = {"val_accuracy": own_figure, "validation": own_validation}
    candidates.update(choice=choice.candidate, reason=choice.reason, voters=list(choice.voters))
    if choice.candidate == MEAN:
        record.val_accuracy = mean.get("val_accuracy")
        record.validation = dict(mean.get("validation") or {})
        record.average_of = list(span)
    return choice
