"""gRPC's I/O layer is chosen in every entry point before grpc loads, and an operator's own
GRPC_EXPERIMENTS is kept. Each case runs in a fresh interpreter: gRPC reads the variable
once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from omnifabric.common import grpc_io

from ..conftest import scaled

#: Runs an entry point's __main__ with --help (it exits), then prints what it chose
#: ("chosen_before_grpc" is None when it never chose).
ENTRY = """
import json, runpy, sys
sys.argv = ["x", ARGS]
try:
    runpy.run_module(MODULE, run_name="__main__")
except SystemExit:
    pass
from omnifabric.common import grpc_io
print(json.dumps(grpc_io.report()))
"""


def run(code: str, env: dict[str, str]) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != grpc_io.ENV}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=scaled(60),
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("omnifabric.edge", ["--help"]),
        ("omnifabric.worker", ["--help"]),
        ("omnifabric.scheduler", ["--help"]),
        ("omnifabric.tools.cli", ["bench", "--help"]),
    ],
)
def test_each_entry_point_chooses_before_grpc_loads(module: str, args: list[str]) -> None:
    code = ENTRY.replace("MODULE", repr(module)).replace("ARGS", repr(args)[1:-1])
    assert run(code, {}) == {"experiments": grpc_io.IOMGR_TCP, "chosen_before_grpc": True}


def test_an_operators_setting_is_kept_even_empty() -> None:
    code = ENTRY.replace("MODULE", "'omnifabric.worker'").replace("ARGS", "'--help'")
    for value in ("", "-event_engine_client"):
        report = run(code, {grpc_io.ENV: value})
        assert report == {"experiments": value, "chosen_before_grpc": True}


def test_too_late_is_reported() -> None:
    code = (
        "import json, grpc\n"
        "from omnifabric.common import grpc_io\n"
        "print(json.dumps([grpc_io.choose(), grpc_io.report()]))"
    )
    chose, report = run(code, {})
    assert chose is False
    assert report == {"experiments": grpc_io.IOMGR_TCP, "chosen_before_grpc": False}
