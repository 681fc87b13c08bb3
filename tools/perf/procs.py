"""CPU time and memory of processes, read from /proc: one process, the whole machine, and a
watch that samples named processes while a bench level runs."""

from __future__ import annotations

import asyncio
import os
import time


def process_cpu_clock(pid: int) -> int:
    """Linux's CPU-time clock of a whole process (every thread, live or ended), for
    `time.clock_gettime`: nanosecond steps, where /proc/<pid>/stat counts clock ticks
    (10 ms), which made a short level's CPU read 0."""
    return ((~pid) << 3) | 2  # the kernel's process clock id, CPUCLOCK_SCHED


def proc_sample(pid: int) -> tuple[float, float] | None:
    """(CPU seconds used so far, RSS MiB) of a live process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            pages = int(statm.read().split()[1])
        cpu = time.clock_gettime(process_cpu_clock(pid))
    except (OSError, IndexError, ValueError):
        return None
    return cpu, pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def machine_busy_s() -> tuple[float, float]:
    """CPU seconds the whole machine has been busy since boot (all cores), and of those the
    steal (a virtual machine's cores taken by its host)."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    steal = ticks[7] if len(ticks) > 7 else 0
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / hz, steal / hz


class ProcessWatch:
    """Samples CPU time and RSS of named processes every `every_s` while a level runs."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.5) -> None:
        self.pids = pids
        self.every_s = every_s
        self.first: dict[str, tuple[float, float]] = {}
        self.last: dict[str, tuple[float, float]] = {}
        self.peak_rss: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._busy0 = (0.0, 0.0)
        self.wall_s = 0.0
        self.machine_cores = 0.0
        self.steal_cores = 0.0

    def _sample(self) -> None:
        for name, pid in self.pids.items():
            sample = proc_sample(pid)
            if sample is None:
                continue
            self.first.setdefault(name, sample)
            self.last[name] = sample
            self.peak_rss[name] = max(self.peak_rss.get(name, 0.0), sample[1])

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self._sample()

    def start(self) -> None:
        self._t0, self._busy0 = time.monotonic(), machine_busy_s()
        self._sample()
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> dict[str, dict[str, float]]:
        """Per process: CPU seconds and cores over the level, peak and last RSS (MiB)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sample()
        self.wall_s = max(1e-9, time.monotonic() - self._t0)
        busy, steal = machine_busy_s()
        self.machine_cores = (busy - self._busy0[0]) / self.wall_s
        self.steal_cores = (steal - self._busy0[1]) / self.wall_s
        out = {}
        for name in self.last:
            cpu_s = self.last[name][0] - self.first[name][0]
            out[name] = {
                "cpu_s": round(cpu_s, 6),
                "cores": round(cpu_s / self.wall_s, 3),
                "rss_mib_peak": round(self.peak_rss[name], 1),
                "rss_mib_end": round(self.last[name][1], 1),
            }
        return out


def cpu_seconds(pids: list[int]) -> tuple[float, float]:
    """(CPU seconds the whole machine was busy, CPU seconds of `pids`) since boot, from
    /proc: the difference over a run is the load of processes not ours."""
    ours = 0.0
    for pid in pids:
        sample = proc_sample(pid)
        if sample is not None:
            ours += sample[0]
    return machine_busy_s()[0], ours
