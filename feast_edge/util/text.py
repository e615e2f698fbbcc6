"""Text from outside (a device's message, a file name) made safe for a one-line log or error: ``printable``."""

from __future__ import annotations


def printable(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters, each character that is not printable (newline, escape, ...) escaped as
    Python writes it (``\\n``, ``\\x1b``), so that one line stays one line and no terminal sequence reaches a console."""
    cut = text[:limit]
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return shown + ("…" if len(text) > limit else "")
