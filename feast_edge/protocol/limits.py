"""Bounds of what a message may hold, beyond the transport's (sizes, depth, numbers)."""

MAX_REASON = 500  # characters in a device's reason for declining a round
MAX_PROBES = 16  # probe variants one evaluation request may name
MAX_EXAMPLES = 2**40  # a bound on any example count a device reports (far above any device's data)
MAX_CLASSES = 10_000  # entries in a per-class count list a device registers (far above any preset's classes)
MAX_CANDIDATES = 4  # candidate models one evaluation request may carry (the round's own weights and up to 3 more)
