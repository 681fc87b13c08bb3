"""`omnifabric serve --schedulers 2 --ha redis://...`: the active/standby pair in the whole
stack on one machine, with a real redis-server (which serve never starts).

/status lists both schedulers with their pids and which one leads; kill -9 of the leader's
pid leaves the stack serving (the standby leads, a new session is served) and serve stops
cleanly later. A Redis that does not answer stops serve before it starts anything.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from omnifabric.tools import serve
from tests.conftest import scaled
from tests.e2e.wsclient import WsClient, served_unit, wait_for
from tests.redis_server import free_port, redis_server  # noqa: F401 - fixture
from tests.stack import read_until_line, start_serve


def get_status(url: str) -> tuple[int, dict[str, Any]]:
    """GET /status of the edge behind the WebSocket `url`: (HTTP status, JSON body)."""
    host_port = url.split("/")[2]
    try:
        with urllib.request.urlopen(f"http://{host_port}/status", timeout=scaled(5)) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def drain(proc: subprocess.Popen, lines: list[str]) -> threading.Thread:
    """Keep reading the child's output into `lines` (a full pipe would stall it)."""

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


@pytest.mark.ci_long  # two serve processes and a failover: ~4 s (tests/conftest.py)
async def test_serve_pair_lists_both_and_survives_kill9_of_the_leader(
    redis_server,  # noqa: F811
):
    proc = start_serve(
        *("--engine", "synthetic", "--compute-ms", "5", "--slots", "2"),
        *("--schedulers", "2", "--ha", redis_server.url, "--ha-ttl", "1", "--grace", "2"),
    )
    lines: list[str] = []
    pump: threading.Thread | None = None
    try:
        url = read_until_line(proc, "omnifabric ready: ").split()[-1]
        metrics = read_until_line(proc, "omnifabric metrics: ", 10)
        assert "scheduler0=http://" in metrics and "scheduler1=http://" in metrics, metrics
        pump = drain(proc, lines)

        code, body = get_status(url)
        assert code == 200, body
        entries = body["schedulers"]
        assert [e["answers"] for e in entries] == [True, True], entries
        assert all(isinstance(e["pid"], int) and e["pid"] > 0 for e in entries), entries
        assert len({e["pid"] for e in entries}) == 2
        [leader] = [e for e in entries if e["leading"]]
        [standby] = [e for e in entries if not e["leading"]]
        assert body["scheduler_leader"] == leader["address"] != standby["address"]
        assert leader["epoch"] >= 1 and leader["leaderships"] == 1
        assert leader["rebuild_s"] is not None and standby["leaderships"] == 0

        os.kill(leader["pid"], signal.SIGKILL)
        killed = time.monotonic()

        async def standby_leads() -> bool:
            code, body = await asyncio.to_thread(get_status, url)
            return code == 200 and body["scheduler_leader"] == standby["address"]

        await wait_for(standby_leads, 10)
        code, body = get_status(url)
        after = {e["address"]: e for e in body["schedulers"]}
        assert not after[leader["address"]]["answers"], after
        assert after[leader["address"]]["pid"] is None
        new = after[standby["address"]]
        assert new["leading"] and new["pid"] == standby["pid"], after
        assert new["epoch"] > leader["epoch"] and new["leaderships"] == 1

        client = await WsClient.open(f"{url}?mode=audio")
        await client.start()
        await served_unit(client)
        await client.close()
        served_s = time.monotonic() - killed
        assert proc.poll() is None, "serve stopped with one scheduler left"
        print(f"kill -9 of the leader: a new session served after {served_s:.2f} s")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(scaled(30))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if pump is not None:
        pump.join(scaled(5))
    out = "".join(lines)
    assert proc.returncode == 0, out
    dead = "scheduler0" if leader["address"] == entries[0]["address"] else "scheduler1"
    assert f"omnifabric serve: {dead} exited (-9); serving on" in out, out
    assert out.rstrip().endswith("omnifabric stopped"), out


def test_serve_names_a_redis_that_does_not_answer():
    """Nothing starts: one line names the store, exit 1, within a few seconds."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    proc = start_serve("--engine", "synthetic", "--schedulers", "2", "--ha", url)
    out, _ = proc.communicate(timeout=scaled(20))
    took = time.monotonic() - started
    assert proc.returncode == 1, out
    [line] = out.strip().splitlines()
    assert line.startswith("omnifabric serve: the election store ") and url in line, line
    assert "serve starts no Redis" in line
    assert took < scaled(10), took


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--schedulers", "2"], "--schedulers 2 runs active/standby schedulers: it needs --ha"),
        (["--schedulers", "0"], "--schedulers must be at least 1"),
        (["--schedulers", "2", "--ha", "http://h:1/0"], "--ha must start with redis://"),
        (["--ha", "redis://h:1/0", "--ha-ttl", "0.1"], "--ha-ttl must be in 0.3..60"),
        (["--ha-ttl", "1"], "--ha-ttl needs --ha"),
    ],
)
def test_serve_refuses_flags_of_a_pair_without_a_store(capsys, argv, words):
    assert serve.main(argv) == 2
    assert words in capsys.readouterr().err


def test_pair_ports_and_names():
    """The second scheduler on --scheduler-port + 1 (0: any), its metrics after the workers'."""
    args = serve.build_parser().parse_args(
        ["--schedulers", "2", "--ha", "redis://h:1/0", "--workers", "3",
         "--metrics-base-port", "9000"]
    )  # fmt: skip
    first, second = (serve.scheduler_args(args, i) for i in (0, 1))
    assert first[first.index("--port") + 1] == "50051"
    assert second[second.index("--port") + 1] == "50052"
    assert first[first.index("--metrics-port") + 1] == "9000"
    assert second[second.index("--metrics-port") + 1] == "9004"  # workers: 9001..9003
    assert second[second.index("--ha") + 1] == "redis://h:1/0"
    assert serve.scheduler_names(1) == ["scheduler"]
    assert serve.scheduler_names(2) == ["scheduler0", "scheduler1"]
    args.scheduler_port = 0
    assert serve.scheduler_args(args, 1)[3] == "0"
