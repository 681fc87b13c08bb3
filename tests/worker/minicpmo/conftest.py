"""Opt-in fixtures: tiny random-weight checkpoints built from the public MiniCPM-o code.

Set OMNI_MINICPMO_CODE_DIR to one or more folders of the public model code (os.pathsep
between them; e.g. a checkout's MiniCPMO45/), and OMNI_MINICPMO_SDK to the
minicpm-o5-sdk 0.0.6 wheel (or install that package). Without OMNI_MINICPMO_CODE_DIR every
test here skips. Checkpoints are built once per run (tools.minicpmo_tiny, ~10 s each).

The engines here run on CPU in float32 unless OMNI_MINICPMO_DEVICE (e.g. cuda) and
OMNI_MINICPMO_DTYPE (float32, bfloat16; default: the engine's, bfloat16 on CUDA) say
otherwise; OMNI_MINICPMO_ATOL widens the 1e-4 bound on batched-vs-solo logits (bfloat16).
OMNI_WORKER_DECODE_AHEAD (the worker's own variable, so the served stacks follow it too)
runs the batched decode with the device that many forwards ahead of the host (0 on a CPU
by default): the whole opt-in suite then checks that path.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omnifabric.tools import minicpmo_tiny
from omnifabric.worker.engine import ToolSpec
from omnifabric.worker.engines.minicpmo import layouts
from tests.conftest import scaled
from tests.stack import read_until_line, start_serve, stop_serve

#: The function the tool tests offer (chat and duplex alike).
WEATHER = ToolSpec(
    "get_weather",
    "Get the current weather in a city.",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
)

CODE_DIRS = [Path(p) for p in os.environ.get("OMNI_MINICPMO_CODE_DIR", "").split(os.pathsep) if p]
SDK = os.environ.get("OMNI_MINICPMO_SDK") or None
DEVICE = os.environ.get("OMNI_MINICPMO_DEVICE") or "cpu"
DTYPE = os.environ.get("OMNI_MINICPMO_DTYPE") or None
LOGITS_ATOL = float(os.environ.get("OMNI_MINICPMO_ATOL") or 1e-4)
#: Where and how the engines of these tests run (MiniCPMOEngine keyword arguments).
ON: dict[str, Any] = {"device": DEVICE, "dtype": DTYPE}
if os.environ.get("OMNI_WORKER_DECODE_AHEAD"):
    ON["decode_ahead"] = int(os.environ["OMNI_WORKER_DECODE_AHEAD"])
if DEVICE.startswith("cuda"):
    import torch

    # float32 means float32 here: no TF32 in matrix products or convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def offered() -> list[tuple[str, Path]]:
    """(layout, code dir) for every layout the configured code folders offer."""
    out: list[tuple[str, Path]] = []
    seen: set[str] = set()
    for code in CODE_DIRS:
        for layout in layouts.detect(code):
            if layout not in seen:
                seen.add(layout)
                out.append((layout, code))
    return out


LAYOUTS = offered()
needs_code = pytest.mark.skipif(
    not CODE_DIRS, reason="set OMNI_MINICPMO_CODE_DIR to the public MiniCPM-o code to run these"
)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[Path, Path]:
    """Code folder -> its tiny checkpoint."""
    built = {}
    for i, code in enumerate(CODE_DIRS):
        out = tmp_path_factory.mktemp(f"minicpmo-tiny-{i}")
        minicpmo_tiny.build(code, out, SDK)
        built[code] = out
    return built


@pytest.fixture(scope="module", params=[layout for layout, _ in LAYOUTS] or ["none"])
def engine(request, tiny_dirs):
    """The minicpmo engine on the tiny checkpoint, once per layout the code offers (CPU, 2
    slots), loaded as a worker loads it."""
    from omnifabric.worker.engines.minicpmo import MiniCPMOEngine

    layout = request.param
    code = dict(LAYOUTS)[layout]
    eng = MiniCPMOEngine(str(tiny_dirs[code]), slots=2, api=layout, **ON)
    eng.load()
    assert eng.layout == layout
    return eng


@contextlib.contextmanager
def tiny_serve(
    tiny_dir: Path, layout: str, *extra: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    """`omnifabric serve --engine minicpmo` on a tiny checkpoint on DEVICE (and `extra`): the
    process and its edge URL once ready; stopped with SIGINT after, and it must exit 0."""
    proc = start_serve(
        "--engine",
        "minicpmo",
        "--model-dir",
        str(tiny_dir),
        "--device",
        DEVICE,
        "--minicpmo-api",
        layout,
        *extra,
        env=env,
    )
    try:
        url = read_until_line(proc, "omnifabric ready: ", timeout_s=scaled(240)).split()[-1]
        yield proc, url
    finally:
        rest = stop_serve(proc, scaled(60))
    assert proc.returncode == 0, rest
