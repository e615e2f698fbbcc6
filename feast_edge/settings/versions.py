"""How served models become versions a device may refuse (feast_edge.versions): whether they do, the canary share a
new version goes to first, and whether devices gate an install on their own held-out split."""

from __future__ import annotations

from dataclasses import dataclass

from feast_edge.settings.nested import Concern, check, setting
from feast_edge.settings.shared import CANARY
from feast_edge.versions.canary import DEFAULT_SHARE

INSTALL_GATES = ("on", "off")  # --install-gate


@dataclass(frozen=True)
class ModelVersions(Concern):
    """Served models as versions: canaries across budget tiers first, then every device, each gating its install."""

    apps = ("simulation",)

    versions: bool = setting(
        False,
        help="Every change of the served round is a new version (versions.sqlite in --out): offered to canaries "
        "first, to every device if they do not regress, each device installing it only if not worse than the model "
        "it runs on its own held-out split (needs --validate-on devices).",
    )
    canary: float = setting(
        DEFAULT_SHARE,
        min=0.0,
        max=1.0,
        help=CANARY,
    )
    install_gate: str = setting(
        "on",
        help="With --versions: on: a device installs a version only if it is not worse than the one it runs "
        "(the served-round rule's test, paired on its held-out split); off: every offered version is installed "
        "(what a fleet without the gate would run).",
    )

    def __post_init__(self) -> None:
        check(
            [
                (0 <= self.canary <= 1, f"--canary {self.canary} must be a share in [0, 1]"),
                (
                    self.install_gate in INSTALL_GATES,
                    f"--install-gate {self.install_gate!r} is unknown; choose one of {', '.join(INSTALL_GATES)}",
                ),
            ]
        )

    @property
    def gated(self) -> bool:
        return self.install_gate == "on"
