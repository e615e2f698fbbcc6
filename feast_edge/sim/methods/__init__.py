"""Training methods of the simulation harness: FEAST, the centralized reference and the paper's baselines (method §9).

``feast-edge simulate --method NAME`` picks one; every method runs on the same
population, partition, cohorts, budgets, data and evaluation (see
:mod:`feast_edge.sim.methods.base` for the contract). Methods are imported on
first use, so listing them costs nothing.
"""

from __future__ import annotations

from feast_edge.evaluate.points import OperatingPoint
from feast_edge.sim.methods.base import Method
from feast_edge.sim.registry import METHODS, MethodError, method_class

__all__ = ["METHODS", "Method", "MethodError", "OperatingPoint", "method_class"]
