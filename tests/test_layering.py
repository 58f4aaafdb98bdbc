"""The layering contract (pyproject.toml ``[tool.importlinter]``, docs/architecture.md), checked with import-linter.

The second test proves the check can fail: a copy of the package with one upward import added
(kernels -> engine) must break both of the first two contracts; the third, that the dashboard
reaching into the scheduler breaks its own.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    # --no-cache: the copy below must not be judged from a cached graph of the real tree.
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept():
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "3 kept, 0 broken" in proc.stdout


def test_an_added_cycle_breaks_the_contracts(tmp_path):
    shutil.copytree(ROOT / "tinyvllm", tmp_path / "tinyvllm", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    init = tmp_path / "tinyvllm" / "kernels" / "__init__.py"
    init.write_text(init.read_text() + "\nfrom tinyvllm.engine import core  # noqa: E402,F401  (the deliberate cycle)\n")
    proc = _lint(tmp_path)
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert "1 kept, 2 broken" in proc.stdout, proc.stdout[-4000:]
    assert "tinyvllm.kernels is not allowed to import tinyvllm.engine" in proc.stdout, proc.stdout[-4000:]
    assert ".kernels -> .engine" in proc.stdout, proc.stdout[-4000:]


def test_dashboard_reaching_into_the_scheduler_breaks_its_contract(tmp_path):
    shutil.copytree(ROOT / "tinyvllm", tmp_path / "tinyvllm", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    hub = tmp_path / "tinyvllm" / "entrypoints" / "dashboard" / "hub.py"
    hub.write_text(hub.read_text() + "\nfrom tinyvllm.core import scheduler  # noqa: E402,F401  (deliberate)\n")
    proc = _lint(tmp_path)
    assert proc.returncode != 0, proc.stdout[-4000:]
    assert "2 kept, 1 broken" in proc.stdout, proc.stdout[-4000:]
    assert "tinyvllm.entrypoints.dashboard.hub -> tinyvllm.core.scheduler" in proc.stdout, proc.stdout[-4000:]
