"""gpu_sessions --profile: a torch profiler trace of a few batched steps, and how busy the
GPU was over the wall time of each phase of them.

The batched minicpmo step marks its phases with record_function ranges (minicpmo.prefill,
.decode, .tts, .vocoder). Per phase: its wall time (the ranges' total), the GPU's busy time
inside those ranges (the union of the CUDA kernels' intervals, so overlapping kernels count
once) and their ratio; the same for the whole profiled window. A phase at 20 % busy waits on
the host (Python, launches, syncs); one near 100 % is bound by the GPU itself. The trace
(Chrome trace JSON, for chrome://tracing or Perfetto) shows which.

What the host issued per phase, counted from the same events (a CPU run has them too, so the
host's load per row shows without a GPU: run two N and take the difference):
- `ops`: torch ops called from Python or the modules, views and other metadata-only ops left
  out (each is at least one kernel launch on a GPU; ops inside ops are not counted again);
- `reads`: device values read on the host (`.item()`, `bool()`, `int()` of a tensor: a
  sync on a GPU, cheap on a CPU);
- on a GPU: `launches` (kernels launched one by one), `replays` (CUDA graph launches, each
  replaying many kernels) and `syncs` (stream, device and event synchronizations).
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
#: Torch ops that launch nothing themselves (views, metadata, allocation): not counted as
#: host ops; what they call inside (the copy a `contiguous` or `reshape` may make) is.
NO_KERNEL = frozenset(
    "aten::" + name
    for name in (
        "view alias as_strided slice select narrow expand expand_as t transpose permute "
        "unsqueeze squeeze reshape flatten unflatten _unsafe_view detach detach_ split "
        "split_with_sizes chunk unbind lift_fresh empty empty_like empty_strided new_empty "
        "view_as _reshape_alias contiguous numpy_T"
    ).split()
)
#: A device value read on the host (`.item()` and what calls it).
READ = "aten::_local_scalar_dense"
#: CUDA runtime calls, by what they count.
RUNTIME = {
    "launches": frozenset(
        {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
    ),
    "replays": frozenset({"cudaGraphLaunch"}),
    "syncs": frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"}),
}


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
    counted = [(e.time_range.start, kind) for e in host if (kind := _kind(e))]
    out: dict[str, Any] = {"phases": {}}
    spans: list[tuple[float, float]] = []
    for name in PHASES:
        ranges = [(e.time_range.start, e.time_range.end) for e in host if e.name == name]
        spans += ranges
        if not ranges:
            continue
        wall = sum(b - a for a, b in ranges)
        gpu = sum(covered(kernels, a, b) for a, b in ranges)
        figures = _figures(wall, gpu, len(ranges))
        figures["host"] = _tally(kind for at, kind in counted if _within(ranges, at))
        out["phases"][name.split(".", 1)[1]] = figures
    out["window"] = _figures(wall_ms * 1000.0, sum(b - a for a, b in kernels), 1)
    # The window's host work: from the first phase's start to the last one's end (the steps
    # and what runs between their phases), not the sessions' open and close around them.
    first = min((a for a, _ in spans), default=float("-inf"))
    last = max((b for _, b in spans), default=float("inf"))
    out["window"]["host"] = _tally(kind for at, kind in counted if first <= at <= last)
    out["gpu_measured"] = bool(kernels)
    return out


def _kind(event: Any) -> str | None:
    """What a host event counts as (HOST_COUNTS), or None."""
    name = event.name
    if name == READ:
        return "reads"
    if name.startswith("aten::"):
        if name in NO_KERNEL:
            return None
        parent = getattr(event, "cpu_parent", None)
        while parent is not None:
            if parent.name.startswith("aten::") and parent.name not in NO_KERNEL:
                return None  # inside an op already counted
            parent = getattr(parent, "cpu_parent", None)
        return "ops"
    return next((kind for kind, names in RUNTIME.items() if name in names), None)


#: The host counts a phase reports.
HOST_COUNTS = ("ops", "reads", *RUNTIME)


def _tally(kinds: Iterable[str]) -> dict[str, int]:
    out = dict.fromkeys(HOST_COUNTS, 0)
    for kind in kinds:
        out[kind] += 1
    return out


def _within(ranges: list[tuple[float, float]], at: float) -> bool:
    return any(a <= at <= b for a, b in ranges)


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
    """The report as text, a line per phase (host counts per step)."""
    steps = max(1, report["steps"])
    gpu = report["gpu_measured"]
    if not gpu:
        head = (
            f"profile: N={report['sessions']}, {report['steps']} steps: no CUDA kernels "
            "recorded (a CPU run): wall times and host counts only"
        )
    else:
        window = report["window"]
        head = (
            f"profile: N={report['sessions']}, {report['steps']} steps: GPU busy "
            f"{window['busy_share']:.0%} of {window['wall_ms']:.0f} ms"
        )
    out = [head]
    kinds = HOST_COUNTS if gpu else ("ops", "reads")
    for name, f in [*report["phases"].items(), ("window", report["window"])]:
        busy = f"{f['busy_share']:.0%} busy" if gpu else "-"
        host = ", ".join(f"{f['host'][k] / steps:.0f} {k}" for k in kinds)
        out.append(
            f"  {name:<8} {f['wall_ms']:9.1f} ms wall  {f['gpu_busy_ms']:9.1f} ms GPU  {busy}"
            f"  a step: {host}"
        )
    out.append(f"  trace: {report['trace']}")
    return out
