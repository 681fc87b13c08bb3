"""The rebuild tool's workers are fleet-bench's reporting ones (issue 55): they follow the
leader, none is taken for hung while the fabric fills, and each registers once with each
leader, its sessions with it."""

from __future__ import annotations

import shutil

import pytest

from omnifabric.tools import ha_rebuild

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server is not installed (tools/dev does)"
)


@pytest.mark.ci_long  # a benchmark tool's own run, end to end (tests/conftest.py)
def test_reporting_workers_follow_the_leader(tmp_path, capsys):
    args = ["--workers", "4", "--slots", "3", "--callers", "5", "--worker-procs", "2"]
    assert ha_rebuild.main([*args, "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    figures = dict(line.strip().split(": ") for line in out.splitlines() if line.startswith("  "))
    assert figures["order_kept"] == "True", out
    assert float(figures["worker_registrations"]) == 8  # 4 workers, once with each leader
    assert float(figures["leader_workers_hung"]) == float(figures["leader_workers_lost"]) == 0
    assert float(figures["standby_leases_lost"]) == 0
    assert 0 < float(figures["standby_leads_s"]) <= float(figures["workers_back_s"])
    assert float(figures["fill_s"]) >= float(figures["slots_leased_s"]) > 0
