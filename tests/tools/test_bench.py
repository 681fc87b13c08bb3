"""`omnifabric bench`: a short run of every path on its own stack, a run against a URL, the
max search's steps and the refusals of bad arguments."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from omnifabric.tools.perf.bench import build_parser, default_paths, next_probe
from omnifabric.tools.perf.bench import main as bench_main
from omnifabric.tools.perf.ledger import PATHS, Level
from omnifabric.tools.perf.procs import proc_sample
from omnifabric.tools.perf.report import markdown, summarize
from tests.conftest import ROOT, scaled
from tests.stack import Stack

BENCH = [sys.executable, "-m", "omnifabric.tools.cli", "bench"]


def run_bench(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*BENCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=scaled(timeout_s)
    )


# The global 120 s (unscaled) would cut short the command's own scaled(180) s.
@pytest.mark.long
@pytest.mark.timeout(scaled(300))
def test_every_path_measured_with_ratios_table_and_plot(tmp_path):
    out = tmp_path / "bench"
    result = run_bench(
        *("--sessions", "1,3", "--seconds", "3", "--warmup-seconds", "0"),
        *("--workers", "1", "--slots", "4", "--progress-every", "1", "--out", str(out)),
        *("--target-sessions", "3", "--compute-ms", "20", "--noisy-retries", "0"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # Progress while it runs: a line per level start and per second of it.
    assert "fabric x3: 3 sessions x 3 s" in result.stdout
    assert "/3 s," in result.stdout
    doc = json.loads((out / "bench.json").read_text())
    levels = {(lv["path"], lv["sessions"]): lv for lv in doc["levels"]}
    paths = PATHS  # every one, the floors grpc-thread and grpc-sync among them (below)
    assert set(levels) == {(p, n) for p in paths for n in (1, 3)}
    for (path, n), lv in levels.items():
        assert lv["units_sent"] == 3 * n, (path, n, lv)
        assert lv["answered"] == lv["units_sent"] and lv["lost"] == 0, (path, n, lv)
        assert lv["lost_sessions"] == 0 and lv["errors"] == [], (path, n, lv)
        o = lv["overhead_ms"]
        assert 0 <= o["p50"] <= o["p95"] <= o["p99"] <= o["max"] < 2000, (path, n, o)
        assert lv["processes"]["client"]["rss_mib_peak"] > 10
    fabric = levels[("fabric", 3)]
    # The engine's compute (20 ms a unit) is taken out of the round trip, not counted twice.
    assert fabric["engine_ms"]["p50"] >= 19.0
    assert fabric["rtt_ms"]["p50"] - fabric["engine_ms"]["p50"] == pytest.approx(
        fabric["overhead_ms"]["p50"], abs=5.0
    )
    assert {"edge", "scheduler", "worker0", "client"} <= set(fabric["processes"])
    assert not {"echo", "grpc-echo"} & set(fabric["processes"])  # each echo is its own path's
    assert set(levels[("ws-echo", 3)]["processes"]) == {"echo", "client"}
    assert set(levels[("grpc-echo", 3)]["processes"]) == {"grpc-echo", "client"}
    assert levels[("grpc-echo", 3)]["engine_ms"]["p50"] == 0
    # grpc-thread (the same server) and grpc-sync (its own): the compute the server's thread
    # measured is taken out (a sleep of 2 x 10 ms overshoots, it never undershoots).
    for path, server in (("grpc-thread", "grpc-echo"), ("grpc-sync", "grpc-sync")):
        thread = levels[(path, 3)]
        assert set(thread["processes"]) == {server, "client"}, path
        assert 20.0 <= thread["engine_ms"]["p50"] < 30.0, path
        assert thread["rtt_ms"]["p50"] - thread["engine_ms"]["p50"] == pytest.approx(
            thread["overhead_ms"]["p50"], abs=5.0
        )
    assert "grpc-sync" not in fabric["processes"]
    assert "edge" not in levels[("grpc-direct", 3)]["processes"]
    assert fabric["edge_cpu_us_per_unit"] > 0
    assert fabric["queue_wait_ms"]["p99"] >= 0
    # The edge's RealtimeService: through the edge (its CPU counted), the worker's compute
    # taken out as on the WebSocket.
    realtime = levels[("grpc-realtime", 3)]
    assert {"edge", "scheduler", "worker0", "client"} <= set(realtime["processes"])
    assert not {"echo", "grpc-echo"} & set(realtime["processes"])
    assert realtime["edge_cpu_us_per_unit"] > 0 and realtime["engine_ms"]["p50"] >= 19.0
    assert 0 <= realtime["in_worker_ms"]["p50"] <= realtime["overhead_ms"]["p50"]
    ratios = {(row["sessions"], row["path"]): row for row in doc["ratios"]}
    assert set(ratios) == {(n, p) for n in (1, 3) for p in ("fabric", "grpc-realtime")}
    for path in ("fabric", "grpc-realtime"):
        row = ratios[(3, path)]
        for key in ("p50_vs_ws-echo", "p99_vs_ws-echo", "p50_vs_grpc-direct", "p99_vs_grpc-direct"):
            assert math.isfinite(row[key]) and row[key] > 0, row
        # The added milliseconds are the difference of the two levels' own figures.
        echo = levels[("ws-echo", 3)]["overhead_ms"]["p50"]
        assert row["p50_added_to_ws-echo_ms"] == pytest.approx(
            levels[(path, 3)]["overhead_ms"]["p50"] - echo, abs=0.002
        )
    assert set(doc["targets"]["edge_cpu_us_per_unit"]) == {"1", "3"}
    # Where the fabric's added p50 goes, from the same run's levels.
    split = {row["sessions"]: row for row in doc["split"]}
    assert set(split) == {1, 3}
    p50 = {path: levels[(path, 3)]["overhead_ms"]["p50"] for path in paths}
    assert split[3]["added_ms"] == pytest.approx(p50["fabric"] - p50["ws-echo"], abs=0.002)
    assert split[3]["grpc_exchange_ms"] == p50["grpc-echo"]
    assert split[3]["worker_ms"] == pytest.approx(p50["grpc-direct"] - p50["grpc-echo"], abs=0.002)
    assert split[3]["engine_handoff_ms"] == pytest.approx(
        p50["grpc-thread"] - p50["grpc-echo"], abs=0.002
    )
    assert split[3]["session_logic_ms"] == pytest.approx(
        p50["grpc-direct"] - p50["grpc-thread"], abs=0.002
    )
    assert split[3]["sync_handoff_ms"] == pytest.approx(
        p50["grpc-sync"] - p50["grpc-echo"], abs=0.002
    )
    assert split[3]["edge_ms"] == pytest.approx(
        p50["fabric"] - p50["ws-echo"] - p50["grpc-direct"], abs=0.002
    )
    # The edge's CPU beside what the two echo servers spend on the same I/O.
    floor = {row["sessions"]: row for row in doc["cpu_floor"]}
    assert set(floor) == {1, 3}
    ws_us = levels[("ws-echo", 3)]["processes"]["echo"]["cpu_s"] / 9 * 1e6
    echo_us = levels[("grpc-echo", 3)]["processes"]["grpc-echo"]["cpu_s"] / 9 * 1e6
    assert floor[3]["ws_echo_server_us"] == pytest.approx(ws_us, abs=0.1)
    assert floor[3]["grpc_echo_server_us"] == pytest.approx(echo_us, abs=0.1)
    assert floor[3]["edge_us"] == fabric["edge_cpu_us_per_unit"]
    assert floor[3]["edge_over_echo_servers_us"] == pytest.approx(
        fabric["edge_cpu_us_per_unit"] - ws_us - echo_us, abs=0.2
    )
    assert doc["targets"]["at_target_sessions"]["sessions"] == 3
    table = (out / "bench.md").read_text()
    assert "| 3 | fabric | 9 | 9 | 0 | 0 |" in table, table
    assert "| 3 | grpc-realtime | 9 | 9 | 0 | 0 |" in table, table
    assert "p99 / gRPC direct" in table and "added to echo p50 / p99" in table
    assert "| worker (grpc-direct - grpc-echo) |" in table
    assert "| and the session logic (grpc-direct - grpc-thread) |" in table
    row = split[3]
    assert (
        f"| {row['session_logic_ms']:+.2f} ms | {row['edge_ms']:+.2f} ms | "
        f"{row['sync_handoff_ms']:+.2f} ms |"
    ) in table
    assert "| the two servers | edge over them |" in table
    row = floor[3]
    assert f"| 3 | {row['edge_us']:.0f} us | {row['ws_echo_server_us']:.0f} us |" in table
    assert table in result.stdout
    # Where the overhead goes: inside the worker, in the measuring client, while all stream.
    assert 0 <= fabric["in_worker_ms"]["p50"] <= fabric["overhead_ms"]["p50"]
    assert fabric["client_loop_lag_ms"]["p50"] >= 0
    assert fabric["overhead_streaming_ms"]["p50"] > 0
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


@pytest.mark.ci_long  # a bench run, measured twice: ~18 s (tests/conftest.py)
def test_against_a_running_edge(tmp_path):
    stack = Stack(tmp_path)
    try:
        stack.start_scheduler()
        stack.start_worker("--compute-ms", "10")
        edge = stack.start_edge()
        result = run_bench(
            *("--url", stack.url, "--edge-pid", str(edge.proc.pid)),
            *("--grpc", stack.grpc_address, "--paths", "fabric,grpc-realtime"),
            *("--sessions", "2", "--seconds", "4", "--warmup-seconds", "0", "--ramp-s", "2"),
            # Every attempt counts as noisy: measured twice, the first set aside.
            *("--max-steal", "-1", "--noisy-retries", "1", "--out", str(tmp_path / "out")),
        )
    finally:
        stack.stop()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    level, realtime = json.loads((tmp_path / "out" / "bench.json").read_text())["levels"]
    # The given edge's RealtimeService, measured on the given edge's pid.
    assert realtime["path"] == "grpc-realtime" and realtime["answered"] == 8
    assert realtime["lost"] == 0 and realtime["lost_sessions"] == 0
    assert set(realtime["processes"]) == {"edge", "client"}
    assert level["path"] == "fabric" and level["answered"] == 8 and level["lost"] == 0
    # The second session opened 1 s after the first (--ramp-s 2 over 2 sessions), and
    # each sent 4 units a second apart: the level lasts at least 1 + 3 s.
    assert level["wall_s"] >= 4.0
    # Only the edge it was given and itself: no service of its own was started.
    assert set(level["processes"]) == {"edge", "client"}
    (noisy,) = level["noisy_attempts"]
    assert noisy["lost"] == 0 and noisy["overhead_ms"]["p50"] > 0
    assert "measuring it again" in result.stdout
    assert not (tmp_path / "out" / "logs" / "scheduler.log").exists()


@pytest.mark.ci_long  # a benchmark tool's own run, end to end (tests/conftest.py)
def test_several_edge_processes_measured_as_one_edge(tmp_path):
    out = tmp_path / "bench"
    result = run_bench(
        *("--paths", "fabric", "--sessions", "4", "--seconds", "3", "--warmup-seconds", "0"),
        *("--workers", "1", "--slots", "4", "--compute-ms", "10", "--edge-processes", "2"),
        *("--noisy-retries", "0", "--out", str(out)),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (level,) = json.loads((out / "bench.json").read_text())["levels"]
    assert level["answered"] == 12 and level["lost"] == 0
    processes = level["processes"]
    assert {"edge-supervisor", "edge-1", "edge-2"} <= set(processes) and "edge" not in processes
    # The edge's CPU per unit is the sum over its processes.
    edge_s = sum(p["cpu_s"] for name, p in processes.items() if name.startswith("edge-"))
    assert level["edge_cpu_us_per_unit"] == pytest.approx(edge_s / 12 * 1e6, rel=0.01)


def test_max_search_grows_then_bisects():
    steps, passed, failed = [], 100, None
    limit_ok = 260  # a fabric that holds up to 260 sessions
    while (n := next_probe(passed, failed, limit=1000, resolution=0.1)) is not None:
        steps.append(n)
        if n <= limit_ok:
            passed = n
        else:
            failed = n
    assert steps[:3] == [150, 225, 337]
    assert passed <= limit_ok < failed and failed - passed <= max(5, passed // 10)
    # The cap ends the growth: a fabric that never fails stops at --max-sessions.
    assert next_probe(600, None, limit=600, resolution=0.1) is None
    assert next_probe(500, None, limit=600, resolution=0.1) == 600


def test_default_paths_leave_out_a_running_edges_unknown_grpc_port():
    def paths(*argv: str) -> list[str]:
        return default_paths(build_parser().parse_args(list(argv))).split(",")

    assert paths() == list(PATHS)
    assert paths("--url", "ws://h:1/v1/realtime") == [p for p in PATHS if p != "grpc-realtime"]
    assert "grpc-realtime" in paths("--url", "ws://h:1/v1/realtime", "--grpc", "h:2")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sessions", "ten"], "not a list of integers"),
        (["--sessions", "0"], "--sessions >= 1"),
        (["--paths", "fabric,carrier-pigeon"], "carrier-pigeon"),
        (["--sessions", "50", "--workers", "1", "--slots", "8"], "cannot hold every session"),
        (["--paths", "ws-echo", "--find-max"], "--find-max measures the fabric"),
        (["--seconds", "5", "--ramp-s", "5"], "--ramp-s must be"),
        (["--edge-processes", "0"], "--edge-processes must be at least 1"),
        (
            ["--url", "ws://127.0.0.1:9/v1/realtime", "--paths", "fabric,grpc-realtime"],
            "needs the edge's gRPC address (--grpc HOST:PORT)",
        ),
        (["--grpc", "127.0.0.1:9"], "--grpc goes with --url"),
    ],
)
def test_bad_arguments_refused_before_anything_starts(args, message, capsys):
    assert bench_main(args) == 2
    assert message in capsys.readouterr().err


def test_a_process_cpu_time_is_read_finer_than_clock_ticks():
    # /proc/<pid>/stat counts 10 ms ticks: a short level's edge read 0 CPU (issue 36).
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
         "while time.process_time() - t < 0.003: pass\nprint(flush=True)\nsys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        before = proc_sample(child.pid)
        child.stdin.write("\n")
        child.stdin.flush()
        child.stdout.readline()  # it spent 3 ms of CPU
        after = proc_sample(child.pid)
    finally:
        child.kill()
        child.wait()
    assert before is not None and after is not None
    spent = after[0] - before[0]
    assert 0.003 <= spent < 1.0
    assert round(spent * 100) != spent * 100  # not a whole number of ticks


def test_a_zero_edge_cpu_figure_is_reported():
    # A level whose edge CPU measured 0 keeps its figure in the targets and the tables.
    args = build_parser().parse_args(["--sessions", "1,3"])
    levels = [
        Level("fabric", 1, 3, units_sent=3, answered=3, edge_cpu_us_per_unit=0.0),
        Level("fabric", 3, 3, units_sent=9, answered=9, edge_cpu_us_per_unit=812.5),
    ]
    for lv in levels:
        lv.overhead_ms = {"p50": 1.0, "p95": 1.0, "p99": 1.0, "max": 1.0}
    doc = summarize(args, levels, None, [])
    assert doc["targets"]["edge_cpu_us_per_unit"]["1"]["whole_level"] == 0.0
    assert doc["targets"]["edge_cpu_us_per_unit"]["3"]["whole_level"] == 812.5
    assert "| 0 us |" in markdown(doc)
