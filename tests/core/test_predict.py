"""Using an exported model on image files: the task from the ONNX metadata, predict's probabilities, evaluate's counts."""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from PIL import Image

from feast_edge.data.images import load_fashion_mnist, normalize
from feast_edge.data.task import Task, TaskError
from feast_edge.errors import FeastError
from feast_edge.evaluate.onnx_export import OnnxModelError, export_onnx, model_task, read_metadata
from feast_edge.evaluate.predict import (
    ImageReadError,
    evaluate,
    image_files,
    load_model,
    predict,
    read_image,
    read_image_folder,
    softmax,
)
from feast_edge.space.arch import Arch
from feast_edge.space.extract import extract, recalibrate_bn
from feast_edge.space.preset import load_preset, load_preset_file
from feast_edge.space.static import Normalized
from feast_edge.space.supernet import Supernet
from strategies import TINY_PRESET

SMALL = load_preset("fmnist-small")
TASK = SMALL.task
CLASSES = ("Trouser", "Sandal", "Bag")  # the device holds 3 of the 10 classes


@pytest.fixture(scope="module")
def fmnist(fashion_mnist_dir):
    return load_fashion_mnist(fashion_mnist_dir, "test")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, fmnist):
    """The smallest fmnist-small variant, BN recalibrated on real images (so its predictions differ between images)."""
    arch = Arch.smallest(SMALL)
    model = extract(Supernet(SMALL, seed=0), arch)
    recalibrate_bn(model, normalize(fmnist.floats(slice(0, 256)), SMALL.mean, SMALL.std).split(64))
    path = tmp_path_factory.mktemp("onnx") / "variant.onnx"
    export_onnx(model, path, SMALL, arch)  # no class_names: the task's names
    return path, model.eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, fmnist) -> Path:
    """Real Fashion-MNIST test images of 3 classes as files: grey PNG 28x28, grey PNG 40x33, RGB JPEG 56x56."""
    root = tmp_path_factory.mktemp("images")
    for name in CLASSES:
        label = TASK.index_of(name)
        picked = (fmnist.labels == label).nonzero().flatten()[:6]
        (root / name / "sub").mkdir(parents=True)
        for j, i in enumerate(picked.tolist()):
            grey = Image.fromarray(fmnist.images[i, 0].numpy(), "L")
            if j % 3 == 0:
                grey.save(root / name / f"{j}.png")
            elif j % 3 == 1:
                grey.resize((40, 33)).save(root / name / "sub" / f"{j}.PNG")
            else:
                grey.resize((56, 56)).convert("RGB").save(root / name / f"{j}.jpg", quality=95)
    return root


def _reference(path: Path, model, files: list[Path]) -> np.ndarray:
    """Softmax of the PyTorch model on the task's tensors of ``files``, normalized as the task says."""
    images = torch.stack([TASK.image_tensor(Image.open(f)) for f in files])
    with torch.no_grad():
        return torch.softmax(model(TASK.normalized(images)).double(), dim=1).numpy()


# ---------------------------------------------------------------------- the task in the file


def test_the_file_carries_the_presets_task(exported):
    path, _ = exported
    meta = read_metadata(path)
    assert Task.from_dict(json.loads(meta["task"])) == TASK and meta["task_digest"] == TASK.digest
    assert json.loads(meta["class_names"]) == list(TASK.classes)  # the task's names by default
    assert model_task(path) == TASK == model_task(meta)


def test_explicit_class_names_keep_the_old_key_and_the_task_stays_the_presets(tmp_path):
    arch = Arch.smallest(SMALL)
    model = extract(Supernet(SMALL, seed=0), arch)
    names = tuple(f"c{i}" for i in range(10))
    meta = export_onnx(model, tmp_path / "m.onnx", SMALL, arch, class_names=names)
    assert json.loads(meta["feast.class_names"]) == list(names)
    assert model_task(tmp_path / "m.onnx") == TASK
    wrong = Task(3, 28, TASK.classes, (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(FeastError, match="does not fit the model"):
        export_onnx(model, tmp_path / "w.onnx", SMALL, arch, task=wrong)
    assert not (tmp_path / "w.onnx").exists()


def test_files_from_before_the_task_key_are_read_from_input_shape_and_class_names(exported):
    meta = {k: v for k, v in read_metadata(exported[0]).items() if k not in ("task", "task_digest")}
    meta["class_names"] = json.dumps(["T-shirt/top", *TASK.classes[1:]])  # what old exports wrote
    assert model_task(meta) == TASK  # 'T-shirt/top' -> 'T-shirt_top', stretch, the stored mean/std
    bare = {"input_shape": "[3, 32, 32]", "classes": "4"}
    assert model_task(bare) == Task(3, 32, ("0", "1", "2", "3"), (0.0,) * 3, (1.0,) * 3)
    with pytest.raises(OnnxModelError, match="lacks feast.task and feast.input_shape"):
        model_task({"preset": "fmnist-small"})
    with pytest.raises(OnnxModelError, match="has no feast.\\* metadata"):
        model_task({})


def test_an_edited_or_malformed_task_is_refused(exported):
    meta = read_metadata(exported[0])
    edited = json.loads(meta["task"]) | {"resize": "pad"}
    with pytest.raises(OnnxModelError, match="does not match its feast.task_digest"):
        model_task({**meta, "task": json.dumps(edited)})
    with pytest.raises(OnnxModelError, match="malformed task"):
        model_task({**meta, "task": json.dumps({**edited, "channels": 2}), "task_digest": "x"})
    with pytest.raises(OnnxModelError, match="cannot be read"):
        model_task({**meta, "task": "{not json"})


def test_bad_model_files_are_one_line_errors(tmp_path, exported):
    with pytest.raises(OnnxModelError, match="does not exist"):
        load_model(tmp_path / "missing.onnx")
    (tmp_path / "text.onnx").write_text("this is not a model\n" * 20)
    with pytest.raises(OnnxModelError, match="not an ONNX file|no feast"):
        load_model(tmp_path / "text.onnx")
    identity = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Identity", ["x"], ["y"])],
            "plain",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 1, 28, 28])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 1, 28, 28])],
        )
    )
    onnx.save(identity, tmp_path / "plain.onnx")
    with pytest.raises(OnnxModelError, match="no feast.\\* metadata, so it is not a model exported by feast-edge"):
        load_model(tmp_path / "plain.onnx")
    # a feast-edge file whose graph does not take what its metadata says
    meta = read_metadata(exported[0])
    proto = onnx.load(exported[0])
    for entry in proto.metadata_props:
        if entry.key == "feast.task":
            entry.value = json.dumps(json.loads(meta["task"]) | {"size": 32}, separators=(",", ":"))
        if entry.key == "feast.task_digest":
            entry.value = Task.from_dict(json.loads(meta["task"]) | {"size": 32}).digest
    onnx.save(proto, tmp_path / "lying.onnx")
    with pytest.raises(OnnxModelError, match="its graph takes \\[1, 28, 28\\]"):
        load_model(tmp_path / "lying.onnx")


# ---------------------------------------------------------------------- predict


def test_probabilities_equal_pytorch_and_onnxruntime_on_the_same_tensors(exported, folder):
    path, model = exported
    loaded = load_model(path)
    files = image_files(folder)
    got = predict(loaded, files, k=10, batch_size=64)
    assert [p.file for p in got.items] == [str(f) for f in files] and not got.skipped
    probs = np.array([[p for _, _, p in sorted(item.top, key=lambda t: t[1])] for item in got.items])
    np.testing.assert_allclose(probs, _reference(path, model, files), atol=1e-5)
    # the graph normalizes: onnxruntime on pixels / 255 gives the same probabilities
    pixels = torch.stack([TASK.image_tensor(Image.open(f)) for f in files]).numpy().astype(np.float32) / 255
    logits = loaded.session.run(["logits"], {"pixels": pixels})[0]
    np.testing.assert_allclose(probs, softmax(logits.astype(np.float64)), atol=1e-6)
    with torch.no_grad():  # ... which is the wrapped model the file was exported from
        wrapped = Normalized(model, SMALL.mean, SMALL.std)(torch.from_numpy(pixels))
    np.testing.assert_allclose(logits, wrapped.numpy(), atol=1e-4)
    assert len({item.top[0][1] for item in got.items}) > 1, "the model predicts one class for everything"


def test_top_k_is_ordered_and_names_the_task_classes(exported, folder):
    loaded = load_model(exported[0])
    got = predict(loaded, image_files(folder), k=3)
    for item in got.items:
        assert len(item.top) == 3
        assert [p for _, _, p in item.top] == sorted((p for _, _, p in item.top), reverse=True)
        assert all(TASK.classes[index] == name for name, index, _ in item.top)
        document = item.to_dict()
        assert set(document) == {"file", "predictions"}
        assert [set(p) for p in document["predictions"]] == [{"class", "index", "probability"}] * 3
    for k in (0, 11):
        with pytest.raises(FeastError, match=f"--top-k {k} must be between 1 and the model's 10 classes"):
            predict(loaded, image_files(folder), k=k)


def test_batches_give_what_one_file_at_a_time_gives(exported, folder):
    loaded = load_model(exported[0])
    files = image_files(folder)
    batched = predict(loaded, files, k=10, batch_size=4)  # 18 files: batches of 4, 4, 4, 4, 2
    assert [p.file for p in batched.items] == [str(f) for f in files]
    for item, path in zip(batched.items, files):
        alone = predict(loaded, [path], k=10, batch_size=1).items[0]
        by_index = lambda top: [p for _, _, p in sorted(top, key=lambda t: t[1])]  # noqa: E731
        np.testing.assert_allclose(by_index(item.top), by_index(alone.top), atol=1e-6, rtol=0)


def test_folders_are_walked_recursively_sorted_without_hidden_files(tmp_path):
    png = io.BytesIO()
    Image.new("L", (8, 8)).save(png, "PNG")
    for name in ("b/2.png", "a/z.JPEG", "a/deep/er/1.webp", "c.BMP", ".hidden.png", ".cache/x.png", "notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(png.getvalue())
    os.symlink(tmp_path, tmp_path / "a" / "loop")  # a link loop is not followed
    found = [str(p.relative_to(tmp_path)) for p in image_files(tmp_path)]
    assert found == ["a/deep/er/1.webp", "a/z.JPEG", "b/2.png", "c.BMP"]


def test_unreadable_files_are_skipped_in_a_folder_and_an_error_alone(exported, tmp_path, monkeypatch):
    loaded = load_model(exported[0])
    good = tmp_path / "good.png"
    Image.new("RGB", (30, 20), (200, 10, 10)).save(good)
    (tmp_path / "truncated.png").write_bytes(good.read_bytes()[:60])
    (tmp_path / "text.jpg").write_text("not a picture")
    palette = Image.new("P", (12, 12))
    palette.putpalette([0, 0, 0, 255, 255, 255] + [0] * 762)
    palette.save(tmp_path / "palette.png")
    Image.fromarray(np.full((9, 9), 40000, dtype=np.uint16)).save(tmp_path / "sixteen.png")
    got = predict(loaded, image_files(tmp_path), k=1)
    assert [Path(p.file).name for p in got.items] == ["good.png", "palette.png", "sixteen.png"]
    assert sorted((Path(s.file).name, s.reason.split(":")[0]) for s in got.skipped) == [
        ("text.jpg", "not an image Pillow can identify"),
        ("truncated.png", "cannot be decoded"),
    ]
    with pytest.raises(ImageReadError, match="text.jpg: not an image Pillow can identify"):
        predict(loaded, [tmp_path / "text.jpg"], k=1, skip_unreadable=False)
    with pytest.raises(ImageReadError, match="none of the 2 image file"):
        predict(loaded, [tmp_path / "text.jpg", tmp_path / "truncated.png"], k=1)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 600 pixels: over the limit, a decompression bomb
    with pytest.raises(ImageReadError, match="more than Pillow's limit of 100 pixels"):
        read_image(good, TASK)


# ---------------------------------------------------------------------- evaluate


def test_evaluate_counts_match_a_hand_count(exported, folder):
    path, model = exported
    loaded = load_model(path)
    (folder / "Bag" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    try:
        data = read_image_folder(folder, TASK)
        result = evaluate(loaded, data.images, data.labels, batch_size=5, skipped=len(data.skipped))
    finally:
        (folder / "Bag" / "broken.png").unlink()
    # by hand: each class folder's files through the PyTorch model, one at a time
    want = {}
    for name in CLASSES:
        files = image_files(folder / name)
        predicted = _reference(path, model, files).argmax(axis=1)
        want[name] = (len(files), int((predicted == TASK.index_of(name)).sum()))
    assert {c.name: (c.examples, c.correct) for c in result.classes} == want
    assert [c.index for c in result.classes] == sorted(TASK.index_of(n) for n in CLASSES)
    assert result.examples == 18 and result.correct == sum(c for _, c in want.values())
    assert result.skipped == 1 and [Path(s.file).name for s in data.skipped] == ["broken.png"]
    assert 0 < result.correct < 18, "a test of the counts needs right and wrong predictions"
    document = result.to_dict()
    assert document["accuracy"] == pytest.approx(result.correct / 18)
    assert [c["class"] for c in document["classes"]] == ["Trouser", "Sandal", "Bag"]


def test_a_folder_the_task_lacks_names_the_closest_classes(tmp_path):
    (tmp_path / "Trouser").mkdir()
    (tmp_path / "sandal").mkdir()
    with pytest.raises(TaskError, match="class 'sandal' is not one of the task's 10 classes; did you mean 'Sandal'"):
        read_image_folder(tmp_path, TASK)


def test_image_folder_layout_errors(tmp_path):
    with pytest.raises(FeastError, match="does not exist"):
        read_image_folder(tmp_path / "nowhere", TASK)
    Image.new("L", (8, 8)).save(tmp_path / "loose.png")
    with pytest.raises(FeastError, match="has no class folders"):
        read_image_folder(tmp_path, TASK)
    (tmp_path / "Bag").mkdir()
    with pytest.raises(FeastError, match="hold no image files"):
        read_image_folder(tmp_path, TASK)
    Image.new("L", (8, 8)).save(tmp_path / "Bag" / "one.png")
    data = read_image_folder(tmp_path, TASK)
    assert data.labels.tolist() == [8] and [s.reason for s in data.skipped] == ["not in a class folder"]


def test_an_rgb_center_crop_task_reaches_the_model_as_its_metadata_says(tmp_path):
    """A 3x16x16 task with center-crop and its own class names: the file's task drives the preprocessing."""
    tiny = load_preset_file(TINY_PRESET)
    rgb = dataclasses.replace(
        tiny,
        name="test-rgb",
        in_channels=3,
        mean=(0.5, 0.4, 0.3),
        std=(0.2, 0.25, 0.3),
        class_names=("ant", "bee", "cat", "dog", "eel"),
        resize="center-crop",
    )
    arch = Arch.smallest(rgb)
    model = extract(Supernet(rgb, seed=0), arch).eval()
    export_onnx(model, tmp_path / "rgb.onnx", rgb, arch)
    loaded = load_model(tmp_path / "rgb.onnx")
    assert loaded.task == rgb.task and loaded.task.resize == "center-crop"
    rng = np.random.default_rng(3)
    files = []
    for i, (w, h) in enumerate([(16, 16), (40, 20), (17, 50)]):
        files.append(tmp_path / f"{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(files[-1])
    files.append(tmp_path / "grey.jpg")
    Image.fromarray(rng.integers(0, 256, (30, 30), dtype=np.uint8)).save(files[-1])
    got = predict(loaded, files, k=5)
    images = torch.stack([rgb.task.image_tensor(Image.open(f)) for f in files])
    assert images.shape == (4, 3, 16, 16)
    with torch.no_grad():
        want = torch.softmax(model(rgb.task.normalized(images)).double(), dim=1).numpy()
    probs = np.array([[p for _, _, p in sorted(item.top, key=lambda t: t[1])] for item in got.items])
    np.testing.assert_allclose(probs, want, atol=1e-5)
    assert {name for item in got.items for name, _, _ in item.top} == set(rgb.task.classes)
