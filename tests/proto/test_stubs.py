"""The contract itself: stubs are fresh, the proto passes buf STANDARD lint."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from omnifabric.tools import gen_stubs


def test_stubs_are_fresh():
    result = subprocess.run(
        [sys.executable, "-m", "omnifabric.tools.gen_stubs", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_stale_check_detects_a_changed_proto(tmp_path, monkeypatch):
    """The freshness check fails when a .proto differs from what the stamp recorded."""
    fake_pkg = tmp_path / "omni" / "realtime" / "v1"
    fake_pkg.mkdir(parents=True)
    for path in gen_stubs.proto_files():
        shutil.copy(path, fake_pkg / path.name)
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            (fake_pkg / (path.stem + suffix)).write_text("")
    monkeypatch.setattr(gen_stubs, "PROTO_ROOT", tmp_path)
    monkeypatch.setattr(gen_stubs, "PACKAGE_DIR", fake_pkg)
    monkeypatch.setattr(gen_stubs, "STAMP", fake_pkg / "STUBS_STAMP")
    assert gen_stubs.stale_reason() == "no stubs generated yet"
    gen_stubs.STAMP.write_text(gen_stubs.expected_stamp())
    assert gen_stubs.stale_reason() is None
    with open(fake_pkg / "common.proto", "a") as f:
        f.write("\n// changed\n")
    assert "changed" in gen_stubs.stale_reason()


def test_generated_import_path_follows_file_path():
    from omnifabric.omni.realtime.v1 import common_pb2, worker_service_pb2

    assert worker_service_pb2.DESCRIPTOR.package == "omni.realtime.v1"
    assert common_pb2.DESCRIPTOR.name == "omni/realtime/v1/common.proto"


def test_buf_lint_standard():
    buf = shutil.which("buf") or (str(ROOT / ".tools/node_modules/.bin/buf") if (ROOT / ".tools/node_modules/.bin/buf").exists() else None)
    if buf is None:
        pytest.skip("buf not installed (bash tools/dev test installs it with npm)")
    result = subprocess.run([buf, "lint"], cwd=ROOT / "proto", capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
