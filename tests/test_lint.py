"""Style gate: ruff lint and format over the services, tools and tests."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import ROOT

PATHS = ["common", "edge", "scheduler", "worker", "tools", "tests"]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(args):
    ruff = shutil.which("ruff", path=str(ROOT / ".venv" / "bin")) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed (bash tools/dev test installs it)")
    result = subprocess.run([ruff, *args, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
