"""The final weights of fixed-seed simulations, as digests: what a change to the round's plumbing must not move.

Each case is a ``feast-edge simulate`` command line (the tiny simulation of tests/simconfigs.py, one PyTorch thread,
float32): the methods, central DP with fixed and adaptive clipping, local DP, each robust rule, each server
optimizer and a cohort spread over two processes. The command line is the contract: option names outlive the
internals, so the same cases run on an older commit and on a newer one.

``digest(run)`` hashes the model tensors of a run's last checkpoint (names, dtypes, shapes and bytes), leaving out
what is not weights (a server optimizer's state, the records' timing fields). Floating-point results depend on the
CPU's instruction set, so digests are kept per machine (``machine()``: CPU model, the flags that pick PyTorch's
kernels, torch's version) in tests/data/same-weights.json, beside the commit they were made from.

    python tests/sameweights.py record           # add this machine's digests, made by the code in this checkout
    python tests/sameweights.py record --commit C   # ... made by commit C's code (built from git into a temp folder)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from safetensors import safe_open

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RECORD = HERE / "data" / "same-weights.json"
sys.path.insert(0, str(HERE))

from simconfigs import cli_options, tiny_config  # noqa: E402

EXTRA_PREFIX = "extra/"  # feast_edge.run.checkpoint.EXTRA: a server optimizer's state, not weights
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "fma")

COMMON = ["--threads", "1", "--amp", "off"]
CASES: dict[str, list[str]] = {
    "feast": [],
    "heterofl": ["--method", "heterofl"],
    "scalefl": ["--method", "scalefl"],
    # seeded noise (the default noise comes from the OS and is never replayed)
    "dp-central-fixed-clip": ["--dp-clip", "1.0", "--dp-noise", "0.5", "--dp-seed", "7"],
    "dp-central-adaptive-clip": [
        "--dp-clip",
        "1.0",
        "--dp-noise",
        "0.5",
        "--dp-clip-quantile",
        "0.5",
        "--dp-seed",
        "7",
    ],
    "dp-local": ["--dp-mode", "local", "--dp-clip", "1.0", "--dp-noise", "0.2", "--dp-seed", "7"],
    # five clients a round, so that a trimmed mean (one value off each end) is neither the mean nor the median
    "robust-clip": ["--clients", "5", "--per-round", "5", "--aggregation", "clip"],
    "robust-trimmed-mean": ["--clients", "5", "--per-round", "5", "--aggregation", "trimmed-mean", "--trim", "0.2"],
    "robust-median": ["--clients", "5", "--per-round", "5", "--aggregation", "median"],
    "server-momentum": ["--server-opt", "momentum", "--server-lr", "1.0", "--server-momentum", "0.5"],
    "server-adam": ["--server-opt", "adam", "--server-lr", "0.01"],
    "server-yogi": ["--server-opt", "yogi", "--server-lr", "0.01"],
    "nproc-2": ["--nproc", "2"],
}


def machine() -> str:
    """What decides floating-point results here: CPU model (family and model numbers), the kernel-picking flags it
    has, torch's version."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = (
        f"{fields.get('model name', platform.processor() or '?')} (family {fields.get('cpu family', '?')}, "
        f"model {fields.get('model', '?')})"
    )
    flags = set(fields.get("flags", "").split())
    import torch  # noqa: PLC0415 (only where digests are made or compared)

    have = "+".join(f for f in KERNEL_FLAGS if f in flags) or "none"
    return f"{model} [{have}] torch {torch.__version__.split('+')[0]}"


def digest(run: Path) -> str:
    """SHA-256 of the model tensors in ``run``'s last checkpoint."""
    import torch  # noqa: PLC0415

    h = hashlib.sha256()
    with safe_open(run / "checkpoint.safetensors", framework="pt") as f:
        for name in sorted(k for k in f.keys() if not k.startswith(EXTRA_PREFIX)):
            tensor = f.get_tensor(name).contiguous()
            h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            h.update(tensor.flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def command(case: str, out: Path, data_dir: str) -> list[str]:
    """``feast-edge simulate`` for ``case`` (module form: it runs whatever ``feast_edge`` the interpreter imports)."""
    return [
        sys.executable, "-m", "feast_edge.cli", "simulate", *cli_options(tiny_config(data_dir)), *COMMON,
        *CASES[case], "--out", str(out),
    ]  # fmt: skip


def run_cases(cases: Iterable[str], work: Path, data_dir: str, pythonpath: str | None = None) -> dict[str, str]:
    """Each case's digest, run in ``work``; ``pythonpath`` first on the path (an older commit's build)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEAST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    work.mkdir(parents=True, exist_ok=True)
    if pythonpath:  # the older build, not this checkout's editable install, must be the one imported
        where = subprocess.run(
            [sys.executable, "-c", "import feast_edge.server, feast_edge; print(feast_edge.__file__)"],
            capture_output=True, text=True, env=env, cwd=work, check=True,
        ).stdout.strip()  # fmt: skip
        if not where.startswith(pythonpath):
            raise RuntimeError(f"the build in {pythonpath} is not the feast_edge imported ({where})")
    out = {}
    for case in cases:
        run = work / case
        done = subprocess.run(command(case, run, data_dir), capture_output=True, text=True, env=env, cwd=work)
        if done.returncode != 0:
            raise RuntimeError(f"case {case} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        out[case] = digest(run)
    return out


def build_commit(commit: str, into: Path) -> Path:
    """``commit``'s feast_edge installed (no dependencies: this environment's) into ``into``/site; returns that path."""
    source = into / "source"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(source), commit], check=True,
                   capture_output=True)  # fmt: skip
    try:
        site = into / "site"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target",
             str(site), str(source)],
            check=True, capture_output=True,
        )  # fmt: skip
        return site
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(source)], capture_output=True)


def read_record() -> dict:
    return json.loads(RECORD.read_text()) if RECORD.is_file() else {"commit": None, "machines": {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("record", "show"))
    parser.add_argument("--commit", help="make the digests with this commit's code (default: this checkout's)")
    parser.add_argument("--data", default=os.environ.get("FEAST_FMNIST_DIR", "/usr/share/datasets/fashion-mnist"))
    args = parser.parse_args()
    record = read_record()
    key = machine()
    if args.action == "show":
        print(json.dumps({"machine": key, **record}, indent=2))
        return
    work = Path(tempfile.mkdtemp(prefix="same-weights-"))
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", args.commit or "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        site = build_commit(commit, work) if args.commit else None
        if record["commit"] and record["commit"] != commit:
            sys.exit(f"{RECORD} holds digests of commit {record['commit']}, not {commit}: record with --commit it")
        digests = run_cases(CASES, work, args.data, str(site) if site else None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record["commit"] = commit
    record["machines"][key] = digests
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"{len(digests)} digests of commit {commit[:12]} on {key} -> {RECORD}")


if __name__ == "__main__":
    main()
