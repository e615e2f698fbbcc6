"""The processes of a spread simulation (``--nproc``, ``torchrun``) and what crosses between them.

Where each process stands (:class:`World`), which backend carries the bytes
(gloo on CPU, NCCL between GPUs), and the wire: a round's JSON header and
safetensors blobs in uint8 tensors (:class:`Channel`), a cohort's updates as
one safetensors blob plus a JSON list (:func:`pack_updates`), never pickled
objects. ``feast_edge.sim.distributed`` spreads a cohort over them.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from feast_edge.cache.variants import VariantCache
from feast_edge.errors import FeastError
from feast_edge.route.envelope import Envelope
from feast_edge.route.plans import ClientPlan
from feast_edge.run.collect import ClientUpdate

BACKENDS = ("auto", "gloo", "nccl")
# A wait on the process group gives up after this long: rank 0 validates and checkpoints between rounds while the others wait.
TIMEOUT = timedelta(hours=2)
_META = ("samples", "loss", "samples_seen", "train_macs", "compute_seconds", "variants_per_batch")


class DistributedError(FeastError, RuntimeError):
    """The processes of a spread simulation cannot start, agree or reach each other."""


@dataclass(frozen=True)
class World:
    """This process's place among the simulation's processes."""

    rank: int
    size: int
    local_rank: int = 0
    local_size: int = 1


def torchrun_world() -> World | None:
    """The world ``torchrun`` (or any launcher setting RANK/WORLD_SIZE) put this process in; None when run alone."""
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
        local = (
            int(os.environ.get("LOCAL_RANK", "0")),
            int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
        )
    except ValueError:
        raise DistributedError(
            "WORLD_SIZE, RANK, LOCAL_RANK or LOCAL_WORLD_SIZE is not a number; launch with torchrun, or unset them"
        ) from None
    return World(rank, size, *local) if size > 1 else None


def pick_backend(requested: str, device: str, local_size: int) -> str:
    """gloo on CPU; NCCL when every process on this machine has a GPU of its own (``auto``)."""
    if requested not in BACKENDS:
        raise DistributedError(f"--dist-backend {requested!r} is not supported; choose one of {', '.join(BACKENDS)}")
    cuda = device.startswith("cuda") and torch.cuda.is_available() and dist.is_nccl_available()
    gpus = torch.cuda.device_count() if cuda else 0
    if requested == "nccl":
        if not cuda:
            raise DistributedError(
                f"--dist-backend nccl needs CUDA GPUs and --device cuda (the device is {device}); use --dist-backend gloo"
            )
        if gpus < local_size:
            raise DistributedError(
                f"--dist-backend nccl needs one GPU per process: {local_size} processes on this machine, {gpus} GPUs; lower --nproc or use gloo"
            )
        return "nccl"
    return "nccl" if requested == "auto" and cuda and gpus >= local_size else "gloo"


def worker_device(device: str, world: World) -> str:
    """The device a rank trains on: its own GPU (local rank, wrapped around the GPUs there are), or the CPU."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return device
    return f"cuda:{world.local_rank % torch.cuda.device_count()}"


def plans_digest(plans: Mapping[str, Any], cohort: Sequence[str]) -> str:
    """A digest of the cohort's plans, so every rank can check it planned the round as rank 0 did."""
    return hashlib.sha256(repr([(c, plans[c]) for c in cohort]).encode()).hexdigest()


def affordable_indices(
    plans: Mapping[str, Any], cohort: Sequence[str], cache: VariantCache
) -> dict[str, list[int]] | None:
    """Each member's routed variants as cache indices (FEAST's plans), for the other ranks: a secure round's plans are
    cut to what it reveals (feast_edge.run.stratified), which the method's own plans do not know; None for other
    methods' plans."""
    if not all(isinstance(plans[c], ClientPlan) for c in cohort):
        return None
    index = {e.arch: i for i, e in enumerate(cache.entries)}
    return {c: [index[a] for a in plans[c].affordable] for c in cohort}


def cut_to(plans: Mapping[str, Any], affordable: Mapping[str, Sequence[int]], cache: VariantCache) -> dict[str, Any]:
    """The method's ``plans`` cut to the variants rank 0 routed (``affordable``: cache indices); a plan that rank 0's
    does not narrow stays as it is, and the digest check then says where the ranks differ."""
    out = dict(plans)
    for c, indices in affordable.items():
        plan = plans.get(c)
        kept = tuple(cache.entries[i].arch for i in indices)
        if isinstance(plan, ClientPlan) and kept != plan.affordable and set(kept) <= set(plan.affordable):
            out[c] = ClientPlan(kept, plan.global_min, Envelope.of(kept))
    return out


def pack_updates(updates: Sequence[ClientUpdate]) -> bytes:
    """Updates -> bytes: the JSON header's length (8 bytes), the header (what each client reported), a safetensors blob of their
    states under ``client/name``."""
    header = json.dumps([{"client": u.client, **{k: getattr(u, k) for k in _META}} for u in updates]).encode()
    body = save_tensors({f"{u.client}/{k}": v.contiguous() for u in updates for k, v in u.state.items()})
    return len(header).to_bytes(8, "little") + header + body


def unpack_updates(data: bytes) -> list[ClientUpdate]:
    """The inverse of :func:`pack_updates`."""
    if not data:
        return []
    n = int.from_bytes(data[:8], "little")
    header, body = data[8 : 8 + n], data[8 + n :]
    states: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_tensors(body).items():
        client, _, name = key.partition("/")
        states.setdefault(client, {})[name] = tensor
    return [
        ClientUpdate(m["client"], states.get(m["client"], {}), **{k: m[k] for k in _META}) for m in json.loads(header)
    ]


class Channel:
    """Byte messages over the default process group; every wait polls ``alive`` (which raises when a peer is gone)."""

    def __init__(self, world: World, device: torch.device, alive: Callable[[], None]) -> None:
        self.world, self.device, self.alive = world, device, alive

    def _wait(self, work: Any, what: str) -> None:
        delay = 0.0005
        while not work.is_completed():
            self.alive()
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        try:
            work.wait()
        except RuntimeError as exc:
            for _ in range(40):  # a dead peer's sockets close a moment before its exit is seen; name it when we can
                self.alive()
                time.sleep(0.05)
            raise DistributedError(
                f"rank {self.world.rank}: {what} failed ({str(exc).splitlines()[0][:200]}); another process has stopped, see its error"
            ) from None

    def _buffer(self, data: bytes | None, size: int) -> torch.Tensor:
        if data:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def broadcast(self, data: bytes | None = None) -> bytes:
        """Rank 0 sends ``data`` to every rank; the others get it."""
        what = "sending the round" if data is not None else "receiving a round from rank 0"
        length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        self._wait(dist.broadcast(length, 0, async_op=True), what)
        buf = self._buffer(data, int(length.item()))
        if buf.numel():
            self._wait(dist.broadcast(buf, 0, async_op=True), what)
        return data if data is not None else buf.cpu().numpy().tobytes()

    def gather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` to rank 0, in rank order (the others get an empty list).

        Collectives only: gloo's point-to-point work never reports completion to a poll, and every wait here polls.
        """
        size = self.world.size
        lengths = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(size)]
        self._wait(
            dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=self.device), async_op=True),
            "gathering the updates",
        )
        sizes = [int(n.item()) for n in lengths]
        buf = torch.zeros(max(sizes), dtype=torch.uint8, device=self.device)
        if data:
            buf[: len(data)] = self._buffer(data, len(data))
        out = [torch.empty_like(buf) for _ in range(size)] if self.world.rank == 0 else None
        if buf.numel():
            self._wait(dist.gather(buf, out, dst=0, async_op=True), "gathering the updates")
        return [o[:n].cpu().numpy().tobytes() for o, n in zip(out, sizes)] if out is not None else []


def connect(world: World, backend: str, store: Any = None) -> None:
    """Join the default process group: through ``store`` (a local ``--nproc`` run) or env:// (torchrun)."""
    if backend == "nccl":
        torch.cuda.set_device(world.local_rank)
    if store is None:
        dist.init_process_group(backend, init_method="env://", rank=world.rank, world_size=world.size, timeout=TIMEOUT)
    else:
        dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size, timeout=TIMEOUT)


def channel_device(backend: str, world: World) -> torch.device:
    return torch.device("cuda", world.local_rank) if backend == "nccl" else torch.device("cpu")
