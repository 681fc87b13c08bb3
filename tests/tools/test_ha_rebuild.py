"""The rebuild-at-scale tool on a small fabric: it runs end to end, and the new leader's
queue is the old one's order."""

from __future__ import annotations

import shutil

import pytest

from omnifabric.tools import ha_rebuild

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server is not installed (tools/dev does)"
)


@pytest.mark.ci_long  # a benchmark tool's own run, end to end (tests/conftest.py)
@pytest.mark.parametrize("signal", ["kill", "term"])
def test_small_rebuild_keeps_the_order(signal, tmp_path, capsys):
    args = ["--workers", "3", "--slots", "2", "--callers", "12", "--signal", signal]
    assert ha_rebuild.main([*args, "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "order_kept: True" in out and "misplaced: 0.000" in out, out
    figures = dict(line.strip().split(": ") for line in out.splitlines() if line.startswith("  "))
    assert 0 < float(figures["standby_leads_s"]) <= float(figures["callers_back_s"])
