"""A run's settings, nested by concern and shared by the simulation, the federation server and the Flower apps
(:mod:`feast_edge.settings.concerns`), with their flat form by key (:mod:`feast_edge.settings.nested`)."""

from feast_edge.settings.concerns import Aggregation, Population, Privacy, Schedule, Training, Validation
from feast_edge.settings.nested import Concern, SettingsError, changed, flat, flat_types, of, setting

__all__ = [
    "Aggregation",
    "Concern",
    "Population",
    "Privacy",
    "Schedule",
    "SettingsError",
    "Training",
    "Validation",
    "changed",
    "flat",
    "flat_types",
    "of",
    "setting",
]
