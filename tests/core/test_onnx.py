"""ONNX export: runs in real onnxruntime, matches PyTorch, carries its own metadata."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from feast_edge.data.images import load_fashion_mnist, normalize
from feast_edge.evaluate.onnx_export import export_onnx, max_abs_diff, onnx_session, read_metadata
from feast_edge.space.arch import Arch
from feast_edge.space.cost import arch_cost
from feast_edge.space.extract import extract, recalibrate_bn
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet

SMALL = load_preset("fmnist-small")
ARCH = Arch((1, 2, 0, 1), (0.5, 1.0, 0.25, 0.75), (4, 3, 5, 7, 8))


@pytest.fixture(scope="module")
def exported(tmp_path_factory, fashion_mnist_dir):
    data = load_fashion_mnist(fashion_mnist_dir, "test")
    model = extract(Supernet(SMALL, seed=0), ARCH)
    recalibrate_bn(model, normalize(data.floats(slice(0, 256)), SMALL.mean, SMALL.std).split(64))
    path = tmp_path_factory.mktemp("onnx") / "variant.onnx"
    export_onnx(model, path, SMALL, ARCH, class_names=data.classes, extra={"device": "jetson-nano-1"})
    return path, model, data


def test_matches_pytorch_on_random_inputs(exported):
    path, model, _ = exported
    pixels = torch.rand(16, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    assert max_abs_diff(path, model, SMALL, pixels) <= 1e-4


def test_matches_pytorch_on_fashion_mnist(exported):
    path, model, data = exported
    assert max_abs_diff(path, model, SMALL, data.floats(slice(1000, 1200))) <= 1e-4


@pytest.mark.parametrize("batch", [1, 3, 50])
def test_dynamic_batch_axis(exported, batch):
    path, _, _ = exported
    session = onnx_session(path)
    out = session.run(None, {"pixels": np.random.rand(batch, 1, 28, 28).astype(np.float32)})[0]
    assert out.shape == (batch, SMALL.classes)


def test_metadata_makes_the_file_self_describing(exported):
    path, _, data = exported
    meta = read_metadata(path)
    macs, params = arch_cost(SMALL, ARCH)
    assert meta["preset"] == "fmnist-small"
    assert Arch.parse(meta["arch"]) == ARCH
    assert (int(meta["macs"]), int(meta["params"]), int(meta["classes"])) == (macs, params, 10)
    assert json.loads(meta["input_shape"]) == [1, 28, 28]
    assert json.loads(meta["mean"]) == list(SMALL.mean) and json.loads(meta["std"]) == list(SMALL.std)
    assert json.loads(meta["class_names"]) == list(data.classes)
    assert meta["device"] == "jetson-nano-1"
    # the same figures are readable through onnxruntime, which is all a device has
    custom = onnx_session(path).get_modelmeta().custom_metadata_map
    assert custom["feast.macs"] == str(macs)


def test_unwritable_output_is_refused_before_export(tmp_path):
    from feast_edge.errors import FeastError

    model = extract(Supernet(SMALL), Arch.smallest(SMALL))
    with pytest.raises(FeastError, match="does not exist; create it or choose another --out"):
        export_onnx(model, tmp_path / "missing" / "m.onnx", SMALL, Arch.smallest(SMALL))
