"""Federated validation on Flower as records: a run without server data has its cohort nodes test round t's model on
their own held-out splits (method §8 on the devices), as ``feast-server run`` without ``--data`` has its agents do.

    evaluate  (a validated round: every eval-every rounds and the last, run config data = "")
           ServerApp -> node   ConfigRecord "feast": {"request": "validate", "feast_edge": version, "message": an
                               Evaluate (feast_edge.protocol: the plan, the targets as indices into its affordable
                               variants, the training examples BN is recalibrated on, the transfer describing the
                               routed slice)}; ArrayRecord "routed": the routed sub-supernet in the run's payload
                               dtype; at the last round also "candidate-1": the tail mean's routed slice (described in
                               the Evaluate's ``candidates``), tested on the same examples
           node -> ServerApp   ConfigRecord "feast": {"message": an Evaluated: (correct, total) per target, in the
                               request's order, and per further candidate the same}; or {"message": a Declined}

The personalization "evaluate" Message (``records.ServedVariant``, after the last round) carries no "request" key:
``is_validation`` tells the two apart, so a ClientApp reads personalization messages as before. The request's arrays
pass ``records.read_arrays`` (the plan's envelope, the transfer's size and SHA-256, finite values); the answer is read
by the same bounded parser as over MQTT (non-negative integers, correct <= total) and ``read_counts`` then holds it to
the request: the device, round and routed slice it answers, one result per target, no total above the held-out
examples the node registered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from flwr.app import RecordDict

from feast_edge import __version__
from feast_edge.flower.records import FEAST, ROUTED, array_record, message_record, read_arrays, read_message
from feast_edge.protocol import Declined, Evaluate, Evaluated
from feast_edge.route.plans import ClientPlan
from feast_edge.space.arch import Arch
from feast_edge.space.preset import Preset
from feast_edge.transport.errors import ProtocolError

REQUEST = "request"  # the "feast" ConfigRecord's key naming what an evaluate Message asks
VALIDATE = "validate"  # ... a validation of round t's model (absent: the personalization step)


@dataclass(frozen=True)
class ValidationRequest:
    """What a node reads from a validation request: the Evaluate, its plan and the routed slice's tensors (float32)."""

    request: Evaluate
    plan: ClientPlan
    routed: dict[str, torch.Tensor]
    candidates: list[dict[str, torch.Tensor]] = field(default_factory=list)  # further candidates' routed slices

    @property
    def targets(self) -> list[Arch]:
        """The variants to test, in the request's order (the answer's order)."""
        return self.request.probe_archs(self.plan)

    def answer(
        self, counts: list[tuple[int, int]], calibrated_on: int, others: list[list[tuple[int, int]]] | None = None
    ) -> RecordDict:
        """The node's answer: (correct, total) per target, per further candidate the same, and the training examples
        BN was recalibrated on."""
        return counts_content(Evaluated.of(self.request, counts, calibrated_on, others))


def candidate_key(i: int) -> str:
    """The ArrayRecord of the request's ``i``-th further candidate (1-based)."""
    return f"candidate-{i}"


def validation_content(
    request: Evaluate, routed: Mapping[str, torch.Tensor], candidates: Sequence[Mapping[str, torch.Tensor]] = ()
) -> RecordDict:
    """A validation request for one node: ``request``, its routed slice and those of its further ``candidates`` (each
    described in ``request.candidates``; already in the request's payload dtype)."""
    config = message_record(request, feast_edge=__version__)
    config[REQUEST] = VALIDATE
    arrays = {ROUTED: array_record(routed)}
    arrays.update({candidate_key(i): array_record(c) for i, c in enumerate(candidates, start=1)})
    return RecordDict({FEAST: config, **arrays})


def is_validation(content: RecordDict) -> bool:
    """Whether an evaluate Message asks for a validation (else it is the personalization step's)."""
    config = content.config_records.get(FEAST) if isinstance(content, RecordDict) else None
    return config is not None and config.get(REQUEST) == VALIDATE


def read_validation(content: RecordDict, preset: Preset) -> ValidationRequest:
    """The request of a validation Message, its routed slice checked against the plan it names and the transfer it
    describes; ProtocolError or PayloadError naming the first problem, before anything unexpected is allocated."""
    message = read_message(content, Evaluate)
    assert isinstance(message, Evaluate)
    plan = message.client_plan(preset)
    arrays = content.array_records.get(ROUTED)
    if arrays is None:
        raise ProtocolError('the validation request carries no routed slice (ArrayRecord "routed")')
    routed = read_arrays(arrays, preset, plan.envelope, message.payload_dtype, message.transfer_info())
    candidates = []
    for i, info in enumerate(message.candidate_infos(), start=1):
        more = content.array_records.get(candidate_key(i))
        if more is None:
            raise ProtocolError(f'the validation request names {len(message.candidates)} further candidate(s) but '
                                f'carries no ArrayRecord "{candidate_key(i)}"')  # fmt: skip
        candidates.append(read_arrays(more, preset, plan.envelope, message.payload_dtype, info))
    return ValidationRequest(message, plan, routed, candidates)


def counts_content(answer: Evaluated | Declined) -> RecordDict:
    """A node's answer to a validation request: its counts (never an example), or why it declined."""
    return RecordDict({FEAST: message_record(answer)})


def read_counts(content: RecordDict, request: Evaluate, holdout: int) -> Evaluated | Declined:
    """A node's answer to ``request``: its Evaluated ((correct, total) per target in the request's order, per further
    candidate the same on the same examples), or its Declined; ProtocolError when the answer is not possible for a
    node that registered ``holdout`` held-out examples: malformed, for another device, round or slice, more or fewer
    results than targets or candidates, a total above ``holdout``, a candidate tested on other examples."""
    answer = read_message(content, Evaluated, Declined)
    if isinstance(answer, Declined):
        return answer
    assert isinstance(answer, Evaluated)
    if (answer.device, answer.round, answer.routed) != (
        request.device,
        request.round,
        request.transfer_info().transfer,
    ):
        raise ProtocolError(
            f"its counts answer {answer.device!r} round {answer.round + 1} ({answer.routed[:40]}), not this request"
        )
    counts = answer.counts()
    if len(counts) != len(request.probes):
        raise ProtocolError(f"it answers {len(counts)} results for {len(request.probes)} targets")
    # The counts weigh the round's figure: no node may weigh more than the held-out split it registered.
    if any(total > holdout for _, total in counts):
        raise ProtocolError(f"it counts more examples than the {holdout} it registered as held out")
    others = answer.candidate_counts()
    if len(others) != len(request.candidates):
        raise ProtocolError(
            f"it answers for {len(others)} further candidate(s); the request carried {len(request.candidates)}"
        )
    if any([n for _, n in other] != [n for _, n in counts] for other in others):
        raise ProtocolError("it tested a further candidate on other examples than the first")
    return answer
