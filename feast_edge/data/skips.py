"""What a data source left out, by reason: counted, a few names kept for the console line, never silently dropped."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# The reasons (the keys of LoadedData.skipped). Everything else a source can hold wrong stops the load.
NOT_IMAGE = "not an image file"  # no PNG/JPEG/WebP/BMP extension, or content Pillow cannot identify as one
CORRUPT = "corrupt or truncated image"
TOO_MANY_PIXELS = "too many pixels (decompression bomb)"
UNREADABLE = "unreadable (permission denied or I/O error)"
UNREADABLE_FOLDER = "unreadable folder"
SYMLINK_LOOP = "symlink loop"
LINKED_TWICE = "folder reached twice through links"
BROKEN_LINK = "broken symlink"
OUTSIDE_CLASS = "file outside a class folder"
CLASS_NOT_IN_TASK = "example of a class the task does not have"

SHOWN = 3  # names kept per reason for the console line
NAME_CHARS = 120  # of each name kept


@dataclass
class Skips:
    """Counts of what was left out per reason, with the first few names of each."""

    counts: dict[str, int] = field(default_factory=dict)
    names: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, name: str | None = None, count: int = 1) -> None:
        if count <= 0:
            return
        self.counts[reason] = self.counts.get(reason, 0) + count
        shown = self.names.setdefault(reason, [])
        if name is not None and len(shown) < SHOWN:
            shown.append(name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 3] + "...")

    def merge(self, other: Skips) -> Skips:
        merged = Skips(dict(self.counts), {k: list(v) for k, v in self.names.items()})
        for reason, count in other.counts.items():
            merged.add(reason, None, count)
            shown = merged.names.setdefault(reason, [])
            shown.extend(other.names.get(reason, [])[: max(0, SHOWN - len(shown))])
        return merged

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """``"2 corrupt or truncated image (a.png, b.jpg), 1 not an image file (notes.txt)"``."""
        parts = []
        for reason, count in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0])):
            shown = self.names.get(reason, [])
            more = ", ..." if count > len(shown) and shown else ""
            parts.append(f"{count:,} {reason}" + (f" ({', '.join(shown)}{more})" if shown else ""))
        return ", ".join(parts)

    def to_json(self) -> dict[str, object]:
        return {"counts": dict(self.counts), "names": {k: list(v) for k, v in self.names.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> Skips:
        counts = data.get("counts", {})
        names = data.get("names", {})
        if not isinstance(counts, Mapping) or not isinstance(names, Mapping):
            raise ValueError("skips: counts and names must be objects")
        skips = cls()
        for reason, count in counts.items():
            shown = names.get(reason, [])
            if not isinstance(count, int) or not isinstance(shown, list):
                raise ValueError("skips: a count must be an integer and names a list")
            skips.counts[str(reason)] = count
            skips.names[str(reason)] = [str(n) for n in shown[:SHOWN]]
        return skips
