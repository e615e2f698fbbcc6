"""The board installs of docs/install-device.md as written (issue 38): the test reads what it checks from the page
itself.

* **Jetson boards**: the ``pip install --no-deps`` list for a board whose PyTorch is NVIDIA's. An empty venv gets
  exactly the listed packages with ``--no-deps`` (repacked from this environment's installed copies: nothing is
  downloaded) and the project's wheel; it sees PyTorch, torchvision and what PyTorch requires through a ``.pth``
  file, as a Jetson venv sees NVIDIA's wheels, and nothing else. ``feast-agent --help`` and ``predict`` must work
  there, and every module of the agent must import: a package missing from the list fails it.
* **Boards that cannot run the agent**: the ONNX Runtime-only ``classify.py`` turns image files into exactly the
  pixels ``feast-agent predict`` feeds the model, for every resize policy, and the opset-13 copy for older ONNX
  Runtimes gives the same logits as the file it was made from.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as metadata
import json
import os
import re
import shlex
import subprocess
import sys
import types
import venv
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from PIL import Image

from feast_edge.evaluate.onnx_export import export_onnx
from feast_edge.evaluate.predict import image_files, load_model, predict, read_image
from feast_edge.space.arch import Arch
from feast_edge.space.extract import extract
from feast_edge.space.preset import load_preset
from feast_edge.space.supernet import Supernet

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "install-device.md"
# The comment line that marks the documented --no-deps list, and the first line of the ONNX Runtime-only script.
NO_DEPS_MARK = "# feast-agent's runtime dependencies besides PyTorch"
CLASSIFY_MARK = '"""Classify image files with a feast-edge ONNX model'
OPSET_MARK = "model.ir_version = 7"


def _code_block(mark: str) -> str:
    """The fenced code block of docs/install-device.md that contains ``mark`` (exactly one must)."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)
    found = [block for block in blocks if mark in block]
    assert len(found) == 1, f"docs/install-device.md has {len(found)} code blocks with {mark!r}; it needs exactly one"
    return found[0]


def documented_packages() -> list[str]:
    """The packages of the page's ``pip install --no-deps`` line that installs no wheel file."""
    commands = _code_block(NO_DEPS_MARK).replace("\\\n", " ").splitlines()
    lists = [
        words[3:]
        for words in (shlex.split(line, comments=True) for line in commands)
        if words[:3] == ["pip", "install", "--no-deps"] and not any(w.endswith(".whl") for w in words)
    ]
    assert len(lists) == 1, f"the marked block needs one 'pip install --no-deps PACKAGE...' line: {commands}"
    return lists[0]


# ---------------------------------------------------------------------- an environment like a Jetson's


def _requirement_closure(roots: list[str]) -> set[str]:
    """The installed distributions ``roots`` require, transitively (markers and extras evaluated here)."""
    extras: dict[str, set[str]] = {}
    todo = [(name, frozenset()) for name in roots]
    while todo:
        name, wanted = todo.pop()
        key = canonicalize_name(name)
        if key in extras and wanted <= extras[key]:
            continue
        extras[key] = extras.get(key, set()) | wanted
        for line in metadata.distribution(name).requires or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in ("", *extras[key])):
                todo.append((requirement.name, frozenset(requirement.extras)))
    return set(extras)


def _top_levels(name: str) -> set[Path]:
    """The top-level files and folders of an installed distribution (scripts outside site-packages left out)."""
    dist = metadata.distribution(name)
    return {
        Path(dist.locate_file(f.parts[0]))
        for f in dist.files or []
        if f.parts[0] != ".." and "__pycache__" not in f.parts
    }


def _repack(name: str, folder: Path) -> Path:
    """A wheel of the installed distribution ``name``, from its files as installed (no network, no build)."""
    dist = metadata.distribution(name)
    info = next(f for f in dist.files or [] if f.name == "WHEEL" and f.parent.name.endswith(".dist-info"))
    tags = [
        line.split(":", 1)[1].strip().split("-") for line in info.read_text().splitlines() if line.startswith("Tag:")
    ]
    tag = "-".join(
        ".".join(dict.fromkeys(t[i] for t in tags)) for i in range(3)
    )  # py2-none-any + py3-... : py2.py3-...
    wheel = folder / f"{re.sub(r'[-_.]+', '_', dist.metadata['Name'])}-{dist.version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        for f in dist.files or []:
            path = Path(dist.locate_file(f))
            if f.parts[0] != ".." and "__pycache__" not in f.parts and path.is_file():
                archive.write(path, f.as_posix())
    return wheel


def _jetson_like_venv(root: Path, packages: list[str], project: Path) -> Path:
    """An empty venv with ``packages`` and feast-edge installed --no-deps, seeing only PyTorch's files from outside.

    Outside means torch, torchvision and what torch requires; torchvision's own numpy and pillow stay out: the agent
    imports both itself (they are dependencies of feast-edge), so the documented list must name them.
    """
    wheels, pytorch, env = root / "wheels", root / "pytorch", root / "venv"
    wheels.mkdir()
    pytorch.mkdir()
    outside = _requirement_closure(["torch"]) | {"torch", "torchvision"}
    for top in set().union(*(_top_levels(name) for name in outside)):
        (pytorch / top.name).symlink_to(top)
    missing = [p for p in packages if _installed(p) is None]
    assert not missing, f"docs/install-device.md lists packages that are not distributions installed here: {missing}"
    built = [_repack(name, wheels) for name in packages] + [project]
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env)
    python = env / "bin" / "python"
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    (Path(purelib) / "nvidia-pytorch.pth").write_text(f"{pytorch}\n")  # after the venv's own site-packages
    pip = [sys.executable, "-m", "pip", "--isolated", "--python", python, "install"]
    _run(*pip, "--no-deps", "--no-index", "--no-compile", *built)
    return env


def _installed(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def _run(*command: str | Path, cwd: Path | None = None) -> str:
    """Run ``command`` without this environment's PYTHONPATH; its stdout, or a failure that shows its stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    done = subprocess.run(list(map(str, command)), capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert done.returncode == 0, f"{' '.join(map(str, command[:4]))} ... exited {done.returncode}:\n{done.stderr}"
    return done.stdout


def _model(tmp: Path, resize: str = "stretch", preset: str = "fmnist-small") -> Path:
    """The smallest variant of ``preset`` exported with its task under the ``resize`` policy."""
    loaded = load_preset(preset)
    arch = Arch.smallest(loaded)
    path = tmp / f"{preset}-{resize}.onnx"
    variant = extract(Supernet(loaded, seed=1), arch).eval()
    export_onnx(variant, path, loaded, arch, task=dataclasses.replace(loaded.task, resize=resize))
    return path


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("wheel")  # beside test_wheel.py: the project's wheel is built once (conftest.project_wheel)
def test_the_documented_jetson_no_deps_list_runs_the_agent(tmp_path: Path, project_wheel: tuple[Path, Path]) -> None:
    env = _jetson_like_venv(tmp_path, documented_packages(), project_wheel[1])
    assert "predict" in _run(env / "bin" / "feast-agent", "--help")

    model, image = _model(tmp_path), tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 30), dtype=np.uint8)).save(image)
    predicted = _run(env / "bin" / "feast-agent", "predict", "--model", model, image, "--json", "--threads", "1")
    want = predict(load_model(model), [image], k=3)
    assert json.loads(predicted) == [item.to_dict() for item in want.items]

    # run, profile and fetch-model import most of their modules only when they start: import all of them, and
    # check that the venv holds feast-edge itself and sees nothing of this environment but PyTorch.
    check = (
        "import importlib, importlib.util, pkgutil, sys, feast_edge, feast_edge.agent as a, torch\n"
        "for m in pkgutil.walk_packages(a.__path__, 'feast_edge.agent.'): importlib.import_module(m.name)\n"
        f"assert feast_edge.__file__.startswith({str(env)!r}), feast_edge.__file__\n"
        f"assert torch.__file__.startswith({str(tmp_path / 'pytorch')!r}), torch.__file__\n"
        "assert importlib.util.find_spec('starlette') is None\n"
    )
    _run(env / "bin" / "python", "-c", check, cwd=tmp_path)  # not the checkout: python -c imports from its folder


# ---------------------------------------------------------------------- ONNX Runtime only


@pytest.fixture(scope="module")
def classify():
    """docs/install-device.md's ONNX Runtime-only script, loaded as a module."""
    module = types.ModuleType("classify")
    exec(compile(_code_block(CLASSIFY_MARK), "classify.py", "exec"), module.__dict__)  # noqa: S102 - the page's own code
    return module


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Image files of the kinds a device meets: grey, RGB, transparent, palette, 16-bit, turned by EXIF, odd sizes."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)

    def noise(*shape: int) -> np.ndarray:
        return rng.integers(0, 256, shape, dtype=np.uint8)

    Image.fromarray(noise(40, 30)).save(root / "grey.png")
    Image.fromarray(noise(33, 57, 3)).save(root / "rgb.jpg")
    Image.fromarray(noise(50, 50, 4), "RGBA").save(root / "transparent.png")
    Image.fromarray(noise(20, 64, 3)).convert("P").save(root / "palette.png", transparency=3)
    Image.fromarray(rng.integers(0, 65536, (31, 29)).astype(np.uint16)).save(root / "deep.png")
    turned = Image.fromarray(noise(24, 48, 3))
    exif = turned.getexif()
    exif[0x0112] = 6  # EXIF orientation: rotate 90 degrees to show it upright
    turned.save(root / "turned.jpg", exif=exif)
    Image.fromarray(noise(100, 7, 3)).save(root / "thin.webp")
    return image_files(root)


@pytest.mark.parametrize("preset", ["fmnist-small", "paper-cifar100"])
@pytest.mark.parametrize("resize", ["stretch", "center-crop", "pad"])
def test_the_onnx_runtime_only_script_classifies_as_feast_agent_predict(classify, photos, tmp_path, preset, resize):
    path = _model(tmp_path, resize, preset)
    model = load_model(path)
    session, task = classify.load(str(path))
    for photo in photos:
        want = read_image(photo, model.task)
        pixels = classify.pixels(str(photo), task)
        np.testing.assert_array_equal(pixels, want.numpy().astype(np.float32) / np.float32(255.0), err_msg=photo.name)
        np.testing.assert_allclose(classify.probabilities(session, pixels[None]), model.probabilities(want[None]))


def test_the_opset_13_copy_gives_the_logits_and_metadata_of_the_exported_file(tmp_path: Path) -> None:
    _model(tmp_path).rename(tmp_path / "nano.onnx")  # the names the page's snippet uses
    _run(sys.executable, "-c", _code_block(OPSET_MARK), cwd=tmp_path)
    copy = onnx.load(str(tmp_path / "nano-opset13.onnx"))
    assert ([o.version for o in copy.opset_import], copy.ir_version) == ([13], 7)
    x = np.random.default_rng(0).random((4, 1, 28, 28), dtype=np.float32)
    sessions = [
        onnxruntime.InferenceSession(str(tmp_path / name), providers=["CPUExecutionProvider"])
        for name in ("nano.onnx", "nano-opset13.onnx")
    ]
    exported, restamped = (session.run(None, {"pixels": x})[0] for session in sessions)
    np.testing.assert_array_equal(restamped, exported)
    exported_meta, restamped_meta = (session.get_modelmeta().custom_metadata_map for session in sessions)
    assert restamped_meta == exported_meta and "feast.task" in restamped_meta
