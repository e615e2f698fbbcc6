"""ONNX export of an extracted variant, self-describing for the device that runs it.

The exported graph takes float32 pixels in [0, 1], shape ``[batch, C, H, W]``
(dynamic batch), normalizes them itself and returns logits ``[batch,
classes]``. Everything a device needs (preset, arch, MACs, params, class names,
input shape, normalization) is stored in the file's ``metadata_props`` under
``feast.*`` keys; ``feast.task`` holds the whole task contract
(:class:`~feast_edge.data.task.Task` as JSON, with ``feast.task_digest``), so
a device turns its image files into the model's input exactly as the
federation did (:func:`model_task`).
"""

from __future__ import annotations

import inspect
import io
import json
import os
import statistics
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from feast_edge.data.task import Task, TaskError
from feast_edge.errors import FeastError
from feast_edge.space.arch import Arch
from feast_edge.space.cost import count_macs, count_params
from feast_edge.space.preset import Preset
from feast_edge.space.static import Normalized, StaticResNet
from feast_edge.util.atomic import atomic_write_bytes, check_writable

FORMAT = "feast-edge/onnx-variant"
INPUT_NAME = "pixels"
OUTPUT_NAME = "logits"
OPSET = 18


class OnnxModelError(FeastError):
    """An exported file cannot be loaded or run in onnxruntime."""


def _to_onnx_bytes(model: torch.nn.Module, example: torch.Tensor) -> bytes:
    """Export with the TorchScript exporter, or the torch.export-based one where PyTorch no longer has it.

    A variant is a plain static network (convolutions, BN, ReLU, pooling, a linear head): both exporters write the
    same function, and tracing takes well under a second where torch.export takes about ten
    (bench/bench_onnx_export.py, docs/benchmarks.md "ONNX export"), which every device's export pays.
    """
    try:
        return export_torchscript(model, example)
    except _NO_TORCHSCRIPT:  # a PyTorch whose torch.onnx.export has only the torch.export-based exporter
        return export_dynamo(model, example)


def export_torchscript(model: torch.nn.Module, example: torch.Tensor) -> bytes:
    """``model`` as ONNX bytes from the TorchScript (tracing) exporter, batch dimension dynamic."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deprecation notice is for PyTorch's users, not ours
        torch.onnx.export(
            model,
            (example,),
            buffer,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            opset_version=OPSET,
            **_TORCHSCRIPT,
        )
    return buffer.getvalue()


def export_dynamo(model: torch.nn.Module, example: torch.Tensor) -> bytes:
    """``model`` as ONNX bytes from the torch.export-based exporter (PyTorch >= 2.5), batch dimension dynamic."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model,
            (example,),
            None,
            dynamo=True,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1)}},
            opset_version=OPSET,
            verbose=False,
        )
    return program.model_proto.SerializeToString()


# PyTorch >= 2.5 takes dynamo= (and from 2.9 defaults to True); older ones have only the TorchScript exporter.
_TORCHSCRIPT = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
_NO_TORCHSCRIPT = (TypeError, NotImplementedError, ImportError, AttributeError)


def _task_of(preset: Preset, model: StaticResNet, task: Task | None) -> Task:
    """The task a variant is exported for (the preset's unless given); it must fit the model's input and outputs."""
    task = preset.task if task is None else task
    layout = model.layout
    if task.shape != (layout.in_channels, layout.input_size, layout.input_size) or len(task.classes) != layout.classes:
        raise FeastError(
            f"task {task.describe()} does not fit the model ({layout.in_channels}x{layout.input_size}x"
            f"{layout.input_size}, {layout.classes} classes); export with the preset's own task"
        )
    return task


def variant_metadata(
    preset: Preset,
    arch: Arch,
    model: StaticResNet,
    class_names: tuple[str, ...] | None = None,
    extra: Mapping[str, Any] | None = None,
    task: Task | None = None,
) -> dict[str, str]:
    """The ``feast.*`` metadata entries of one exported variant (``task``: the preset's unless given)."""
    layout = model.layout
    task = _task_of(preset, model, task)
    meta: dict[str, Any] = {
        "format": FORMAT,
        "preset": preset.name,
        "preset_digest": preset.digest,
        "arch": arch.to_json(),
        "macs": count_macs(layout),
        "params": count_params(layout),
        "classes": layout.classes,
        "input_name": INPUT_NAME,
        "output_name": OUTPUT_NAME,
        "input_shape": json.dumps([layout.in_channels, layout.input_size, layout.input_size]),
        "input_range": "[0, 1]",
        "normalization": "applied inside the model: (pixels - mean) / std",
        "mean": json.dumps(list(task.mean)),
        "std": json.dumps(list(task.std)),
        "task": json.dumps(task.to_dict(), separators=(",", ":")),
        "task_digest": task.digest,
        "precision": "fp32",  # feast_edge.evaluate.quantize writes "int8" into its twin
        # Kept for readers of files from before feast.task; the task's names unless the caller names them.
        "class_names": json.dumps(list(task.classes if class_names is None else class_names)),
    }
    for key, value in (extra or {}).items():
        meta[key] = value if isinstance(value, str) else json.dumps(value)
    return {f"feast.{k}": str(v) for k, v in meta.items()}


_EXPORTING = threading.Lock()


def export_onnx(
    model: StaticResNet,
    path: str | os.PathLike[str],
    preset: Preset,
    arch: Arch,
    class_names: tuple[str, ...] | None = None,
    extra: Mapping[str, Any] | None = None,
    task: Task | None = None,
) -> dict[str, str]:
    """Write ``model`` (an extracted variant) as a checked ONNX file; returns its metadata."""
    path = check_writable(path, "ONNX file")
    meta = variant_metadata(preset, arch, model, class_names, extra, task)
    task = _task_of(preset, model, task)
    # The graph takes pixels in [0, 1] and normalizes them with the task's mean/std, the values feast.task records.
    wrapped = Normalized(model, task.mean, task.std).eval()
    example = torch.rand(2, model.layout.in_channels, model.layout.input_size, model.layout.input_size)
    with _EXPORTING:  # torch.export traces through process-global state: one export at a time (agents in threads)
        proto = onnx.load_from_string(_to_onnx_bytes(wrapped, example))
    del proto.metadata_props[:]
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    proto.producer_name = "feast-edge"
    onnx.checker.check_model(proto)
    atomic_write_bytes(path, proto.SerializeToString())
    return meta


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``feast.*`` metadata of an exported file (prefix stripped); OnnxModelError if it is no ONNX file."""
    if not Path(path).is_file():
        raise OnnxModelError(f"model {path} does not exist or is not a file; give the .onnx file's path")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError, RuntimeWarning-as-error, OSError, ...
        raise OnnxModelError(
            f"model {path} is not an ONNX file ({type(exc).__name__}); fetch it again with feast-agent fetch-model"
        ) from None
    return {p.key[len("feast.") :]: p.value for p in proto.metadata_props if p.key.startswith("feast.")}


def model_task(source: str | os.PathLike[str] | Mapping[str, str]) -> Task:
    """The task an exported file was trained for, from its ``feast.*`` metadata (a path, or :func:`read_metadata`'s dict).

    Files exported before ``feast.task`` existed are read from ``input_shape``,
    ``class_names`` (else ``"0"``, ``"1"``, ...) and ``mean``/``std``, with the
    stretch resize policy; their normalization is inside the graph anyway.
    """
    meta = read_metadata(source) if isinstance(source, (str, os.PathLike)) else dict(source)
    where = f"{source}" if isinstance(source, (str, os.PathLike)) else "the model"
    if not meta:
        raise OnnxModelError(
            f"{where} has no feast.* metadata, so it is not a model exported by feast-edge; "
            "use the file feast-server pushed, feast-agent fetch-model or feast-edge export wrote"
        )
    try:
        if "task" in meta:
            task = Task.from_dict(json.loads(meta["task"]))
            if meta.get("task_digest", task.digest) != task.digest:
                raise OnnxModelError(
                    f"{where}: feast.task does not match its feast.task_digest (the metadata was edited); "
                    "fetch or export the model again"
                )
            return task
        if "input_shape" not in meta:
            raise OnnxModelError(
                f"{where} lacks feast.task and feast.input_shape, so its input is unknown; "
                "re-export it with this version of feast-edge (feast-edge export or feast-server export)"
            )
        channels, height, width = json.loads(meta["input_shape"])
        if height != width:
            raise OnnxModelError(f"{where} takes {height}x{width} images; a feast-edge task is square")
        count = int(meta.get("classes", 0))
        names = json.loads(meta["class_names"]) if "class_names" in meta else [str(i) for i in range(count)]
        names = [name.replace("/", "_").replace("\\", "_") for name in names]  # old files named 'T-shirt/top'
        mean = json.loads(meta["mean"]) if "mean" in meta else [0.0] * channels
        std = json.loads(meta["std"]) if "std" in meta else [1.0] * channels
        return Task(channels, height, tuple(names), tuple(mean), tuple(std))
    except TaskError as exc:
        raise OnnxModelError(f"{where}: its feast.* metadata holds a malformed task ({exc}); fetch it again") from None
    except (ValueError, TypeError) as exc:  # JSON that is not what the keys promise
        raise OnnxModelError(f"{where}: its feast.* metadata cannot be read ({exc}); fetch it again") from None


def onnx_session(path: str | os.PathLike[str], threads: int | None = None):
    """An onnxruntime CPU session for an exported file."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(Path(path)), options, providers=["CPUExecutionProvider"])


def max_abs_diff(path: str | os.PathLike[str], model: StaticResNet, preset: Preset, pixels: torch.Tensor) -> float:
    """Largest |onnxruntime − PyTorch| logit difference on ``pixels`` (float32 in [0, 1])."""
    session = onnx_session(path)
    got = session.run([OUTPUT_NAME], {INPUT_NAME: pixels.numpy().astype(np.float32)})[0]
    with torch.no_grad():
        want = Normalized(model, preset.mean, preset.std).eval()(pixels).numpy()
    return float(np.abs(got - want).max())


def measure_latency(
    path: str | os.PathLike[str], repeats: int = 50, warmup: int = 5, threads: int | None = 1
) -> dict[str, float]:
    """Batch-1 latency of an exported file in onnxruntime on random pixels: median and 90th percentile in ms."""
    try:
        meta = read_metadata(path)
        shape = json.loads(meta["input_shape"])
        session = onnx_session(path, threads=threads)
    except Exception as exc:  # onnx/onnxruntime raise many types for a bad file
        raise OnnxModelError(f"{path} cannot be loaded in onnxruntime ({exc}); fetch the model again") from None
    x = np.random.default_rng(0).random((1, *shape), dtype=np.float32)
    for _ in range(warmup):
        session.run([OUTPUT_NAME], {INPUT_NAME: x})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run([OUTPUT_NAME], {INPUT_NAME: x})
        times.append((time.perf_counter() - start) * 1000.0)
    times.sort()
    return {
        "median_ms": statistics.median(times),
        "p90_ms": times[int(0.9 * (len(times) - 1))],
        "repeats": float(repeats),
    }
