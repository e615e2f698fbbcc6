"""How many threads PyTorch and onnxruntime use in a feast-agent command: the count ``--threads`` gives.

``feast-agent run``, ``profile``, ``fetch-model``, ``predict`` and ``evaluate``
take ``--threads`` (one option, ``feast_edge.agent.cli.threaded``). PyTorch's
intra-op threads are set before the command reads or computes anything
(``torch.set_num_threads`` must come before the first operator); the command
passes the count on to the onnxruntime sessions it opens as their intra-op
threads. 0, the default, means: ``run`` chooses the threads from the cores free
before each step (training, validation, BN calibration, the served model:
``feast_edge.util.cores.Threads``); ``profile`` times on every core of the
process's affinity mask, a declared count recorded in the profile; the others
leave PyTorch and onnxruntime their own choice. The latency of a received model
is timed on one thread under 0, whatever the load. On a
Raspberry Pi 4 whose PyTorch build stops with "Illegal instruction" in
multi-threaded kernels, ``--threads 1`` keeps every kernel on one thread
(docs/install-device.md, "Raspberry Pi 4 and 5").
"""

from __future__ import annotations


def use_threads(threads: int) -> int:
    """Set PyTorch's intra-op threads to ``threads`` (0 keeps PyTorch's default); ``threads`` again, for onnxruntime."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    return threads


def profile_threads(threads: int) -> int:
    """The threads ``feast-agent profile`` times variants on: ``threads``, or every core this process may use for 0
    (declared and recorded, so a device's budget does not depend on what else ran while it was profiled)."""
    from feast_edge.util.cores import affinity_cpus

    return threads or len(affinity_cpus())


def latency_threads(threads: int) -> int:
    """The onnxruntime threads a received model's batch-1 latency is timed on: ``threads``, or one for 0 (comparable
    between devices, as ``feast_edge.evaluate.onnx_export.measure_latency`` times it)."""
    return threads or 1
