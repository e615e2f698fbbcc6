"""What a run without an end keeps of its rounds: every round's figures, the last rounds' details.

A federation without an end (``--continuous``) must not keep more of each round forever: every checkpoint holds the
run's history, so a run of 10,000 rounds would rewrite megabytes of reasons, per-client timings and per-variant
validation points after every round. A finite run keeps every round in full (its files are what they always were).
The policy, without an end:

    the last KEEP_FULL rounds       in full (RoundRecord as the round wrote it)
    every older round               compact: its figures (lr, loss, samples, compute, bytes, seconds, clock,
                                    validation accuracy, DP's ε and clip, staleness), who took part and who was
                                    refused, declined, missed or dropped (names without their reasons), and of its
                                    validation what the served-round rule reads (feast_edge.evaluate.served_round:
                                    source, each device's served-variant counts, flagged devices, the choice and its
                                    reason) and of its candidates the choice
    dropped from older rounds       reasons, per-client timings and variants per batch, the validation's per-variant
                                    points and examples, the candidates' figures, secure sums' withheld segments'
                                    reasons (kept as names)

``rounds.csv`` is the same either way (its columns are figures and counts, feast_edge.run.roundlog), the served-round
rule decides the same (its inputs are kept), and the served round's full record is in ``best.safetensors``, written
when it was chosen. What a round costs on disk once compact, and a run directory's size after 1,000 rounds, are
measured in docs/benchmarks.md, "A run directory after a thousand rounds".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, fields, replace
from typing import Any

from feast_edge.run.round_record import RoundRecord

KEEP_FULL = 50  # rounds kept in full, the newest
# Of a validation record, what the served-round rule (and the status's served line) reads.
VALIDATION_KEPT = ("source", "served", "flagged", "served_round", "served_reason", "distrusted")


def compact(record: RoundRecord) -> RoundRecord:
    """``record`` as it is kept once older than the last KEEP_FULL rounds (see the module docstring)."""
    names = dict.fromkeys
    return replace(
        record,
        rejected=names(record.rejected, ""),
        declined=names(record.declined, ""),
        incomplete=names(record.incomplete, ""),
        withheld=names(record.withheld, ""),
        capped={},
        ignored=[],
        variants_per_batch={},
        compute_seconds={},
        durations={},
        validation=_kept(record.validation),
        candidates={k: record.candidates[k] for k in ("of", "choice") if k in record.candidates},
    )


def _kept(validation: Mapping[str, Any]) -> dict[str, Any]:
    return {k: validation[k] for k in VALIDATION_KEPT if k in validation}


def retain(history: list[RoundRecord], keep: int = KEEP_FULL) -> None:
    """After a round was appended: compact, in place, the round that left the last ``keep`` (the older ones are)."""
    i = len(history) - keep - 1
    if i >= 0:
        history[i] = compact(history[i])


def retained(history: list[RoundRecord], keep: int = KEEP_FULL) -> list[RoundRecord]:
    """A whole history (a resumed one) as the policy keeps it: all but the last ``keep`` rounds compact."""
    cut = max(0, len(history) - keep)
    return [compact(h) for h in history[:cut]] + history[cut:]


def _defaults() -> dict[str, Any]:
    out = {}
    for f in fields(RoundRecord):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


_DEFAULTS = _defaults()


def written(history: Sequence[RoundRecord], endless: bool, keep: int = KEEP_FULL) -> list[dict[str, Any]]:
    """The history as a checkpoint stores it: every record in full for a finite run; without an end (``endless``),
    the older rounds without the fields they leave at their defaults (RoundRecord.from_dict fills them back)."""
    cut = max(0, len(history) - keep) if endless else 0
    older = [
        {k: v for k, v in asdict(h).items() if k == "round" or v != _DEFAULTS.get(k, MISSING)} for h in history[:cut]
    ]
    return older + [asdict(h) for h in history[cut:]]
