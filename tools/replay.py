"""`omnifabric replay DIR --url URL`: replay a recorded session and compare the answers.

DIR is one session folder written by `omnifabric edge --record-dir` (it holds meta.json,
units.jsonl and in/<seq>.wav). A new session is opened on URL in the recorded mode and
dialect with the recorded system prompt, config and voices; the recorded input units are
sent in order, bit-identical (1 s per unit, or `--fast`: each once the previous one is
answered). Then, per unit, listen/speak, end_of_turn and text are compared with the
recording. Exit 0 when at most `--tolerance` units differ, else 1 (2: unreadable folder).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omnifabric.edge.recording import read_float32_wav
from omnifabric.tools.client import SessionReport, run_session


@dataclass
class Recording:
    """What a replay needs from a session folder."""

    folder: Path
    meta: dict[str, Any]
    units: list[np.ndarray]
    unit_extra: list[dict[str, Any]]
    expected: dict[int, dict[str, Any]]

    @property
    def dialect(self) -> str:
        return self.meta.get("dialect", "current")


def load(folder: Path) -> Recording:
    """Read a session folder; ValueError/OSError when it is not a recording."""
    meta = json.loads((folder / "meta.json").read_text())
    appends: list[dict[str, Any]] = []
    events = folder / "events.jsonl"
    if events.exists():
        for line in events.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            event = rec.get("event") or {}
            if rec.get("dir") == "in" and isinstance(event.get("audio"), dict):
                appends.append(event)
    if not appends:  # events.jsonl cut short: the unit files alone
        appends = [
            {"audio": {"wav": f"in/{p.name}"}} for p in sorted((folder / "in").glob("*.wav"))
        ]
    units, extra = [], []
    for event in appends:
        samples, rate = read_float32_wav((folder / event["audio"]["wav"]).read_bytes())
        if rate != 16000:
            raise ValueError(f"{event['audio']['wav']}: {rate} Hz, expected 16000")
        units.append(samples)
        body: dict[str, Any] = {}
        if event.get("force_listen"):
            body["force_listen"] = True
        if event.get("max_slice_nums"):
            body["max_slice_nums"] = event["max_slice_nums"]
        extra.append(body)
    expected: dict[int, dict[str, Any]] = {}
    for line in (folder / "units.jsonl").read_text().splitlines():
        if line.strip():
            unit = json.loads(line)
            seq = int(unit["seq"])
            if unit.get("early") and seq in expected:
                # A reply's start sent after unit `seq` listened: a client sees that unit
                # speak (its text first), as the next unit's result would have.
                unit = {**unit, "text": (expected[seq].get("text") or "") + unit["text"]}
                expected[seq] = unit
            else:
                expected.setdefault(seq, unit)
    return Recording(folder, meta, units, extra, expected)


def init_extra(rec: Recording) -> dict[str, Any]:
    """Config, slices and reference voices of the recorded init, in its dialect."""
    meta = rec.meta
    extra: dict[str, Any] = {}
    if meta.get("config"):
        extra["config"] = meta["config"]
    if meta.get("max_slice_nums", 1) != 1:
        extra["max_slice_nums"] = meta["max_slice_nums"]
    voices = {}
    for name, file in (meta.get("voices") or {}).items():
        samples, _ = read_float32_wav((rec.folder / file).read_bytes())
        voices[name] = base64.b64encode(samples.astype("<f4").tobytes()).decode()
    if voices and rec.dialect == "first":
        extra.update(voices)
    elif voices:
        extra["voice"] = {f"{k}_base64": v for k, v in voices.items()}
    return extra


def _view(unit: dict[str, Any] | None) -> tuple[str, bool, str]:
    if unit is None:
        return ("lost", False, "")
    return (unit.get("kind") or "lost", bool(unit.get("end_of_turn")), unit.get("text") or "")


def compare(rec: Recording, report: SessionReport) -> list[tuple[int, str, str, str]]:
    """Per recorded unit: (seq, what differs, expected, got) for each unit that differs.

    end_of_turn of a listening unit is invisible in the current dialect (a plain listen
    delta), so it is compared there only for speaking units."""
    diffs = []
    for seq in sorted(rec.expected):
        exp_kind, exp_eot, exp_text = _view(rec.expected[seq])
        got_unit = report.units.get(seq)
        got = _view(None if got_unit is None else got_unit.__dict__)
        got_kind, got_eot, got_text = got
        if rec.dialect == "current" and exp_kind == "listen":
            exp_eot = got_eot = False
        what = []
        if exp_kind != got_kind or exp_eot != got_eot:
            what.append("timeline")
        if exp_text != got_text:
            what.append("text")
        if what:
            diffs.append(
                (
                    seq,
                    "+".join(what),
                    f"{exp_kind} end_of_turn={exp_eot} {exp_text!r}",
                    f"{got_kind} end_of_turn={got_eot} {got_text!r}",
                )
            )
    return diffs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnifabric replay", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a recorded session folder (DIR/<session_id>)")
    parser.add_argument("--url", default="ws://127.0.0.1:8006/v1/realtime")
    parser.add_argument(
        "--fast", action="store_true", help="send each unit once the previous one is answered"
    )
    parser.add_argument(
        "--tolerance", type=int, default=0, help="units allowed to differ (default 0)"
    )
    parser.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rec = load(args.folder)
        extra = init_extra(rec)
    except (OSError, ValueError, KeyError) as exc:
        print(
            f"omnifabric replay: {args.folder} is not a readable recording: {exc}", file=sys.stderr
        )
        return 2
    url = args.url
    if "mode=" not in url:
        url += ("&" if "?" in url else "?") + f"mode={rec.meta.get('mode', 'audio')}"
    print(
        f"replaying {rec.meta.get('session_id')} ({rec.meta.get('mode')}, {rec.dialect} dialect, "
        f"{len(rec.units)} units) on {url}"
    )
    try:
        report = asyncio.run(
            run_session(
                url,
                rec.units,
                pace_s=0.0 if args.fast else 1.0,
                dialect=rec.dialect,
                system_prompt=rec.meta.get("system_prompt", ""),
                api_key=args.api_key,
                close_reason=rec.meta.get("client_close_reason") or "user_stop",
                init_extra=extra,
                unit_extra=rec.unit_extra,
            )
        )
    except Exception as exc:  # refused handshake, unreachable edge
        print(f"omnifabric replay: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if report.error:
        print(f"server error: {report.error}")
    print(f"replay session {report.session_id}, closed: {report.closed_reason}")
    diffs = compare(rec, report)
    for seq, what, expected, got in diffs:
        print(f"unit {seq}: {what} differs: expected {expected}; got {got}")
    n = len(rec.expected)
    timeline = sum("timeline" in d[1] for d in diffs)
    text = sum("text" in d[1] for d in diffs)
    print(f"timeline: {'match' if not timeline else f'{timeline} units differ'} ({n} units)")
    print(f"text: {'match' if not text else f'{text} units differ'}")
    ok = len(diffs) <= args.tolerance
    print(
        f"replay: {len(diffs)} of {n} units differ (tolerance {args.tolerance}): "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
