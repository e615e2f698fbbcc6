"""Where a run keeps its rounds: atomic checkpoints, the previous good one beside the current, and resume.

    out/checkpoint.safetensors        the last completed round: weights, round, history, best, the caller's fields
    out/checkpoint.prev.safetensors   the one before it (a hard link, kept before every write)
    out/best.safetensors              the served round's weights, where validation chose one

Resume refuses a checkpoint of another kind or of other settings (naming the options that differ), except the
horizon's (EXTENDABLE: a run may go on with a larger --rounds, or --continuous, or back to a finite --rounds; the loop
refuses a horizon below the rounds done), and a damaged one with a message naming the kept previous checkpoint; with ``fall_back`` it resumes from that one instead, keeping
the damaged file renamed. What the loop does with the rounds it reads back is the loop's (feast_edge.run.loop).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from feast_edge.errors import CheckpointError
from feast_edge.run.checkpoint import (
    FORMAT,
    MODEL_FORMAT,
    keep_previous,
    load_module,
    load_supernet,
    read_record,
    save_module,
    save_supernet,
)
from feast_edge.settings.validated import RunError
from feast_edge.space.preset import Preset
from feast_edge.util.atomic import DiskFullError

CHECKPOINT = "checkpoint.safetensors"
PREVIOUS = "checkpoint.prev.safetensors"  # the last good checkpoint before the current one
BEST = "best.safetensors"
OPTIONS_OF = {"server_optimizer": "server_optimizer (--server-opt and its --server-* settings)"}  # in resume errors
# The settings a run may change when it is resumed (extended): its horizon. Everything else in its fingerprint stays.
EXTENDABLE = ("rounds", "continuous", "lr_period")
HISTORY_FORMAT = 2  # 2: RoundRecord with 1-based rounds (1: 0-based RoundLog / server RoundRecord)


@dataclass
class Resumed:
    """What a checkpoint gave back: its stored fields (history, best, ...), the extra tensors (a server optimizer's
    state), the file they came from, and why the previous checkpoint was used instead of the last (None: it was not)."""

    fields: dict[str, Any]
    extra: dict[str, torch.Tensor]
    path: Path
    recovered: str | None = None


class RunStore:
    """The checkpoints of one run in ``out`` (see the module docstring).

    ``model`` is written and, on resume, loaded in place; a model that is not a full Supernet needs ``model_record``
    (its checkpoint header), and ``preset`` checks a supernet checkpoint's preset.
    """

    def __init__(
        self,
        out: str | Path,
        model: torch.nn.Module,
        *,
        kind: str,
        fingerprint: str,
        config: Mapping[str, Any],
        preset: Preset | None,
        model_record: Mapping[str, Any] | None,
        fingerprint_of: Callable[[Mapping[str, Any]], str] | None = None,
    ) -> None:
        """``fingerprint_of(config)``: the fingerprint of a stored config as this run computes its own (None: a run
        that cannot be extended)."""
        self.fingerprint_of = fingerprint_of
        self.extended: dict[str, tuple[Any, Any]] = {}  # a resumed run's horizon settings that changed: (was, now)
        self.out = Path(out)
        self.model = model
        self.kind = kind
        self.fingerprint = fingerprint
        self.config = dict(config)
        self.preset = preset
        self.model_record = None if model_record is None else dict(model_record)

    def write(self, name: str, fields: Mapping[str, Any], extra: Mapping[str, torch.Tensor] | None = None) -> None:
        """Write ``model`` with ``fields`` (and the kind, fingerprint and config) to ``out/name``, atomically; the
        last checkpoint is kept as the previous one first."""
        if name == CHECKPOINT:
            keep_previous(self.out / CHECKPOINT, self.out / PREVIOUS)
        fields = dict(kind=self.kind, fingerprint=self.fingerprint, config=self.config, **fields)
        try:
            if self.model_record is None:
                save_supernet(self.out / name, self.model, extra, **fields)
            else:
                save_module(self.out / name, self.model, self.model_record, extra, **fields)
        except DiskFullError:
            done = int(fields.get("round", 1)) - 1  # the round whose checkpoint could not be written is lost, no other
            kept = f"the last good checkpoint, round {done}, is intact" if done else "no round was checkpointed yet"
            raise RunError(
                f"cannot write the checkpoint to {self.out / name}: no space left on device; free space and rerun the "
                f"same command ({kept})"
            ) from None

    def load(self, path: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
        """A checkpoint of this run's model (validated against it): (a loaded copy or the model itself, the record)."""
        if self.model_record is None:
            return load_supernet(path, self.preset)
        record = load_module(path, self.model, self.model_record)
        return self.model, record

    def selected(self) -> Path:
        """``best.safetensors`` when validation chose one, else the last checkpoint."""
        best = self.out / BEST
        return best if best.is_file() else self.out / CHECKPOINT

    def resume(self, hint: str, *, fall_back: bool = False) -> Resumed | None:
        """Load ``checkpoint.safetensors`` into the model if there is one (None: there is none).

        ``hint`` finishes the error when the checkpoint belongs to another run ("use another --out", ...).
        """
        path = self.out / CHECKPOINT
        if not path.is_file():
            return None
        self._check_belongs(path, read_record(path, format=None), hint)
        recovered = None
        try:
            model, record = self.load(path)
        except CheckpointError as exc:
            model, record, recovered = self._previous(path, exc, fall_back)
        if model is not self.model:
            self.model.load_state_dict(model.state_dict())
        return Resumed(dict(record["fields"]), dict(record.get("extra_tensors", {})), path, recovered)

    def _check_belongs(self, path: Path, record: Mapping[str, Any], hint: str) -> None:
        stored = record.get("fields", {})
        if record["format"] != (FORMAT if self.model_record is None else MODEL_FORMAT):
            raise RunError(
                f"{path} holds another kind of model ({record.get('model', {}).get('method', 'a supernet')}); {hint}"
            )
        if stored.get("kind") != self.kind:
            raise RunError(f"{path} is not a {self.kind} checkpoint; {hint}")
        if stored.get("fingerprint") != self.fingerprint and not self._extends(stored):
            theirs = stored.get("config", {})
            free = EXTENDABLE if self.fingerprint_of is not None else ()  # may change: not why it is refused
            differ = sorted(
                k
                for k in {*self.config, *theirs}
                if k not in free
                and json.dumps(self.config.get(k), sort_keys=True) != json.dumps(theirs.get(k), sort_keys=True)
            )
            named = [OPTIONS_OF.get(k, k) for k in differ]
            raise RunError(
                f"{path} belongs to a {self.kind} with other settings (differs in: {', '.join(named) or 'the preset'}); {hint}"
            )

    def _extends(self, stored: Mapping[str, Any]) -> bool:
        """Whether the stored run is this one with another horizon (EXTENDABLE): its fingerprint is ours with its
        horizon settings; ``extended`` then names what changed."""
        theirs = stored.get("config")
        if self.fingerprint_of is None or not isinstance(theirs, dict):
            return False
        as_theirs = {k: v for k, v in self.config.items() if k not in EXTENDABLE}
        as_theirs.update({k: theirs[k] for k in EXTENDABLE if k in theirs})
        if self.fingerprint_of(as_theirs) != stored.get("fingerprint"):
            return False
        self.extended = {
            k: (theirs.get(k), self.config.get(k)) for k in EXTENDABLE if theirs.get(k) != self.config.get(k)
        }
        return True

    def _previous(
        self, path: Path, exc: CheckpointError, fall_back: bool
    ) -> tuple[torch.nn.Module, dict[str, Any], str]:
        """The previous good checkpoint in place of the damaged last one (only with ``fall_back``)."""
        previous = self.out / PREVIOUS
        if not previous.is_file():
            raise RunError(
                f"cannot resume: {exc}; no previous checkpoint is kept; start a new run in another --out"
            ) from None
        if not fall_back:
            raise RunError(
                f"cannot resume: {exc}; the previous good checkpoint is kept beside it: to resume from there, run 'mv {previous} {path}' "
                f"and start again with the same options (feast-server run --resume-previous does this itself)"
            ) from None
        damaged = path.with_name(f"checkpoint.damaged-{time.strftime('%Y%m%d-%H%M%S')}.safetensors")
        try:
            model, record = self.load(previous)
        except CheckpointError as second:
            raise RunError(
                f"cannot resume: {exc}; the previous checkpoint is damaged too: {second}; start a new run in another --out"
            ) from None
        path.rename(damaged)
        os.link(previous, path)  # the previous one becomes the last good checkpoint; it stays the previous one too
        recovered = f"{path} is damaged ({exc}); kept it as {damaged.name} and resumed from the previous checkpoint {previous.name}"
        return model, record, recovered
