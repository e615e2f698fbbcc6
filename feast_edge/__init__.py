"""feast-edge: federated shared-space training (FEAST) for heterogeneous edge fleets.

The method as a library: presets and architectures of the shared elastic
network, its exact cost model, the elastic supernet, extraction of a static
model for one device, and its ONNX export.
"""

from feast_edge.errors import ArchError, CheckpointError, FeastError, PresetError
from feast_edge.space.arch import Arch
from feast_edge.space.cost import count_macs, count_params
from feast_edge.space.geometry import Layout, StageLayout, arch_layout, make_divisible, supernet_layout
from feast_edge.space.preset import Preset, available_presets, load_preset

__version__ = "0.1.0"

__all__ = [
    "Arch",
    "ArchError",
    "CheckpointError",
    "FeastError",
    "Layout",
    "Preset",
    "PresetError",
    "StageLayout",
    "arch_layout",
    "available_presets",
    "count_macs",
    "count_params",
    "load_preset",
    "make_divisible",
    "supernet_layout",
]
