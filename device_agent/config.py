"""What a ``feast-agent run`` is told: the CLI flags of ``feast-agent run`` map onto :class:`AgentConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from feast_edge.privacy.local import LocalDp
from feast_edge.transport.frames import DEFAULT_CHUNK_SIZE


@dataclass(frozen=True)
class AgentConfig:
    """Who the agent is and how it trains; the CLI flags of ``feast-agent run`` map onto these fields."""

    host: str  # --device-id: the agent's presence id (and the device id of a single client)
    federation: str = "feast"
    preset: str = "fmnist-small"
    cache: str | None = None  # --cache: variant cache JSON (None: beside the preset's own file, else the shipped one)
    torch_device: str = "cpu"  # where local training runs (--device: cpu, cuda[:N])
    amp: str = (
        "off"  # mixed precision of local training (feast_edge.local.precision.AMP_MODES; the CLI's default is auto)
    )
    budget_macs: float | None = (
        None  # one budget for every hosted client (--budget / --profile); None: each shard's own
    )
    profile: dict[str, Any] = field(default_factory=dict)  # summary sent with the registration
    # The precision the device is served in, which its budget was measured at (the --profile's; fp32 with --budget).
    # Not --amp: that is how local training computes.
    precision: str = "fp32"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    # --threads: N fixes PyTorch's and onnxruntime's; 0 (feast-agent run's default) chooses them from the free cores
    # before each step (feast_edge.util.cores); None leaves PyTorch's as the process has it (a library caller's)
    threads: int | None = None
    register_timeout: float = 60.0
    send_timeout: float = 120.0
    model_dir: str | None = None  # where pushed ONNX models are saved (None: announced models are only logged)
    # --personalize: auto, off, METHOD or METHOD:STRENGTH (feast_edge.personalize.select.CHOICES); the personal model
    # is written beside the served one in model_dir
    personalize: str = "auto"
    # --evaluate-up-to: "auto" (memory allowing), "serving" (its budget), or a MAC count as text ("20M"): the largest
    # variant it evaluates and BN-calibrates for the federation (feast_edge.budget.derive.evaluation_limit).
    evaluate_up_to: str = "auto"
    # --rescan: seconds between two listings of a growing image folder or manifest, at least (0: read it once);
    # feast_edge.agent.growth
    rescan: float = 60.0
    stay: bool = False  # after the federation finishes, keep waiting for the next run instead of exiting
    # --dp-clip/--dp-noise: local DP this device requires on every update it sends, whatever the server asks
    # (feast_edge.privacy.local); the ledger keeps what it spent across runs, ε reported at dp_delta.
    dp_clip: float | None = None
    dp_noise: float | None = None
    dp_delta: float = 1e-5
    dp_ledger: str | None = None  # None: nothing kept between runs (the CLI always gives one)

    def required_dp(self) -> LocalDp | None:
        """The local DP this device requires (None: what the server asks, if anything)."""
        return None if self.dp_clip is None or self.dp_noise is None else LocalDp(self.dp_clip, self.dp_noise)
