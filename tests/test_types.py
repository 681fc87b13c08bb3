"""Type gate: mypy over every package with the project's configuration (pyproject's
[tool.mypy]) finds no error.

mypy cannot follow setuptools' editable finder, so the packages are checked from a tree of
links laid out as pyproject's package-dir maps them (omnifabric/edge -> edge/,
omnifabric/omni -> proto/omni, ...). The tree and mypy's cache stay in .mypy_cache/
(git-ignored): the first run checks everything (~25 s), a run after it only what changed
(~1 s when nothing did).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT, scaled

PYPROJECT = ROOT / "pyproject.toml"
CACHE = ROOT / ".mypy_cache"
TREE = CACHE / "tree"
#: Generated code (the gRPC stubs): checked where the packages import it, not as a package.
GENERATED = ("omnifabric.omni",)
#: A first run on a slow machine checks ~110 modules plus what they import (numpy, torch).
MYPY_TIMEOUT_S = 600

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None,
    reason="mypy not installed (the dev extra pins it; bash tools/dev test installs it)",
)


def package_dirs() -> dict[str, Path]:
    """Package name -> its source folder, from pyproject's [tool.setuptools.package-dir]."""
    with PYPROJECT.open("rb") as file:
        mapping = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def link_tree(tree: Path, packages: dict[str, Path]) -> None:
    """tree/omnifabric/edge -> edge/ and so on: a link per package, made or corrected in
    place (by rename, so a concurrent run never sees a missing one); links of packages
    pyproject no longer names are removed."""
    wanted = {tree.joinpath(*name.split(".")): folder for name, folder in packages.items()}
    for link, folder in wanted.items():
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() and Path(os.readlink(link)) == folder:
            continue
        tmp = link.with_name(f".{link.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(folder, target_is_directory=True)
        os.replace(tmp, link)
    for parent in {link.parent for link in wanted}:
        for entry in parent.iterdir():
            if entry.is_symlink() and entry not in wanted and not entry.name.startswith("."):
                entry.unlink(missing_ok=True)


def run_mypy(*args: str) -> subprocess.CompletedProcess[str]:
    """mypy with the project's configuration and cache, the packages importable as
    omnifabric.* from the linked tree; `args` says what to check."""
    link_tree(TREE, package_dirs())
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(PYPROJECT),
        "--cache-dir",
        str(CACHE),
        "--explicit-package-bases",
        "--no-color-output",
        "--no-error-summary",
        *args,
    ]
    env = {**os.environ, "MYPYPATH": str(TREE)}
    return subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(MYPY_TIMEOUT_S),
    )


def source_paths(output: str) -> str:
    """mypy's output with the tree's paths as the source files' own (edge/app.py, not
    .mypy_cache/tree/omnifabric/edge/app.py)."""
    for name, folder in package_dirs().items():
        link = TREE.joinpath(*name.split("."))
        for shown in (link, link.relative_to(ROOT)):
            output = output.replace(f"{shown}/", f"{folder.relative_to(ROOT)}/")
    return output


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.search(r":\d+: error: ", line)]


def checked_packages() -> list[str]:
    """Every package pyproject maps, but the generated one."""
    return sorted(name for name in package_dirs() if name not in GENERATED)


@pytest.mark.timeout(scaled(MYPY_TIMEOUT_S + 30))
def test_packages_type_check():
    if not (ROOT / "proto" / "omni" / "realtime" / "v1" / "STUBS_STAMP").exists():
        pytest.skip("no gRPC stubs generated yet (python -m omnifabric.tools.gen_stubs)")
    packages = checked_packages()
    assert "omnifabric.edge" in packages, packages  # pyproject's mapping was read
    args = [arg for name in packages for arg in ("-p", name)]
    result = run_mypy(*args)
    output = source_paths(result.stdout + result.stderr)
    errors = error_lines(output)
    assert result.returncode == 0 and not errors, (
        f"mypy found {len(errors)} errors (exit {result.returncode}):\n{output[-20000:]}"
    )


@pytest.mark.timeout(scaled(MYPY_TIMEOUT_S + 30))
def test_the_gate_can_fail():
    """The same run reports a wrong type in code that uses the packages: their imports
    resolve through the tree (else the error would be a missing import instead). The code
    is passed as a string: a file's module would stay in the shared cache under its path."""
    wrong = (
        "from omnifabric.edge.config import EdgeConfig\n"
        "\n"
        "\n"
        "def port_text(config: EdgeConfig) -> str:\n"
        "    return config.port\n"
    )
    result = run_mypy("--no-warn-unused-configs", "-c", wrong)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert error_lines(output) == [
        '<string>:5: error: Incompatible return value type (got "int", expected "str")'
        "  [return-value]"
    ], output
