"""fleet-bench's queue ETA figures (issue 55): arrivals above capacity make callers queue,
and the estimate each was first given is set against the wait that followed."""

from __future__ import annotations

import argparse
import json

import pytest

from omnifabric.tools import fleet_bench
from omnifabric.tools.fleet_bench import Level, Plan


def test_overload_makes_arrivals_faster_than_the_sessions_keep():
    args = argparse.Namespace(load=1.0, session_s=60.0, rate=0.0, overload=1.2)
    plan = Plan.of(Level(100, 64), args)
    assert plan.running == 6400 and plan.session_s == pytest.approx(60.0)
    assert plan.rate == pytest.approx(1.2 * 6400 / 60)


def test_eta_figures_size_and_sign():
    figures = fleet_bench._eta_figures([3.0, -1.0, 2.0, 4.0, -2.0])
    assert figures["eta_error_median_s"] == 2.0
    assert figures["eta_error_p90_s"] == 4.0
    assert figures["eta_bias_s"] == pytest.approx(1.2)
    assert fleet_bench._eta_figures([]) == {
        "eta_error_median_s": 0.0,
        "eta_error_p90_s": 0.0,
        "eta_bias_s": 0.0,
    }


@pytest.mark.ci_long  # a benchmark tool's own run, end to end (tests/conftest.py)
def test_an_overloaded_tiny_fleet_queues_its_callers(tmp_path):
    figures_path = tmp_path / "figures.json"
    args = ["--levels", "2x2", "--seconds", "4", "--session-s", "1", "--load", "1"]
    args += ["--overload", "1.5", "--status-every", "0", "--worker-procs", "1"]
    args += ["--caller-procs", "1", "--log-dir", str(tmp_path), "--json", str(figures_path)]
    assert fleet_bench.main(args) == 0
    [row] = json.loads(figures_path.read_text())
    assert row["queued"] > 0 and row["failed"] == 0, row
    assert row["eta_error_p90_s"] >= row["eta_error_median_s"] > 0
    assert "| 2x2 |" in fleet_bench.markdown([row])
