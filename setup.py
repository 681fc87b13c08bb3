"""Build hook: generate the gRPC stubs before setuptools copies the packages.

The stubs (omnifabric.omni, from proto/) are git-ignored, so a clone has none: build_py runs
tools/gen_stubs.py first (regenerating only when stale, as `omnifabric stubs` does) and then
packs them like any module. `pip install .`, `pip wheel .`, a wheel built from the sdist and
`pip install -e .` all get them. grpcio-tools comes from pyproject's build requirements.
Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py

GEN_STUBS = Path(__file__).resolve().parent / "tools" / "gen_stubs.py"


def load_gen_stubs() -> ModuleType:
    """tools/gen_stubs.py, loaded from its file (the package is not importable mid-build)."""
    spec = importlib.util.spec_from_file_location("omnifabric_build_gen_stubs", GEN_STUBS)
    assert spec is not None and spec.loader is not None, GEN_STUBS
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    """build_py that generates the stubs into proto/ first (editable installs too: their
    build_py copies nothing but still runs)."""

    def run(self) -> None:
        if importlib.util.find_spec("grpc_tools") is None:
            raise SystemExit(
                "building omnifabric generates its gRPC stubs with grpcio-tools, a build "
                "requirement: build with isolation (the default) or, with --no-build-isolation, "
                "install pyproject's [build-system] requires first"
            )
        if load_gen_stubs().main([]) != 0:
            raise SystemExit("generating the gRPC stubs failed (tools/gen_stubs.py)")
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
