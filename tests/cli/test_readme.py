"""The README stays short, and its commands run as written (issue 38).

Every command line of the README's ``bash`` code blocks is of one of three kinds, and a line of none of them fails
``test_every_readme_command_is_run_parsed_or_covered``:

* **run** (``RUN``): it finishes in seconds without a broker or training, so it runs here exactly as the README writes
  it, through the console script's entry function (``cli.invoke``), in a fresh directory;
* **parsed** (``PARSED``): it needs a broker, devices or a long training run, so the command itself parses the line
  (click's ``make_context``: option names, types and ranges, required options, paths that must exist) in the
  directory the block before it left behind, without running it; the test that runs such a command for real is named
  beside it;
* **covered** (``COVERED``): not a feast-edge command; the test (or CI step) that runs it is named beside it.

What the README says is yours, and what the test puts in its place; everything else is the README's text:

=============================  ================================================================================
the README writes              the test
=============================  ================================================================================
``sample/``                    3 Fashion-MNIST classes, 10 images each, as 64x64 PNG files in ``sample/<class>/``
``photos/`` (cam-1's images)   2 of those classes, 8 images each
``new-photos/``                4 images of 2 classes
``cam-1/``                     the bundle ``lab-pki/devices/cam-1``, copied there as the README says
``"$(id -un)"``                what the shell makes of it: the user name (``getpass.getuser()``)
``models/cam-1.onnx``          what ``feast-agent run`` writes after a federation: here ``feast-edge export`` of the
                               smallest cached variant of a freshly initialised supernet of ``my-task.toml``
=============================  ================================================================================

The three machines' commands all run in one directory, as if server.lab, cam-1 and cam-2 shared it.
"""

from __future__ import annotations

import getpass
import re
import shlex
import shutil
from pathlib import Path

import click
import pytest
import typer
from imagefolders import write_image_folder

from feast_edge.cache.variants import load_cache
from feast_edge.data.images import load_fashion_mnist
from feast_edge.space.preset import load_preset_file

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_LINES = 200
PROGRAMS = ("feast-edge", "feast-server", "feast-agent")
SHELL = {'"$(id -un)"': shlex.quote(getpass.getuser())}  # expansions the shell would make, made here

RUN = {"feast-edge preset new", "feast-edge cache build", "feast-server provision", "feast-agent profile",
       "feast-agent predict"}  # fmt: skip
PARSED = {
    # (own images, a preset file, a server without data) tests/federation/test_user_preset_federation.py;
    # (provisioned, over TLS) tests/federation/test_provision.py::
    # test_a_provisioned_federation_trains_and_refuses_what_the_identities_do_not_allow
    "feast-server run",
    "feast-agent run",
    # tests/cli/test_cli.py (the session's finished_run), tests/methods/ (a real run of every baseline)
    "feast-edge simulate",
    # tests/cli/test_report.py
    "feast-edge report",
}
COVERED = {
    "make demo": "tests/federation/test_federation_demo.py (feast-edge demo, which make demo runs after the set-up)",
    "make test": "CI: .ci/run runs make test in a fresh clone",
    "make test-fast": "CI: make test runs the same set-up and every test make test-fast runs",
    "mosquitto": "tests/federation/test_provision.py (mosquitto -c on the configuration provision writes)",
    # the quickstart without root or apt-get
    "python3 -m": "tests/cli/test_wheel.py (a fresh venv, the package installed into it, run from an empty directory)",
    "pip install": "tests/cli/test_wheel.py (pip installs the package into that venv; PyTorch is the machine's)",
    "feast-edge demo": "tests/federation/test_federation_demo.py (--data on a folder of the four files, amqtt broker)",
}
CLASSES = {0: "T-shirt_top", 1: "Trouser", 8: "Bag"}  # Fashion-MNIST labels -> the class folders the test writes


def code_blocks(text: str) -> list[list[str]]:
    """The command lines of every ``bash`` block: continuations joined, comments and blank lines left out."""
    blocks = []
    for body in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
        lines = (line.strip() for line in re.sub(r"\\\n[ \t]*", " ", body).splitlines())
        blocks.append([line for line in lines if line and not line.startswith("#")])
    return blocks


def words(line: str) -> list[str]:
    for written, made in SHELL.items():
        line = line.replace(written, made)
    return shlex.split(line, comments=True)


def _apps() -> dict[str, click.Command]:
    from feast_edge.agent.cli import app as agent
    from feast_edge.cli.main import app as edge
    from feast_edge.server.cli import app as server

    return {"feast-edge": typer.main.get_command(edge), "feast-server": typer.main.get_command(server),
            "feast-agent": typer.main.get_command(agent)}  # fmt: skip


def command_of(argv: list[str]) -> tuple[str, click.Command | None, list[str]]:
    """(its name: the program and subcommands, its click command or None, the arguments after the subcommands)."""
    if argv[0] not in PROGRAMS:
        name = "mosquitto" if argv[0] == "mosquitto" else " ".join(argv[:2])
        return name, None, argv[1:]
    command, taken = _apps()[argv[0]], 1
    for word in argv[1:]:
        sub = getattr(command, "commands", {}).get(word)
        if sub is None:
            break
        command, taken = sub, taken + 1
    return " ".join(argv[:taken]), command, argv[taken:]


def parse(argv: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the command parse ``argv`` in ``cwd`` as it would before running; a click error if it would refuse it."""
    name, command, args = command_of(argv)
    monkeypatch.chdir(cwd)
    with command.make_context(name, list(args)):
        pass


def run(argv: list[str], cwd: Path, clis: dict) -> str:
    """Run a README command line as written, in ``cwd``; its stdout. Fails the test with its stderr otherwise."""
    result = clis[argv[0]].invoke(*argv[1:], cwd=cwd)
    assert result.returncode == 0, f"{shlex.join(argv)} failed:\n{result.stderr[-3000:]}"
    return result.stdout


def block_of(heading: str) -> list[str]:
    """The command lines of the first ``bash`` block under the README heading ``heading``."""
    text = README.read_text(encoding="utf-8")
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    [first, *_] = code_blocks(section)
    return first


def your_files(root: Path, fashion_mnist_dir: Path) -> None:
    """What the README says is yours (the table above)."""
    train = load_fashion_mnist(fashion_mnist_dir, "train")
    names = [CLASSES.get(i, f"unused-{i}") for i in range(10)]
    write_image_folder(root / "sample", {c: 10 for c in CLASSES}, "png-64", train, names)
    write_image_folder(root / "photos", {0: 8, 1: 8}, "png-64", train, names, offset=10)
    write_image_folder(root / "new-photos", {0: 2, 8: 2}, "png-64", train, names, offset=20)


def a_model_as_the_federation_leaves_it(root: Path, clis: dict) -> None:
    """``models/cam-1.onnx``: a cached variant of the README's preset, exported as the agent exports its model."""
    smallest = load_cache(load_preset_file(root / "my-task.toml")).entries[0].arch
    (root / "models").mkdir()  # --model-dir; the agent makes it
    run(["feast-edge", "init", "--preset", "my-task.toml", "--out", "supernet.safetensors"], root, clis)
    run(["feast-edge", "export", "--checkpoint", "supernet.safetensors", "--preset", "my-task.toml",
         "--arch", smallest.to_json(), "--out", "models/cam-1.onnx"], root, clis)  # fmt: skip


@pytest.fixture
def clis(cli, server_cli, agent_cli) -> dict:
    return {"feast-edge": cli, "feast-server": server_cli, "feast-agent": agent_cli}


def test_the_readme_has_at_most_200_lines() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/ (at most {MAX_LINES})"


def test_every_readme_command_is_run_parsed_or_covered() -> None:
    names = [command_of(words(line))[0] for block in code_blocks(README.read_text(encoding="utf-8")) for line in block]
    assert names, "no bash blocks found in README.md"
    unknown = sorted({n for n in names if n not in RUN | PARSED | set(COVERED)})
    assert unknown == [], f"README commands this test neither runs, parses nor names a test for: {unknown}"
    assert RUN <= set(names), f"commands RUN expects in the README but it no longer shows: {sorted(RUN - set(names))}"


def test_a_broken_readme_command_fails_here(clis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the slow test below would meet if the README wrote an option the program does not have.
    [preset_new] = [line for line in block_of("Your own images on three machines") if " preset new " in line]
    result = clis["feast-edge"].invoke(*words(preset_new.replace("--input ", "--input-shape "))[1:], cwd=tmp_path)
    assert result.returncode != 0 and "--input-shape" in result.stderr
    [server_run] = [line for line in block_of("Your own images on three machines") if "feast-server run" in line]
    with pytest.raises(click.UsageError, match="twenty"):
        parse(words(server_run.replace("--rounds 20", "--rounds twenty")), tmp_path, monkeypatch)


def test_the_simulate_commands_parse_as_written(tmp_path: Path, monkeypatch, fashion_mnist_dir: Path) -> None:
    lines = block_of("Simulate, and compare with the baselines")
    assert [command_of(words(line))[0] for line in lines] == ["feast-edge simulate"] * 2 + ["feast-edge report"]
    (tmp_path / "runs" / "feast").mkdir(parents=True)  # what the two simulate lines write, for report's arguments
    (tmp_path / "runs" / "heterofl").mkdir()
    for line in lines:
        parse(words(line), tmp_path, monkeypatch)


@pytest.mark.slow  # cache build and profile take 10-20 s each on two cores
@pytest.mark.timeout(600)
def test_the_three_machines_block_runs_as_written(
    clis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fashion_mnist_dir: Path
) -> None:
    your_files(tmp_path, fashion_mnist_dir)
    seen = []
    for line in block_of("Your own images on three machines"):
        argv = words(line)
        name, _, _ = command_of(argv)
        seen.append(name)
        if name == "feast-agent run":
            shutil.copytree(tmp_path / "lab-pki" / "devices" / "cam-1", tmp_path / "cam-1")  # "copied to cam-1/"
        if name == "feast-agent predict":
            a_model_as_the_federation_leaves_it(tmp_path, clis)
        if name in RUN:
            out = run(argv, tmp_path, clis)
            if name == "feast-agent predict":
                assert "classes Bag, T-shirt_top, Trouser" in out and out.count(".png") == 4, out
        elif name in PARSED:
            parse(argv, tmp_path, monkeypatch)
        else:
            assert name in COVERED, name
    assert seen == ["feast-edge preset new", "feast-edge cache build", "feast-server provision", "mosquitto",
                    "feast-server run", "feast-agent profile", "feast-agent run", "feast-agent predict"]  # fmt: skip
    for written in ("my-task.toml", "my-task.cache.json", "lab-pki/server/bundle.json",
                    "lab-pki/devices/cam-2/bundle.json", "cam-1.json"):  # fmt: skip
        assert (tmp_path / written).is_file(), written
    assert f"user {getpass.getuser()}" in (tmp_path / "lab-pki" / "broker" / "mosquitto.conf").read_text()


def test_the_quickstart_without_root_parses_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    [block] = [b for b in code_blocks(README.read_text(encoding="utf-8")) if any(" demo --data " in line for line in b)]
    [demo] = [words(line) for line in block if command_of(words(line))[0] == "feast-edge demo"]
    (tmp_path / "fashion-mnist").mkdir()  # the folder the README names, where the reader put the four files
    _, command, args = command_of(demo)
    monkeypatch.chdir(tmp_path)
    with command.make_context("feast-edge demo", list(args)) as ctx:
        assert Path(ctx.params["data"]).name == "fashion-mnist"
