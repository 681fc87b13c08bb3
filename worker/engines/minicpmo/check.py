"""`omnifabric worker --engine minicpmo --check --model-dir D`: what a model directory and
this environment lack, reported before a GPU is tied up (nothing is loaded)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from omnifabric.worker.engines.minicpmo import layouts
from omnifabric.worker.engines.minicpmo.engine import (
    CODE_REQUIREMENTS,
    TRANSFORMERS_SERIES,
    check_model_dir,
    vocoder_problem,
)
from omnifabric.worker.errors import EngineUnavailable


def report(model_dir: str | None, device: str, api: str = "auto") -> tuple[bool, list[str]]:
    """(whether the engine can start, one line per check: "ok ...", "MISSING ...",
    "note ...")."""
    lines: list[str] = []
    ok = True

    def fail(text: str) -> None:
        nonlocal ok
        ok = False
        lines.append(f"MISSING {text}")

    root: Path | None = None
    try:
        root = check_model_dir(model_dir)
        lines.append(f"ok      model directory {root}")
    except EngineUnavailable as exc:
        fail(str(exc))
    if root is not None:
        found = layouts.detect(root)
        try:
            chosen = layouts.choose(root, api)
            offered = ", ".join(found)
            lines.append(f"ok      code layouts offered: {offered}; would drive {chosen}")
        except EngineUnavailable as exc:
            fail(str(exc))
    version = importlib.metadata.version("transformers")
    if version.startswith(TRANSFORMERS_SERIES):
        lines.append(f"ok      transformers {version}")
    else:
        fail(f"transformers {TRANSFORMERS_SERIES}x (found {version})")
    for module in CODE_REQUIREMENTS:
        if importlib.util.find_spec(module) is None:
            fail(f"python package {module}: pip install '.[minicpmo]'")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            fail("CUDA: torch.cuda.is_available() is False")
        else:
            lines.append(f"ok      CUDA: {torch.cuda.get_device_name(0)}")
    if root is not None:
        problem = vocoder_problem(root, device)
        if problem:
            lines.append(f"note    speech output off, text only: {problem}")
        else:
            lines.append("ok      vocoder: speech output on")
    return ok, lines
