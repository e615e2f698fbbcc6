"""FEAST on Flower: a ServerApp and a ClientApp over feast-edge's own core (``pip install 'feast-edge[flower]'``).

    feast_edge.flower.serverapp:app   the run loop of feast-server, collecting each round through Flower's Grid
    feast_edge.flower.clientapp:app   the device agent's local step, on the SuperNode's own data
    feast_edge.flower.records         FEAST's round messages as Flower records, checked on arrival

``feast-edge flower new DIR`` writes a Flower App project that names these components (docs/flower.md).
"""

from __future__ import annotations

FLWR_RANGE = ">=1.42,<1.43"  # the flwr versions tested (pyproject.toml [project.optional-dependencies] flower)


def require_flwr() -> None:
    """FeastError when flwr cannot be imported: the one line that names the extra to install."""
    from feast_edge.errors import FeastError

    try:
        import flwr  # noqa: F401
    except ImportError:
        raise FeastError(
            f"Flower is not installed: pip install 'feast-edge[flower]' (flwr{FLWR_RANGE}) to run feast-edge on Flower"
        ) from None


def log_to_stderr(level: int = 20) -> None:
    """feast-edge's log lines on stderr, where Flower collects an app's output (``flwr log``, a SuperNode's log).

    Only in a process whose logging nobody configured (Flower's app processes): elsewhere the caller's handlers
    (a test's, an application's) keep receiving feast-edge's records unchanged."""
    import logging

    if logging.getLogger().handlers:
        return
    logger = logging.getLogger("feast_edge")
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    if not any(getattr(h, "feast_edge", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s feast-edge %(levelname)s %(message)s", "%H:%M:%S"))
        handler.feast_edge = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
