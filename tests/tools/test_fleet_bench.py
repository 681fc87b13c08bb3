"""The fleet benchmark (tools/fleet_bench.py) on a tiny fleet: it runs end to end with
real processes (a scheduler, simulated workers and callers) and reads its figures from the
scheduler's side; and its arithmetic."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from omnifabric.tools import fleet_bench
from omnifabric.tools.fleet_bench import Level, Plan, Snapshot


@pytest.mark.ci_long  # a benchmark tool's own run, end to end (tests/conftest.py)
def test_a_tiny_fleet_runs_end_to_end(tmp_path, capsys):
    figures_path = tmp_path / "figures.json"
    args = ["--levels", "3x4", "--seconds", "3", "--session-s", "4", "--status-every", "1"]
    args += ["--worker-procs", "1", "--caller-procs", "1", "--log-dir", str(tmp_path)]
    pinned = len(os.sched_getaffinity(0)) >= 2
    if pinned:  # the scheduler on a core of its own, the simulators on the rest
        args += ["--scheduler-cpus", str(min(os.sched_getaffinity(0)))]
    host = os.sched_getaffinity(0)
    assert fleet_bench.main([*args, "--json", str(figures_path)]) == 0
    assert os.sched_getaffinity(0) == host  # the orchestrator's own pinning ends with it
    [row] = json.loads(figures_path.read_text())
    assert row["scheduler_cpus"] == ([min(os.sched_getaffinity(0))] if pinned else [])
    print(fleet_bench.markdown([row]))
    assert row["level"] == "3x4" and row["running"] == 11
    assert row["arrivals"] > 0 and row["failed"] == 0
    assert row["workers_lost"] == row["leases_lost"] == 0
    assert 1.0 <= row["reports_per_s"] <= 6.0  # three workers, one report a second each
    assert row["cpu_pct"] > 0 and row["rss_mib"] > 0 and row["status_kib"] > 0
    # The probe (10 short sessions a second by default) timed its own Acquires.
    assert row["probe_failed"] == 0 and 0 < row["probe_p50_ms"] <= row["probe_p99_ms"]
    assert (tmp_path / "3x4" / "probe.log").exists()
    assert "| 3x4 | 11 |" in capsys.readouterr().out


def test_a_simulator_places_itself_and_starts_without_a_preexec_fn(tmp_path, monkeypatch):
    # A preexec_fn makes subprocess fork (gRPC's fork handlers then run in a child of a
    # process with busy gRPC threads: one aborted before its exec in CI); the child sets
    # its own cores and niceness instead.
    starts: list[dict] = []
    popen = subprocess.Popen

    def spy(*args, **kwargs):
        starts.append(kwargs)
        return popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spy)
    cpus = {max(os.sched_getaffinity(0))}
    argv = ["--role", "workers", "--scheduler", "127.0.0.1:1", "--count", "0"]
    role = fleet_bench.Role("workers0", argv, tmp_path, cpus, nice=3)
    try:
        role.expect("ready", 60)  # no workers to register: ready at once
        assert os.sched_getaffinity(role.proc.pid) == cpus
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, role.proc.pid) == min(19, ours + 3)
        role.send("stop")
        assert role.expect("done", 30)["registrations"] == 0
    finally:
        role.stop(10)
    assert [kwargs.get("preexec_fn") for kwargs in starts] == [None]
    assert role.proc.returncode == 0


def test_without_a_probe_its_columns_say_so_and_the_simulators_keep_their_priority():
    args = argparse.Namespace(probe_rate=0.0)
    assert fleet_bench.simulator_nice(args) == 0
    assert fleet_bench.simulator_nice(argparse.Namespace(probe_rate=5.0)) > 0
    row = {key: 1.0 for key, _, _ in fleet_bench.COLUMNS}
    row.update(level="1x1", running=1, **fleet_bench._probe_figures([]))
    cells = fleet_bench.markdown([row]).splitlines()[-1].split(" | ")
    titles = [title for _, title, _ in fleet_bench.COLUMNS]
    assert cells[titles.index("probe p99 ms")] == "-"
    assert cells[titles.index("p99 ms")] == "1.0"


def test_levels_percentiles_and_shares():
    assert fleet_bench.parse_levels("10x8, 100x64") == [Level(10, 8), Level(100, 64)]
    assert fleet_bench.percentile([], 99) == 0.0
    assert fleet_bench.percentile([float(n) for n in range(1, 101)], 99) == 99.0
    assert fleet_bench.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert fleet_bench.split_evenly(10, 3) == [4, 3, 3]
    assert fleet_bench.split_evenly(1, 4) == [1]


def test_a_plan_keeps_its_sessions_running():
    args = argparse.Namespace(load=0.9, session_s=300.0, rate=0.0)
    plan = Plan.of(Level(100, 64), args)
    assert (plan.running, plan.rate, plan.session_s) == (5760, pytest.approx(19.2), 300.0)
    args.rate = 250.0  # a rate given: sessions as long as keeps the load (Little's law)
    assert Plan.of(Level(100, 64), args).session_s == pytest.approx(23.04)


def test_the_loop_lag_quantile_reads_the_histogram_between_two_scrapes():
    def snapshot(counts: list[float]) -> Snapshot:
        bounds = ["0.001", "0.01", "0.1", "+Inf"]
        name = "omni_scheduler_loop_lag_seconds_bucket"
        samples = {name: [({"le": b}, c) for b, c in zip(bounds, counts, strict=True)]}
        return Snapshot(0.0, 0.0, 0.0, samples)

    before = snapshot([10, 10, 10, 10])
    after = snapshot([100, 109, 110, 110])  # 90 under 1 ms, 9 under 10 ms, 1 under 100 ms
    assert fleet_bench.lag_quantile(before, after, 0.5) == 0.001
    assert fleet_bench.lag_quantile(before, after, 0.99) == 0.01
    assert fleet_bench.lag_quantile(before, after, 1.0) == 0.1


def test_scheduler_cpus_name_some_cores_and_pin_every_thread():
    host = sorted(os.sched_getaffinity(0))
    for bad in (",".join(map(str, host)), "999", ""):
        with pytest.raises(ValueError, match="some, not all"):
            fleet_bench.parse_cpus(bad)
    if len(host) < 2:
        pytest.skip("one core: nothing to pin apart")
    assert fleet_bench.parse_cpus(str(host[0])) == {host[0]}
    code = (
        "import threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print(1, flush=True); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "1"
        fleet_bench.pin(child.pid, {host[0]})
        tasks = os.listdir(f"/proc/{child.pid}/task")
        assert len(tasks) >= 4
        assert all(os.sched_getaffinity(int(t)) == {host[0]} for t in tasks)
    finally:
        child.kill()
        child.wait()
