"""Style gate: ruff lint and format over the services, tools and tests."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PATHS = ["edge", "scheduler", "worker", "tools", "tests"]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(args):
    ruff = shutil.which("ruff", path=str(ROOT / ".venv" / "bin")) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed (bash tools/dev test installs it)")
    result = subprocess.run([ruff, *args, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]


def test_services_do_not_import_torch():
    """Only engine modules may import torch: edge, scheduler and the worker core load without it."""
    code = (
        "import sys, edge.server, scheduler.server, worker.server, worker.session; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_every_package_is_installed():
    """A package missing from pyproject's list works in the source tree but not in a wheel
    (worker.engines.reference once did: a `pip install .` had no reference engine)."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("edge", "scheduler", "worker", "tools")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found - listed == set()
