"""``feast-agent predict`` and ``feast-agent evaluate`` on real image files with a real exported model, in-process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from feast_edge.data.images import load_fashion_mnist
from feast_edge.evaluate.onnx_export import export_onnx
from feast_edge.evaluate.predict import evaluate, image_files, load_model, predict, read_image_folder
from feast_edge.space.arch import Arch
from feast_edge.space.extract import extract, recalibrate_bn
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet

SMALL = load_preset("fmnist-small")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    arch = Arch.smallest(SMALL)
    variant = extract(Supernet(SMALL, seed=1), arch)
    noise = torch.rand(64, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    recalibrate_bn(variant, [(noise - SMALL.mean[0]) / SMALL.std[0]])
    path = tmp_path_factory.mktemp("model") / "device.onnx"
    export_onnx(variant, path, SMALL, arch)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """Two class folders of small grey PNG and RGB JPEG files of several sizes."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for name in ("Coat", "Sneaker"):
        (root / name).mkdir()
        for i in range(3):
            size = (28 + 6 * i, 28 + 3 * i)
            if i % 2:
                Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(
                    root / name / f"{i}.jpg"
                )
            else:
                Image.fromarray(rng.integers(0, 256, (size[1], size[0]), dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


def test_predict_prints_a_table_of_top_classes(agent_cli, model, images):
    result = agent_cli.invoke("predict", "--model", str(model), str(images), "--top-k", "2")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # six images, one batch: no progress bar
    want = predict(load_model(model), image_files(images), k=2)
    for item in want.items:
        row = next(line for line in result.stdout.splitlines() if str(Path(item.file).relative_to(images)) in line)
        for name, _, p in item.top:
            assert f"{name} {100 * p:.1f}%" in row


def test_predict_json_is_the_only_thing_on_stdout(agent_cli, model, images):
    result = agent_cli.invoke("predict", "--model", str(model), str(images), "--json", "-k", "3")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    want = predict(load_model(model), image_files(images), k=3)
    assert document == [item.to_dict() for item in want.items]
    assert [set(d) for d in document] == [{"file", "predictions"}] * 6
    single = agent_cli.invoke("predict", "--model", str(model), str(images / "Coat" / "1.jpg"), "--json", "-k", "1")
    first = want.items[1].to_dict()  # Coat/1.jpg
    assert json.loads(single.stdout) == [{"file": first["file"], "predictions": first["predictions"][:1]}]


def test_a_large_folder_shows_progress_on_stderr_and_skips_unreadable_files(agent_cli, model, images, tmp_path):
    for i in range(5):
        Image.new("L", (28, 28), 20 * i).save(tmp_path / f"{i}.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    result = agent_cli.invoke("predict", "--model", str(model), str(tmp_path), "--json", "--batch-size", "2")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)) == 5
    lines = result.stderr.splitlines()
    assert any(line.startswith("predicting 6 images 6/6") for line in lines), result.stderr
    assert lines[-1].startswith(f"skipped 1 file(s): {tmp_path / 'broken.png'} (not an image Pillow can identify)")


def test_evaluate_prints_accuracy_per_class(agent_cli, model, images):
    loaded = load_model(model)
    data = read_image_folder(images, loaded.task)
    want = evaluate(loaded, data.images, data.labels)
    result = agent_cli.invoke("evaluate", "--model", str(model), "--data", str(images))
    assert result.returncode == 0, result.stderr
    for c in want.classes:
        assert any(
            line.split("│")[1:6]
            and [cell.strip() for cell in line.split("│")[1:6]]
            == [c.name, str(c.index), str(c.examples), str(c.correct), f"{100 * c.accuracy:.2f}%"]
            for line in result.stdout.splitlines()
        ), result.stdout
    said = " ".join(result.stdout.split())  # a long path may wrap
    assert (
        f"accuracy {100 * want.accuracy:.2f}% on all of {images}, which has no train/test split "
        f"({want.correct} of 6 images, 2 of the model's 10 classes), 0 file(s) skipped" in said
    )
    as_json = agent_cli.invoke("evaluate", "--model", str(model), "--data", str(images), "--json")
    document = json.loads(as_json.stdout)
    assert document == {"model": str(model), "data": str(images), "split": None, **want.to_dict()}
    assert [(c["class"], c["examples"]) for c in document["classes"]] == [("Coat", 3), ("Sneaker", 3)]
    batched = agent_cli.invoke("evaluate", "--model", str(model), "--data", str(images), "--json", "--batch-size", "2")
    assert json.loads(batched.stdout) == document
    # The images were decoded (and cached) by the first call: this one reads the cache, only evaluating shows progress.
    assert "evaluating 6/6" in batched.stderr, batched.stderr


def _idx_files(folder: Path, prefix: str, labels: list[int], seed: int) -> None:
    """Fashion-MNIST's IDX pair ``{prefix}-images-idx3-ubyte`` and ``{prefix}-labels-idx1-ubyte``: 28x28 noise images."""
    n = len(labels)
    pixels = np.random.default_rng(seed).integers(0, 256, (n, 28, 28), dtype=np.uint8)
    (folder / f"{prefix}-images-idx3-ubyte").write_bytes(
        b"\x00\x00\x08\x03" + np.array([n, 28, 28], dtype=">u4").tobytes() + pixels.tobytes()
    )
    (folder / f"{prefix}-labels-idx1-ubyte").write_bytes(
        b"\x00\x00\x08\x01" + np.array([n], dtype=">u4").tobytes() + np.array(labels, dtype=np.uint8).tobytes()
    )


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """A Fashion-MNIST folder as published, small: 12 training images (all T-shirt_top) and 7 test images (7 classes)."""
    folder = tmp_path_factory.mktemp("fashion-mnist")
    _idx_files(folder, "train", [0] * 12, seed=1)
    _idx_files(folder, "t10k", list(range(7)), seed=2)
    return folder


def test_evaluate_scores_a_release_s_test_split_and_names_it(agent_cli, model, release):
    loaded = load_model(model)
    for split, count in (("test", 7), ("train", 12)):
        data = load_fashion_mnist(release, split)
        want = evaluate(loaded, data.images, data.labels)
        args = ("evaluate", "--model", str(model), "--data", str(release))
        result = agent_cli.invoke(*args, *(["--split", split] if split == "train" else []))
        assert result.returncode == 0, result.stderr
        said = " ".join(result.stdout.split())
        assert f"Fashion-MNIST {release} ({split} split): {count} images in" in said, said
        assert f"accuracy {100 * want.accuracy:.2f}% on the {split} split ({want.correct} of {count} images" in said
        document = json.loads(
            agent_cli.invoke(*args, "--json", *(["--split", split] if split == "train" else [])).stdout
        )
        assert document["split"] == split and document["examples"] == count
        assert document["correct"] == want.correct


def test_evaluate_scores_the_test_folder_of_an_image_folder_laid_out_by_split(agent_cli, model, images, tmp_path):
    shutil.copytree(images, tmp_path / "train")
    shutil.copytree(images / "Coat", tmp_path / "test" / "Coat")  # 3 images, against 6 in train/
    result = agent_cli.invoke("evaluate", "--model", str(model), "--data", str(tmp_path))
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stdout.split())
    assert f"image folder {tmp_path / 'test'}: 3 images in 1 class" in said and "on the test split (" in said, said
    assert " of 3 images, 1 of the model's 10 classes)" in said, said


def test_evaluate_refuses_a_split_the_data_does_not_hold(agent_cli, model, images, tmp_path):
    _idx_files(tmp_path, "train", [0, 1, 2], seed=3)  # a release folder with the training files only
    result = agent_cli.invoke("evaluate", "--model", str(model), "--data", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"{tmp_path} holds no test split: scoring its train split" in " ".join(result.stderr.split())
    assert "on the train split (" in " ".join(result.stdout.split())
    cases = [
        (tmp_path, "test", f"--split test: Fashion-MNIST {tmp_path} holds no test split (it holds train)"),
        (images, "test", f"--split test: image folder {images} has no splits (it is scored whole); leave out --split"),
        (images, "validation", "--split 'validation' is not a split; use one of train, val, test"),
    ]
    for data, split, fragment in cases:
        result = agent_cli.invoke("evaluate", "--model", str(model), "--data", str(data), "--split", split)
        assert result.returncode == 2 and result.stdout == "", result.stdout
        agent_cli.assert_user_error(result, fragment)


def test_bad_input_is_one_line_and_exit_2(agent_cli, model, images, tmp_path):
    (tmp_path / "junk.onnx").write_bytes(b"\x00\x01 not a model")
    (tmp_path / "junk.png").write_text("not an image")
    (tmp_path / "empty").mkdir()
    (tmp_path / "odd" / "coats").mkdir(parents=True)
    Image.new("L", (28, 28)).save(tmp_path / "odd" / "coats" / "a.png")
    cases = [
        (("predict", "--model", str(tmp_path / "none.onnx"), str(images)), "does not exist or is not a file"),
        (("predict", "--model", str(tmp_path / "junk.onnx"), str(images)), "junk.onnx"),
        (("predict", "--model", str(model), str(images), "--top-k", "0"), "--top-k 0 must be between 1 and"),
        (("predict", "--model", str(model), str(images), "--top-k", "11"), "the model's 10 classes"),
        (("predict", "--model", str(model), str(tmp_path / "empty")), "holds no image files"),
        (("predict", "--model", str(model), str(tmp_path / "nowhere")), "nowhere does not exist"),
        (("predict", "--model", str(model), str(tmp_path / "junk.png")), "junk.png: not an image Pillow can identify"),
        (("evaluate", "--model", str(model), "--data", str(tmp_path / "nowhere")), "does not exist"),
        (("evaluate", "--model", str(model), "--data", str(tmp_path / "empty")), "holds no class folders"),
        (("evaluate", "--model", str(model), "--data", str(tmp_path / "odd")), "did you mean 'Coat'"),
    ]
    for args, fragment in cases:
        result = agent_cli.invoke(*args)
        assert result.returncode == 2, (args, result.stderr)
        agent_cli.assert_user_error(result, fragment)
        assert result.stdout == ""


def _personal_file(folder: Path, name: str, extra: dict) -> Path:
    """The fixture's variant exported as a personal model's file whose metadata holds ``extra``."""
    arch = Arch.smallest(SMALL)
    variant = extract(Supernet(SMALL, seed=1), arch)
    noise = torch.rand(64, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    recalibrate_bn(variant, [(noise - SMALL.mean[0]) / SMALL.std[0]])
    path = folder / name
    export_onnx(variant, path, SMALL, arch, extra={"personal_method": "prior", "personal_strength": 1.0, **extra})
    return path


def test_evaluate_names_what_a_personal_model_was_tuned_to_and_reads_one_written_before_it_said(
    agent_cli, images, tmp_path
):
    tuned = _personal_file(tmp_path, "tuned.onnx", {"personal_classes": ["Coat"], "personal_task_classes": 10})
    document = json.loads(agent_cli.invoke("evaluate", "--model", str(tuned), "--data", str(images), "--json").stdout)
    part = document["personal"]
    assert part["personal_classes"] == ["Coat"] and len(part["not_tuned_to"]) == 9 and "Sneaker" in part["not_tuned_to"]
    assert part["tuned"] == "tuned to 1 of 10 classes: Coat; serve the global model for the others"
    assert [(c["class"], c["tuned"]) for c in document["classes"]] == [("Coat", True), ("Sneaker", False)]
    assert (part["on_tuned_classes"]["examples"], part["on_other_classes"]["examples"]) == (3, 3)
    # A personal model's file from before the classes were recorded: evaluated as it was, and said so.
    old = _personal_file(tmp_path, "old.onnx", {})
    result = agent_cli.invoke("evaluate", "--model", str(old), "--data", str(images))
    assert result.returncode == 0, result.stderr
    assert "personal model: its file does not record the classes it was tuned to" in " ".join(result.stdout.split())
    document = json.loads(agent_cli.invoke("evaluate", "--model", str(old), "--data", str(images), "--json").stdout)
    assert document["personal"]["personal_classes"] is None and "tuned" not in document["classes"][0]


@pytest.mark.parametrize(
    "extra",
    [
        {"personal_classes": ["Coat", "Coat"], "personal_task_classes": 10},
        {"personal_classes": ["Unicorn"], "personal_task_classes": 10},
        {"personal_classes": ["Coat"], "personal_task_classes": 9},
        {"personal_classes": "[not json", "personal_task_classes": 10},
    ],
    ids=["twice", "not-a-class", "other-task", "not-json"],
)
def test_a_personal_models_classes_that_do_not_add_up_are_one_line_and_exit_2(agent_cli, images, tmp_path, extra):
    path = _personal_file(tmp_path, "bad.onnx", extra)
    result = agent_cli.invoke("evaluate", "--model", str(path), "--data", str(images))
    assert result.returncode == 2 and result.stdout == ""
    agent_cli.assert_user_error(result, "write the personal model again")
