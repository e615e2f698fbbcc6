"""Protocol features: what an agent states at registration that it understands beyond protocol version 1.

    device -> server  Register.features   the names below this agent implements (() from agents before them)
    server            sends a field or a request that a feature adds only to devices that listed it; to the others
                      it sends what version 1 has, and says in its log what they were not asked and why

A feature is a name, never a version number, so agents and servers of different ages agree on what both have: the
server ignores names it does not know (a newer agent), and a device that lists none gets what the first release of
the protocol had (an older agent). docs/protocol.md, "Protocol features", lists each with what it adds.
"""

from __future__ import annotations

from feast_edge.transport.errors import ProtocolError
from feast_edge.transport.topics import MAX_ID_LENGTH

# An ``evaluate`` request may carry more than one candidate model (``Evaluate.candidates``: the tail mean beside the
# round's own weights); the answer gives each candidate's counts on the same held-out examples (``Evaluated.candidates``).
EVALUATE_CANDIDATES = "evaluate-candidates"

# A round message may carry ``rounds`` 0: a federation without an end (feast-server run --continuous). An agent that
# does not list it is sent ``rounds`` = the round's own number + 1, which its check of the horizon accepts.
NO_HORIZON = "no-horizon"

# Served models are versions (manifest ``version``) the agent compares with the model it runs, on its held-out
# split, and installs only if not worse, answering ``version_report`` (feast_edge.versions). An agent that does not
# list it installs what it is sent: the server records those installs as ``ungated`` and says it cannot refuse one.
MODEL_VERSIONS = "model-versions"

AGENT_FEATURES: tuple[str, ...] = (
    EVALUATE_CANDIDATES,
    NO_HORIZON,
    MODEL_VERSIONS,
)  # what this version's agent implements
MAX_FEATURES = 64  # names one registration may list


def check_features(features: tuple[str, ...]) -> None:
    """A registration's feature list: at most MAX_FEATURES distinct names of lower-case letters, digits and '-'."""
    if len(features) > MAX_FEATURES:
        raise ProtocolError(f"field 'features' must list at most {MAX_FEATURES} names, got {len(features)}")
    for name in features:
        if not (1 <= len(name) <= MAX_ID_LENGTH and all(c in "abcdefghijklmnopqrstuvwxyz0123456789-" for c in name)):
            raise ProtocolError(
                f"field 'features' must hold names of 1-{MAX_ID_LENGTH} lower-case letters, digits and '-', "
                f"got {name[:24]!r}"
            )
    if len(set(features)) != len(features):
        raise ProtocolError("field 'features' must not repeat a name")
