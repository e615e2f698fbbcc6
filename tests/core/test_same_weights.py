"""Fixed-seed simulations end on the same weights as the commit the digests in tests/data/same-weights.json were made
from: the methods, central DP (fixed and adaptive clipping), local DP, each robust rule, each server optimizer, a cohort
over two processes (tests/sameweights.py lists the command lines).

On a machine the record knows, the digests are compared directly. On another one (floating-point results depend on
the CPU's instruction set) the recorded commit is built from git into a temporary folder and runs the same command
lines beside this checkout. The MQTT federation and the Flower app compute what the simulator computes
(tests/federation/test_federation_same_math.py, tests/federation/test_flower.py), so the same weights here carry over
to them.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from sameweights import CASES, build_commit, command, digest, machine, read_record, run_cases

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The record, and this machine's reference: its digests, or the recorded commit's build to make them."""
    record = read_record()
    assert record["commit"], "tests/data/same-weights.json records no commit: run 'python tests/sameweights.py record'"
    digests = record["machines"].get(machine())
    site = None
    if digests is None:
        try:
            site = build_commit(record["commit"], tmp_path_factory.mktemp("same-weights-build"))
        except subprocess.CalledProcessError as exc:
            pytest.fail(
                f"this machine ({machine()}) has no recorded digests and commit {record['commit'][:12]} could not be "
                f"built to make them ({exc.stderr!r:.400}); a full clone of the repository is needed"
            )
    return {"commit": record["commit"], "digests": digests, "site": site}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_fixed_seed_run_ends_on_the_recorded_weights(
    case: str, recorded: dict, fashion_mnist_dir: Path, tmp_path: Path
) -> None:
    [now] = run_cases([case], tmp_path / "now", str(fashion_mnist_dir)).values()
    if recorded["digests"] is not None:
        then = recorded["digests"][case]
    else:
        [then] = run_cases([case], tmp_path / "then", str(fashion_mnist_dir), str(recorded["site"])).values()
    assert now == then, f"{case}: the final weights differ from commit {recorded['commit'][:12]}'s"


def test_a_run_directory_the_recorded_commit_wrote_resumes_here(
    recorded: dict, fashion_mnist_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # The recorded commit's build writes a finished run; this checkout resumes it (same options, --resume) and ends on
    # its weights: the checkpoint's format and the settings' fingerprint still match.
    site = recorded["site"] or build_commit(recorded["commit"], tmp_path_factory.mktemp("same-weights-build"))
    [then] = run_cases(["server-adam"], tmp_path, str(fashion_mnist_dir), str(site)).values()
    run = tmp_path / "server-adam"
    written = [r["seconds"] for r in json.loads((run / "results.json").read_text())["rounds"]]
    resumed = subprocess.run([*command("server-adam", run, str(fashion_mnist_dir)), "--resume"], capture_output=True,
                             text=True, cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert digest(run) == then
    # the rounds came from the old checkpoint, not from training them again (their timings are the old run's)
    assert [r["seconds"] for r in json.loads((run / "results.json").read_text())["rounds"]] == written
