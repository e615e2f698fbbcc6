"""The classes a personal model was tuned to, and the words every reader prints for them.

A personal model is fitted on the device's training split. On a label-skewed fleet that split holds only some of
the task's classes, and the personal model forgets the others: 100 % on the device's own held-out split (which holds
the same classes) can be 0 % on a class it never saw. Wherever a personal model's own accuracy is printed or stored,
it says so:

    tuned to 6 of 10 classes: zero, one, two, three, four, five; serve the global model for the others

Records hold the class *names* (``personal_classes``, a JSON list) and the task's class count
(``personal_task_classes``), so a reader without the data or the preset (``feast-server status``, the report, the
dashboard) prints the words. A record from before these fields, or of a model tuned to every class, says nothing.
What came over the network or out of a file is checked by :meth:`Tuned.read` before it is believed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from feast_edge.data.task import MAX_CLASSES, TaskError, check_class_name
from feast_edge.errors import FeastError
from feast_edge.evaluate.coverage import class_list
from feast_edge.util.text import printable

CLASSES_KEY, TASK_KEY = "personal_classes", "personal_task_classes"
NAME_SHOWN = 16  # characters of one class name the words show: the words stay within 200 (a dashboard string)
MAX_SENT = 16_000  # characters of class names a device's metrics carry at most (a message holds 64 KiB)


class TunedError(FeastError, ValueError):
    """A record's ``personal_classes`` / ``personal_task_classes`` do not add up."""


@dataclass(frozen=True)
class Tuned:
    """The classes a personal model was tuned to (names, in the task's order) of the task's ``of`` classes."""

    classes: tuple[str, ...]
    of: int

    @classmethod
    def of_labels(cls, labels: Any, names: Sequence[str]) -> Tuned:
        """The classes present in ``labels`` (the task's indices of the training split the model was tuned on)."""
        present = sorted({int(v) for v in labels.reshape(-1).unique().tolist()})
        return cls(tuple(names[k] for k in present if 0 <= k < len(names)), len(names))

    @classmethod
    def read(cls, record: Mapping[str, Any]) -> Tuned | None:
        """The fields of ``record`` (a manifest, a device's metrics, a results row), checked; None when it has
        neither (a record from before them); TunedError naming what does not add up."""
        names, total = record.get(CLASSES_KEY), record.get(TASK_KEY)
        if names is None and total is None:
            return None
        if isinstance(total, bool) or not isinstance(total, int) or not 1 <= total <= MAX_CLASSES:
            raise TunedError(f"{TASK_KEY} must be a whole number of classes in [1, {MAX_CLASSES}]")
        if not isinstance(names, list) or not 1 <= len(names) <= total:
            raise TunedError(f"{CLASSES_KEY} must be a list of 1 to {TASK_KEY} ({total}) class names")
        try:
            for name in names:
                check_class_name(name, CLASSES_KEY)
        except TaskError as exc:
            raise TunedError(str(exc)) from None
        if len(set(names)) != len(names):
            raise TunedError(f"{CLASSES_KEY} names a class twice")
        return cls(tuple(names), total)

    @classmethod
    def read_metadata(cls, meta: Mapping[str, str], task_classes: Sequence[str]) -> Tuned | None:
        """The fields of an ONNX file's ``feast.*`` metadata (JSON text), checked against the file's task; None when
        it is not a personal model or is one from before them; TunedError naming what does not add up."""
        raw = {k: meta[k] for k in (CLASSES_KEY, TASK_KEY) if k in meta}
        try:
            tuned = cls.read({k: json.loads(v) for k, v in raw.items()})
        except json.JSONDecodeError:
            raise TunedError(f"its {' and '.join(raw)} metadata is not JSON") from None
        if tuned is not None and (tuned.of != len(task_classes) or not set(tuned.classes) <= set(task_classes)):
            raise TunedError(f"its {CLASSES_KEY} are not classes of its task ({len(task_classes)} classes)")
        return tuned

    @property
    def partial(self) -> bool:
        """Whether the model was tuned to fewer than all the task's classes."""
        return len(self.classes) < self.of

    def words(self) -> str:
        """``tuned to 6 of 10 classes: zero, one, …; serve the global model for the others``, or "" when the model
        was tuned to every class."""
        if not self.partial:
            return ""
        shown = [printable(n, NAME_SHOWN) for n in self.classes]
        return (
            f"tuned to {len(shown)} of {self.of} classes: {class_list(range(len(shown)), shown)}; "
            "serve the global model for the others"
        )

    def untuned(self, task_classes: Sequence[str]) -> list[str]:
        """The classes of the task (``task_classes``, in order) the model was not tuned to."""
        tuned = set(self.classes)
        return [n for n in task_classes if n not in tuned]

    def to_dict(self) -> dict[str, Any]:
        """The record's fields: the names as a JSON list and the task's class count."""
        return {CLASSES_KEY: list(self.classes), TASK_KEY: self.of}

    def to_metrics(self) -> dict[str, Any]:
        """:meth:`to_dict` when the names fit a metrics message (:data:`MAX_SENT` characters), else nothing: the
        server then shows no classes, as for a record from before them (the manifest on the device keeps them)."""
        return self.to_dict() if sum(len(n) + 4 for n in self.classes) <= MAX_SENT else {}


def tuned_words(record: Mapping[str, Any]) -> str:
    """The words of a record that may hold the fields (:meth:`Tuned.read`): "" when it does not, or is tuned to every
    class; TunedError when the fields do not add up."""
    tuned = Tuned.read(record)
    return "" if tuned is None else tuned.words()


def split_accuracy(tuned: Tuned, per_class: Iterable[tuple[str, int, int]]) -> dict[str, dict[str, Any]]:
    """Examples, correct and accuracy over the classes ``tuned`` names and over the others, from per-class
    ``(name, examples, correct)``; an accuracy is None where there are no examples."""
    parts = {"tuned": [0, 0], "not_tuned": [0, 0]}
    names = set(tuned.classes)
    for name, examples, correct in per_class:
        part = parts["tuned" if name in names else "not_tuned"]
        part[0] += examples
        part[1] += correct
    return {k: {"examples": n, "correct": c, "accuracy": c / n if n else None} for k, (n, c) in parts.items()}
