"""The server's serving concern: which variant each device is served, in which precision, and how a new version
reaches the devices (docs/server.md, "Versions, canaries and installs")."""

from __future__ import annotations

from dataclasses import dataclass

from feast_edge.evaluate.coverage import SERVING_RULES
from feast_edge.settings import Concern
from feast_edge.settings.nested import check, setting
from feast_edge.settings.shared import CANARY
from feast_edge.versions.canary import DEFAULT_SHARE

SERVED_PRECISIONS = ("auto", "fp32", "int8")  # --precision: auto = the precision each device registered


@dataclass(frozen=True)
class Serving(Concern):
    """Which variant each device is served, and in which precision."""

    serving_rule: str = setting(
        "validated",
        help="Which variant a device is served: validated (its largest affordable, unless a smaller affordable one "
        "is clearly better on the federation's validation: by 2 points and 2 standard errors) or largest "
        "(method §8's largest affordable, whatever validation says).",
    )
    # auto: the precision of each device's registration (feast_edge.evaluate.quantize).
    precision: str = setting(
        "auto",
        help="Precision of the served ONNX files: auto (each device's, as its profile was measured), fp32, or int8 "
        "(onnxruntime static quantization on the server's calibration split, or on each device's own data).",
    )
    int8_samples: int = setting(256, min=1, help="Images that set an int8 file's activation ranges.")
    int8_tolerance: float = setting(
        0.01,
        help="Accuracy an int8 file may lose against float32 on held-out data (0.01 = 1 point); past it, the float32 "
        "file is kept.",
    )
    canary: float = setting(
        DEFAULT_SHARE,
        min=0,
        max=1,
        help=CANARY,
    )

    def __post_init__(self) -> None:
        check(
            [
                (
                    self.serving_rule in SERVING_RULES,
                    f"--serving-rule {self.serving_rule!r} must be one of {', '.join(SERVING_RULES)}",
                ),
                (
                    self.precision in SERVED_PRECISIONS,
                    f"--precision {self.precision!r} must be one of {', '.join(SERVED_PRECISIONS)} (auto: each "
                    "device's profile)",
                ),
                (self.int8_samples >= 1, f"--int8-samples {self.int8_samples} must be at least 1"),
                (0 <= self.canary <= 1, f"--canary {self.canary:g} must be a share in [0, 1] (0: no canaries)"),
                (
                    0 <= self.int8_tolerance <= 1,
                    f"--int8-tolerance {self.int8_tolerance:g} must be a fraction in [0, 1] (0.01 = 1 point)",
                ),
            ]
        )
