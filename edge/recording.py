"""Opt-in session recording (`omnifabric edge --record-dir DIR`) and its retention.

One folder per duplex session (the Realtime dialects, legacy `/ws/duplex` and
`/ws/half_duplex`), `DIR/<recording id>/`: the session id, or the session id with a short
suffix when a client-chosen id (legacy paths) is already taken or holds characters a
recording id may not (RECORDING_ID). Dialects hand the id to their clients
(`recording_session_id`).

- `meta.json`: session id, mode, dialect, URL path and query (keys that look like
  secrets dropped), start/end times, close reason, the client's own close reason,
  system prompt, duplex config, max_slice_nums, unit count, file formats.
- `events.jsonl`: every command in (init, append, close) and every event out, one JSON
  object a line: `{"t": seconds since the recorder opened (monotonic), "wall": unix time,
  "dir": "in"|"out", "event": {...}}`. Audio is never inline: an input unit's audio is
  `{"wav": "in/000001.wav", "samples": N}`, an output's `{"wav": "model.wav", "start":
  sample offset, "samples": N}`; video frames are counted, not stored.
- `user.wav`: the user's audio, all units back to back, 16 kHz mono 16-bit PCM.
- `model.wav`: the model's speech, all speaking units back to back, 24 kHz mono 16-bit.
- `in/<seq>.wav`: each unit's input exactly as received: 16 kHz mono 32-bit IEEE float WAV
  (WAVE_FORMAT_IEEE_FLOAT, written here: the `wave` module only writes integer PCM), so a
  replay sends bit-identical samples. `ref_audio.wav` / `tts_ref_audio.wav` likewise when
  the client sent reference voices.
- `units.jsonl`: per unit answered: seq, kind (listen/speak/dropped), text, end_of_turn,
  kv, prefill_ms, generate_ms, wall_clock_ms, edge_ms (edge receive -> send).
- The reference server's layout too, so that its clients and tools read our recordings:
  `recording.json` (`{session_id, mode: "duplex", worker_id, start_ts, config, chunks}`,
  one chunk per answered unit: `{index, receive_ts_ms, user_audio, result: {mode:
  LISTEN|SPEAK, timing, text, ai_audio, ai_audio_duration_ms, end_of_turn}}`), each unit's
  input as `user_audio/<index>.wav` and each speaking unit's speech as
  `ai_audio/turn_<turn>_chunk_<k>.wav` (16-bit PCM, 16 and 24 kHz), and meta.json's
  `app_type`, `created_at`, `duration_s`, `worker_id` and `title` beside ours. Half-duplex
  calls are laid out turn by turn, as the reference records them: `{..., mode:
  "half_duplex_audio", turns: [{turn_index, request_ts_ms, input: {type: "voice",
  duration_ms, audio: "user_audio/<turn>.wav"}, output: {text, audio:
  "ai_audio/turn_<turn>.wav", audio_duration_ms}, timing: {elapsed_ms, speech_input_ms}}]}`
  (the user's turn is what came since the last reply, at most 30 units).

While the session runs, recording.json's timeline is spooled to `recording.timeline.jsonl`
(one line per entry), so a recorder's memory does not grow with the session's length; the
spool becomes recording.json when the session ends.

Writes happen on the event loop but stay small (appends, one ~64 KB file per unit, no
fsync). Any failure logs once and turns the recorder off: recording never breaks a session.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import os
import re
import secrets
import shutil
import struct
import time
import wave
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TextIO
from urllib.parse import parse_qs, urlsplit

import numpy as np

from omnifabric.edge import events as ev

log = logging.getLogger("omnifabric.edge.recording")

USER_RATE = 16000
MODEL_RATE = 24000
FORMAT_VERSION = 1
#: What a recording id (its folder's name, the `{sid}` of /api/sessions) looks like.
RECORDING_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: Query keys never written to meta.json.
_SECRET = re.compile(r"key|token|secret|auth|pass|sig|cred", re.IGNORECASE)
#: A half-duplex user turn recorded at most (units, seconds): the reference engine ends a
#: turn by 25 s.
_MAX_TURN_UNITS = 30
#: Events kept in memory before the session starts (queue updates), at most.
_MAX_PENDING = 256
#: recording.json's timeline while the session runs (one JSON line per entry); finish turns
#: it into recording.json and removes it.
TIMELINE_SPOOL = "recording.timeline.jsonl"
#: Recording folders still being written (retention never removes them).
_ACTIVE: set[Path] = set()
#: Background retention tasks (kept referenced).
_TASKS: set[asyncio.Task] = set()


# ---- float32 WAV ------------------------------------------------------------------


def float32_wav(pcm: bytes, rate: int = USER_RATE) -> bytes:
    """Mono 32-bit IEEE float WAV (format 3) around raw little-endian float32 bytes."""
    n = len(pcm) // 4
    fmt = struct.pack("<HHIIHHH", 3, 1, rate, rate * 4, 4, 32, 0)
    fact = struct.pack("<I", n)
    body = (
        b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"fact"
        + struct.pack("<I", 4)
        + fact
        + b"data"
        + struct.pack("<I", len(pcm))
        + pcm
    )
    return b"RIFF" + struct.pack("<I", len(body)) + body


def read_float32_wav(data: bytes) -> tuple[np.ndarray, int]:
    """(samples, rate) of a mono float32 WAV written by `float32_wav`; ValueError otherwise."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a WAV file")
    pos, fmt, samples = 12, None, None
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        chunk = data[pos + 8 : pos + 8 + size]
        if cid == b"fmt ":
            fmt = struct.unpack("<HHIIHH", chunk[:16])
        elif cid == b"data":
            samples = chunk
        pos += 8 + size + (size & 1)
    if fmt is None or samples is None:
        raise ValueError("WAV without fmt or data chunk")
    tag, channels, rate, _, _, bits = fmt
    if tag != 3 or channels != 1 or bits != 32:
        raise ValueError(f"not mono float32 (format {tag}, {channels} ch, {bits} bit)")
    return np.frombuffer(samples, dtype="<f4").copy(), rate


def _pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def _user_audio(seq: int) -> str:
    """The reference layout's name of unit `seq`'s input (its chunks count from 0)."""
    return f"user_audio/{seq - 1:03d}.wav"


def _write_pcm16_wav(path: Path, pcm16: bytes, rate: int) -> None:
    path.parent.mkdir(exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm16)


def _b64_len(value: str) -> int:
    """Decoded byte length of a base64 string, without decoding it."""
    pad = 2 if value.endswith("==") else 1 if value.endswith("=") else 0
    return len(value) * 3 // 4 - pad


def public_query(path: str) -> dict[str, list[str]]:
    """The URL query without keys that look like secrets (api_key, token, ...)."""
    query = parse_qs(urlsplit(path).query)
    return {k: v for k, v in query.items() if not _SECRET.search(k)}


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")


# ---- the recorder -----------------------------------------------------------------


_P = ParamSpec("_P")


def _guarded(
    method: Callable[Concatenate[SessionRecorder, _P], None],
) -> Callable[Concatenate[SessionRecorder, _P], None]:
    """Run a recorder method only while enabled; any failure disables the recorder."""

    @functools.wraps(method)
    def wrapper(self: SessionRecorder, /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        if not self.enabled:
            return
        try:
            method(self, *args, **kwargs)
        except Exception:
            log.exception("session %s: recording failed; recording off", self.session_id)
            self._disable()

    return wrapper


class SessionRecorder:
    """Records one session; every public method is safe to call when disabled."""

    def __init__(self, root: Path | None, session_id: str, mode: str, path: str) -> None:
        self.root = root
        self.session_id = session_id
        self.mode = mode
        self.path = urlsplit(path).path
        self.query = public_query(path)
        self.enabled = root is not None
        self.folder: Path | None = None
        self._t0 = time.monotonic()
        self._wall0 = time.time()
        self._pending: list[str] = []
        self._meta: dict[str, Any] = {}
        self._events: TextIO | None = None
        self._units: TextIO | None = None
        self._user: wave.Wave_write | None = None
        self._model: wave.Wave_write | None = None
        self._model_samples = 0
        self._model_ref: tuple[int, int, int] | None = None
        """(seq, first sample in model.wav, samples) of the latest speaking unit: its events
        are rendered and sent right after `output`, so no older one is looked up again."""
        self._received: dict[int, float] = {}
        self._seq = 0
        self._timeline: TextIO | None = None
        """recording.json's timeline (the reference server's chunks, or its half-duplex
        turns), one JSON line per entry, spooled to TIMELINE_SPOOL as it goes: the session
        keeps none of it in memory however long it runs; finish writes recording.json from it."""
        self._received_ms: dict[int, float] = {}
        self._chunk_received_ms = 0.0
        """The receive time of the latest chunk's unit (an early output's chunk follows it)."""
        self._turn = 0
        self._speak_in_turn = 0
        self._heard: collections.deque[bytes] = collections.deque(maxlen=_MAX_TURN_UNITS)
        """Half-duplex: the input of the units since the last reply (the user's turn)."""
        self._inputs: dict[int, bytes] = {}
        self._reply: dict[str, Any] | None = None
        """Half-duplex: the reply being spoken (text, speech, when it was asked)."""
        self._closed_reason: str | None = None
        self._client_reason: str | None = None
        self._last_flush = self._t0

    @classmethod
    def for_session(cls, config: Any, session_id: str, mode: str, path: str) -> SessionRecorder:
        """A recorder for this session; a disabled one when the edge does not record."""
        root = getattr(config, "record_dir", None)
        return cls(Path(root) if root else None, session_id, mode, path)

    # ---- hooks -----------------------------------------------------------------

    @_guarded
    def start(self, init: ev.InitCommand) -> None:
        """The session is initialized (dialect known): open the folder, write meta."""
        assert self.root is not None
        folder = self._new_folder(self.root)
        self.folder = folder
        _ACTIVE.add(folder)
        self._events = open(folder / "events.jsonl", "w", encoding="utf-8")
        self._units = open(folder / "units.jsonl", "w", encoding="utf-8")
        self._user = _open_wav(folder / "user.wav", USER_RATE)
        self._model = _open_wav(folder / "model.wav", MODEL_RATE)
        self._timeline = open(folder / TIMELINE_SPOOL, "w", encoding="utf-8")
        dialect = "first" if init.dialect is ev.Dialect.FIRST else "current"
        config = init.config.given()
        voices: dict[str, str] = {}
        for name, pcm in (("ref_audio", init.ref_audio), ("tts_ref_audio", init.tts_ref_audio)):
            if pcm:
                (folder / f"{name}.wav").write_bytes(float32_wav(pcm))
                voices[name] = f"{name}.wav"
        self._meta = {
            "format": FORMAT_VERSION,
            "session_id": self.session_id,
            "recording_id": folder.name,
            "mode": self.mode,
            "dialect": dialect,
            "path": self.path,
            "query": self.query,
            "started_at": _iso(self._wall0),
            "started_unix": round(self._wall0, 3),
            "ended_at": None,
            "ended_unix": None,
            "close_reason": None,
            "client_close_reason": None,
            "system_prompt": init.system_prompt,
            # The settings as sent, and the system prompt (where the reference server's
            # meta.json has it).
            "config": {**config, "system_prompt": init.system_prompt},
            "max_slice_nums": init.max_slice_nums,
            "voices": voices,
            "units": 0,
            # The reference server's names for what its clients read.
            "app_type": self._app_type(),
            "created_at": _iso(self._wall0),
            "title": "Session " + datetime.fromtimestamp(self._wall0, UTC).strftime("%m-%d %H:%M"),
            "duration_s": None,
            "worker_id": None,
            "files": {
                "user.wav": "user audio, 16 kHz mono 16-bit PCM, units back to back",
                "model.wav": "model speech, 24 kHz mono 16-bit PCM, speaking units back to back",
                "in/<seq>.wav": "each unit's exact input, 16 kHz mono 32-bit float WAV",
                "events.jsonl": "every command in and event out; audio as file references",
                "units.jsonl": "per-unit kind, text, end_of_turn, kv and timings",
            },
        }
        self._write_meta()
        for line in self._pending:
            self._events.write(line)
        self._pending.clear()
        init_event: dict[str, Any] = {
            "type": init.dialect.value,
            "system_prompt": init.system_prompt,
            "config": config,
            "max_slice_nums": init.max_slice_nums,
        }
        init_event.update({k: {"wav": v} for k, v in voices.items()})
        self._log("in", init_event)

    @property
    def recording_id(self) -> str | None:
        """The folder's name once recording started (the id clients fetch it by)."""
        return self.folder.name if self.enabled and self.folder is not None else None

    def _new_folder(self, root: Path) -> Path:
        """Create this session's folder: named by the session id where that is a valid,
        unused recording id, else by its valid characters and a random suffix."""
        base = re.sub(r"[^A-Za-z0-9_-]", "_", self.session_id)[:100] or "session"
        name = base
        for _ in range(8):
            folder = root / name
            try:
                (folder / "in").mkdir(parents=True, exist_ok=False)
            except FileExistsError:
                name = f"{base}-{secrets.token_hex(4)}"
                continue
            return folder
        raise FileExistsError(f"no free recording folder for session {self.session_id}")

    @_guarded
    def append(self, cmd: ev.AppendCommand, dialect: ev.Dialect | None) -> None:
        """One input unit, before it goes to the worker (its seq is the next one)."""
        if self.folder is None:
            return
        self._seq += 1
        seq = self._seq
        self._received[seq] = time.monotonic()
        self._received_ms[seq] = (self._received[seq] - self._t0) * 1000.0
        name = f"in/{seq:06d}.wav"
        (self.folder / name).write_bytes(float32_wav(cmd.pcm))
        pcm16 = _pcm16(np.frombuffer(cmd.pcm, dtype="<f4"))
        assert self._user is not None
        self._user.writeframes(pcm16)
        if self._turn_based():
            self._inputs[seq] = cmd.pcm
        else:
            _write_pcm16_wav(self.folder / _user_audio(seq), pcm16, USER_RATE)
        kind = "input_audio_buffer.append" if dialect is ev.Dialect.FIRST else "input.append"
        self._log(
            "in",
            {
                "type": kind,
                "seq": seq,
                "audio": {"wav": name, "samples": len(cmd.pcm) // 4},
                "frames": len(cmd.frames),
                "force_listen": cmd.force_listen,
                "max_slice_nums": cmd.max_slice_nums,
            },
        )

    @_guarded
    def close_command(self, cmd: ev.CloseCommand) -> None:
        """The client asked to close."""
        self._client_reason = cmd.reason
        self._log("in", {"type": "session.close", "reason": cmd.reason})

    @_guarded
    def output(self, out: ev.Output) -> None:
        """One unit's result, before it is rendered and sent: model audio and timings."""
        if self.folder is None:
            return
        now = time.monotonic()
        if out.pcm:
            n = len(out.pcm) // 4
            self._model_ref = (out.seq, self._model_samples, n)
            assert self._model is not None
            self._model.writeframes(_pcm16(np.frombuffer(out.pcm, dtype="<f4")))
            self._model_samples += n
        assert self._units is not None
        for dropped in out.dropped_seqs:
            self._units.write(json.dumps({"seq": dropped, "kind": "dropped"}) + "\n")
        received = self._received.pop(out.seq, None)
        t = out.timings_ms
        unit = {
            "seq": out.seq,
            "kind": "listen" if out.is_listen else "speak",
            "text": out.text,
            "end_of_turn": out.end_of_turn,
            "kv": out.kv_cache_length,
            "prefill_ms": round(t.get("prefill_ms", 0.0), 2),
            "generate_ms": round(t.get("generate_ms", 0.0), 2),
            "wall_clock_ms": round(t.get("wall_clock_ms", 0.0), 2),
            "edge_ms": None if received is None else round((now - received) * 1000.0, 2),
            "audio_samples": len(out.pcm) // 4,
        }
        if out.early:  # a reply's start sent between units: unit `seq` had listened
            unit["early"] = True
        self._units.write(json.dumps(unit, ensure_ascii=False) + "\n")
        if self._turn_based():
            self._turn_step(out)
        else:
            self._chunk(out)
        self._forget_through(out.seq)
        if now - self._last_flush > 5.0:  # bounded loss on a crash, no fsync
            self._last_flush = now
            assert self._events is not None  # opened with _units by start
            self._events.flush()
            self._units.flush()
            if self._timeline is not None:
                self._timeline.flush()

    @_guarded
    def outbound(self, event: dict[str, Any]) -> None:
        """An event as sent to the client (not modified; audio replaced in the copy)."""
        if event.get("type") == "session.closed":
            self._closed_reason = event.get("reason")
        # Realtime events carry audio as `audio`, the flat dialects' as `audio_data`.
        for key in ("audio", "audio_data"):
            audio = event.get(key)
            if not isinstance(audio, str) or not audio:
                continue
            event = dict(event)
            seq = (event.get("metrics") or {}).get("seq")
            ref = self._model_ref
            if ref is not None and ref[0] == seq:
                event[key] = {"wav": "model.wav", "start": ref[1], "samples": ref[2]}
            else:
                event[key] = {"omitted_bytes": _b64_len(audio)}
        self._log("out", event)

    def finish(self, worker_id: str = "") -> None:
        """The connection is over: close the files, complete meta.json and write
        recording.json (`worker_id`: the worker that served the session, when known)."""
        if self.enabled and self.folder is not None:
            try:
                now = time.time()
                self._meta.update(
                    ended_at=_iso(now),
                    ended_unix=round(now, 3),
                    close_reason=self._closed_reason or ev.CLIENT_CLOSED,
                    client_close_reason=self._client_reason,
                    units=self._seq,
                    duration_s=round(now - self._wall0, 1),
                    worker_id=worker_id,
                )
                self._close_files()
                self._write_meta()
                self._write_recording_json(worker_id)
                log.info("session %s recorded in %s", self.session_id, self.folder)
            except Exception:
                log.exception("session %s: recording not finished", self.session_id)
        self._disable()

    # ---- internals -------------------------------------------------------------

    def _forget_through(self, seq: int) -> None:
        """Results come in seq order: a unit at or before `seq` that still has a receive
        time got no result of its own (dropped, or heard with a later unit) and never will."""
        for times in (self._received, self._received_ms):
            while times and (oldest := next(iter(times))) <= seq:
                del times[oldest]

    def _app_type(self) -> str:
        """The reference server's app type of this session."""
        if urlsplit(self.path).path.startswith("/ws/half_duplex"):
            return "half_duplex_audio"
        return "omni_duplex" if self.mode == "video" else "audio_duplex"

    def _turn_based(self) -> bool:
        """Half-duplex calls are recorded turn by turn, as the reference server does."""
        return self._app_type() == "half_duplex_audio"

    def _turn_step(self, out: ev.Output) -> None:
        """recording.json's turns: the units heard since the last reply are the user's turn
        (`user_audio/<turn>.wav`); the speaking units up to the end of the turn are the
        reply (`ai_audio/turn_<turn>.wav`)."""
        assert self.folder is not None
        # Earlier units without a result of their own: dropped by the worker, or heard with
        # this one (a half-duplex call joins the units that waited for a slow engine).
        for seq in sorted(s for s in self._inputs if s < out.seq):
            self._heard.append(self._inputs.pop(seq))
        heard = self._inputs.pop(out.seq, b"")
        # The pieces of an answer the worker goes on with by itself answer no unit of ours
        # (they carry the seq of the one that began it): timed as they come.
        received_ms = self._received_ms.pop(out.seq, None)
        if received_ms is None:
            received_ms = (time.monotonic() - self._t0) * 1000.0
        if out.is_listen and self._reply is None:
            self._heard.append(heard)
            return
        if self._reply is None:  # the unit that ended the user's turn
            self._heard.append(heard)
            said = b"".join(self._heard)
            self._heard.clear()
            name = f"user_audio/{self._turn:03d}.wav"
            _write_pcm16_wav(self.folder / name, _pcm16(np.frombuffer(said, "<f4")), USER_RATE)
            duration_ms = round(len(said) / 4 / USER_RATE * 1000)
            self._reply = {
                "turn_index": self._turn,
                "request_ts_ms": round(received_ms, 1),
                "input": {"type": "voice", "duration_ms": duration_ms, "audio": name},
                "text": [],
                "speech": [],
            }
        reply = self._reply
        reply["text"].append(out.text)
        reply["speech"].append(out.pcm)
        if not out.end_of_turn:
            return
        output: dict[str, Any] = {"text": "".join(reply["text"])}
        speech = b"".join(reply["speech"])
        if speech:
            name = f"ai_audio/turn_{self._turn}.wav"
            pcm16 = _pcm16(np.frombuffer(speech, "<f4"))
            _write_pcm16_wav(self.folder / name, pcm16, MODEL_RATE)
            output["audio"] = name
            output["audio_duration_ms"] = round(len(speech) / 4 / MODEL_RATE * 1000)
        self._entry(
            {
                "turn_index": reply["turn_index"],
                "request_ts_ms": reply["request_ts_ms"],
                "input": reply["input"],
                "output": output,
                "timing": {
                    "elapsed_ms": round(received_ms - reply["request_ts_ms"], 1),
                    "speech_input_ms": reply["input"]["duration_ms"],
                },
            }
        )
        self._reply = None
        self._turn += 1

    def _chunk(self, out: ev.Output) -> None:
        """recording.json's entry for one answered unit (and its speech file)."""
        assert self.folder is not None
        timing: dict[str, Any] = {
            key: round(out.timings_ms[key], 1)
            for key in ("prefill_ms", "generate_ms", "wall_clock_ms")
            if key in out.timings_ms
        }
        timing["kv_cache_length"] = out.kv_cache_length
        result: dict[str, Any] = {"mode": "LISTEN" if out.is_listen else "SPEAK", "timing": timing}
        if out.early:  # sent after this unit's own entry, before the next unit's
            result["early"] = True
        if not out.is_listen:
            if out.text:
                result["text"] = out.text
            if out.pcm:
                name = f"ai_audio/turn_{self._turn}_chunk_{self._speak_in_turn:03d}.wav"
                self._speak_in_turn += 1
                pcm16 = _pcm16(np.frombuffer(out.pcm, dtype="<f4"))
                _write_pcm16_wav(self.folder / name, pcm16, MODEL_RATE)
                result["ai_audio"] = name
                result["ai_audio_duration_ms"] = round(len(out.pcm) / 4 / MODEL_RATE * 1000)
            if out.end_of_turn:
                result["end_of_turn"] = True
                self._turn += 1
                self._speak_in_turn = 0
        if out.early:  # after its unit's own entry: that unit's receive time
            received_ms = self._chunk_received_ms
        else:
            received_ms = self._chunk_received_ms = self._received_ms.pop(out.seq, 0.0)
        self._entry(
            {
                "index": out.seq - 1,
                "receive_ts_ms": round(received_ms, 1),
                "user_audio": _user_audio(out.seq),
                "result": result,
            }
        )

    def _entry(self, entry: dict[str, Any]) -> None:
        """One timeline entry of recording.json, onto the spool."""
        assert self._timeline is not None  # opened by start
        self._timeline.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def _write_recording_json(self, worker_id: str) -> None:
        """recording.json from the spooled timeline, entry by entry (the whole timeline is
        never in memory); the spool is removed after."""
        assert self.folder is not None
        head = {
            "session_id": self.folder.name,
            "mode": "half_duplex_audio" if self._turn_based() else "duplex",
            "worker_id": worker_id,
            "start_ts": self._meta["started_at"],
            "config": dict(self._meta["config"]),
        }
        key = "turns" if self._turn_based() else "chunks"
        spool = self.folder / TIMELINE_SPOOL
        tmp = self.folder / "recording.json.tmp"
        with open(tmp, "w", encoding="utf-8") as out:
            # The head's keys, then the timeline's list: the same object json.dumps would
            # write, one entry a line.
            out.write(json.dumps(head, ensure_ascii=False)[:-1] + f', "{key}": [')
            first = True
            if spool.exists():
                with open(spool, encoding="utf-8") as entries:
                    for line in entries:
                        out.write(("\n" if first else ",\n") + line.rstrip("\n"))
                        first = False
            out.write("\n]}\n")
        os.replace(tmp, self.folder / "recording.json")
        spool.unlink(missing_ok=True)

    def _log(self, direction: str, event: dict[str, Any]) -> None:
        now = time.monotonic()
        line = (
            json.dumps(
                {
                    "t": round(now - self._t0, 6),
                    "wall": round(time.time(), 6),
                    "dir": direction,
                    "event": event,
                },
                ensure_ascii=False,
                separators=(",", ":"),
            )
            + "\n"
        )
        if self._events is None:
            if len(self._pending) < _MAX_PENDING:
                self._pending.append(line)
            return
        self._events.write(line)

    def _write_meta(self) -> None:
        assert self.folder is not None
        tmp = self.folder / "meta.json.tmp"
        tmp.write_text(json.dumps(self._meta, indent=2, ensure_ascii=False) + "\n")
        os.replace(tmp, self.folder / "meta.json")

    def _close_files(self) -> None:
        for f in (self._events, self._units, self._user, self._model, self._timeline):
            if f is not None:
                try:
                    f.close()
                except Exception:
                    log.debug("session %s: closing a recording file failed", self.session_id)
        self._events = self._units = self._user = self._model = self._timeline = None

    def _disable(self) -> None:
        self.enabled = False
        self._pending.clear()
        self._close_files()
        if self.folder is not None:
            _ACTIVE.discard(self.folder)


def _open_wav(path: Path, rate: int) -> wave.Wave_write:
    w = wave.open(str(path), "wb")
    w.setnchannels(1)
    w.setsampwidth(2)
    w.setframerate(rate)
    return w


# ---- retention --------------------------------------------------------------------


def _folder_usage(folder: Path) -> tuple[int, float]:
    """(bytes, newest modification time) of everything under a folder."""
    size, newest = 0, 0.0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:
                continue
            size += st.st_size
            newest = max(newest, st.st_mtime)
    return size, newest or folder.stat().st_mtime


def prune(
    root: Path,
    max_age_s: float,
    max_bytes: int,
    now: float | None = None,
    active: set[Path] | None = None,
) -> list[str]:
    """Delete recordings (folders holding a meta.json) older than `max_age_s` (by their
    newest file), then the oldest until the rest fit in `max_bytes`. Folders still being
    recorded are never deleted. Returns the names removed."""
    now = time.time() if now is None else now
    active = _ACTIVE if active is None else active
    if not root.is_dir():
        return []
    entries = []
    for child in root.iterdir():
        if child.is_symlink() or not child.is_dir() or not (child / "meta.json").is_file():
            continue  # not a recording: never touched
        size, newest = _folder_usage(child)
        entries.append((newest, child.name, size, child))
    entries.sort()
    removed: list[str] = []
    kept = []
    for newest, name, size, child in entries:
        if now - newest > max_age_s and child not in active:
            shutil.rmtree(child, ignore_errors=True)
            removed.append(name)
        else:
            kept.append((newest, name, size, child))
    total = sum(e[2] for e in kept)
    for _newest, name, size, child in kept:
        if total <= max_bytes:
            break
        if child in active:
            continue
        shutil.rmtree(child, ignore_errors=True)
        removed.append(name)
        total -= size
    return removed


def start_retention(config: Any, interval_s: float = 3600.0) -> asyncio.Task | None:
    """When the edge records: prune now (off the loop), then every `interval_s`."""
    if not getattr(config, "record_dir", None):
        return None
    root = Path(config.record_dir)
    root.mkdir(parents=True, exist_ok=True)
    max_age_s = config.record_max_age_days * 86400.0
    max_bytes = config.record_max_bytes

    async def loop() -> None:
        while True:
            try:
                removed = await asyncio.to_thread(prune, root, max_age_s, max_bytes)
                if removed:
                    log.info("retention: removed %d recordings from %s", len(removed), root)
            except Exception:
                log.exception("retention: pruning %s failed", root)
            await asyncio.sleep(interval_s)

    task = asyncio.get_running_loop().create_task(loop())
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)
    log.info(
        "recording sessions into %s (max age %.1f days, max %d bytes)",
        root,
        config.record_max_age_days,
        max_bytes,
    )
    return task
