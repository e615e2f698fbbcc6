"""One co-training step (min + rand + max with KD) vs the same variants' single-variant steps; AMP vs float32.

    python bench/bench_cotrain.py [--preset fmnist-small] [--batch 64] [--repeats 20] [--threads N]
                                  [--device cpu|cuda] [--amp off|auto|bf16|fp16]

Both sides see the same augmented Fashion-MNIST batch. The co-training step is
``feast_edge.local.cotrain.cotrain_step`` (three forward/backward passes, KD, gradient
clipping, slice-masked weight decay, one SGD step); each single-variant step is
a plain forward / backward / SGD step. Prints the medians and the ratio
co-train / (sum of single steps) (target <= 1.1). With ``--amp`` other than off, a
second copy of the supernet runs the same co-training step under that mixed precision
(feast_edge.local.precision) and the ratio AMP / float32 is printed as well. On CUDA every timed
call ends with a synchronize, so the times are the GPU's.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _timing import interleaved  # noqa: E402

from feast_edge.data.images import FASHION_MNIST_DIR, load_fashion_mnist  # noqa: E402
from feast_edge.local.augment import BatchAugmenter  # noqa: E402
from feast_edge.local.cotrain import ShapeCache, cotrain_step, make_optimizer, supervised_loss  # noqa: E402
from feast_edge.local.precision import resolve_amp  # noqa: E402
from feast_edge.local.recipe import TrainConfig  # noqa: E402
from feast_edge.space.arch import Arch  # noqa: E402
from feast_edge.space.cost import arch_cost  # noqa: E402
from feast_edge.space.preset import Preset, load_preset  # noqa: E402
from feast_edge.space.supernet import Supernet  # noqa: E402


def bench_variants(preset: Preset) -> dict[str, Arch]:
    """``a_min``, an intermediate ``a_rand`` and ``a_max`` (the ~40M-MAC cached top on fmnist-small)."""
    n = preset.num_stages
    mid_e = preset.expansion_ratios[len(preset.expansion_ratios) // 2]
    top = (
        Arch((0, 0, 2, 2), (1.0, 0.5, 1.0, 0.5), (3, 6, 8, 8, 9))
        if preset.name == "fmnist-small"
        else Arch.largest(preset)
    )
    return {"min": Arch.smallest(preset), "rand": Arch((1,) * n, (mid_e,) * n, (4,) * (n + 1)), "max": top}


def batch_for(preset: Preset, size: int):
    """One augmented batch: real Fashion-MNIST for 1x28x28 presets, random uint8 pixels otherwise."""
    g = torch.Generator().manual_seed(0)
    if (preset.in_channels, preset.input_size) == (1, 28):
        data = load_fashion_mnist(FASHION_MNIST_DIR, "train")
        images, labels = data.images[:size], data.labels[:size] % preset.classes
    else:
        shape = (size, preset.in_channels, preset.input_size, preset.input_size)
        images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        labels = torch.randint(0, preset.classes, (size,), generator=g)
    return BatchAugmenter(preset.mean, preset.std, preset.classes)(images, labels, 0, g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="fmnist-small")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--amp", default="off", help="also time the co-training step under this mixed precision: auto, bf16 or fp16"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = load_preset(args.preset)
    config = TrainConfig()
    variants = bench_variants(preset)
    device = torch.device(args.device)
    precision = resolve_amp(args.amp, device)
    batch = batch_for(preset, args.batch)
    batch = type(batch)(batch.images.to(device), batch.targets.to(device), batch.mixer)
    x, targets = batch.images, batch.targets

    cotrained = Supernet(preset, seed=0).to(device).train()
    co_opt, shapes = make_optimizer(cotrained, config, config.lr), ShapeCache(cotrained)
    plan = [("max", variants["max"]), ("min", variants["min"]), ("rand", variants["rand"])]

    single = copy.deepcopy(cotrained)
    plain_opt = torch.optim.SGD(
        single.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )

    def single_step(arch: Arch) -> None:
        plain_opt.zero_grad(set_to_none=True)
        supervised_loss(single(x, arch), targets).backward()
        plain_opt.step()

    fns = {"co-train": lambda: cotrain_step(cotrained, co_opt, batch, plan, config, shapes)}
    fns.update({f"single {role}": (lambda a=arch: single_step(a)) for role, arch in variants.items()})
    amp_name = f"co-train {precision.mode}"
    if precision.mode != "off":
        mixed = copy.deepcopy(cotrained)
        mixed_opt, mixed_shapes, grad = make_optimizer(mixed, config, config.lr), ShapeCache(mixed), precision.scaler()
        fns[amp_name] = lambda: cotrain_step(mixed, mixed_opt, batch, plan, config, mixed_shapes, precision, grad)
    if device.type == "cuda":  # CUDA runs asynchronously: time each call to the end of its kernels
        fns = {name: (lambda f=fn: (f(), torch.cuda.synchronize(device))) for name, fn in fns.items()}
    times = interleaved(fns, repeats=args.repeats)

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"preset {preset.name}, batch {args.batch}, torch {torch.__version__}, {torch.get_num_threads()} threads, {where}, AMP {precision.describe()}"
    )
    for role, arch in variants.items():
        print(f"  a_{role:<4} {arch_cost(preset, arch)[0] / 1e6:>7.2f}M MACs  {arch}")
    for name, seconds in times.items():
        print(f"{name:<12} {seconds * 1e3:>9.2f} ms")
    singles = sum(v for k, v in times.items() if k.startswith("single"))
    print(f"{'sum singles':<12} {singles * 1e3:>9.2f} ms")
    print(f"ratio co-train / sum of single-variant steps: {times['co-train'] / singles:.3f} (target <= 1.1)")
    if amp_name in times:
        print(
            f"ratio co-train {precision.describe()} / float32: {times[amp_name] / times['co-train']:.3f} (speed-up {times['co-train'] / times[amp_name]:.2f}x)"
        )


if __name__ == "__main__":
    main()
