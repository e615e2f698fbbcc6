"""The wheel as a user installs it: built from the repository's files, installed in a fresh venv, run outside the checkout.

Nothing is downloaded: the wheel is built without build isolation (setuptools of
this environment) and installed with ``--no-deps --no-index``; its dependencies
(torch, onnx, typer, ...) come from the environment running the tests, which the
venv sees through ``--system-site-packages`` and, when the tests themselves run
in a venv (``make test``), through a ``.pth`` file naming that venv's
site-packages. Both come after the venv's own site-packages, so the venv's copy
of ``feast_edge`` wins over an editable install of the checkout.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest

# A wheel built and installed in a fresh venv (its fixture takes minutes on 2 cores), then its console scripts run.
# xdist_group: every test of the module on one pytest-xdist worker, so that the wheel is built once per run.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("wheel")]


def _outer_site_dirs() -> list[str]:
    """Site-packages of the interpreter running the tests (its venv's and the system's)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


@dataclass(frozen=True)
class Installed:
    repo: Path
    src: Path
    wheel: Path
    venv: Path
    site_packages: Path
    cwd: Path  # empty: nothing in it to import
    env: dict[str, str]

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def script(self, name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.run(str(self.venv / "bin" / name), *args, timeout=timeout)


@pytest.fixture(scope="module")
def installed(repo: Path, project_wheel: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Installed:
    if find_spec("venv") is None or find_spec("ensurepip") is None:
        pytest.skip("this Python has no venv/ensurepip module (on Debian/Ubuntu: apt-get install python3-venv)")
    base = tmp_path_factory.mktemp("wheel")
    venv, cwd = base / "venv", base / "cwd"
    cwd.mkdir()

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "VIRTUAL_ENV")
    }
    env.update({"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "COLUMNS": "160"})
    env.pop("FEAST_EDGE_PRESET_PATH", None)
    env.pop("FEAST_EDGE_PROFILE_PATH", None)

    def check(argv: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, (
            f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
        return result

    src, wheel = project_wheel
    made = subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    if made.returncode != 0 and "ensurepip" in made.stdout + made.stderr:
        pytest.skip(
            f"venv cannot install pip here (ensurepip unavailable): {(made.stdout + made.stderr).strip()[-300:]}"
        )
    assert made.returncode == 0, made.stdout + made.stderr
    python = str(venv / "bin" / "python")
    site_packages = Path(
        check([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    )
    # When the tests run in a venv, --system-site-packages reaches the base interpreter's packages only; add the
    # running environment's, after the venv's own (lines of a .pth file are appended to sys.path).
    (site_packages / "_feast_test_outer_env.pth").write_text("".join(f"{d}\n" for d in _outer_site_dirs()))
    check([python, "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)])
    return Installed(repo.resolve(), src, wheel, venv, site_packages.resolve(), cwd, env)


def test_wheel_holds_one_package_and_its_data(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as archive:
        names = set(archive.namelist())
    top = {name.split("/", 1)[0] for name in names}
    assert [
        t for t in top if t != "feast_edge" and not (t.startswith("feast_edge-") and t.endswith(".dist-info"))
    ] == [], sorted(top)
    assert not top & {"server", "device_agent", "feast_mqtt", "profiles", "tests", "bench"}

    src = installed.src
    data = {
        "presets": sorted((src / "feast_edge" / "presets").glob("*.toml")),
        "caches": sorted((src / "feast_edge" / "caches").glob("*.json")),
        "profiles": sorted((src / "profiles").glob("*.json")),
    }
    assert all(data.values()), data
    expected = {f"feast_edge/{kind}/{p.name}" for kind, files in data.items() for p in files}
    # Every module of the library (a package missing from pyproject's list would be left out silently), and the
    # applications' folders inside the namespace, every module of them, subpackages too.
    expected |= {p.relative_to(src).as_posix() for p in (src / "feast_edge").rglob("*.py")}
    for folder, package in (("server", "server"), ("device_agent", "agent"), ("profiles", "profiles")):
        expected |= {
            f"feast_edge/{package}/{p.relative_to(src / folder).as_posix()}" for p in (src / folder).rglob("*.py")
        }
    assert sorted(expected - names) == []
    assert {
        "feast_edge/presets/fmnist-small.toml",
        "feast_edge/profiles/jetson-nano.json",
        "feast_edge/caches/fmnist-small.json",
    } <= names

    # The licence travels with the wheel: its text in the dist-info, its name in the metadata (issue 38).
    licence = [n for n in names if ".dist-info/" in n and n.rsplit("/", 1)[-1] == "LICENSE"]
    assert len(licence) == 1, sorted(n for n in names if ".dist-info/" in n)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(installed.wheel) as archive:
        assert b"Apache License" in archive.read(licence[0])
        assert "Apache-2.0" in archive.read(metadata).decode()
    entry_points = next(archive_name for archive_name in names if archive_name.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(installed.wheel) as archive:
        scripts = archive.read(entry_points).decode()
    for line in (
        "feast-edge = feast_edge.cli.main:main",
        "feast-server = feast_edge.server.cli:main",
        "feast-agent = feast_edge.agent.cli:main",
    ):
        assert line in scripts


def test_venv_imports_its_own_copy(installed: Installed) -> None:
    code = (
        "import json, feast_edge, feast_edge.server, feast_edge.agent, feast_edge.transport, feast_edge.profiles as p; "
        "print(json.dumps([m.__file__ for m in (feast_edge, feast_edge.server, feast_edge.agent, feast_edge.transport, p)]))"
    )
    result = installed.run(str(installed.venv / "bin" / "python"), "-c", code)
    assert result.returncode == 0, result.stderr
    for file in map(Path, json.loads(result.stdout)):
        assert installed.site_packages in file.resolve().parents, (file, installed.site_packages)
        assert installed.repo not in file.resolve().parents, file


def test_presets_are_package_data(installed: Installed) -> None:
    result = installed.script("feast-edge", "presets")
    assert result.returncode == 0, result.stderr
    assert "fmnist-small" in result.stdout and "paper-cifar100" in result.stdout


def test_profiles_are_package_data(installed: Installed) -> None:
    result = installed.script("feast-agent", "profiles", "--json")
    assert result.returncode == 0, result.stderr
    listed = {record["name"]: Path(record["file"]) for record in map(json.loads, result.stdout.splitlines())}
    assert {"jetson-nano", "raspberry-pi-5", "desktop-gpu"} <= set(listed)
    assert installed.site_packages in listed["jetson-nano"].resolve().parents
    table = installed.script("feast-agent", "profiles")
    assert table.returncode == 0 and "jetson-nano" in table.stdout, table.stderr


def test_agent_finds_its_profile_and_reports_the_real_problem(installed: Installed) -> None:
    result = installed.script(
        "feast-agent",
        "run",
        "--insecure",
        "--profile",
        "jetson-nano",
        "--device-id",
        "d1",
        "--data",
        "/nonexistent",
        "--broker",
        "mqtt://127.0.0.1:1",
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "unknown device profile" not in lines[0] and "jetson-nano" not in lines[0], lines[0]
    assert "/nonexistent" in lines[0] or "broker" in lines[0], lines[0]


def test_the_installed_agent_reads_an_image_folder_against_its_task(installed: Installed, tmp_path: Path) -> None:
    from PIL import Image

    photos = tmp_path / "photos"
    for name, shade in (("Bag", 40), ("Sneaker", 200)):
        (photos / name).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (40 + i, 30), (shade, shade, shade)).save(photos / name / f"{i}.jpg")
    cache = tmp_path / "cache"
    args = ("run", "--insecure", "--profile", "jetson-nano", "--device-id", "d1", "--broker", "mqtt://127.0.0.1:1")
    installed.env["FEAST_EDGE_DATA_CACHE"] = str(cache)
    result = installed.script("feast-agent", *args, "--data", str(photos))
    # The folder is checked against the task and decoded (then cached) before the agent connects; only the broker fails.
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr, result.stderr
    assert "decoded 6 images" in result.stdout + result.stderr and "broker" in result.stderr.splitlines()[-1]
    assert any(cache.iterdir())
    (photos / "Sandals").mkdir()
    Image.new("L", (28, 28)).save(photos / "Sandals" / "x.png")
    refused = installed.script("feast-agent", *args, "--data", str(photos))
    assert refused.returncode == 2 and "did you mean 'Sandal'" in refused.stderr, refused.stderr


def test_provisioning_works_from_the_wheel(installed: Installed) -> None:
    """A lab sets up identities on a machine with only the wheel: the bundles it writes are what the installed agent takes."""
    pki = installed.cwd.parent / "pki"
    result = installed.script(
        "feast-server", "provision", "--out", str(pki), "--federation", "lab", "--device", "orin-1", "--device", "pi-2"
    )
    assert result.returncode == 0, result.stderr
    assert (pki / "broker" / "mosquitto.conf").is_file() and (pki / "devices" / "orin-1" / "bundle.json").is_file()
    assert "orin-1" in result.stdout and "mosquitto -c" in result.stdout
    wrong = installed.script(
        "feast-agent",
        "run",
        "--credentials",
        str(pki / "devices" / "orin-1"),
        "--device-id",
        "pi-2",
        "--data",
        "/nonexistent",
    )
    assert wrong.returncode == 2 and "differs from the credentials bundle's identity 'orin-1'" in wrong.stderr, (
        wrong.stderr
    )


def test_the_installed_cli_writes_an_int8_model(installed: Installed, fashion_mnist_dir: Path) -> None:
    """Issue 22: onnxruntime's quantizer and the int8 check run from the installed package, outside the checkout."""
    checkpoint, out = installed.cwd / "init.safetensors", installed.cwd / "m-int8.onnx"
    made = installed.script("feast-edge", "init", "--preset", "fmnist-small", "--out", str(checkpoint))
    assert made.returncode == 0, made.stderr
    arch = '{"d":[1,0,1,0],"e":[0.5,0.5,0.5,0.5],"w":[2,2,2,2,2]}'
    result = installed.script(
        "feast-edge", "export", "-k", str(checkpoint), "-a", arch, "-o", str(out),
        "--calibration-data", str(fashion_mnist_dir), "--calibration-samples", "64",
        "--precision", "int8", "--int8-samples", "32", "--int8-check", "100", "--int8-tolerance", "1",
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert ", int8" in result.stdout
    code = (
        "import sys, onnxruntime as ort; "
        "m = ort.InferenceSession(sys.argv[1]).get_modelmeta().custom_metadata_map; print(m['feast.precision'])"
    )
    meta = installed.run(str(installed.venv / "bin" / "python"), "-c", code, str(out))
    assert meta.stdout.strip() == "int8", meta.stderr
