"""The GPU machine's scripts (tools/gpu): shell that parses, and a bundle that refuses what
it cannot use before it writes anything."""

from __future__ import annotations

import re
import subprocess
import tomllib
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


def _bash_array(text: str, name: str) -> list[str]:
    body = re.search(rf"^{name}=\((.*?)^\)", text, re.S | re.M)
    assert body, name
    lines = [line.split("#")[0] for line in body.group(1).splitlines()]
    return re.findall(r'"[^"]*"|\S+', " ".join(lines))


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _host_packages() -> set[str]:
    lines = (GPU / "host_packages.txt").read_text().splitlines()
    return {_name(line) for line in lines if line.strip() and not line.startswith("#")}


def _carried() -> set[str]:
    wheels = _bash_array((GPU / "bundle.sh").read_text(), "WHEELS")
    return {_name(w) for w in wheels} | {"minicpmo-utils"}


def test_every_requirement_reaches_the_gpu_host() -> None:
    """Each of the project's requirements the device run may import (base, minicpmo and its
    vocoder) is a wheel the bundle carries, in the host's image (host_packages.txt), or named
    in the bundle as never imported there, with the reason: a session once lost its lent GPU
    to a run that stopped at imports (grpc_health, opentelemetry, av) no bundle carried."""
    reasons = _bash_array((GPU / "bundle.sh").read_text(), "NOT_NEEDED")
    assert reasons and all(": " in r for r in reasons), "each says why"
    skipped = {_name(r.strip('"').split(":")[0]) for r in reasons}
    project = tomllib.loads((GPU.parents[1] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *extras["minicpmo"], *extras["minicpmo-vocoder"]]
    missing = sorted({_name(r) for r in wanted} - _carried() - _host_packages() - skipped)
    assert not missing, f"not carried to the GPU host: {missing} (tools/gpu/bundle.sh)"


# Run by a Python without its site-packages (-S): it sees only the farm of the packages the
# GPU host would have and the repo, linked as tools/gpu/install.sh links it.
_REHEARSAL = r"""
import importlib, json, sys
farm, repo, installed = sys.argv[1], sys.argv[2], set(json.loads(sys.argv[3]))
sys.path[:0] = [farm, repo]
missing, unchecked = [], []
for module in sys.argv[4:]:
    try:
        if module.startswith("run:"):
            exec(module[4:], {"work": farm + "/..", "repo": repo})
        else:
            importlib.import_module(module)
    except BaseException as exc:  # ImportError, and pytest's skip at an importorskip
        said = f"{module[:60]}: {type(exc).__name__} {exc}"
        name = getattr(exc, "name", None)  # an ImportError's module
        if name is None and "could not import '" in str(exc):  # pytest.importorskip's
            name = str(exc).split("'")[1]
        # Only an import of what is not installed here at all goes unchecked.
        absent = name is not None and name.partition(".")[0] not in installed
        (unchecked if absent else missing).append(said)
print(json.dumps({"missing": missing, "unchecked": unchecked}))
"""

# What tools/gpu/run.sh imports there: its tools, the engine, the tests it runs with their
# conftests, and gpu_sessions reading its fixture as samples (av is not carried).
_RUN_IMPORTS = [
    "omnifabric.tools.gpu_sessions",
    "omnifabric.tools.vocoder_bench",
    "omnifabric.tools.minicpmo_tiny",
    "omnifabric.worker.engines.minicpmo.engine",
    "omnifabric.worker.engines.minicpmo.vocoder",
    "omnifabric.worker.server",
    "tests.worker.conftest",
    "tests.worker.minicpmo.conftest",
    "tests.worker.minicpmo.test_vocoder_batch",
    "tests.worker.minicpmo.test_batched_step",
    "tests.worker.minicpmo.test_mel",
    "tests.worker.minicpmo.test_audio_batch",
    "run:import numpy as np; from pathlib import Path; from omnifabric.tools import gpu_sessions\n"
    "fixture = Path(work) / 'fixture.npy'; np.save(fixture, np.zeros(48000, np.float32))\n"
    "argv = ['--engine', 'synthetic', '--device', 'cpu', '--fixture', str(fixture)]\n"
    "argv += ['--batched', '1', '--units', '1', '--batch-share', '0.1']\n"
    "assert gpu_sessions.main(argv) == 0",
]

_INSTALL_LINKS = {
    "omni": "proto/omni",
    "edge": "edge",
    "worker": "worker",
    "scheduler": "scheduler",
    "tools": "tools",
    "common": "common",
}


def _farm(root: Path, allowed: set[str]) -> set[str]:
    """Links the files of every installed distribution in `allowed` into `root`,
    and the repo's packages as tools/gpu/install.sh does; the top-level names of all the
    distributions installed here (what a missing import may name)."""
    import importlib.metadata as metadata

    installed: set[str] = set()
    for dist in metadata.distributions():
        tops = {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}
        modules = {t.removesuffix(".py") for t in tops if not t.endswith((".dist-info", ".pth"))}
        installed |= {m.partition(".")[0] for m in modules if m != "__pycache__"}
        if _name(dist.metadata["Name"] or "") not in allowed:
            continue
        # File by file: distributions share namespace folders (opentelemetry's).
        for file in dist.files or []:
            if not file.parts or file.parts[0] in ("..", "__pycache__") or file.suffix == ".pyc":
                continue
            source, link = Path(str(dist.locate_file(file))), root / file
            if source.is_file() and not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(source)
    package = root / "omnifabric"
    package.mkdir()
    for link, target in _INSTALL_LINKS.items():
        (package / link).symlink_to(GPU.parents[1] / target)
    return installed - {"omnifabric", "tests"}


def test_the_rehearsal_imports_every_test_file_the_device_run_runs() -> None:
    """A test file added to run.sh without the rehearsal would meet its imports first on the
    lent machine."""
    script = (GPU / "run.sh").read_text()
    files = set(re.findall(r"tests/[\w/]+\.py", script))
    assert files
    modules = {name.removesuffix(".py").replace("/", ".") for name in files}
    assert modules <= set(_RUN_IMPORTS), modules - set(_RUN_IMPORTS)


def test_the_device_run_imports_only_what_reaches_the_gpu_host(tmp_path: Path) -> None:
    """tools/gpu/run.sh's imports, rehearsed in a Python that sees only the packages the
    host's image holds and the bundle carries (linked from this environment): none may need
    another. Modules whose packages are not installed here at all (the vocoder package in
    CI's clone) are not checked; the rest are."""
    import json
    import sys

    farm = tmp_path / "site"
    farm.mkdir()
    installed = _farm(farm, _host_packages() | _carried())
    argv = [sys.executable, "-S", "-c", _REHEARSAL, str(farm), str(GPU.parents[1])]
    done = subprocess.run(
        [*argv, json.dumps(sorted(installed)), *_RUN_IMPORTS],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["missing"], "\n".join(result["missing"])
