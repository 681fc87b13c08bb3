"""Packaging: every package is installed under omnifabric.*, and the roles that need no model
(edge, scheduler, a synthetic worker) run on the base install, without torch."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import tomllib

import pytest

from tests.conftest import ROOT, scaled
from tests.e2e.wsclient import WsClient, served_unit
from tests.stack import read_until_line, start_serve

#: Top-level modules that only the extras bring (reference, minicpmo, bench).
NOT_IN_BASE = (
    "torch", "transformers", "accelerate", "scipy", "matplotlib", "xllamacpp", "silero_vad",
    "librosa", "soundfile", "tokenizers", "onnxruntime", "gguf", "piper",
)  # fmt: skip

#: Run with the extras' modules unimportable, as in an environment with the base install.
BASE_ONLY = textwrap.dedent(
    f"""
    import importlib.abc, sys

    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {NOT_IN_BASE!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (base install)")
            return None

    sys.meta_path.insert(0, NotInstalled())
    """
)


def run_base_only(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BASE_ONLY + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )


@pytest.mark.parametrize("command", ["edge", "scheduler", "worker", "serve"])
def test_role_commands_start_without_the_extras(command):
    """`omnifabric COMMAND --help` on the base install: argparse's own exit, no import error."""
    result = run_base_only(
        f"""
        from omnifabric.tools.cli import main
        try:
            main([{command!r}, "--help"])
        except SystemExit as exit:
            sys.exit(exit.code)
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout


def test_services_load_without_the_extras():
    """The edge, the scheduler and the worker core (synthetic engine) import no extra."""
    result = run_base_only(
        """
        import omnifabric.edge.app, omnifabric.edge.server, omnifabric.scheduler.server
        import omnifabric.worker.server, omnifabric.worker.session
        from omnifabric.worker.engines.registry import load_engine
        print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


async def test_a_synthetic_stack_serves_on_the_base_install(tmp_path):
    """`omnifabric serve --engine synthetic` with the extras unimportable in every process
    (a sitecustomize on PYTHONPATH installs the blocker in the children too): scheduler,
    worker and edge start, and a session is served."""
    (tmp_path / "sitecustomize.py").write_text(BASE_ONLY)
    serve = start_serve("--engine", "synthetic", env={"PYTHONPATH": str(tmp_path)})
    try:
        url = read_until_line(serve, "omnifabric ready: ").split()[-1]
        client = await WsClient.open(f"{url}?mode=audio")
        try:
            await client.start()
            unit = await served_unit(client)
            assert unit["type"] in ("delta.listen", "response.output.delta"), unit
        finally:
            await client.close()
    finally:
        serve.send_signal(signal.SIGINT)
        rest, _ = serve.communicate(timeout=scaled(30))
    assert serve.returncode == 0, rest
    assert "No module named" not in rest, rest


def test_the_blocker_can_fail():
    """The check above would see an extra: importing the reference engine fails under it."""
    result = run_base_only("import omnifabric.worker.engines.reference.engine")
    assert result.returncode != 0
    assert "base install" in result.stderr


def test_every_package_is_installed():
    """A package missing from pyproject's list works in the source tree but not in a wheel
    (worker.engines.reference once did: a `pip install .` had no reference engine)."""
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(("omnifabric", *init.parent.relative_to(ROOT).parts))
        for top in ("common", "edge", "scheduler", "worker", "tools")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found - listed == set()


def test_base_dependencies_hold_no_model_runtime():
    """The base install is the fabric: torch and the models are extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {re.split(r"[=<>\[ ]", d)[0] for d in project["dependencies"]}
    assert not base & {"torch", "transformers", "xllamacpp", "matplotlib", "scipy"}
    extras = project["optional-dependencies"]
    assert {"reference", "minicpmo", "bench", "dev"} <= set(extras)
    assert any(d.startswith("torch==") for d in extras["reference"])
