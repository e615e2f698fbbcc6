"""Text for one log line: outside text (a device's message, a file name) made safe (``printable``), a duration in words
(``duration``), long text cut between words (``shortened``)."""

from __future__ import annotations


def printable(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters, each character that is not printable (newline, escape, ...) escaped as
    Python writes it (``\\n``, ``\\x1b``), so that one line stays one line and no terminal sequence reaches a console."""
    cut = text[:limit]
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return shown + ("…" if len(text) > limit else "")


def duration(seconds: float) -> str:
    """``12 s``, ``3 min``, ``5 h``, ``2 d``: the largest unit of which ``seconds`` holds at least one and a half."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 1.5 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{max(0.0, seconds):.0f} s"


def shortened(text: str, limit: int) -> str:
    """``text`` whole where it fits in ``limit`` characters, else cut after its last whole word that fits, with ``…``
    (mid-word only where cutting between words would drop more than a quarter of ``limit``: a very long word)."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space >= 3 * limit // 4 else cut).rstrip(" ,;:") + "…"
