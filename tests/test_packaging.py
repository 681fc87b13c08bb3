"""Packaging: every package is installed under omnifabric.*, and the roles that need no model
(edge, scheduler, a synthetic worker) run on the base install, without torch."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, scaled
from tests.e2e.wsclient import WsClient, served_unit
from tests.stack import read_until_line, start_serve, stop_serve

#: Top-level modules that only the extras bring (reference, minicpmo, bench).
NOT_IN_BASE = (
    "torch", "transformers", "accelerate", "scipy", "matplotlib", "xllamacpp", "silero_vad",
    "librosa", "soundfile", "tokenizers", "onnxruntime", "gguf", "piper",
)  # fmt: skip

#: What tools/gen_stubs.py generates for each .proto file (git-ignored, so not in a clone).
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

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
        rest = stop_serve(serve, scaled(30))
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


def fresh_clone(dest: Path) -> Path:
    """The files a clone of this working tree has (tracked, plus untracked ones git does not
    ignore): no generated stubs, no egg-info, no virtual environment."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.mark.ci_long  # a clone, its stubs and a wheel built: ~18 s (tests/conftest.py)
@pytest.mark.timeout(scaled(300))
def test_a_wheel_from_a_fresh_clone_holds_the_stubs(tmp_path):
    """`pip wheel .` in a clone generates the gRPC stubs (git-ignored) and packs them: the
    wheel, installed alone into a new environment, runs `omnifabric scheduler --help` and
    imports the stubs from that install (issue 36: a plain `pip install .` had no
    omnifabric.omni). The build is pip's isolated one, as `pip install .` runs it: its
    requirements (pyproject's [build-system]) come from the package index (~15 s)."""
    clone = fresh_clone(tmp_path / "clone")
    assert not list((clone / "proto").rglob("*_pb2*.py")), "the clone has stubs already"
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", dist, clone],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = dist.glob("omnifabric-*.whl")
    package = "omnifabric/omni/realtime/v1"
    stems = [p.stem for p in (ROOT / "proto" / "omni" / "realtime" / "v1").glob("*.proto")]
    assert stems
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    expected = {f"{package}/{stem}{suffix}" for stem in stems for suffix in STUB_SUFFIXES}
    expected |= {f"{p}/__init__.py" for p in ("omnifabric/omni", "omnifabric/omni/realtime")}
    expected.add(f"{package}/__init__.py")
    assert expected - names == set()

    # A new environment holding the wheel alone; its dependencies (grpcio, protobuf, ...)
    # are read from this environment's site-packages, appended after its own.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install",
         "--no-deps", "--no-index", wheel],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(tmp_path))}

    def in_venv(program: str, *args: str) -> subprocess.CompletedProcess:
        """`program` of the new environment, run outside the checkout; it must succeed."""
        done = subprocess.run(
            [venv / "bin" / program, *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=scaled(60),
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    assert "usage:" in in_venv("omnifabric", "scheduler", "--help").stdout
    in_venv("omnifabric", "stubs", "--check")  # the build's stubs, complete
    modules = [f"omnifabric.omni.realtime.v1.{stem}{suffix[:-3]}" for stem in stems
               for suffix in STUB_SUFFIXES if suffix.endswith(".py")]  # fmt: skip
    imported = in_venv(
        "python",
        "-c",
        f"import importlib\nfor m in {modules!r}: print(importlib.import_module(m).__file__)",
    )
    files = [Path(line) for line in imported.stdout.split()]
    assert len(files) == len(modules)
    assert all(f.is_relative_to(site) for f in files), files


def test_the_build_generates_with_the_runtime_grpcio_tools():
    """The stubs a build generates carry the stamp of the grpcio-tools that made them: the
    build requirement pins the version the package depends on, so an installed package's
    stubs match `omnifabric stubs` there."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = {d for d in config["project"]["dependencies"] if d.startswith("grpcio-tools")}
    assert len(pins) == 1
    assert pins <= set(config["build-system"]["requires"])
