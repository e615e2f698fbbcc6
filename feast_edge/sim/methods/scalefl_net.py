"""ScaleFL's network: a ResNet-18-style stack of 8 BasicBlocks with early exits, its costs and its level search.

The network (Ilhan et al. 2023 as the FEAST paper runs it, supplement E.1): the
preset's stem (3×3 conv ``in → hidden[0]`` at the preset's stem stride, BN,
ReLU; no max-pool), four stages of two BasicBlocks (strides 1, 2, 2, 2; a 1×1
projection shortcut in the first block of stages 2–4), and an exit head
(global average pool → Linear, all classes) after the last block of every
level. Scaling a level is structural: the first ``blocks`` blocks, every
hidden width ``ceil(width · C)`` (input channels and classes never scaled), so
every tensor of a level's network is the leading slice of the global tensor of
the same state-dict name.

Hidden widths: HeteroFL's rule (:func:`feast_edge.sim.methods.resnet18.hidden_for_budget`,
so the two baselines share one network scale): ``(w, 2w, 4w, 8w)`` with ``w``
the largest multiple of 8 whose full network fits ``preset.budget_cap`` MACs,
i.e. widths 64·k rounded to multiples of 8. On the paper presets that is the
paper's [64, 128, 256, 512] (555.5M MACs against the 600M cap; w = 72 would
cost 703M); on ``fmnist-small`` (28×28×1, 40M cap) [16, 32, 64, 128] at
28.6M MACs.

Level search (ScaleFL §3.1.1, "scale depth and width alike", as the FEAST
reference ``baselines/scalefl/split_config.py`` runs it; ScaleFL's own code
takes the widths as arguments): for each compute ratio r < 1 of
(0.061, 0.13, 0.25, 1.0), every (blocks ∈ 1..8, width ∈ {1/20, …, 20/20})
whose MACs lie within 15 % of ``r ·`` the full network's is a candidate; the
level is the candidate with the smallest ``|blocks/8 − width|`` (compared in
exact integers), ties to the cheaper one; without a candidate in tolerance the
closest ratio wins. On paper-cifar100 this gives the paper's (3, 0.40),
(4, 0.50), (5, 0.60), (8, 1.00) at 35.3M / 72.2M / 127.1M / 555.5M MACs.
Choices: the tie rule matters once, (5, 0.60) against (5, 0.65), both 0.025
off balance and in tolerance; the reference keeps the first its
(blocks, width) loop finds, the cheaper one, and so do we (the one closer to
the target would be 0.65). A candidate's MACs include its own deepest exit
head (what serving it costs); the reference counts the backbone only; the head
is < 0.2 % of a level and changes no level on any preset.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from feast_edge.sim.methods.resnet18 import hidden_for_budget
from feast_edge.space.preset import Preset
from feast_edge.space.supernet import init_weights
from feast_edge.util.slicing import leading_slice

STAGES = 4
BLOCKS_PER_STAGE = 2
TOTAL_BLOCKS = STAGES * BLOCKS_PER_STAGE
RATIOS = (0.061, 0.13, 0.25, 1.0)  # ScaleFL's compute ratios of its four levels
TOLERANCE = 0.15  # |MAC / target − 1| a level candidate may miss its target by
WIDTH_STEPS = 20  # width candidates 1/20 … 20/20


@dataclass(frozen=True)
class Geometry:
    """The network's fixed shape: input, stem stride, classes and every stage's full hidden width."""

    in_channels: int
    input_size: int
    stem_stride: int
    classes: int
    hidden: tuple[int, ...]

    @classmethod
    def of(cls, preset: Preset) -> Geometry:
        """The preset's input, stem and classes with HeteroFL's widths for its budget cap (module docstring)."""
        hidden = hidden_for_budget(
            preset.in_channels, preset.input_size, preset.classes, preset.stem_stride, preset.budget_cap
        )
        return cls(preset.in_channels, preset.input_size, preset.stem_stride, preset.classes, tuple(hidden))

    def channels(self, width: float) -> tuple[int, ...]:
        """Every stage's width at ``width`` (``ceil(width·C)``, rounding noise of the float product removed)."""
        return tuple(max(1, math.ceil(round(width * c, 9))) for c in self.hidden)

    def layout(self, blocks: int, width: float) -> list[tuple[int, int, int, int]]:
        """``(c_in, c_out, stride, output resolution)`` of the first ``blocks`` blocks at ``width``."""
        chans = self.channels(width)
        size = (self.input_size - 1) // self.stem_stride + 1
        c_in, shapes = chans[0], []
        for k in range(blocks):
            stage = k // BLOCKS_PER_STAGE
            stride = 2 if stage > 0 and k % BLOCKS_PER_STAGE == 0 else 1
            size = (size - 1) // stride + 1
            shapes.append((c_in, chans[stage], stride, size))
            c_in = chans[stage]
        return shapes

    def exit_channels(self, after: int, width: float) -> int:
        """Input features of an exit head after block ``after`` (1-based count)."""
        return self.channels(width)[(after - 1) // BLOCKS_PER_STAGE]

    def macs(self, blocks: int, width: float, exits: Sequence[int]) -> int:
        """Conv + linear MACs of the first ``blocks`` blocks at ``width`` with heads after the blocks ``exits`` (method §2 rules)."""
        size = (self.input_size - 1) // self.stem_stride + 1
        total = self.in_channels * self.channels(width)[0] * 9 * size * size
        for c_in, c_out, stride, h in self.layout(blocks, width):
            total += (c_in * c_out * 9 + c_out * c_out * 9) * h * h
            if stride > 1:
                total += c_in * c_out * h * h
        return total + sum(self.exit_channels(b, width) * self.classes for b in exits)

    def params(self, blocks: int, width: float, exits: Sequence[int]) -> int:
        """Parameters (conv weights, BN weight+bias, linear weight+bias) of the same network."""
        c0 = self.channels(width)[0]
        total = self.in_channels * c0 * 9 + 2 * c0
        for c_in, c_out, stride, _ in self.layout(blocks, width):
            total += c_in * c_out * 9 + c_out * c_out * 9 + 4 * c_out
            if stride > 1:
                total += c_in * c_out + 2 * c_out
        return total + sum((self.exit_channels(b, width) + 1) * self.classes for b in exits)

    def to_dict(self) -> dict:
        return {
            "input": [self.in_channels, self.input_size, self.input_size],
            "stem_stride": self.stem_stride,
            "classes": self.classes,
            "hidden": list(self.hidden),
        }


@dataclass(frozen=True)
class Level:
    """One ScaleFL level: its (blocks, width), where its exits sit, and its costs.

    ``macs``/``params``: the served model (backbone + deepest exit). ``train_macs``/``train_params``:
    the network a client of this level trains and receives (backbone + every exit up to its own).
    """

    level: int  # 1-based
    blocks: int
    width: float
    exit_after: tuple[int, ...]  # block count after which exits 1..level sit
    macs: int
    params: int
    train_macs: int
    train_params: int

    @property
    def label(self) -> str:
        return f"level {self.level} ({self.blocks} blocks, width {self.width:.2f})"


def search_splits(
    geometry: Geometry, ratios: Sequence[float] = RATIOS, tolerance: float = TOLERANCE, steps: int = WIDTH_STEPS
) -> list[tuple[int, float]]:
    """``(blocks, width)`` per compute ratio: the most depth–width balanced candidate within tolerance (module docstring)."""
    full = geometry.macs(TOTAL_BLOCKS, 1.0, (TOTAL_BLOCKS,))
    cost = {
        (nb, i): geometry.macs(nb, i / steps, (nb,)) for nb in range(1, TOTAL_BLOCKS + 1) for i in range(1, steps + 1)
    }
    splits = []
    for r in ratios:
        if r >= 1:
            splits.append((TOTAL_BLOCKS, 1.0))
            continue
        inside = [c for c, m in cost.items() if abs(m / (r * full) - 1) <= tolerance]
        if inside:  # |nb/8 − i/steps| in exact integers: |steps·nb − 8·i|
            nb, i = min(inside, key=lambda c: (abs(steps * c[0] - TOTAL_BLOCKS * c[1]), cost[c]))
        else:
            nb, i = min(cost, key=lambda c: (abs(cost[c] / full - r), cost[c]))
        splits.append((nb, i / steps))
    return splits


def build_levels(geometry: Geometry, splits: Sequence[tuple[int, float]]) -> tuple[Level, ...]:
    """The levels of ``splits``; each level's network must contain every earlier level's exit (nested depth and width)."""
    for (b0, w0), (b1, w1) in itertools.pairwise(splits):
        if b1 < b0 or w1 < w0:
            raise ValueError(f"ScaleFL levels must grow in depth and width; got {tuple(splits)}")
    blocks = [b for b, _ in splits]
    levels = []
    for k, (b, w) in enumerate(splits):
        exits = tuple(blocks[: k + 1])
        levels.append(
            Level(
                k + 1,
                b,
                w,
                exits,
                geometry.macs(b, w, (b,)),
                geometry.params(b, w, (b,)),
                geometry.macs(b, w, exits),
                geometry.params(b, w, exits),
            )
        )
    return tuple(levels)


class BasicBlock(nn.Module):
    """Two 3×3 conv–BN layers with a residual; a 1×1 conv–BN projection where the stage downsamples."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride > 1
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ScaleFLNet(nn.Module):
    """The first ``blocks`` blocks at ``width`` with exit heads after the block counts ``exit_after``; returns every exit's logits."""

    def __init__(
        self, geometry: Geometry, blocks: int, width: float, exit_after: Sequence[int], seed: int | None = None
    ) -> None:
        super().__init__()
        c0 = geometry.channels(width)[0]
        self.stem = nn.Sequential(
            nn.Conv2d(geometry.in_channels, c0, 3, geometry.stem_stride, 1, bias=False), nn.BatchNorm2d(c0), nn.ReLU()
        )
        self.blocks = nn.ModuleList(
            BasicBlock(c_in, c_out, stride) for c_in, c_out, stride, _ in geometry.layout(blocks, width)
        )
        self.exits = nn.ModuleList(nn.Linear(geometry.exit_channels(b, width), geometry.classes) for b in exit_after)
        self.exit_after = tuple(exit_after)
        if seed is not None:
            init_weights(self, torch.Generator().manual_seed(seed))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = self.stem(x)
        logits = []
        for count, block in enumerate(self.blocks, start=1):
            x = block(x)
            if count in self.exit_after:
                pooled = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
                logits += [head(pooled) for head, at in zip(self.exits, self.exit_after) if at == count]
        return logits


class DeepestExit(nn.Module):
    """A ScaleFLNet answering with its deepest exit only (what a level serves)."""

    def __init__(self, net: ScaleFLNet) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)[-1]


def level_net(geometry: Geometry, level: Level) -> ScaleFLNet:
    """An uninitialised network of ``level``'s shape (its blocks, width and exits 1..level)."""
    return ScaleFLNet(geometry, level.blocks, level.width, level.exit_after)


@torch.no_grad()
def load_slices(net: nn.Module, global_state: Mapping[str, torch.Tensor]) -> nn.Module:
    """Copy into ``net`` the leading slice of the same-named global tensor for every entry of its state dict."""
    net.load_state_dict(
        {name: leading_slice(global_state[name], t.shape).clone() for name, t in net.state_dict().items()}
    )
    return net
