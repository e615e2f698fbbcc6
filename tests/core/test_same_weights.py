"""Fixed-seed runs end on the same weights as the commit the digests in tests/data/same-weights.json were made from:
simulations of the methods, central DP (fixed and adaptive clipping), local DP, each robust rule, each server
optimizer and a cohort over two processes; a federation of real ``feast-server`` and ``feast-agent`` processes through
a private mosquitto; the Flower app on Flower's Deployment Engine (tests/sameweights.py lists the command lines).

On a machine the record knows, the digests are compared directly. On another one (floating-point results depend on
the CPU's instruction set) the recorded commit is built from git into a temporary folder and runs the same command
lines beside this checkout.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from sameweights import CASES, build_commit, command, commit_of, digest, machine, read_record, run_cases

pytestmark = pytest.mark.slow


class Recorded:
    """The record (its commits) and this machine's digests; each commit's build, made the first time a case needs it
    (a machine the record does not know, or a case recorded after the machine was)."""

    def __init__(self, record: dict, digests: dict[str, str], folder: pytest.TempPathFactory) -> None:
        self.record, self.digests, self.folder = record, digests, folder
        self.commit = record["commit"]
        self.sites: dict[str, Path] = {}

    def commit_of(self, case: str) -> str:
        return commit_of(self.record, case)

    def build(self, commit: str | None = None) -> Path:
        commit = commit or self.commit
        if commit not in self.sites:
            try:
                self.sites[commit] = build_commit(commit, self.folder.mktemp("same-weights-build"))
            except subprocess.CalledProcessError as exc:
                pytest.fail(
                    f"this machine ({machine()}) lacks recorded digests and commit {commit[:12]} could not be "
                    f"built to make them ({exc.stderr!r:.400}); a full clone of the repository is needed"
                )
        return self.sites[commit]


@pytest.fixture(scope="session")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    record = read_record()
    assert record["commit"], "tests/data/same-weights.json records no commit: run 'python tests/sameweights.py record'"
    return Recorded(record, record["machines"].get(machine(), {}), tmp_path_factory)


# A federation runs a few processes for half a minute or more, twice where the recorded commit makes its digest.
MARKS_OF_KIND = {
    "simulate": (),
    "mqtt": (pytest.mark.broker, pytest.mark.timeout(600)),
    "flower": (pytest.mark.timeout(600),),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=MARKS_OF_KIND[CASES[c].kind]) for c in sorted(CASES)])
def test_a_fixed_seed_run_ends_on_the_recorded_weights(
    case: str, recorded: Recorded, fashion_mnist_dir: Path, tmp_path: Path
) -> None:
    [now] = run_cases([case], tmp_path / "now", str(fashion_mnist_dir)).values()
    then, commit = recorded.digests.get(case), recorded.commit_of(case)
    if then is None:
        [then] = run_cases([case], tmp_path / "then", str(fashion_mnist_dir), str(recorded.build(commit))).values()
    assert now == then, f"{case}: the final weights differ from commit {commit[:12]}'s"


def test_a_run_directory_the_recorded_commit_wrote_resumes_here(
    recorded: Recorded, fashion_mnist_dir: Path, tmp_path: Path
) -> None:
    # The recorded commit's build writes a finished run; this checkout resumes it (same options, --resume) and ends on
    # its weights: the checkpoint's format and the settings' fingerprint still match.
    [then] = run_cases(["server-adam"], tmp_path, str(fashion_mnist_dir), str(recorded.build())).values()
    run = tmp_path / "server-adam"
    written = [r["seconds"] for r in json.loads((run / "results.json").read_text())["rounds"]]
    resumed = subprocess.run([*command("server-adam", run, str(fashion_mnist_dir)), "--resume"], capture_output=True,
                             text=True, cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert digest(run) == then
    # the rounds came from the old checkpoint, not from training them again (their timings are the old run's)
    assert [r["seconds"] for r in json.loads((run / "results.json").read_text())["rounds"]] == written
