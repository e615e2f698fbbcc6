"""Architecture value type ``a = (d, e, w)`` (method §1).

* ``d[s]``: extra blocks of stage ``s`` (the stage runs ``1 + d[s]`` blocks);
* ``e[s]``: expansion ratio of stage ``s`` (one of the preset's ratios);
* ``w[j]``: width-multiplier index of the stem (``j = 0``) and of each stage.

Canonical text form: ``d=[3,7,6,7] e=[0.18,0.18,0.1,0.1] w=[2,0,0,0,0]``;
JSON form: ``{"d":[3,7,6,7],"e":[0.18,0.18,0.1,0.1],"w":[2,0,0,0,0]}``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from feast_edge.errors import ArchError
from feast_edge.space.preset import Preset

_EXAMPLE = '{"d":[3,7,6,7],"e":[0.18,0.18,0.1,0.1],"w":[2,0,0,0,0]}'


def _fmt(v: float) -> str:
    return repr(round(float(v), 6))


@dataclass(frozen=True)
class Arch:
    """One architecture of the shared elastic space; hashable and printable."""

    d: tuple[int, ...]
    e: tuple[float, ...]
    w: tuple[int, ...]

    def __post_init__(self) -> None:
        for field in ("d", "e", "w"):
            value = getattr(self, field)
            if not isinstance(value, (tuple, list)):
                raise ArchError(f"arch field {field!r} must be a list, got {value!r}; example: {_EXAMPLE}")
            object.__setattr__(self, field, tuple(value))
        for field in ("d", "w"):
            for i, v in enumerate(getattr(self, field)):
                if isinstance(v, bool) or not isinstance(v, int):
                    if isinstance(v, float) and v.is_integer():
                        continue
                    raise ArchError(f"arch field {field}[{i}] = {v!r} must be an integer; example: {_EXAMPLE}")
        object.__setattr__(self, "d", tuple(int(v) for v in self.d))
        object.__setattr__(self, "w", tuple(int(v) for v in self.w))
        for i, v in enumerate(self.e):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ArchError(f"arch field e[{i}] = {v!r} must be a number; example: {_EXAMPLE}")
        object.__setattr__(self, "e", tuple(float(v) for v in self.e))

    # ---------------------------------------------------------------- forms
    def __str__(self) -> str:
        return self.text

    @property
    def text(self) -> str:
        """Canonical text form, e.g. ``d=[3,7,6,7] e=[0.18,0.18,0.1,0.1] w=[2,0,0,0,0]``."""
        d = ",".join(str(v) for v in self.d)
        e = ",".join(_fmt(v) for v in self.e)
        w = ",".join(str(v) for v in self.w)
        return f"d=[{d}] e=[{e}] w=[{w}]"

    @property
    def slug(self) -> str:
        """File-name-safe form, e.g. ``d3-7-6-7_e0.18-0.18-0.1-0.1_w2-0-0-0-0``."""
        return "_".join(
            [
                "d" + "-".join(str(v) for v in self.d),
                "e" + "-".join(_fmt(v) for v in self.e),
                "w" + "-".join(str(v) for v in self.w),
            ]
        )

    def to_dict(self) -> dict[str, list[Any]]:
        return {"d": list(self.d), "e": [round(v, 6) for v in self.e], "w": list(self.w)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any) -> "Arch":
        if not isinstance(data, dict):
            raise ArchError(f"arch must be an object with keys d, e, w, got {type(data).__name__}; example: {_EXAMPLE}")
        missing = [k for k in ("d", "e", "w") if k not in data]
        extra = sorted(set(data) - {"d", "e", "w"})
        if missing:
            raise ArchError(f"arch lacks the field(s) {', '.join(missing)}; example: {_EXAMPLE}")
        if extra:
            raise ArchError(
                f"arch has unknown field(s) {', '.join(extra)}; only d, e, w are allowed; example: {_EXAMPLE}"
            )
        return cls(d=data["d"], e=data["e"], w=data["w"])

    @classmethod
    def parse(cls, text: str) -> "Arch":
        """Parse the JSON form or the canonical text form (brackets optional)."""
        text = text.strip()
        if text.startswith("{"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ArchError(
                    f"arch is not valid JSON ({exc.msg} at column {exc.colno}); example: {_EXAMPLE}"
                ) from None
            return cls.from_dict(data)
        pairs = re.findall(r"([dew])\s*=\s*(\[[^\]]*\]|[-0-9.,]+)", text)
        fields = {k: v.strip("[]") for k, v in pairs}
        if len(pairs) != 3 or set(fields) != {"d", "e", "w"}:
            raise ArchError(
                f"cannot parse arch {text!r}; use JSON {_EXAMPLE} or text 'd=[3,7,6,7] e=[0.18,0.18,0.1,0.1] w=[2,0,0,0,0]'"
            )
        try:
            return cls(
                d=tuple(int(v) for v in fields["d"].split(",") if v.strip()),
                e=tuple(float(v) for v in fields["e"].split(",") if v.strip()),
                w=tuple(int(v) for v in fields["w"].split(",") if v.strip()),
            )
        except ValueError as exc:
            raise ArchError(f"cannot parse arch {text!r} ({exc}); example: {_EXAMPLE}") from None

    # ----------------------------------------------------------- validation
    def validated(self, preset: Preset) -> "Arch":
        """Check against the preset; return the arch with e snapped to the preset's exact ratios."""
        n = preset.num_stages
        lengths = {"d": (len(self.d), n), "e": (len(self.e), n), "w": (len(self.w), n + 1)}
        for field, (got, want) in lengths.items():
            if got != want:
                what = "stem + one per stage" if field == "w" else "one per stage"
                raise ArchError(f"arch field {field!r} has {got} entries; preset {preset.name} needs {want} ({what})")
        for i, v in enumerate(self.d):
            if not 0 <= v <= preset.max_extra_blocks:
                raise ArchError(
                    f"arch field d[{i}] = {v} is out of range; preset {preset.name} allows 0..{preset.max_extra_blocks}"
                )
        for i, v in enumerate(self.w):
            top = len(preset.width_multipliers) - 1
            if not 0 <= v <= top:
                raise ArchError(
                    f"arch field w[{i}] = {v} is out of range; preset {preset.name} allows width indices 0..{top}"
                )
        snapped = []
        for i, v in enumerate(self.e):
            match = [r for r in preset.expansion_ratios if abs(r - v) < 1e-6]
            if not match:
                allowed = ", ".join(_fmt(r) for r in preset.expansion_ratios)
                raise ArchError(
                    f"arch field e[{i}] = {_fmt(v)} is not an allowed expansion ratio; preset {preset.name} allows {{{allowed}}}"
                )
            snapped.append(match[0])
        return Arch(d=self.d, e=tuple(snapped), w=self.w)

    @classmethod
    def largest(cls, preset: Preset) -> "Arch":
        """The full supernet: deepest, widest, largest expansion everywhere."""
        n = preset.num_stages
        return cls(
            d=(preset.max_extra_blocks,) * n,
            e=(preset.expansion_ratios[-1],) * n,
            w=(len(preset.width_multipliers) - 1,) * (n + 1),
        )

    @classmethod
    def smallest(cls, preset: Preset) -> "Arch":
        """The smallest point of the space: one block per stage, narrowest everywhere."""
        n = preset.num_stages
        return cls(d=(0,) * n, e=(preset.expansion_ratios[0],) * n, w=(0,) * (n + 1))
