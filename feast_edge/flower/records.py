"""FEAST's round messages as Flower records: what a Message between the ServerApp and a ClientApp carries, checked.

    query  ServerApp -> node   ConfigRecord "feast": {"feast_edge": version, "preset": name, "preset_digest": sha}
           node -> ServerApp   ConfigRecord "feast": {"message": a Register}       or {"message": a Declined}
    train  ServerApp -> node   ConfigRecord "feast": {"message": a RoundStart, "feast_edge": version}
                               ArrayRecord "routed": the routed sub-supernet (method §5) in the round's payload dtype
           node -> ServerApp   ConfigRecord "feast": {"message": an Update}, ArrayRecord "update": the trained slice
                               or ConfigRecord "feast": {"message": a Declined}
    evaluate  (run config personalize, after the last round)
           ServerApp -> node   ConfigRecord "feast": the node's served variant (ServedVariant: arch, where its BN was
                               calibrated, the --personalize choice, seed), ArrayRecord "served": its float32 weights
           node -> ServerApp   MetricRecord "personal": its held-out counts, served and personal (and "task-classes");
                               ConfigRecord "feast": {"device", "method", "reason", "classes": the classes its personal
                               model was tuned to}; or ConfigRecord "feast": {"message": a Declined}

The JSON messages are ``feast_edge.protocol``'s own, read by the same bounded parser as over MQTT. The "transfer"
a RoundStart or Update names describes the ArrayRecord beside it: its byte size and a SHA-256 over every tensor's
name, dtype, shape and bytes. Arrays are materialised (Flower's ``Array.numpy``: ``np.load(allow_pickle=False)``)
only after their names, storage type, dtypes, shapes and byte sizes match what the plan routes, and their tensors
then pass the payload checks of ``feast_edge.route.payload.checked_tensors`` (finite values included).
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from feast_edge import __version__
from feast_edge.errors import PayloadError
from feast_edge.personalize.fleet import OwnRow
from feast_edge.personalize.select import METHODS, Choice, PersonalizeError
from feast_edge.personalize.tuned import Tuned, TunedError
from feast_edge.protocol import MAX_REASON, Declined, Register, RoundStart, Update
from feast_edge.route.envelope import Envelope
from feast_edge.route.payload import checked_tensors, expected_shapes, wire_tensors
from feast_edge.space.arch import Arch
from feast_edge.space.geometry import arch_layout
from feast_edge.space.preset import Preset
from feast_edge.space.static import StaticResNet
from feast_edge.transport.errors import ProtocolError
from feast_edge.transport.frames import TransferInfo
from feast_edge.transport.messages import Message, parse

FEAST = "feast"  # the ConfigRecord every FEAST message carries
ROUTED = "routed"  # the ArrayRecord of a train message
UPDATE = "update"  # the ArrayRecord of a train reply
SERVED = "served"  # the ArrayRecord of an evaluate message: the node's served variant
PERSONAL = "personal"  # the MetricRecord of an evaluate reply: its personalization step's counts
CALIBRATIONS = ("server", "device")  # where a served variant's BN is calibrated: the ServerApp's data, the node's own
FLOWER_DTYPES = ("float32", "float16")  # payload dtypes an ArrayRecord holds (NumPy has no bfloat16)
NPY_HEADER = 4096  # bytes an Array's .npy header may add to its tensor's bytes
NUMPY_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.int64: "int64"}


def check_flower_dtype(name: str) -> str:
    """``name`` if a Flower run can carry payloads in it, else a PayloadError naming the choices."""
    if name not in FLOWER_DTYPES:
        raise PayloadError(
            f"payload dtype {name!r} cannot travel in a Flower ArrayRecord (NumPy has no bfloat16); "
            f"use {' or '.join(FLOWER_DTYPES)}"
        )
    return name


def digest(tensors: Mapping[str, torch.Tensor]) -> tuple[str, int]:
    """SHA-256 over each tensor's name, dtype, shape and bytes, in order; and the bytes the tensors hold."""
    sha, size = hashlib.sha256(), 0
    for name, tensor in tensors.items():
        data = tensor.detach().cpu().contiguous().numpy().tobytes()
        sha.update(f"{name}|{NUMPY_NAMES.get(tensor.dtype, tensor.dtype)}|{tuple(tensor.shape)}|{len(data)}|".encode())
        sha.update(data)
        size += len(data)
    return sha.hexdigest(), size


def describe(
    tensors: Mapping[str, torch.Tensor], *, federation: str, round: int, device: str, kind: str
) -> TransferInfo:
    """The "transfer" a RoundStart or Update names for the ArrayRecord that travels with it."""
    sha, size = digest(tensors)
    return TransferInfo(
        federation=federation,
        round=round,
        device=device,
        transfer=f"{kind}-{sha[:16]}",
        count=1 if size else 0,
        size=size,
        chunk=max(size, 1),
        sha256=sha,
    )


def array_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """``tensors`` (already in their wire dtype) as an ArrayRecord, in order."""
    record = ArrayRecord()
    for name, tensor in tensors.items():
        record[name] = Array(tensor.detach().cpu().contiguous().numpy())
    return record


def wire(state: Mapping[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """``state`` as it travels: floating tensors in payload dtype ``dtype`` (PayloadError where one does not fit)."""
    return wire_tensors(state, check_flower_dtype(dtype))


def read_arrays(
    record: ArrayRecord, preset: Preset, envelope: Envelope, dtype: str, info: TransferInfo
) -> dict[str, torch.Tensor]:
    """The tensors of ``record`` if they are exactly what ``envelope`` routes in ``dtype`` and what ``info`` describes
    (float32 out); a PayloadError naming the first problem, before anything unexpected is allocated."""
    check_flower_dtype(dtype)
    tensors = _exact_arrays(record, expected_shapes(preset, preset.classes, envelope), dtype)
    sha, size = digest(tensors)
    if (sha, size) != (info.sha256, info.size):
        raise PayloadError(f"the arrays do not match their transfer {info.transfer} (SHA-256 or size differs)")
    return checked_tensors(tensors, preset, preset.classes, envelope, dtype)


def _exact_arrays(record: ArrayRecord, shapes: Mapping[str, tuple[int, ...]], dtype: str) -> dict[str, torch.Tensor]:
    """The tensors of ``record`` if their names are ``shapes``' and each is a numpy array of its shape in ``dtype``
    (int64 for BN's ``num_batches_tracked``), read only after its .npy header says so; PayloadError otherwise."""
    names = list(record.keys())
    missing, extra = sorted(set(shapes) - set(names)), sorted(set(names) - set(shapes))
    if missing or extra:
        raise PayloadError(
            f"the arrays do not match the envelope ({len(missing)} missing, e.g. {missing[:2]}; "
            f"{len(extra)} unexpected, e.g. {[str(e)[:64] for e in extra[:2]]})"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        array = record[name]
        want = "int64" if name.endswith("num_batches_tracked") else dtype
        if array.stype != "numpy.ndarray" or array.dtype != want or tuple(array.shape) != shapes[name]:
            raise PayloadError(
                f"array {name} is {str(array.stype)[:32]} {str(array.dtype)[:16]} {tuple(array.shape)[:8]}; "
                f"the envelope routes numpy.ndarray {want} {shapes[name]}"
            )
        limit = int(np.prod(shapes[name], dtype=np.int64)) * np.dtype(want).itemsize + NPY_HEADER
        if len(array.data) > limit:
            raise PayloadError(f"array {name} holds {len(array.data)} bytes; its shape needs at most {limit}")
        header = npy_header(array.data)
        if header != (shapes[name], np.dtype(want)):
            raise PayloadError(
                f"array {name}'s .npy header declares {str(header)[:120]}, not {np.dtype(want)} {shapes[name]}"
            )
        try:
            value = array.numpy()
        except (ValueError, TypeError, EOFError, OSError, MemoryError) as exc:
            raise PayloadError(f"array {name} cannot be read ({type(exc).__name__})") from None
        if value.dtype != np.dtype(want) or value.shape != shapes[name]:
            raise PayloadError(f"array {name} holds {value.dtype} {value.shape}, not what its header says")
        tensors[name] = torch.from_numpy(np.array(value, copy=True))
    return tensors


def npy_header(data: bytes) -> tuple[tuple[int, ...], np.dtype] | str:
    """(shape, dtype) that the .npy ``data`` declares, read from its header alone (nothing allocated for the array), or
    why it cannot be read: what NumPy would allocate is compared with the envelope before ``np.load`` runs."""
    stream = io.BytesIO(bytes(data[:NPY_HEADER]))
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            return f"an unknown .npy version {version}"
    except (ValueError, TypeError, EOFError, OSError, SyntaxError) as exc:
        return f"an unreadable .npy header ({type(exc).__name__})"
    if fortran:
        return "a Fortran-ordered array"
    return tuple(int(n) for n in shape), dtype


def message_record(message: Message, **extra: Any) -> ConfigRecord:
    """A protocol message (and a few plain fields) as the "feast" ConfigRecord."""
    return ConfigRecord({"message": message.encode().decode("utf-8"), **extra})


def read_message(content: RecordDict, *kinds: type[Message]) -> Message:
    """The protocol message of a reply's "feast" ConfigRecord, one of ``kinds``; ProtocolError otherwise."""
    config = content.config_records.get(FEAST) if isinstance(content, RecordDict) else None
    text = None if config is None else config.get("message")
    if not isinstance(text, str):
        raise ProtocolError('the reply carries no feast-edge message (ConfigRecord "feast" with a "message" string)')
    message = parse(text.encode("utf-8"))
    if not isinstance(message, kinds):
        names = ", ".join(k.__name__ for k in kinds)
        raise ProtocolError(f"the reply is a {message.kind} message, expected {names}")
    return message


def query_content(preset: Preset, federation: str) -> RecordDict:
    """What the ServerApp asks each node once: who it is, its budget and examples (answered by a Register)."""
    config = {
        "feast_edge": __version__,
        "federation": federation,
        "preset": preset.name,
        "preset_digest": preset.digest,
    }
    return RecordDict({FEAST: ConfigRecord(config)})


def train_content(start: RoundStart, routed: Mapping[str, torch.Tensor]) -> RecordDict:
    """A round for one node: its RoundStart and its routed slice (in the wire dtype the RoundStart names)."""
    return RecordDict({FEAST: message_record(start, feast_edge=__version__), ROUTED: array_record(routed)})


def update_content(update: Update, state: Mapping[str, torch.Tensor]) -> RecordDict:
    """A node's answer to a round: its Update and the trained slice (in the wire dtype)."""
    return RecordDict({FEAST: message_record(update), UPDATE: array_record(state)})


def reply_content(message: Declined | Register) -> RecordDict:
    """A node's answer without tensors: a registration, or why it takes no part."""
    return RecordDict({FEAST: message_record(message)})


def sent_field(content: RecordDict, key: str) -> str:
    """A plain field of the "feast" ConfigRecord the ServerApp sent (the feast-edge version, the federation), or ""."""
    config = content.config_records.get(FEAST)
    value = None if config is None else config.get(key)
    return value[:64] if isinstance(value, str) else ""


# ------------------------------------------------------------------ personalization (evaluate, after the last round)
@dataclass(frozen=True)
class ServedVariant:
    """What an evaluate message asks of a node: personalize this served variant (its weights travel beside it)."""

    federation: str
    device: str
    arch: Arch
    choice: Choice
    calibration: str  # "server": BN calibrated on the ServerApp's data; "device": the node calibrates it on its own
    calibration_samples: int  # with "device": the training examples it calibrates BN on, at most
    seed: int
    rounds: int  # the rounds the served checkpoint holds

    def content(self, model: StaticResNet) -> RecordDict:
        """The evaluate message's content: this and ``model``'s float32 weights."""
        config = {
            "feast_edge": __version__,
            "federation": self.federation,
            "device": self.device,
            "arch": self.arch.to_json(),
            "personalize": str(self.choice),
            "calibration": self.calibration,
            "calibration_samples": self.calibration_samples,
            "seed": self.seed,
            "rounds": self.rounds,
        }
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        return RecordDict({FEAST: ConfigRecord(config), SERVED: array_record(state)})

    @classmethod
    def read(cls, content: RecordDict, preset: Preset) -> tuple[ServedVariant, StaticResNet]:
        """The request of an evaluate message and its served model holding the weights that came with it (checked
        against the arch before they are read, finite float32); ProtocolError or PayloadError naming the problem."""
        config = content.config_records.get(FEAST)
        arrays = content.array_records.get(SERVED)
        if config is None or arrays is None:
            raise ProtocolError(
                'the evaluate message carries no served variant (ConfigRecord "feast", ArrayRecord "served")'
            )
        try:
            arch = Arch.parse(str(config["arch"])[:2000]).validated(preset)
            asked = cls(
                federation=str(config.get("federation", "")),
                device=str(config["device"]),
                arch=arch,
                choice=Choice.parse(str(config["personalize"])),
                calibration=str(config["calibration"]),
                calibration_samples=int(config["calibration_samples"]),
                seed=int(config["seed"]),
                rounds=int(config.get("rounds", 0)),
            )
        except (KeyError, TypeError, ValueError, PersonalizeError) as exc:
            raise ProtocolError(f"the evaluate message's served variant is malformed ({str(exc)[:200]})") from None
        if asked.calibration not in CALIBRATIONS or asked.calibration_samples < 1:
            raise ProtocolError(
                f"the evaluate message's calibration {asked.calibration[:16]!r} ({asked.calibration_samples}) is not "
                f"one of {', '.join(CALIBRATIONS)} with at least one example"
            )
        model = StaticResNet(arch_layout(preset, arch))
        want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        state = _exact_arrays(arrays, want, "float32")
        bad = next((k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
        if bad is not None:
            raise PayloadError(f"the served variant's tensor {bad} holds non-finite values")
        model.load_state_dict(state)
        return asked, model.eval()


def personal_content(row: OwnRow) -> RecordDict:
    """A node's answer to an evaluate message: its personalization step's counts (never an example) and its choice."""
    metrics = {
        "examples": row.examples,
        "served-correct": row.served_correct,
        "personal-correct": row.personal_correct,
        "served-macs": row.served_macs,
        "seconds": float(row.seconds),
        **({} if row.strength is None else {"strength": float(row.strength)}),
        **({} if row.tuned is None else {"task-classes": row.tuned.of}),
    }
    config = {"device": row.client, "method": row.method, "reason": row.reason[:MAX_REASON]}
    if row.tuned is not None:
        config["classes"] = list(row.tuned.classes)
    return RecordDict({PERSONAL: MetricRecord(metrics), FEAST: ConfigRecord(config)})


def read_personal(content: RecordDict, holdout: int, names: Sequence[str] = ()) -> OwnRow:
    """The row of a node's evaluate reply, if its counts are possible for a node that registered ``holdout`` held-out
    examples (non-negative, at most that many right, a known method) and the classes its personal model was tuned to
    are classes of the task (``names``: the task's, when known); ProtocolError naming the first problem."""
    metrics = content.metric_records.get(PERSONAL)
    config = content.config_records.get(FEAST)
    if metrics is None or config is None:
        raise ProtocolError('the reply carries no personalization counts (MetricRecord "personal")')
    try:
        counts = {k: metrics[k] for k in ("examples", "served-correct", "personal-correct", "served-macs")}
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in counts.values()):
            raise ValueError("the counts must be non-negative integers")
        method, reason = str(config["method"]), str(config.get("reason", ""))[:MAX_REASON]
        strength = metrics.get("strength")
        strength = None if strength is None else float(strength)
        seconds = float(metrics.get("seconds", 0.0))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"the personalization counts are malformed ({str(exc)[:200]})") from None
    examples = counts["examples"]
    if examples != holdout:
        raise ProtocolError(f"it counts {examples} held-out examples; it registered {holdout}")
    if max(counts["served-correct"], counts["personal-correct"]) > examples:
        raise ProtocolError(f"it counts more right answers than its {examples} held-out examples")
    if method not in ("", *METHODS):
        raise ProtocolError(f"its method {method[:32]!r} is not one of {', '.join(METHODS)}")
    if (method == "") != (strength is None) or not (strength is None or math.isfinite(strength)):
        raise ProtocolError("its strength does not go with its method")
    if method == "" and counts["personal-correct"] != counts["served-correct"]:
        raise ProtocolError("it keeps the served model but counts the personal one differently")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ProtocolError("its device time is not a non-negative number")
    tuned = _tuned(config, metrics, names)
    if method == "" and tuned is not None:
        raise ProtocolError("it keeps the served model but names classes a personal model was tuned to")
    return OwnRow(
        str(config.get("device", ""))[:64],
        counts["served-macs"],
        method,
        strength,
        examples,
        counts["served-correct"],
        counts["personal-correct"],
        reason,
        round(seconds, 3),
        tuned,
    )


def _tuned(config: ConfigRecord, metrics: MetricRecord, names: Sequence[str]) -> Tuned | None:
    """The classes a node's personal model was tuned to (None: its reply names none, as before they were sent),
    checked (``feast_edge.personalize.tuned``) and, where ``names`` are known, classes of that task."""
    raw = {"personal_classes": config.get("classes"), "personal_task_classes": metrics.get("task-classes")}
    try:
        if isinstance(raw["personal_classes"], (list, tuple)):
            raw["personal_classes"] = list(raw["personal_classes"])
        tuned = Tuned.read(raw)
    except TunedError as exc:
        raise ProtocolError(f"the classes of its personal model do not add up: {exc}") from None
    if tuned is not None and names and (tuned.of != len(names) or not set(tuned.classes) <= set(names)):
        raise ProtocolError(f"the classes of its personal model are not the task's ({len(names)} classes)")
    return tuned
