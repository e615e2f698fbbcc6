"""``import feast_edge`` (presets, archs, the cost model, the task contract) needs neither PyTorch nor numpy."""

from __future__ import annotations

import subprocess
import sys


def test_presets_and_tasks_import_without_torch_or_numpy() -> None:
    code = (
        "import sys, feast_edge; p = feast_edge.load_preset('fmnist-small'); p.task.digest; "
        "print(sorted(m for m in ('torch', 'numpy', 'PIL') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
