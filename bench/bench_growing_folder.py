"""A folder that grows: rescan + incremental decode of 50 new images beside 5,000 cached ones, vs decoding all again.

    PYTHONPATH=. python bench/bench_growing_folder.py [--images 5000] [--new 50] [--size 32] [--repeats 3]

Writes ``--images`` PNG and JPEG files of mixed sizes (24..256 px a side, grey and RGB, 10 classes; as
bench/bench_decode.py's pictures) to a temporary folder and decodes them once into a decoded cache (the entry a running agent
holds), then writes ``--new`` more files (not timed; all in the OS page cache). Then, interleaved ``--repeats`` times,
each from a fresh copy of that cache:

* ``incremental``: what ``feast-agent run`` does between rounds: list the folder (``scan_source``: one stat per file),
  compare its key, and read it through the cache, which decodes only the new files and copies the others' rows
  from the previous entry (``load_listing``), writing the new entry;
* ``decode everything``: what a change to the folder cost before: the same listing, then every file decoded again and
  the entry written (an empty cache folder);
* ``rescan, nothing new``: the periodic listing alone, when the folder did not change (what ``--rescan`` costs).

Prints the median seconds of each, the ratio, and whether the tensors are identical; writes the figures as a record
(bench/results/growing-folder-<date>-<commit>.json).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _records import REPO, write_record  # noqa: E402
from bench_decode import CLASSES, write_images  # noqa: E402

from feast_edge.data.decode import default_workers  # noqa: E402
from feast_edge.data.sources import load_listing, scan_source  # noqa: E402
from feast_edge.data.task import Task  # noqa: E402


def add_images(root: Path, folder: Path, count: int) -> int:
    """``count`` more files (bench_decode's pictures, another seed) moved into ``root/<class>/`` as ``new-*``; bytes."""
    written = write_images(folder, count, seed=1)
    for file in sorted(folder.rglob("*.*")):
        file.rename(root / file.parent.name / f"new-{file.name}")
    return written


def timed(run):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = run()
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--new", type=int, default=50)
    parser.add_argument("--size", type=int, default=32, help="the task's input size (3 x size x size, stretch)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    task = Task(3, args.size, CLASSES, (0.5,) * 3, (0.25,) * 3)
    workers = default_workers()
    tmp = Path(tempfile.mkdtemp(prefix="bench-grow-"))
    root, base = tmp / "images", tmp / "cache-before"
    try:
        written = write_images(root, args.images)
        first = load_listing(scan_source(root, task), task, cache_dir=base)  # the entry the agent holds
        assert not first.from_cache and len(first) == args.images
        written_new = add_images(root, tmp / "new", args.new)
        print(
            f"{args.images:,} images ({written / 2**20:.1f} MiB) + {args.new} new ({written_new / 2**10:.0f} KiB): "
            f"half PNG, half JPEG, 24..256 px a side, 30% grey; task {task.describe()}; {workers} decoding threads"
        )

        def incremental():  # type: ignore[no-untyped-def]
            listing = scan_source(root, task, unknown="skip")
            assert listing.key(task) != first.key
            data = load_listing(listing, task, cache_dir=cache)
            assert data.reused == args.images and not data.from_cache
            return data

        def everything():  # type: ignore[no-untyped-def]
            listing = scan_source(root, task, unknown="skip")
            data = load_listing(listing, task, cache_dir=cache)
            assert data.reused == 0
            return data

        def unchanged():  # type: ignore[no-untyped-def]
            listing = scan_source(root, task, unknown="skip")
            return listing.key(task)

        seconds: dict[str, list[float]] = {"incremental": [], "decode everything": [], "rescan, nothing new": []}
        results = {}
        for _ in range(args.repeats):
            cache = tmp / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            shutil.copytree(base, cache)
            s, results["incremental"] = timed(incremental)
            seconds["incremental"].append(s)
            s, key = timed(unchanged)
            assert key == results["incremental"].key
            seconds["rescan, nothing new"].append(s)
            shutil.rmtree(cache)
            cache.mkdir()
            s, results["decode everything"] = timed(everything)
            seconds["decode everything"].append(s)
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        ratio = medians["decode everything"] / medians["incremental"]
        a, b = results["incremental"], results["decode everything"]
        identical = torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
        print(f"{'':24} {'median s':>9}  runs")
        for name, values in seconds.items():
            print(f"{name:24} {medians[name]:9.3f}  {', '.join(f'{v:.3f}' for v in values)}")
        print(f"decode everything / incremental: {ratio:.1f}x; tensors identical: {'yes' if identical else 'NO'}")
        figures = {
            "images": args.images,
            "new": args.new,
            "size": args.size,
            "workers": workers,
            "repeats": args.repeats,
            "seconds": seconds,
            "median_seconds": medians,
            "ratio_everything_to_incremental": ratio,
            "identical": identical,
            "os_cpus": os.cpu_count(),
        }
        print(f"wrote {write_record('growing-folder', figures).relative_to(REPO)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
