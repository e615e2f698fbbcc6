"""The training methods the harness can run, by name (``feast-edge simulate --method NAME``), each imported on first use."""

from __future__ import annotations

import importlib

from feast_edge.errors import FeastError

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


class MethodError(FeastError, ValueError):
    """A method cannot run with the given settings (unknown name, missing or invalid option)."""


def method_class(name: str) -> type:
    """The class of method ``name`` (a ``feast_edge.sim.methods.base.Method``; imported here by name, so the set-up that
    checks a method's options never imports the methods' base); a one-line MethodError for an unknown name."""
    if name not in _REGISTRY:
        raise MethodError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)
