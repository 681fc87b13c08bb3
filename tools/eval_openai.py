"""One spoken-question session of `omnifabric eval --dialect openai`: the OpenAI Realtime
dialect as its clients speak it.

The question's 16 kHz audio is converted to 24 kHz PCM16 here with a polyphase low-pass
(scipy's resample_poly), so what is under test is the server's own 24 -> 16 kHz conversion
on the way to the engine. The session keeps the server's turn detection (server VAD, the
default), streams the audio in real time in 100 ms `input_audio_buffer.append`s, as a
microphone would, then silence until the reply to the last question has ended. It keeps
the engine's transcripts of the user (`conversation.item.input_audio_transcription
.completed`) and each response's audio deltas (24 kHz PCM16) with their arrival times and
its transcript; eval_reference scores them as it scores the MiniCPM-o dialect's sessions.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np

from omnifabric.tools.eval_outcome import OUTPUT_RATE, Outcome, time_reply

INPUT_RATE = 24000
#: Seconds of audio in one append (a microphone's buffer).
CHUNK_S = 0.1
#: The instructions the MiniCPM-o dialect's eval sessions get (tools.client's default).
INSTRUCTIONS = "You are a helpful assistant."


@dataclass
class Reply:
    """One response: when it was created, its audio as it arrived, its transcript."""

    created_at: float
    chunks: list[tuple[float, bytes]] = field(default_factory=list)
    """(arrival time, PCM16 24 kHz bytes) per audio delta."""
    text: str = ""
    done: bool = False


@dataclass
class Conversation:
    """What one session heard and got back (times are time.monotonic())."""

    origin: float = 0.0
    """When stream second 0 would have been sent: a chunk goes out when it is complete."""
    transcripts: list[str] = field(default_factory=list)
    replies: dict[str, Reply] = field(default_factory=dict)
    error: str = ""

    def replies_after(self, stream_s: float) -> list[Reply]:
        """The responses created after stream second `stream_s`, in order."""
        at = self.origin + stream_s
        return [r for r in self.replies.values() if r.created_at > at]

    def answered(self, stream_s: float) -> bool:
        """A response created after `stream_s` has ended and none is in progress."""
        after = self.replies_after(stream_s)
        return bool(after) and all(r.done for r in self.replies.values())


def openai_url(url: str) -> str:
    """The edge's /v1/realtime URL with a `model` parameter (what selects this dialect);
    one that names a model already is kept."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query.setdefault("model", "eval")
    return urlunsplit(parts._replace(query=urlencode(query)))


def pcm16_24k(audio: np.ndarray, rate: int) -> bytes:
    """Float audio at 16 kHz (converted by a polyphase low-pass: no aliasing added here) or
    at 24 kHz (as it is) as 24 kHz PCM16."""
    from scipy.signal import resample_poly

    if rate not in (16000, INPUT_RATE):
        raise ValueError(f"questions come at 16 or 24 kHz, not {rate} Hz")
    if rate != INPUT_RATE:
        audio = resample_poly(audio, 3, 2)
    return np.round(np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def pcm16_float(raw: bytes) -> np.ndarray:
    """PCM16 bytes as float32 in [-1, 1)."""
    return np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0


#: Events about a response's output, with the response's id in `response_id`.
_OUTPUT = ("response.output_audio.delta", "response.output_audio_transcript.delta")


def note(event: dict[str, Any], talk: Conversation, now: float) -> None:
    """Keep what a server event says about the question and the replies."""
    kind = event.get("type")
    if kind == "conversation.item.input_audio_transcription.completed":
        talk.transcripts.append(str(event.get("transcript") or ""))
    elif kind == "response.created":
        talk.replies[event["response"]["id"]] = Reply(now)
    elif kind == "error":
        talk.error = str((event.get("error") or {}).get("message") or event)
    elif kind == "response.done":
        reply = talk.replies.get(event["response"]["id"])
        if reply is not None:
            reply.done = True
    elif kind in _OUTPUT and (reply := talk.replies.get(str(event.get("response_id")))):
        if kind == "response.output_audio.delta":
            reply.chunks.append((now, base64.b64decode(event["delta"])))
        else:
            reply.text += str(event.get("delta") or "")


async def converse(url: str, pcm: bytes, last_start_s: float, tail_s: float) -> Conversation:
    """One session: `pcm` (24 kHz PCM16) streamed in real time, then silence until the
    reply to the question that starts at stream second `last_start_s` has ended, or
    `tail_s` seconds after the audio."""
    from websockets.asyncio.client import connect

    talk = Conversation()
    step = int(INPUT_RATE * CHUNK_S) * 2  # bytes
    silence = bytes(step)
    async with connect(openai_url(url), max_size=None, open_timeout=30) as ws:
        session = {"type": "realtime", "instructions": INSTRUCTIONS}
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        async for raw in ws:
            event = json.loads(raw)
            note(event, talk, time.monotonic())
            if event["type"] in ("session.updated", "error"):
                break
        if talk.error:
            return talk
        reader = asyncio.ensure_future(_read(ws, talk))
        try:
            await _stream(ws, talk, pcm, step, silence, last_start_s, tail_s, reader)
        finally:
            reader.cancel()
    return talk


async def _read(ws: Any, talk: Conversation) -> None:
    async for raw in ws:
        note(json.loads(raw), talk, time.monotonic())


async def _stream(
    ws: Any,
    talk: Conversation,
    pcm: bytes,
    step: int,
    silence: bytes,
    last_start_s: float,
    tail_s: float,
    reader: asyncio.Future[None],
) -> None:
    """Appends in real time: the input's chunks, then silence while the reply comes."""
    talk.origin = time.monotonic() + 0.05
    chunks = -(-len(pcm) // step)
    k = 0
    while not reader.done():
        if k < chunks:
            chunk = pcm[k * step : (k + 1) * step]
        elif k < chunks + tail_s / CHUNK_S and not talk.answered(last_start_s):
            chunk = silence
        else:
            break
        await asyncio.sleep(max(0.0, talk.origin + (k + 1) * CHUNK_S - time.monotonic()))
        body = {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}
        await ws.send(json.dumps(body))
        k += 1
    if reader.done() and not talk.error and not talk.answered(last_start_s):
        failure = reader.exception()
        talk.error = f"connection closed: {failure!r}" if failure else "connection closed"


async def session(
    out: Outcome, url: str, units: list[np.ndarray], start_s: float, end_s: float, tail_s: int
) -> np.ndarray:
    """eval_reference's session in this dialect: `units` (1 s each, at 16 or 24 kHz; the
    question from stream second `start_s` to `end_s`) as one stream; what the engine heard,
    the reply's text and timing go into `out`; returns the reply's audio (24 kHz float)."""
    rate = units[0].size if units else INPUT_RATE
    talk = await converse(url, pcm16_24k(np.concatenate(units), rate), start_s, tail_s)
    out.error = talk.error
    out.heard = " / ".join(t for t in talk.transcripts if t)
    replies = talk.replies_after(start_s)
    out.reply_text = "".join(r.text for r in replies).strip()
    arrived = [chunk for r in replies for chunk in r.chunks]
    chunks = [(t, len(raw) / 2 / OUTPUT_RATE) for t, raw in arrived]
    time_reply(out, chunks, talk.origin + end_s)
    return np.concatenate([np.zeros(0, np.float32), *(pcm16_float(raw) for _, raw in arrived)])
