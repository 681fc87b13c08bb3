"""The half-duplex voice call `/ws/half_duplex/{session_id}`, as the reference server offers
it: the user speaks, the server hears the end of the turn, the model answers with streamed
text and speech while the user's input is ignored, and the conversation (the model's
context) goes on across turns.

Client: `prepare{system_content | system_prompt, config{tts{enabled}, ...}, ref_audio_base64?}`
(`system_content`, the reference page's form: text parts joined into the system prompt, the
first audio part the reference voice),
`audio_chunk{audio_base64}` (float32 16 kHz, any length up to 30 s; the reference pages send
0.5 s), `stop`. Server: `queued` /
`queue_update` / `queue_done`, `prepared{session_id, timeout_s, recording_session_id, notes?}`,
`vad_state{speaking}`, `generating{speech_duration_ms}`, `chunk{text_delta, audio_data}`,
`turn_done{turn_index, text}` (turn_index: the turns answered so far, 1 after the first),
`stopped`, `timeout{reason}`, `error{error}`.

How it runs on the fabric: as a session of the worker's engine marked `half_duplex`, so every
engine serves it. MiniCPM-o answers through its turn-based streaming chat path (silero-vad
finds the turn, the turn's audio is prefilled whole, the context goes on across turns:
worker/engines/minicpmo/half_duplex.py); the reference engine and the synthetic one take
turns as in a duplex session. The input is a stream, not units: chunks shorter than the
leased worker's shortest unit wait for the next ones, longer ones go in units it serves.
From the engine's first speaking unit the reply streams with no input at all: the worker
goes on with the answer by itself (worker/session.py: it feeds the engine silent units of
its own, back to back, and streams each piece as a result under the seq of the unit that
began the answer) until the engine ends its turn. The reply waits for neither the client,
which stops sending audio while it plays the answer, nor the edge, which sends nothing per
piece (it used to send one second of silence after each piece: a round trip to the worker
per piece). `audio_chunk` during the answer is ignored, as the protocol says (a unit already
on its way when the answer began is dropped by the worker).
`vad_state` comes from the input's energy (RMS above 0.01), reported with the unit's answer.
`config.session.timeout_s` (default 180 s) ends the call after that long without an
`audio_chunk` (`timeout{elapsed_s}`). `config.vad` (`threshold`, `min_speech_duration_ms`,
`min_silence_duration_ms`) goes to engines that find the end of the turn by voice activity
(the reference engine, MiniCPM-o's calls); `speech_pad_ms` is not used (the engine keeps
its own margins).
`config.generation`: `temperature` and `length_penalty` go to the engine as session
settings; `max_new_tokens` (default 256, as the reference server's) ends an answer once its
tokens reach it: it goes to the worker as the session's `max_tokens`, which in a half-duplex
session caps each answer (the worker's next silent unit carries force_listen, as the
external stop's unit does). The external stop (POST /api/half_duplex/stop) sends the worker
one force_listen unit; the worker's next piece of the answer takes it and ends the turn.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from omnifabric.edge import events as ev
from omnifabric.edge import fields, pcm
from omnifabric.edge.cadence import CUT
from omnifabric.edge.dialects.base import DuplexDialect, Traits
from omnifabric.edge.dialects.legacy_duplex import (
    end_json,
    error_json,
    error_text,
    path_id_refusal,
    queue_json,
)
from omnifabric.edge.errors import EdgeError, InvalidPayload, MissingField, UnknownEvent

#: The call ends after this long without an audio_chunk (config.session.timeout_s; the
#: reference server's default), and the most accepted, seconds.
TIMEOUT_S = 180.0
MAX_TIMEOUT_S = 3600.0
#: An answer's tokens at most unless `config.generation.max_new_tokens` says otherwise (the
#: reference server's default).
MAX_NEW_TOKENS = 256
#: The longest audio_chunk taken, 16 kHz samples: 30 s, the most of a turn a worker hears
#: as one unit; a longer message is refused whole.
MAX_CHUNK_SAMPLES = 30 * 16000


def system_content(value: Any) -> tuple[list[str], bytes]:
    """The reference server's `system_content` ([{type: "text", text}, {type: "audio", data:
    base64 float32 16 kHz}], in any order): its texts, and its first audio as the reference
    voice (b"" when it has none; later audio parts are not used)."""
    if not isinstance(value, list):
        raise InvalidPayload("'system_content' must be a list of {type, text|data} parts")
    texts: list[str] = []
    audio = b""
    for i, part in enumerate(value):
        where = f"system_content[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text", "")
            if not isinstance(text, str):
                raise InvalidPayload(f"{where}.text must be a string")
            if text:
                texts.append(text)
        elif kind == "audio":
            data = part.get("data")
            if data and not audio:  # the reference page sends null until a voice is loaded
                audio = pcm.reference_audio(data, f"{where}.data")
        else:
            raise InvalidPayload(
                f"{where} must be {{type: 'text', text}} or {{type: 'audio', data}}"
            )
    return texts, audio


class HalfDuplex(DuplexDialect):
    """/ws/half_duplex/{session_id}."""

    name = "half_duplex"
    #: Its own app (edge.apps): switched on and off apart from audio duplex. Its stream of
    #: chunks is cut into the worker's units by the driver's cadence (edge.cadence).
    traits = Traits(
        recorded=True,
        already_initialized="the session is already prepared",
        app_mode="half_duplex",
        cadence=CUT,
    )

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.mode = "audio"
        self._stopping = False
        self._answering = False
        self._speaking = False
        self._speech_ms = 0
        self._turn_index = 0
        self._turn_text = ""
        self._speech_seqs: set[int] = set()
        self._timeout_s = TIMEOUT_S
        self._asked_timeout_s = TIMEOUT_S
        """What the last prepare taken by this dialect asked (the call's once created)."""
        self._last_chunk = 0.0
        self._prepared = False
        self._answer_began = False
        """An answer began with the last output: the audio held before it is dropped."""

    def refusal(self) -> EdgeError | None:
        return path_id_refusal(self.session_id)

    def not_ready(self, cmd: ev.Command) -> str:
        return "send prepare and wait for prepared before audio_chunk"

    # ---- client -> commands -------------------------------------------------------------

    def decode(self, message: Any) -> list[ev.Command]:
        if isinstance(message, bytes):
            raise InvalidPayload("binary frames are not part of the protocol")
        event = fields.parse_frame(message)
        kind = event["type"]
        if kind == "audio_chunk":
            audio = event.get("audio_base64", event.get("audio"))
            if audio is None:
                raise MissingField("'audio_base64' is required")
            # Any length, none too: a stream's chunk may be empty.
            raw = b"" if audio == "" else pcm.unit_pcm(audio, "audio_base64")
            if len(raw) // 4 > MAX_CHUNK_SAMPLES:
                raise InvalidPayload(
                    f"audio_base64: {len(raw) // 4} samples; an audio_chunk carries at most "
                    f"{MAX_CHUNK_SAMPLES} (30 s)"
                )
            # Every chunk restarts the inactivity timer, also one ignored during an answer.
            self._last_chunk = time.monotonic()
            idle: list[ev.Command] = (
                [ev.PauseCommand(self._timeout_s, idle=True)] if self._prepared else []
            )
            if self._answering:
                return idle  # the model is answering: input is ignored (no echo of its voice)
            return [ev.AudioCommand(np.frombuffer(raw, "<f4")), *idle]
        if kind == "prepare":
            return [self._prepare(event)]
        if kind == "stop":
            self._stopping = True
            return [ev.CloseCommand()]
        raise UnknownEvent(f"unknown message type {kind[:64]!r}")

    def _prepare(self, event: dict[str, Any]) -> ev.InitCommand:
        prompt = event.get("system_prompt", "")
        if prompt is None:
            prompt = ""
        if not isinstance(prompt, str):
            raise InvalidPayload("'system_prompt' must be a string")
        ref = event.get("ref_audio_base64")
        ref_audio = pcm.reference_audio(ref, "ref_audio_base64") if ref else b""
        content = event.get("system_content")
        if content is not None:
            texts, audio = system_content(content)
            prompt = "\n".join(t for t in (prompt, *texts) if t)
            ref_audio = ref_audio or audio
        cfg = fields.obj(event, "config")
        timeout = fields.number_field(
            fields.obj(cfg, "session"), "timeout_s", 1.0, MAX_TIMEOUT_S, "config.session"
        )
        settings = self._settings(cfg)
        init = ev.InitCommand(
            dialect=ev.Dialect.CURRENT,
            system_prompt=prompt,
            config=settings,
            ref_audio=ref_audio,
            ref_audio_id=fields.voice_id((event,), "ref_audio_id", "ref_audio_base64"),
        )
        # The call's timeout changes when the session is created (``encode``): a prepare
        # refused here or by the session (a second one) leaves the call as it was.
        self._asked_timeout_s = self._timeout_s if timeout is None else timeout
        return init

    def _settings(self, cfg: dict[str, Any]) -> ev.DuplexSettings:
        """The session's settings from `config.tts`, `config.generation` and `config.vad`."""
        generation = fields.obj(cfg, "generation")
        sampling = {
            k: generation.get(k) for k in ("temperature", "length_penalty", "top_p", "top_k")
        }
        settings = fields.duplex_settings(sampling, "config.generation")
        cap = fields.integer_field(
            generation, "max_new_tokens", 1, fields.MAX_CONTEXT_TOKENS, "config.generation"
        )
        vad = fields.obj(cfg, "vad")

        def ms(key: str, bounds: tuple[int, int]) -> int | None:
            value = fields.number_field(vad, key, *bounds, "config.vad")
            return None if value is None else round(value)

        return dataclasses.replace(
            settings,
            tts_enabled=fields.flag(fields.obj(cfg, "tts"), "enabled", "config.tts"),
            vad_threshold=fields.number_field(
                vad, "threshold", *fields.VAD_THRESHOLD, "config.vad"
            ),
            min_speech_ms=ms("min_speech_duration_ms", fields.MIN_SPEECH_MS),
            end_of_turn_silence_ms=ms("min_silence_duration_ms", fields.END_OF_TURN_SILENCE_MS),
            half_duplex=True,
            # A half-duplex session's max_tokens caps each answer (the worker ends it).
            max_tokens=MAX_NEW_TOKENS if cap is None else cap,
        )

    def appended(self, seq: int, cmd: ev.AppendCommand) -> None:
        samples = np.frombuffer(cmd.pcm, "<f4")
        if pcm.holds_speech(samples):
            self._speech_seqs.add(seq)
            self._speech_ms += samples.size * 1000 // 16000

    def stop_turn(self) -> list[ev.Command]:
        """An external stop (POST /api/half_duplex/stop): while the model answers, a unit
        with force_listen ends its turn (the worker's next piece of the answer takes it;
        turn_done follows with what was said); nothing to do otherwise."""
        return [ev.EndTurnCommand()] if self._answering else []

    def after_output(self, event: ev.Output) -> list[ev.Command]:
        """The user's last instant before an answer is ignored too (as input during it)."""
        began, self._answer_began = self._answer_began, False
        return [ev.ClearAudioCommand()] if began else []

    # ---- session events -> client -------------------------------------------------------

    def encode(self, event: ev.SessionEvent) -> list[Any]:
        if isinstance(event, ev.Queued | ev.QueueDone):
            return [queue_json(event)]
        if isinstance(event, ev.Created):
            self._timeout_s, self._prepared = self._asked_timeout_s, True
            prepared: dict[str, Any] = {
                "type": "prepared",
                "session_id": self.session_id,
                "timeout_s": self._timeout_s,
                "recording_session_id": event.recording_id,
                "prompt_length": event.prompt_length,
            }
            if event.notes:  # what the engine could not do as asked (settings it ignores)
                prepared["notes"] = list(event.notes)
            return [prepared]
        if isinstance(event, ev.Output):
            return self._output(event)
        if isinstance(event, ev.Paused | ev.Resumed | ev.Expiring):
            return []  # no such events in the reference server's protocol
        assert isinstance(event, ev.Closed)
        if event.client_reason == ev.PAUSE_TIMEOUT:  # no audio_chunk for timeout_s
            elapsed = round(time.monotonic() - self._last_chunk, 1)
            return [{"type": "timeout", "elapsed_s": elapsed, "reason": "timeout"}]
        if self._stopping:
            return [{"type": "stopped", "session_id": self.session_id}]
        return [end_json(event)]

    def _output(self, out: ev.Output) -> list[Any]:
        messages: list[Any] = []
        # This unit and those the worker heard with it (a slow engine joins waiting units).
        heard = {seq for seq in self._speech_seqs if seq <= out.seq}
        heard_speech = bool(heard)
        self._speech_seqs -= heard
        if out.is_listen:
            if heard_speech and not self._speaking and not self._answering:
                self._speaking = True
                messages.append({"type": "vad_state", "speaking": True})
            if self._answering and out.end_of_turn:
                messages += self._turn_done()
            return messages
        if not self._answering:
            self._answering = True
            self._answer_began = True
            if self._speaking:
                messages.append({"type": "vad_state", "speaking": False})
            self._speaking = False
            messages.append({"type": "generating", "speech_duration_ms": self._speech_ms})
            self._speech_ms = 0
            self._turn_text = ""
        self._turn_text += out.text
        messages.append(
            {
                "type": "chunk",
                "text_delta": out.text,
                "audio_data": pcm.encode_pcm(out.pcm) if out.pcm else None,
            }
        )
        if out.end_of_turn:
            messages += self._turn_done()
        return messages

    def _turn_done(self) -> list[Any]:
        self._turn_index += 1  # the turns answered so far, as the reference server counts
        done = {"type": "turn_done", "turn_index": self._turn_index, "text": self._turn_text}
        self._answering = False
        self._turn_text = ""
        self._speech_seqs.clear()
        return [done]

    def error(self, err: EdgeError) -> dict[str, Any]:
        return error_json(error_text(err))
