"""Training methods of the simulation harness: FEAST, the centralized reference and the paper's baselines (SPEC §9).

``feast-edge simulate --method NAME`` picks one; every method runs on the same
population, partition, cohorts, budgets, data and evaluation (see
:mod:`feast_edge.sim.methods.base` for the contract). Methods are imported on
first use, so listing them costs nothing.
"""

from __future__ import annotations

import importlib

from feast_edge.sim.methods.base import Method, MethodError, OperatingPoint

# name -> "module:Class"; the order is the order of --help and of reports.
_REGISTRY = {
    "feast": "feast_edge.sim.methods.feast:Feast",
    "centralized": "feast_edge.sim.methods.centralized:Centralized",
    "heterofl": "feast_edge.sim.methods.heterofl:HeteroFL",
    "scalefl": "feast_edge.sim.methods.scalefl:ScaleFL",
    "fiarse": "feast_edge.sim.methods.fiarse:Fiarse",
    "sfn": "feast_edge.sim.methods.fednas:SuperFedNAS",
    "dfn": "feast_edge.sim.methods.fednas:DeepFedNAS",
}
METHODS = tuple(_REGISTRY)


def method_class(name: str) -> type[Method]:
    """The class of method ``name``; a one-line MethodError for an unknown name."""
    if name not in _REGISTRY:
        raise MethodError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["METHODS", "Method", "MethodError", "OperatingPoint", "method_class"]
