"""The GPU machine's scripts (tools/gpu): shell that parses, and a bundle that refuses what
it cannot use before it writes anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[2] / "tools" / "gpu"


@pytest.mark.parametrize("script", ["bundle.sh", "install.sh", "run.sh"])
def test_the_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(GPU / script)], check=True)


def test_the_bundle_names_what_it_lacks(tmp_path: Path) -> None:
    for args, says in (
        ([], "--code-dir"),
        (["--code-dir", str(tmp_path)], "--code-dir"),
        (["--sdk", str(tmp_path / "no.whl")], "--code-dir"),
        (["--bogus"], "unknown argument --bogus"),
    ):
        done = subprocess.run(
            ["bash", str(GPU / "bundle.sh"), *args], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 2 and says in done.stderr, (args, done.stderr)
    (tmp_path / "modeling_minicpmo.py").write_text("")
    done = subprocess.run(
        ["bash", str(GPU / "bundle.sh"), "--code-dir", str(tmp_path), "--sdk", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "--sdk" in done.stderr
