"""`omnifabric probe`: stream a WAV file to a Realtime endpoint like a real client.

Sends 1 s of 16 kHz audio per second (`--fast`: each unit as soon as the previous one
is answered), then silence until the model's reply has ended (`--tail-s`, at most 20 s),
writes the reply audio as a 24 kHz WAV, prints the events' text and a per-unit summary,
and with `--transcribe` what the reply says.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import wave
from pathlib import Path
from typing import Any

import numpy as np

from omnifabric.common.stats import percentile
from omnifabric.tools.client import SILENCE_UNIT, SessionReport, run_session


def read_wav_16k(path: Path) -> np.ndarray:
    """A WAV file (any PCM or float encoding, rate and channel count the edge takes) as mono
    float32 at 16 kHz."""
    from omnifabric.edge.pcm import wav_to_pcm16k

    return np.frombuffer(wav_to_pcm16k(path.read_bytes(), str(path)), dtype="<f4")


def write_wav_24k(path: Path, audio: np.ndarray) -> None:
    """Mono 16-bit PCM WAV at 24 kHz."""
    pcm16 = (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(24000)
        wav.writeframes(pcm16.tobytes())


def split_units(audio: np.ndarray, tail_s: int) -> list[np.ndarray]:
    """1 s units (the last padded with silence), then `tail_s` silent units."""
    units = []
    for start in range(0, audio.size, 16000):
        chunk = audio[start : start + 16000]
        if chunk.size < 16000:
            chunk = np.concatenate([chunk, np.zeros(16000 - chunk.size, np.float32)])
        units.append(chunk)
    return units + [SILENCE_UNIT] * tail_s


def transcribe_24k(audio: np.ndarray) -> str:
    """What 24 kHz reply audio says, by Whisper tiny.en (loads the model: a few seconds)."""
    if audio.size == 0:
        return ""
    from omnifabric.common.resample import resample
    from omnifabric.worker.engines.reference.asr import Transcriber

    return Transcriber(model="tiny.en", precision="fp32").transcribe(resample(audio, 24000, 16000))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnifabric probe", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8006/v1/realtime")
    parser.add_argument("--mode", default="audio", choices=["audio", "video"])
    parser.add_argument(
        "--input", required=True, type=Path, help="WAV file (any rate; mono or stereo)"
    )
    parser.add_argument("--output", type=Path, help="where to write the reply audio (24 kHz WAV)")
    parser.add_argument(
        "--fast", action="store_true", help="send each unit once the previous one is answered"
    )
    parser.add_argument(
        "--tail-s",
        type=int,
        default=20,
        help="after the input, send silence until the reply's turn ends, at most this many s",
    )
    parser.add_argument(
        "--tail", type=int, help="instead: exactly this many silent units after the input"
    )
    parser.add_argument(
        "--transcribe",
        action="store_true",
        help="print what the reply says (Whisper tiny.en, the reference engine's recognizer)",
    )
    parser.add_argument("--dialect", default="current", choices=["current", "first"])
    parser.add_argument("--system-prompt", default="You are a helpful assistant.")
    parser.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    parser.add_argument("--quiet", action="store_true", help="only the summary")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        audio = read_wav_16k(args.input)
    except (OSError, ValueError, Exception) as exc:  # InvalidPayload carries the reason
        print(f"omnifabric probe: cannot read {args.input}: {exc}", file=sys.stderr)
        return 2
    units = split_units(audio, args.tail or 0)
    reply_tail_s = 0 if args.tail is not None else max(0, args.tail_s)
    url = args.url
    if "mode=" not in url:
        url += ("&" if "?" in url else "?") + f"mode={args.mode}"

    def show(event: dict[str, Any], _report: SessionReport) -> None:
        if not args.quiet:
            line = event_line(event)
            if line is not None:
                print(line)

    try:
        report = asyncio.run(
            run_session(
                url,
                units,
                pace_s=0.0 if args.fast else 1.0,
                dialect=args.dialect,
                system_prompt=args.system_prompt,
                api_key=args.api_key,
                on_event=show,
                reply_tail_s=reply_tail_s,
            )
        )
    except OSError as exc:
        print(f"omnifabric probe: cannot connect to {url}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # handshake refused (401, 503) and the like
        print(f"omnifabric probe: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if report.error:
        print(f"omnifabric probe: server error {report.error}", file=sys.stderr)
    print_units(report)
    if reply_tail_s and not report.reply_done(len(units)):
        print(f"the reply had not ended after {reply_tail_s} s of silence (--tail-s)")
    if args.output:
        write_wav_24k(args.output, report.reply_audio)
        print(f"reply audio: {report.reply_audio.size / 24000:.2f}s -> {args.output}")
    if args.transcribe:
        print(f"reply heard as: {transcribe_24k(report.reply_audio)!r}")
    return 0 if report.closed_reason and not report.error else 1


def event_line(event: dict[str, Any]) -> str | None:
    """What probe prints for a server event as it arrives (None: nothing)."""
    kind = event.get("type")
    metrics = event.get("metrics") or {}
    seq = metrics.get("seq")
    if kind in ("session.queued", "session.queue_update"):
        return (
            f"queue: position {event['position']} of {event['queue_length']}, "
            f"eta {event['estimated_wait_s']}s"
        )
    if kind == "response.output.delta":
        if event["kind"] == "text":
            return f"unit {seq}: text {event['text']!r}"
        if event["kind"] == "audio":
            secs = len(event["audio"]) * 3 / 4 / 4 / 24000
            return (
                f"unit {seq}: audio {secs:.2f}s kv={metrics.get('kv_cache_length')} "
                f"prefill {metrics.get('prefill_ms')}ms generate {metrics.get('generate_ms')}ms"
            )
        return f"unit {seq}: listen kv={metrics.get('kv_cache_length')}"
    lines = {
        "session.queue_done": lambda: "queue: done",
        "session.created": lambda: f"session {event.get('session_id')} created",
        "response.listen": lambda: f"unit {seq}: listen kv={event.get('kv_cache_length')}",
        "response.output_audio.delta": lambda: (
            f"unit {seq}: speak {event['text']!r} end_of_turn={event['end_of_turn']}"
        ),
        "session.resumed": lambda: (
            f"connection lost: session resumed ({event.get('replayed')} events replayed, "
            f"units after {event.get('last_input_seq')} sent again)"
        ),
        "session.closed": lambda: f"closed: {event.get('reason')}",
        "error": lambda: f"error: {event['error']}",
    }
    line = lines.get(str(kind))
    return None if line is None else line()


def print_units(report: SessionReport) -> None:
    """The per-unit table and the session's totals."""
    units_seen = sorted(report.units.values(), key=lambda u: u.seq)
    # engine_ms: this unit's prefill + generate; busy_ms and finalize_ms: its waits for the
    # session's earlier unit's compute and deferred finalize (engine time too); overhead_ms:
    # the rest, the fabric's.
    print("\nseq  kind    rtt_ms  engine_ms  busy_ms  finalize_ms  overhead_ms  kv    text")
    for u in units_seen:
        rtt = f"{u.rtt_ms:7.1f}" if u.rtt_ms is not None else "      -"
        ovh = f"{u.overhead_ms:11.1f}" if u.overhead_ms is not None else "          -"
        print(
            f"{u.seq:3d}  {u.kind or 'lost':6s} {rtt}  {u.prefill_ms + u.generate_ms:9.1f}  "
            f"{u.engine_busy_ms:7.1f}  {u.finalize_wait_ms:11.1f}  {ovh}  "
            f"{u.kv_cache_length:4d}  {u.text}"
        )
    overheads = [u.overhead_ms for u in units_seen if u.overhead_ms is not None]
    speak = sum(u.kind == "speak" for u in units_seen)
    listen = sum(u.kind == "listen" for u in units_seen)
    dropped = sum(u.kind == "dropped" for u in units_seen)
    lost = report.lost_units()
    print(
        f"\nunits {len(units_seen)}: listen {listen}, speak {speak}, dropped {dropped}, "
        f"lost {len(lost)}; "
        f"overhead p50 {percentile(overheads, 50):.1f} ms p99 {percentile(overheads, 99):.1f} ms; "
        f"closed: {report.closed_reason}"
    )
