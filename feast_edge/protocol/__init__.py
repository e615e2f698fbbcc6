"""FEAST's application protocol: the round messages, as types that convert to and from the method's objects.

The transport (``feast_edge.transport``) moves validated JSON messages and
chunked payloads; this module says what a federation says with them
(docs/protocol.md §7 "Round sequence"):

    device -> server  Register      one (virtual) client: budget, samples, preset, profile, the task it checked its data against
    server -> device  Registered    accepted, or refused with a reason; the federation's task; ``finished`` when the run is over
    server -> device  RoundStart    RoundStart.from_plan(plan, ...)  ->  .client_plan(preset), .train_config(), .client_seed
    device -> server  Update        Update.from_result(result, ...)  ->  .loss, .samples_seen, .compute_seconds
    server -> device  Evaluate      federated validation: BN-recalibrate these probe variants of the routed state, test them
    device -> server  Evaluated     correct/total per probe variant on the device's held-out split
    server -> device  Calibrate     federated BN statistics of the served variants of the routed state (after the last round)
    device -> server  Update        ... answered by an upload of the statistics (safetensors), weighted by the device's examples
    device -> server  Metrics       free-form numbers (e.g. the served model's latency and held-out accuracy)
    device -> server  ModelRequest  send me my exported model
    server -> device  ModelReady    the model follows as a transfer, or is not available
    device -> server  VersionReport what it did with a served model version: installed, refused, rolled back (figures)
    server -> device  Finished      the federation is over: rounds done, whether a model was exported
    both ways         SecAgg*       secure aggregation's stages around a round's masked update (protocol.secure)

Neither side packs or unpacks a dict by hand: the server builds a
``RoundStart`` from the ``ClientPlan`` the core computed and the agent gets the
same plan back, validated against its preset.
"""

from feast_edge.protocol.evaluation import Calibrate, Evaluate, Evaluated, RoutedRequest
from feast_edge.protocol.limits import MAX_EXAMPLES, MAX_PROBES, MAX_REASON
from feast_edge.protocol.models import Finished, Metrics, ModelReady, ModelRequest, VersionReport
from feast_edge.protocol.registration import Register, Registered
from feast_edge.protocol.round_messages import Declined, RoundStart, Update
from feast_edge.protocol.secure import (
    SecAggBox,
    SecAggKeys,
    SecAggReveal,
    SecAggRoster,
    SecAggShares,
    SecAggUnmask,
    SecureBlock,
)

__all__ = [
    "MAX_EXAMPLES",
    "MAX_PROBES",
    "MAX_REASON",
    "Calibrate",
    "Declined",
    "Evaluate",
    "Evaluated",
    "Finished",
    "Metrics",
    "ModelReady",
    "ModelRequest",
    "Register",
    "Registered",
    "RoundStart",
    "RoutedRequest",
    "SecAggBox",
    "SecAggKeys",
    "SecAggReveal",
    "SecAggRoster",
    "SecAggShares",
    "SecAggUnmask",
    "SecureBlock",
    "Update",
    "VersionReport",
]
