"""User-facing errors: each one names the problem and how to fix it."""


class FeastError(Exception):
    """An error caused by user input; the CLI prints it on one line and exits non-zero."""


class PresetError(FeastError, ValueError):
    """A preset name or preset file is unknown or invalid."""


class ArchError(FeastError, ValueError):
    """An architecture does not parse or does not fit its preset."""


class CheckpointError(FeastError, ValueError):
    """A checkpoint file is missing, malformed or belongs to another preset."""


class PopulationError(FeastError, ValueError):
    """A client-population or data-partition setting cannot be realized (method §4)."""


class PayloadError(FeastError, ValueError):
    """A payload is malformed, does not match what was routed, or does not fit the global state."""


class ProfileError(FeastError, ValueError):
    """A device profile is missing, malformed, inconsistent, or a device cannot be profiled."""
