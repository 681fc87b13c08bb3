"""An hour-long session, fast: does memory stay flat?

    python -m omnifabric.tools.long_session [--minutes 60] [--record]

Starts a scheduler, a synthetic worker (2 ms a unit, no duration limit, a basic context
window) and an edge on free ports, then runs ONE session of `--minutes` x 60 one-second
units, each sent as soon as the previous one is answered (an hour of talk in about a
minute), with a question (a loud second) every 10 s so the engine keeps answering. It
prints the edge's and the worker's RSS after the first five minutes of session time and at
the end, and their growth per hour of session; `--record` records the session at the edge
(written as it goes, to a temporary folder).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SILENCE = np.zeros(16000, np.float32)
SPEECH = (0.3 * np.sin(2 * np.pi * 220 * np.arange(16000) / 16000)).astype(np.float32)


def rss_mib(pid: int) -> float:
    """A process's resident memory, MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def one_session(url: str, units: int, on_unit: Callable[[int], None]) -> str:
    from omnifabric.tools.perf.wsclient import WsClient

    client = await WsClient.open(f"{url}?mode=audio", max_size=None)
    await client.start(prompt="You are a helpful assistant.")
    client.events.clear()
    config_note = ""
    for i in range(units):
        await client.append(SPEECH if i % 10 == 3 else SILENCE)
        event = await client.until("delta.listen", "delta.audio", "session.closed", timeout_s=30)
        if event["type"] == "session.closed":
            return f"closed early at unit {i + 1}: {event.get('reason')}"
        client.events.clear()  # the client keeps nothing: only the services are measured
        on_unit(i + 1)
    await client.send({"type": "session.close"})
    closed = await client.until("session.closed", timeout_s=30)
    await client.close()
    return config_note or f"ran {units} units, closed {closed.get('reason')}"


@dataclass
class Report:
    """What one long session gave: its outcome line and (edge, worker) RSS in MiB after
    the first five minutes of session time and at the end."""

    outcome: str
    units: int
    wall_s: float
    marks: dict[str, tuple[float, float]] = field(default_factory=dict)

    def growth_mib(self) -> tuple[float, float] | None:
        """(edge, worker) RSS growth from the 5-minute mark to the end, MiB."""
        if "5 min" not in self.marks or "end" not in self.marks:
            return None
        (e0, w0), (e1, w1) = self.marks["5 min"], self.marks["end"]
        return e1 - e0, w1 - w0


def run(minutes: float, record: bool) -> Report:
    """One session of `minutes` x 60 units on its own stack (see the module's text)."""
    from omnifabric.tools.perf.stack import Stack

    units = int(minutes * 60)
    root = Path(tempfile.mkdtemp(prefix="long_session_"))
    (root / "logs").mkdir()
    stack = Stack(root / "logs")
    stack.start_scheduler()
    worker = stack.start_worker(
        "--slots", "1", "--compute-ms", "2", "--audio-limit-s", "0", "--context-window", "basic"
    )
    edge_args = ["--record-dir", str(root / "records")] if record else []
    edge = stack.start_edge(*edge_args)
    marks: dict[str, tuple[float, float]] = {}
    started = time.monotonic()

    def on_unit(n: int) -> None:
        if n == 300 or n == units:
            marks["5 min" if n == 300 else "end"] = (
                rss_mib(edge.proc.pid),
                rss_mib(worker.proc.pid),
            )

    try:
        outcome = asyncio.run(one_session(stack.url, units, on_unit))
    finally:
        stack.stop()
        shutil.rmtree(root, ignore_errors=True)
    return Report(outcome, units, time.monotonic() - started, marks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--record", action="store_true", help="record the session at the edge")
    args = parser.parse_args(argv)
    report = run(args.minutes, args.record)
    wall, units = report.wall_s, report.units
    print(
        f"{report.outcome} in {wall:.0f} s ({units / wall:.0f} units/s); recording: {args.record}"
    )
    for name, (edge_mib, worker_mib) in report.marks.items():
        print(f"  RSS after {name:6s} edge {edge_mib:7.1f} MiB  worker {worker_mib:7.1f} MiB")
    growth = report.growth_mib()
    if growth is not None and units > 300:
        hours = (units - 300) / 3600
        for who, grew in zip(("edge", "worker"), growth, strict=True):
            print(f"  {who} growth: {grew / hours:+.1f} MiB per hour of session")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
