"""gpu_sessions --profile: a torch profiler trace of a few batched steps, and how busy the
GPU was over the wall time of each phase of them.

The batched minicpmo step marks its phases with record_function ranges (minicpmo.prefill,
.decode, .tts, .vocoder). Per phase: its wall time (the ranges' total), the GPU's busy time
inside those ranges (the union of the CUDA kernels' intervals, so overlapping kernels count
once) and their ratio; the same for the whole profiled window. A phase at 20 % busy waits on
the host (Python, launches, syncs); one near 100 % is bound by the GPU itself. The trace
(Chrome trace JSON, for chrome://tracing or Perfetto) shows which.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from omnifabric.tools import batched
from omnifabric.worker.engine import Engine, Stepper

#: The record_function ranges the batched step opens, in step order.
PHASES = ("minicpmo.prefill", "minicpmo.decode", "minicpmo.tts", "minicpmo.vocoder")


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intervals (start, end) as disjoint ones, ascending."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(busy: list[tuple[float, float]], start: float, end: float) -> float:
    """How much of [start, end] the disjoint `busy` intervals cover."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)


def shares(events: Iterable[Any], wall_ms: float) -> dict[str, Any]:
    """Per phase and for the whole profiled window (`wall_ms` long): wall ms, GPU busy ms,
    busy share. `events` are the profiler's FunctionEvents (time_range in microseconds;
    CUDA kernels have device_type CUDA)."""
    from torch.profiler import DeviceType

    events = list(events)
    kernels = merged(
        (e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA
    )
    host = [e for e in events if e.device_type == DeviceType.CPU]
    out: dict[str, Any] = {"phases": {}}
    for name in PHASES:
        ranges = [(e.time_range.start, e.time_range.end) for e in host if e.name == name]
        if not ranges:
            continue
        wall = sum(b - a for a, b in ranges)
        gpu = sum(covered(kernels, a, b) for a, b in ranges)
        out["phases"][name.split(".", 1)[1]] = _figures(wall, gpu, len(ranges))
    out["window"] = _figures(wall_ms * 1000.0, sum(b - a for a, b in kernels), 1)
    out["gpu_measured"] = bool(kernels)
    return out


def _figures(wall_us: float, gpu_us: float, count: int) -> dict[str, Any]:
    return {
        "ranges": count,
        "wall_ms": wall_us / 1000.0,
        "gpu_busy_ms": gpu_us / 1000.0,
        "busy_share": gpu_us / wall_us if wall_us > 0 else float("nan"),
    }


def profile(
    engine: Engine,
    stepper: Stepper | None,
    n: int,
    units: list[np.ndarray],
    count: int,
    unit_s: float,
    sync: Callable[[], None],
    out_dir: Path,
) -> dict[str, Any]:
    """`count` batched steps of `n` sessions under the profiler: the trace written to
    out_dir, the busy shares returned (with the trace's path)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch_profile(activities=activities) as prof:
        row = batched.run(engine, stepper, batched.BATCHED, n, units, count, unit_s, sync)
    trace = out_dir / f"steps-N{n}.json"
    prof.export_chrome_trace(str(trace))
    report = shares(prof.events(), row["wall_s"] * 1000.0)
    report.update(trace=str(trace), sessions=n, steps=count, cycle_ms=row["cycle_ms"])
    return report


def lines(report: dict[str, Any]) -> list[str]:
    """The report as text, a line per phase."""
    if not report["gpu_measured"]:
        head = "profile: no CUDA kernels recorded (a CPU run): wall times only"
    else:
        window = report["window"]
        head = (
            f"profile: N={report['sessions']}, {report['steps']} steps: GPU busy "
            f"{window['busy_share']:.0%} of {window['wall_ms']:.0f} ms"
        )
    out = [head]
    for name, f in report["phases"].items():
        busy = f"{f['busy_share']:.0%} busy" if report["gpu_measured"] else "-"
        out.append(
            f"  {name:<8} {f['wall_ms']:9.1f} ms wall  {f['gpu_busy_ms']:9.1f} ms GPU  {busy}"
        )
    out.append(f"  trace: {report['trace']}")
    return out
