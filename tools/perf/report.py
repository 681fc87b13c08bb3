"""What `omnifabric bench` writes: the JSON document (config, levels, ratios to the
baselines, target checks), the markdown tables, and the plot of overhead percentiles
against session count."""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omnifabric.tools.perf.ledger import PATHS, THROUGH_EDGE, Level, us_per_unit, within


def _ratio(a: float, b: float) -> float | None:
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return round(a / b, 2)


def _added(a: float, b: float) -> float | None:
    if not (math.isfinite(a) and math.isfinite(b)):
        return None
    return round(a - b, 3)


def summarize(
    args: argparse.Namespace,
    levels: list[Level],
    max_sessions: int | None,
    max_search: list[dict[str, Any]],
) -> dict[str, Any]:
    """The JSON document: config, every level, ratios to the baselines, target checks."""
    by = {(lv.path, lv.sessions): lv for lv in levels}
    ratios = []
    for (path, n), lv in sorted(by.items(), key=lambda kv: (kv[0][1], PATHS.index(kv[0][0]))):
        if path not in THROUGH_EDGE:
            continue
        row: dict[str, Any] = {"sessions": n, "path": path}
        for base in ("ws-echo", "grpc-direct"):
            other = by.get((base, n))
            if other is None:
                continue
            for q in ("p50", "p99"):
                row[f"{q}_vs_{base}"] = _ratio(lv.overhead_ms[q], other.overhead_ms[q])
                # What the path adds over the baseline, in ms (the issue targets' unit).
                row[f"{q}_added_to_{base}_ms"] = _added(lv.overhead_ms[q], other.overhead_ms[q])
        ratios.append(row)
    targets: dict[str, Any] = {}
    at = by.get(("fabric", args.target_sessions))
    if at is not None:
        targets["at_target_sessions"] = {
            "sessions": args.target_sessions,
            "p99_ms": at.overhead_ms["p99"],
            "lost": at.lost + at.lost_sessions,
            # A unit lost in an attempt set aside for steal is lost all the same.
            "lost_in_noisy_attempts": sum(
                a["lost"] + a["lost_sessions"] for a in at.noisy_attempts
            ),
            "steal_cores": at.steal_cores,
            "passed": at.ok
            and not any(a["lost"] + a["lost_sessions"] for a in at.noisy_attempts)
            and at.overhead_ms["p99"] <= args.target_p99_ms,
            "target": f"p99 <= {args.target_p99_ms:g} ms and 0 lost",
        }
    if max_sessions is not None:
        found = {
            "max_p99_ms": args.max_p99_ms,
            "sessions": max_sessions,
            "capped": max_sessions >= args.max_sessions,
        }
        again = by.get(("fabric", max_sessions))
        if again is not None:
            # Measured once more with the baselines: near the knee the tail moves by run.
            found["remeasured_p99_ms"] = again.overhead_ms["p99"]
            found["remeasured_streaming_p99_ms"] = again.overhead_streaming_ms.get("p99")
            found["remeasured_within"] = within(again, args.max_p99_ms)
        targets["max_sessions_within"] = found
    # The public path's figure (grpc-realtime levels have their own, in their level).
    # A figure of 0 is a measurement: only a level without one (None) is left out.
    edge_us = [lv for lv in levels if lv.edge_cpu_us_per_unit is not None and lv.path == "fabric"]
    if edge_us:
        targets["edge_cpu_us_per_unit"] = {
            str(lv.sessions): {
                "whole_level": lv.edge_cpu_us_per_unit,
                "streaming_only": lv.edge_cpu_us_per_unit_steady,
            }
            for lv in edge_us
        }
    return {
        "split": split(by),
        "cpu_floor": cpu_floor(by),
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("func",)
        },
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "levels": [asdict(lv) for lv in levels],
        "ratios": ratios,
        "max_search": max_search,
        "targets": targets,
    }


def split(by: dict[tuple[str, int], Level]) -> list[dict[str, Any]]:
    """Where the fabric's added p50 goes, per session count with every path measured:
    differences of p50s of the same run (percentiles do not add up exactly).
    - added: fabric - ws-echo (the WebSocket exchange both make);
    - gRPC exchange: grpc-echo (one gRPC round trip of the PCM, nothing else);
    - worker: grpc-direct - grpc-echo (the worker's session machinery), and where
      grpc-thread was measured its two parts: the engine-thread hand-off (grpc-thread -
      grpc-echo: any worker that runs its engine on a thread pays it) and the session
      logic (grpc-direct - grpc-thread); where grpc-sync was measured, what the compute
      costs on the stream's own thread instead (grpc-sync - grpc-echo);
    - edge: fabric - ws-echo - grpc-direct (the edge's own work: translation, checks,
      session logic, one process more on the way)."""
    rows = []
    for (path, n), fabric in sorted(by.items(), key=lambda kv: kv[0][1]):
        levels = [by.get((p, n)) for p in ("ws-echo", "grpc-echo", "grpc-direct")]
        if path != "fabric" or any(lv is None for lv in levels):
            continue
        ws, echo, direct = (lv.overhead_ms["p50"] for lv in levels if lv is not None)
        f = fabric.overhead_ms["p50"]
        t, sync = (
            lv.overhead_ms["p50"] if (lv := by.get((p, n))) is not None else math.nan
            for p in ("grpc-thread", "grpc-sync")
        )
        rows.append(
            {
                "sessions": n,
                "added_ms": _added(f, ws),
                "grpc_exchange_ms": echo,
                "worker_ms": _added(direct, echo),
                "engine_handoff_ms": _added(t, echo),
                "session_logic_ms": _added(direct, t),
                "sync_handoff_ms": _added(sync, echo),
                "edge_ms": _added(f - ws, direct),
            }
        )
    return rows


def _cpu_us_per_unit(level: Level, process: str) -> float | None:
    proc = level.processes.get(process)
    if proc is None or not level.answered:
        return None
    return us_per_unit(proc["cpu_s"], level.answered)


def cpu_floor(by: dict[tuple[str, int], Level]) -> list[dict[str, Any]]:
    """The edge's CPU per unit beside what the baselines' servers spend per unit on the
    same I/O, per session count with fabric, ws-echo and grpc-echo measured (whole levels,
    as the edge's figure):
    - ws-echo's server: the unit's WebSocket frames in and out, no translation;
    - grpc-echo's server: one gRPC message in and one out (the edge makes one such
      exchange per unit, as the client).
    Their sum is what a process that only moved a unit's bytes would spend, with no
    translation and no session."""
    rows = []
    for (path, n), fabric in sorted(by.items(), key=lambda kv: kv[0][1]):
        ws, echo = by.get(("ws-echo", n)), by.get(("grpc-echo", n))
        edge = fabric.edge_cpu_us_per_unit
        if path != "fabric" or ws is None or echo is None or edge is None:
            continue
        ws_us, echo_us = _cpu_us_per_unit(ws, "echo"), _cpu_us_per_unit(echo, "grpc-echo")
        if ws_us is None or echo_us is None:
            continue
        rows.append(
            {
                "sessions": n,
                "edge_us": edge,
                "ws_echo_server_us": ws_us,
                "grpc_echo_server_us": echo_us,
                "echo_servers_us": round(ws_us + echo_us, 1),
                "edge_over_echo_servers_us": round(edge - ws_us - echo_us, 1),
            }
        )
    return rows


def _by_count_then_path(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The levels in the tables' order: by session count, then by PATHS' order."""
    return sorted(levels, key=lambda x: (x["sessions"], PATHS.index(x["path"])))


def _ms_cell(stats: dict[str, float], key: str = "p99") -> str:
    """A percentile of a level's stats, "-" where it has none."""
    value = stats.get(key, math.nan) if stats else math.nan
    return f"{value:.2f}" if math.isfinite(value) else "-"


def _levels_table(levels: list[dict[str, Any]]) -> list[str]:
    """Overhead per path and session count, with the level's counts, CPU and steal."""
    lines = [
        "| sessions | path | units | answered | lost | dropped | overhead p50 | p95 | p99 "
        "| max | p99 while all stream | in worker p99 | client lag p99 | queue wait p99 "
        "| edge CPU per unit (level / streaming) | steal (cores) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ms = _ms_cell
    for lv in _by_count_then_path(levels):
        o = lv["overhead_ms"]
        edge, steady = lv["edge_cpu_us_per_unit"], lv["edge_cpu_us_per_unit_steady"]
        edge_text = (
            "-"
            if edge is None
            else f"{edge:.0f} us" + (f" / {steady:.0f} us" if steady is not None else "")
        )
        lines.append(
            f"| {lv['sessions']} | {lv['path']} | {lv['units_sent']} | {lv['answered']} | "
            f"{lv['lost'] + lv['lost_sessions']} | {lv['dropped']} | {o['p50']:.2f} ms | "
            f"{o['p95']:.2f} | {o['p99']:.2f} | {o['max']:.1f} | "
            f"{ms(lv['overhead_streaming_ms'])} | {ms(lv['in_worker_ms'])} | "
            f"{ms(lv['client_loop_lag_ms'])} | {ms(lv['queue_wait_ms'])} | {edge_text} | "
            f"{lv['steal_cores']:.2f}"
            + (f" ({len(lv['noisy_attempts'])} set aside)" if lv["noisy_attempts"] else "")
            + " |"
        )
    return lines


def _ratios_table(ratios: list[dict[str, Any]]) -> list[str]:
    """The edge paths' overhead as a multiple of the baselines', and the ms added to echo."""
    lines = [
        "",
        "| sessions | path | p50 / echo | p99 / echo | p50 / gRPC direct | p99 / gRPC direct "
        "| added to echo p50 / p99 |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    def added(row: dict[str, Any]) -> str:
        p50, p99 = row.get("p50_added_to_ws-echo_ms"), row.get("p99_added_to_ws-echo_ms")
        return "-" if p50 is None or p99 is None else f"{p50:+.2f} / {p99:+.2f} ms"

    for row in ratios:
        lines.append(
            f"| {row['sessions']} | {row['path']} | {fmt(row.get('p50_vs_ws-echo'))} | "
            f"{fmt(row.get('p99_vs_ws-echo'))} | {fmt(row.get('p50_vs_grpc-direct'))} | "
            f"{fmt(row.get('p99_vs_grpc-direct'))} | {added(row)} |"
        )
    return lines


def _split_table(rows: list[dict[str, Any]]) -> list[str]:
    """Where the fabric's added p50 goes (`split`)."""
    lines = [
        "",
        "| sessions | fabric added p50 (- ws-echo) | one gRPC exchange (grpc-echo) | worker "
        "(grpc-direct - grpc-echo) | of it, the engine-thread hand-off (grpc-thread - "
        "grpc-echo) | and the session logic (grpc-direct - grpc-thread) | edge (fabric - "
        "ws-echo - grpc-direct) | the hand-off on a synchronous server (grpc-sync - "
        "grpc-echo) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def signed(x: float | None) -> str:
        return "-" if x is None else f"{x:+.2f} ms"

    for row in rows:
        lines.append(
            f"| {row['sessions']} | {signed(row['added_ms'])} | "
            f"{signed(row['grpc_exchange_ms'])} | {signed(row['worker_ms'])} | "
            f"{signed(row.get('engine_handoff_ms'))} | "
            f"{signed(row.get('session_logic_ms'))} | {signed(row['edge_ms'])} | "
            f"{signed(row.get('sync_handoff_ms'))} |"
        )
    return lines


def _cpu_floor_table(rows: list[dict[str, Any]]) -> list[str]:
    """The edge's CPU per unit beside the echo servers' (`cpu_floor`)."""
    lines = [
        "",
        "| sessions | edge CPU per unit | ws-echo server | grpc-echo server "
        "| the two servers | edge over them |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['sessions']} | {row['edge_us']:.0f} us | "
            f"{row['ws_echo_server_us']:.0f} us | {row['grpc_echo_server_us']:.0f} us | "
            f"{row['echo_servers_us']:.0f} us | {row['edge_over_echo_servers_us']:+.0f} us |"
        )
    return lines


def _processes_table(levels: list[dict[str, Any]]) -> list[str]:
    """Each watched process's CPU and peak RSS, per level."""
    lines = [
        "",
        "| sessions | path | process | CPU cores | CPU s | RSS peak MiB |",
        "|---:|---|---|---:|---:|---:|",
    ]
    for lv in _by_count_then_path(levels):
        for name, p in sorted(lv["processes"].items()):
            lines.append(
                f"| {lv['sessions']} | {lv['path']} | {name} | {p['cores']:.2f} | "
                f"{p['cpu_s']:.2f} | {p['rss_mib_peak']:.1f} |"
            )
    return lines


def _target_lines(targets: dict[str, Any]) -> list[str]:
    """The target checks as a list: the target session count's, the max search's."""
    lines = [""]
    at = targets.get("at_target_sessions")
    if at:
        lines.append(
            f"- {at['sessions']} sessions: p99 {at['p99_ms']:.2f} ms, lost {at['lost']} "
            f"(+{at['lost_in_noisy_attempts']} in attempts set aside), steal "
            f"{at['steal_cores']:.2f} cores "
            f"(target {at['target']}): {'PASS' if at['passed'] else 'MISS'}"
        )
    mx = targets.get("max_sessions_within")
    if mx:
        capped = " (the search's cap: --max-sessions)" if mx["capped"] else ""
        again = ""
        if "remeasured_p99_ms" in mx:
            again = (
                f"; measured again with the baselines: p99 {mx['remeasured_p99_ms']:.2f} ms"
                f" ({'within' if mx['remeasured_within'] else 'over'} the limit)"
            )
        lines.append(
            f"- largest session count with p99 <= {mx['max_p99_ms']:g} ms and nothing "
            f"lost: {mx['sessions']}{capped}{again}"
        )
    return lines


def markdown(result: dict[str, Any]) -> str:
    """Tables: overhead per path and count, ratios, processes, targets."""
    levels = result["levels"]
    lines = _levels_table(levels) + _ratios_table(result["ratios"])
    if result.get("split"):
        lines += _split_table(result["split"])
    if result.get("cpu_floor"):
        lines += _cpu_floor_table(result["cpu_floor"])
    lines += _processes_table(levels)
    targets = result["targets"]
    if targets:
        lines += _target_lines(targets)
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Overhead p50/p95/p99 against session count, one colour per path (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    colours = {
        "fabric": "tab:red",
        "grpc-realtime": "tab:orange",
        "ws-echo": "tab:blue",
        "grpc-echo": "tab:purple",
        "grpc-thread": "tab:brown",
        "grpc-sync": "tab:pink",
        "grpc-direct": "tab:green",
    }
    styles = {"p50": ":", "p95": "--", "p99": "-"}
    for name in PATHS:
        points = sorted(
            (lv["sessions"], lv["overhead_ms"]) for lv in result["levels"] if lv["path"] == name
        )
        if not points:
            continue
        xs = [n for n, _ in points]
        for q, style in styles.items():
            ax.plot(
                xs,
                [o[q] for _, o in points],
                style,
                marker="o",
                markersize=3,
                color=colours[name],
                label=f"{name} {q}",
            )
    for y, text in (
        (result["config"]["target_p99_ms"], "p99 target"),
        (result["config"]["max_p99_ms"], "max-search limit"),
    ):
        ax.axhline(y, color="grey", linewidth=0.8)
        ax.annotate(
            text,
            (0.005, y),
            xycoords=("axes fraction", "data"),
            fontsize=8,
            va="bottom",
            color="grey",
        )
    probes = result.get("max_search") or []
    if probes:
        ax.scatter(
            [p["sessions"] for p in probes],
            [p["p99_ms"] for p in probes],
            marker="x",
            color="black",
            zorder=3,
            label="max search: fabric p99 per probe",
        )
    ax.set_xscale("log")
    ax.set_xlabel("concurrent sessions (1 unit/s each)")
    ax.set_ylabel("overhead per unit, ms (round trip - engine compute)")
    ax.set_title("omnifabric bench: fabric overhead vs baselines, same run")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
