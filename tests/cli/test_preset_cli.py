"""A preset for your own images: ``feast-edge preset new``, its cache beside it, and the preset used end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from feast_edge.cache.variants import load_cache
from feast_edge.data.images import load_fashion_mnist
from feast_edge.space.preset import BUILTIN_DIR, load_preset, load_preset_file

FIVE_CLASSES = ("T-shirt_top", "Trouser", "Pullover", "Dress", "Coat")  # Fashion-MNIST's labels 0..4, as folder names
NEW = ("preset", "new", "--input", "3x64x64", "--budgets", "2M..200M")
QUICK_GA = ("--population", "8", "--generations", "2")


def _write_folder(root: Path, per_class: dict[str, int], fashion_mnist_dir: Path, split: str = "train") -> None:
    """Fashion-MNIST images of the first five classes, upscaled to 64x64 RGB PNG, in ``root/<class>/``."""
    data = load_fashion_mnist(fashion_mnist_dir, split)
    for label, name in enumerate(FIVE_CLASSES):
        if name not in per_class:
            continue
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in (data.labels == label).nonzero().flatten()[: per_class[name]].tolist():
            grey = Image.fromarray(data.images[i, 0].numpy(), "L")
            grey.convert("RGB").resize((64, 64), Image.Resampling.BILINEAR).save(folder / f"{split}-{i}.png")


def _preset_new(cli, tmp_path: Path, *extra: str, name: str = "my-task"):
    out = tmp_path / f"{name}.toml"
    return out, cli.invoke(*NEW, "--classes", "a,b,c,d,e", "--out", str(out), *extra)


# --------------------------------------------------------------------- preset new
def test_preset_new_writes_a_preset_and_says_what_it_chose(cli, tmp_path):
    out, result = _preset_new(cli, tmp_path)
    assert result.returncode == 0, result.stderr
    p = load_preset_file(out)
    assert (p.name, p.in_channels, p.input_size, p.class_names) == ("my-task", 3, 64, ("a", "b", "c", "d", "e"))
    assert "MAC range" in result.stdout and "1.36M .. 484.98M" in result.stdout
    assert "cache low-compute" in result.stdout and "12 targets 2.00M .. 24.00M" in result.stdout
    assert f"feast-edge cache build --preset {out}" in result.stdout
    assert p.recipe == {"augment": "none", "lr": 0.05} and "[train]" in out.read_text()  # no images counted: batch 64
    # not overwritten without --force; overwritten with it, under another name
    cli.assert_user_error(_preset_new(cli, tmp_path)[1], "exists; choose another file or pass --force")
    _, again = _preset_new(cli, tmp_path, "--force", "--name", "renamed", "--mean", "0.4", "--std", "0.2,0.2,0.3")
    assert again.returncode == 0, again.stderr
    p = load_preset_file(out)
    assert (p.name, p.mean, p.std) == ("renamed", (0.4, 0.4, 0.4), (0.2, 0.2, 0.3))
    assert "Given with --mean / --std" in out.read_text()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--input", "3x64", "--classes", "a,b"), "--input '3x64' is not CxHxW; write e.g. 3x64x64"),
        (("--input", "2x64x64", "--classes", "a,b"), "2 channels; a task takes 1 (grey) or 3 (RGB)"),
        (("--input", "3x64x32", "--classes", "a,b"), "the model takes square images"),
        (("--input", "3x64x64", "--classes", "a,b,a"), "--classes names a more than once"),
        (("--input", "3x64x64", "--classes", "a/b,c"), "cannot name a folder"),
        (("--input", "3x64x64", "--classes", ","), "--classes is empty"),
        (("--input", "3x64x64", "--classes", "a,b", "--budgets", "200M..2M"), "the range is inverted or empty"),
        (("--input", "3x64x64", "--classes", "a,b", "--budgets", "2M-200M"), "is not LOW..HIGH; write e.g. 2M..200M"),
        (("--input", "3x64x64", "--classes", "a,b", "--budgets", "10K..1M"), "low budget 0.01M MACs is below"),
        (("--input", "3x64x64", "--classes", "a,b", "--budgets", "2M..10000G"), "beyond any supernet"),
        (("--input", "3x64x64", "--classes", "a,b", "--mean", "0.1,0.2"), "--mean '0.1,0.2' has 2 values"),
        (("--input", "3x64x64", "--classes", "a,b", "--resize", "crop"), "--resize 'crop' is unknown"),
        (("--input", "3x64x64"), "give the classes once"),
        (
            ("--input", "3x64x64", "--classes", "a,b", "--classes-from", "images"),
            "--classes and --classes-from were both given; give the classes once",
        ),
    ],
)
def test_preset_new_refuses_bad_input_in_one_line(cli, tmp_path, args, fragment):
    budgets = () if "--budgets" in args else ("--budgets", "2M..200M")
    result = cli.invoke("preset", "new", *args, *budgets, "--out", str(tmp_path / "p.toml"))
    cli.assert_user_error(result, fragment)
    assert not (tmp_path / "p.toml").exists()


def test_preset_new_refuses_an_out_file_that_is_not_toml(cli, tmp_path):
    result = cli.invoke(*NEW, "--classes", "a,b", "--out", str(tmp_path / "p.json"))
    cli.assert_user_error(result, "a preset file ends in .toml")


def test_classes_and_statistics_from_an_image_folder(cli, tmp_path, fashion_mnist_dir):
    root = tmp_path / "images"
    _write_folder(root / "train", {"Trouser": 3, "Coat": 2, "Dress": 4}, fashion_mnist_dir)
    (root / "test").mkdir()
    out = tmp_path / "folder.toml"
    result = cli.invoke(*NEW, "--classes-from", str(root), "--out", str(out))
    assert result.returncode == 0, result.stderr
    p = load_preset_file(out)
    assert p.class_names == ("Coat", "Dress", "Trouser")  # root/train's sub-folders, sorted
    pixels = np.stack([np.asarray(Image.open(f), dtype=np.float64) / 255 for f in sorted(root.rglob("*.png"))])
    assert p.mean == pytest.approx(tuple(pixels.mean(axis=(0, 1, 2))), abs=1e-4)  # all 9 images read
    assert p.std == pytest.approx(tuple(pixels.std(axis=(0, 1, 2))), abs=1e-4)
    assert "Measured on 9 images" in out.read_text()
    # the recipe for the images it counted: 9, so the small-data batch
    assert p.recipe == {"augment": "none", "batch_size": 32, "lr": 0.05}
    assert "9 images in the --classes-from folder" in out.read_text() and "batch_size 32" in result.stdout
    cli.assert_user_error(
        cli.invoke(*NEW, "--classes-from", str(tmp_path / "none"), "--out", str(tmp_path / "x.toml")),
        "does not exist",
    )


# --------------------------------------------------------------------- its cache
def test_the_cache_of_a_user_preset_lives_beside_it(cli, tmp_path):
    out, result = _preset_new(cli, tmp_path)
    assert result.returncode == 0, result.stderr
    cache = tmp_path / "my-task.cache.json"
    missing = cli.invoke("cache", "show", "--preset", str(out))
    cli.assert_user_error(missing, f"does not exist; build it with 'feast-edge cache build --preset {out}'")
    built = cli.invoke("cache", "build", "--preset", str(out), "--targets", "2M,50M", *QUICK_GA)
    assert built.returncode == 0, built.stderr
    assert f"wrote {cache}" in built.stdout and cache.is_file()
    # found by path, and by name through $FEAST_EDGE_PRESET_PATH, from another directory
    shown = cli.invoke("cache", "show", "--preset", str(out), cwd=BUILTIN_DIR)
    assert shown.returncode == 0 and "my-task: 2 variants" in shown.stdout, shown.stderr
    by_name = cli.invoke("cache", "show", "--preset", "my-task", env={"FEAST_EDGE_PRESET_PATH": str(tmp_path)})
    assert by_name.returncode == 0 and "my-task: 2 variants" in by_name.stdout, by_name.stderr
    # --cache wins over the one beside the preset
    other = tmp_path / "elsewhere.json"
    cache.rename(other)
    assert cli.invoke("cache", "show", "--preset", str(out), "--cache", str(other)).returncode == 0
    other.rename(cache)
    # mean/std are in the digest: editing them makes the cache stale, and the error says so
    out.write_text(out.read_text().replace("mean = [0.5, 0.5, 0.5]", "mean = [0.4, 0.4, 0.4]"))
    stale = cli.invoke("cache", "show", "--preset", str(out))
    cli.assert_user_error(stale, "was built for another definition of preset 'my-task'")


def test_cache_build_of_a_built_in_preset_needs_out(cli, tmp_path):
    cli.assert_user_error(
        cli.invoke("cache", "build", "--preset", "fmnist-small", *QUICK_GA), "give --out FILE: preset fmnist-small"
    )


def test_the_agent_takes_cache(cli, agent_cli, tmp_path, fashion_mnist_dir):
    """``feast-agent run --cache``: a cache whose smallest variant is 30M refuses a 10M device (the shipped one has 1.4M)."""
    custom = tmp_path / "fmnist-top.json"
    built = cli.invoke("cache", "build", "--preset", "fmnist-small", "--targets", "30M,40M", "--out", str(custom))
    assert built.returncode == 0, built.stderr
    args = (
        "run",
        "--insecure",
        "--broker",
        "mqtt://127.0.0.1:1",
        "--device-id",
        "d1",
        "--data",
        str(fashion_mnist_dir),
    )
    low = agent_cli.invoke(*args, "--shard", "0/500", "--budget", "10M", "--cache", str(custom))
    agent_cli.assert_user_error(low, "budget 10.00M MACs is below the smallest cached variant")
    missing = agent_cli.invoke(*args, "--shard", "0/500", "--budget", "10M", "--cache", str(tmp_path / "no.json"))
    agent_cli.assert_user_error(missing, "no.json: does not exist; pass the cache file you built")
    # a profile records a preset *name*; the same preset given as a .toml file is accepted (then the broker is refused)
    by_file = agent_cli.invoke(
        *args, "--shard", "0/500", "--profile", "laptop-cpu", "--preset", str(BUILTIN_DIR / "fmnist-small.toml")
    )
    assert by_file.returncode == 2 and "error: cannot reach MQTT broker" in by_file.stderr, by_file.stderr


def test_tinyimagenet_names_its_classes_by_wordnet_id():
    p = load_preset("paper-tinyimagenet")
    names = p.task.classes
    assert len(names) == len(set(names)) == 200 and list(names) == sorted(names)
    assert all(len(n) == 9 and n[0] == "n" and n[1:].isdigit() for n in names)
    assert (names[0], names[-1]) == ("n01443537", "n12267677")
    assert len(load_cache(p)) == 55  # class names are not in the digest: the shipped cache still fits


# --------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_a_3x64x64_preset_end_to_end(cli, agent_cli, tmp_path, fashion_mnist_dir):
    """preset new -> cache build -> simulate on PNG folders of that shape -> ONNX export -> onnxruntime."""
    import onnxruntime as ort

    from feast_edge.run.checkpoint import load_supernet
    from feast_edge.space.extract import extract

    root = tmp_path / "images"
    _write_folder(root / "train", dict.fromkeys(FIVE_CLASSES, 40), fashion_mnist_dir, "train")
    _write_folder(root / "test", dict.fromkeys(FIVE_CLASSES, 10), fashion_mnist_dir, "test")
    preset_file = tmp_path / "my-task.toml"
    made = cli.invoke(*NEW, "--classes-from", str(root), "--out", str(preset_file))
    assert made.returncode == 0, made.stderr
    built = cli.invoke("cache", "build", "--preset", str(preset_file), "--population", "16", "--generations", "8")
    assert built.returncode == 0, built.stderr

    preset = load_preset(str(preset_file))
    cache = load_cache(preset)  # found beside the preset
    assert set(preset.class_names) == set(FIVE_CLASSES) and preset.input_size == 64
    assert len(cache) >= 20 and cache.smallest.macs <= 2e6 and cache.largest.macs <= 200e6

    run = tmp_path / "run"
    simulated = cli.invoke(
        "simulate",
        "--preset",
        str(preset_file),
        "--dataset",
        "imagefolder",
        "--data",
        str(root),
        "--out",
        str(run),
        "--clients",
        "2",
        "--per-round",
        "2",
        "--rounds",
        "1",
        "--budgets",
        "2M,6M",
        "--val-samples",
        "10",
        "--calib-samples",
        "10",
        "--batch-size",
        "16",
        "--device",
        "cpu",
    )
    assert simulated.returncode == 0, simulated.stderr[-3000:]
    results = json.loads((run / "results.json").read_text())
    assert len(results["variants"]) == len(cache)

    served = cache.largest_affordable(6e6)
    onnx_file = tmp_path / "served.onnx"
    exported = cli.invoke(
        "export",
        "--checkpoint",
        str(run / "best.safetensors"),
        "--arch",
        served.arch.to_json(),
        "--preset",
        str(preset_file),
        "--out",
        str(onnx_file),
    )
    assert exported.returncode == 0, exported.stderr
    image = next((root / "test" / "Coat").glob("*.png"))
    pixels = preset.task.image_tensor(Image.open(image)).unsqueeze(0)  # uint8 [1, 3, 64, 64]
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    feed = session.get_inputs()[0]
    assert feed.shape[1:] == [3, 64, 64]
    logits = session.run(None, {feed.name: pixels.float().div(255).numpy()})[0]
    assert logits.shape == (1, 5)
    supernet, _ = load_supernet(run / "best.safetensors", preset)
    model = extract(supernet, served.arch).eval()
    with torch.no_grad():
        expected = model(preset.task.normalized(pixels))
    np.testing.assert_allclose(logits, expected.numpy(), rtol=1e-4, atol=1e-4)
    # the device's view: feast-agent predict reads the task (class names, resize) from the file's metadata
    predicted = agent_cli.invoke("predict", "--model", str(onnx_file), str(image), "--json", "--top-k", "5")
    assert predicted.returncode == 0, predicted.stderr
    assert set(_class_names(json.loads(predicted.stdout))) == set(FIVE_CLASSES)
    shutil.rmtree(run)


def _class_names(record) -> list[str]:
    """Every value under a "class" key in predict's JSON document."""
    if isinstance(record, dict):
        return [v for k, v in record.items() if k == "class" and isinstance(v, str)] + [
            n for v in record.values() for n in _class_names(v)
        ]
    if isinstance(record, list):
        return [n for v in record for n in _class_names(v)]
    return []
