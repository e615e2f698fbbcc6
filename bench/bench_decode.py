"""First-start decode throughput of a device's image folder: torchvision ImageFolder loop vs load_data, and the cached start.

    PYTHONPATH=. python bench/bench_decode.py [--images 5000] [--size 32] [--repeats 2] [--workers N]

Writes ``--images`` PNG and JPEG files of mixed sizes (24..256 px a side, grey
and RGB, 10 classes) to a temporary folder once (not timed; the files are then
in the OS page cache), then, interleaved ``--repeats`` times:

* ``torchvision``: ``datasets.ImageFolder`` with ``Resize((size, size))`` and
  ``PILToTensor``, indexed one by one and stacked (what ``simulate --dataset
  imagefolder`` did before ``load_data``);
* ``load_data, 1 thread``: the loader with ``workers=1``, cache off (decoding alone);
* ``load_data, first start``: the loader with its default threads and an empty cache (decode + write the cache);
* ``load_data, cached start``: the loader again: list the files, check the cache's hash, read the tensors.

Prints the median images/s of each, the ratios to torchvision, and whether
the tensors are identical (the same Pillow resize, so they should be).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from feast_edge.data.decode import default_workers
from feast_edge.data.sources import load_data
from feast_edge.data.task import Task

CLASSES = tuple(f"class-{i}" for i in range(10))


def write_images(root: Path, count: int, seed: int = 0) -> int:
    """``count`` PNG/JPEG files of mixed sizes and modes under ``root/<class>/``; returns the bytes written."""
    rng = np.random.default_rng(seed)
    specs = [
        (
            i,
            int(rng.integers(24, 257)),
            int(rng.integers(24, 257)),
            bool(rng.random() < 0.3),
            int(rng.integers(0, 2**31)),
        )
        for i in range(count)
    ]
    for cls in CLASSES:
        (root / cls).mkdir(parents=True, exist_ok=True)

    def one(spec: tuple[int, int, int, bool, int]) -> int:
        i, width, height, grey, seed_i = spec
        r = np.random.default_rng(seed_i)
        y, x = np.mgrid[0:height, 0:width]
        base = (x * r.uniform(0.2, 2) + y * r.uniform(0.2, 2)) % 256  # a smooth picture with some noise
        pixels = np.clip(base[..., None] + r.normal(0, 12, (height, width, 1 if grey else 3)), 0, 255).astype(np.uint8)
        image = Image.fromarray(pixels[..., 0] if grey else pixels)
        path = root / CLASSES[i % len(CLASSES)] / (f"{i:06d}.png" if i % 2 else f"{i:06d}.jpg")
        image.save(path, quality=90) if path.suffix == ".jpg" else image.save(path)
        return path.stat().st_size

    with ThreadPoolExecutor(default_workers()) as pool:
        return sum(pool.map(one, specs))


def torchvision_loop(root: Path, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from torchvision import datasets, transforms

    transform = transforms.Compose(
        [transforms.Lambda(lambda im: im.convert("RGB")), transforms.Resize((size, size)), transforms.PILToTensor()]
    )
    folder = datasets.ImageFolder(str(root), transform=transform)
    images = torch.stack([folder[i][0] for i in range(len(folder))])
    return images, torch.tensor(folder.targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--size", type=int, default=32, help="the task's input size (3 x size x size, stretch)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=None, help="load_data's threads (default: the CPUs)")
    args = parser.parse_args()
    task = Task(3, args.size, CLASSES, (0.5,) * 3, (0.25,) * 3)
    workers = args.workers or default_workers()
    tmp = Path(tempfile.mkdtemp(prefix="bench-decode-"))
    root, cache = tmp / "images", tmp / "cache"
    try:
        started = time.perf_counter()
        written = write_images(root, args.images)
        print(
            f"{args.images:,} images ({written / 2**20:.1f} MiB: half PNG, half JPEG, 24..256 px a side, 30% grey) "
            f"written in {time.perf_counter() - started:.1f} s; task {task.describe()}"
        )
        print(
            f"torch {torch.__version__}, Pillow {Image.__version__}, {os.cpu_count()} CPUs, load_data threads {workers}"
        )
        runs = {
            "torchvision ImageFolder loop": lambda: torchvision_loop(root, args.size),
            "load_data, 1 thread, no cache": lambda: _tensors(load_data(root, task, cache_dir=False, workers=1)),
            f"load_data, first start ({workers} threads)": lambda: _first(root, task, cache, workers),
            "load_data, cached start": lambda: _cached(root, task, cache, workers),
        }
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for _ in range(args.repeats):
            for name, run in runs.items():
                t0 = time.perf_counter()
                results[name] = run()
                seconds[name].append(time.perf_counter() - t0)
        reference = statistics.median(seconds["torchvision ImageFolder loop"])
        print(f"{'':44} {'median s':>9} {'images/s':>10} {'vs torchvision':>15}")
        for name, values in seconds.items():
            median = statistics.median(values)
            print(f"{name:44} {median:9.2f} {args.images / median:10,.0f} {reference / median:14.2f}x")
        tv_images, tv_labels = results["torchvision ImageFolder loop"]
        same = all(torch.equal(tv_images, im) and torch.equal(tv_labels, lb) for im, lb in results.values())
        print(f"tensors identical to torchvision's: {'yes' if same else 'NO'}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tensors(data) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    return data.images, data.labels


def _first(root: Path, task: Task, cache: Path, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    shutil.rmtree(cache, ignore_errors=True)
    data = load_data(root, task, cache_dir=cache, workers=workers)
    assert not data.from_cache
    return _tensors(data)


def _cached(root: Path, task: Task, cache: Path, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = load_data(root, task, cache_dir=cache, workers=workers)
    assert data.from_cache, "the cached start did not find the cache"
    return _tensors(data)


if __name__ == "__main__":
    sys.exit(main())
