"""What every `omnifabric soak` row stands on: its result (RowResult, checked), its own stack
on free ports, the services' figures read from their /metrics, polling and progress lines."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnifabric.tools.perf.console import say
from omnifabric.tools.perf.metrics import http_address, metric, scrape_metrics
from omnifabric.tools.perf.stack import Stack

#: The source checkout: the rows run their services from it, L3 reads its speech fixture
#: and FUZZ runs its tests/fuzz.
ROOT = Path(__file__).resolve().parents[2]
#: Waits of a row's stack, clients and /metrics reads are scaled as the test suite's are
#: (OMNI_TEST_TIME_FACTOR): the suite runs a short soak on loaded machines.
TIME_FACTOR = float(os.environ.get("OMNI_TEST_TIME_FACTOR", "1"))


@dataclass
class RowResult:
    """One row of the final table, and what goes into the JSON file."""

    row: str
    passed: bool
    figure: str
    target: str
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)


def checked(
    row: str, checks: dict[str, bool], figure: str, target: str, **figures: Any
) -> RowResult:
    """A row that passes when every named check does; the checks go into its figures."""
    return RowResult(
        row, all(checks.values()), figure, target, figures={**figures, "checks": checks}
    )


def row_stack(log_dir: Path, row: str) -> Stack:
    """A Stack logging under log_dir/row."""
    path = log_dir / row
    path.mkdir(parents=True, exist_ok=True)
    return Stack(path, cwd=ROOT, time_factor=TIME_FACTOR)


def scrape(address: str) -> dict:
    """A service's /metrics samples (tools.perf.metrics), the timeout scaled."""
    return scrape_metrics(address, timeout_s=5.0 * TIME_FACTOR)


def process_figures(stack: Stack) -> dict[str, dict[str, float]]:
    """RSS (MiB), open fds and live asyncio tasks of every running service, by name."""
    addresses = {"edge": http_address(stack.url)} if stack.edge else {}
    for svc in stack.services:
        if svc.proc.poll() is None and svc.name != "edge":
            addresses[svc.name] = svc.metrics_address()
    figures = {}
    for name, address in addresses.items():
        samples = scrape(address)
        kind = "edge" if name == "edge" else "scheduler" if "scheduler" in name else "worker"
        figures[name] = {
            "rss_mib": round(metric(samples, "process_resident_memory_bytes") / 2**20, 2),
            "fds": metric(samples, "process_open_fds"),
            "tasks": metric(samples, f"omni_{kind}_asyncio_tasks"),
        }
    return figures


def fabric_idle(stack: Stack) -> bool:
    """No session open anywhere and no lease occupying a slot."""
    edge = scrape(http_address(stack.url))
    scheduler = scrape(stack.services[0].metrics_address())
    workers = [scrape(w.metrics_address()) for w in stack.workers if w.proc.poll() is None]
    return (
        metric(edge, "omni_edge_sessions_active") == 0
        and metric(scheduler, "omni_scheduler_leases_occupying") == 0
        and all(metric(w, "omni_worker_sessions_active") == 0 for w in workers)
    )


async def wait_until(check: Callable[[], bool], timeout_s: float, every_s: float = 0.25) -> bool:
    """Poll a blocking check off the loop until it holds; False at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await asyncio.to_thread(check):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(every_s)


async def print_progress(row: str, every_s: float, line: Callable[[], str]) -> None:
    """Print `line()` every `every_s` seconds until cancelled."""
    start = time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        try:
            text = await asyncio.to_thread(line)
        except OSError as exc:
            text = f"(metrics unavailable: {exc})"
        say(row, f"{time.monotonic() - start:.0f} s: {text}")
