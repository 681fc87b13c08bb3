"""A model-free, deterministic duplex engine with a configurable compute time.

For fabric tests, load tests and capacity planning: it follows the real model's turn
taking (startup protection, listen while the user speaks, reply after a silence, barge-in
and force_listen close the turn) and its context accounting, context windows included (the
oldest units leave the accounting as the model's window would drop them), and answers with
a tone. Its chat turns echo the user, and call a function by fixed rules when offered some
(SyntheticEngine.chat), so the fabric's function calling is tested without a model.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import string
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from omnifabric.common.session_types import ContextWindow
from omnifabric.common.tools import FUNCTION, REQUIRED, argument_errors
from omnifabric.worker.engine import (
    OUTPUT_RATE,
    ChatChunk,
    ChatTurn,
    DuplexSettings,
    Engine,
    EngineSession,
    GenerateResult,
    StepOutcome,
    Stepper,
    StepRow,
    ToolCall,
    ToolChoice,
    ToolSpec,
)

#: A unit is speech when its RMS exceeds this.
SPEECH_RMS = 0.01
#: Context tokens: system prompt overhead, per listening unit, per speaking unit.
PROMPT_OVERHEAD_TOKENS = 13
LISTEN_UNIT_TOKENS = 13
SPEAK_UNIT_TOKENS = 20
#: Usage: input audio tokens per unit, vision tokens per frame slice.
AUDIO_TOKENS_PER_UNIT = 10
VISION_TOKENS_PER_SLICE = 64
#: Output audio token rate of the speech tokenizer (one token per 40 ms).
AUDIO_SAMPLES_PER_TTS_TOKEN = OUTPUT_RATE // 25
#: Samples of the first and last piece of a reply (onset and tail are shorter than 1 s).
FIRST_PIECE_SAMPLES = 18000
LAST_PIECE_SAMPLES = 12000
MAX_TEXT_CHARS = 28


class SyntheticSession(EngineSession):
    """Per-session state only, so sessions may run on different threads at once."""

    def __init__(self, engine: SyntheticEngine, session_id: str, mode: str) -> None:
        self.engine = engine
        self.session_id = session_id
        self.mode = mode
        self.settings = DuplexSettings()
        self.kv_cache_length = 0
        self.units = 0
        self.heard_speech = False
        self.reply_number = 0
        self.reply_part = 0
        """Part of the reply spoken by the next speaking unit; 0 = not replying."""
        self.reply_samples = 0
        self.pending_rms: float | None = None
        self.pending_vision_tokens = 0
        self.needs_finalize = False
        self.closed = False
        self.window = ContextWindow()
        self.prompt_tokens = 0
        self.kept: deque[tuple[int, str]] = deque()
        """Units in the context: their tokens and what the model said in them."""
        self.carried_tokens = 0
        """Context mode: tokens of earlier replies carried forward."""
        self.slides = 0
        """How often the context window slid."""
        self.tools: tuple[ToolSpec, ...] = ()
        self.tool_choice = ToolChoice()
        self.calls = 0
        """Function calls made so far (their ids count them)."""
        self.awaiting = ""
        """The call id whose output the session waits for; "" when none."""
        self.answer = ""
        """A function's output the next reply says."""

    def offer_tools(self, tools: tuple[ToolSpec, ...], choice: ToolChoice) -> tuple[str, ...]:
        """Duplex sessions call too: each user turn's reply is first a call (auto and
        required: the first function; function: the named one), then, once its output came
        (tool_output), a reply that says it ("The result: <output>")."""
        self.tools, self.tool_choice = tools, choice
        return ()

    def tool_output(self, call_id: str, output: str) -> None:
        if call_id != self.awaiting:
            return  # not the call it waits for (an old one): nothing to answer
        self.awaiting, self.answer = "", output
        self.reply_number += 1
        self.reply_part = 1
        self.reply_samples = 0

    def _duplex_call(self) -> ToolCall | None:
        """The call a reply starts with, per offer_tools' rule; None without one."""
        if not self.tools or not self.tool_choice.allows_calls():
            return None
        spec = self.tools[0]
        if self.tool_choice.kind == FUNCTION:
            spec = next((t for t in self.tools if t.name == self.tool_choice.name), spec)
        arguments = json.dumps(_arguments(spec.parameters, "synthetic"))
        if argument_errors(spec, arguments):
            return None
        self.calls += 1
        return ToolCall(f"call_{self.session_id[-8:]}_{self.calls}", spec.name, arguments)

    def _busy(self, share: float) -> float:
        """Spend `share` of the unit's compute time; returns the ms spent."""
        return _spend(self.engine.compute_ms * share / 1000.0, self.engine.cpu_bound)

    def prepare(
        self,
        system_prompt: str,
        ref_audio: np.ndarray | None,
        tts_ref_audio: np.ndarray | None,
        config: DuplexSettings,
    ) -> int:
        self._check_open()
        self.settings = config
        self.notes = config.vad_note()
        self.window = config.window()
        self.prompt_tokens = PROMPT_OVERHEAD_TOKENS + len(system_prompt) // 4
        self.kept.clear()
        self.carried_tokens = 0
        self.kv_cache_length = self.prompt_tokens
        return self.kv_cache_length

    def _account(self, tokens: int, text: str) -> None:
        """A unit's context tokens, and the window's slide when it is due: the oldest units
        go (basic: from past the high watermark down to the low one; context: down to the
        units kept, what they said carried forward as text); the prompt always stays."""
        self.kept.append((tokens, text))
        self.kv_cache_length += tokens
        window = self.window
        if window.mode == "basic" and self.kv_cache_length > window.high_tokens:
            while self.kept and self.kv_cache_length > window.low_tokens:
                self.kv_cache_length -= self.kept.popleft()[0]
            self.slides += 1
        elif window.mode == "context" and len(self.kept) > window.units:
            said = 0
            while len(self.kept) > window.units:
                dropped, spoken = self.kept.popleft()
                self.kv_cache_length -= dropped
                said += len(spoken.split())
            carried = min(window.previous_tokens, self.carried_tokens + said)
            self.kv_cache_length += carried - self.carried_tokens
            self.carried_tokens = carried
            self.slides += 1

    def prefill(
        self, pcm: np.ndarray, frames: list[bytes], max_slice_nums: int
    ) -> dict[str, float]:
        self._check_ready()  # the real model raises too: finalize must run between units
        spent = self._busy(0.5)
        self._take(pcm, frames, max_slice_nums)
        return {"prefill": spent}

    def _take(self, pcm: np.ndarray, frames: list[bytes], max_slice_nums: int) -> None:
        """A unit's input, prefilled (its compute aside)."""
        samples = np.asarray(pcm, dtype=np.float32)
        self.pending_rms = float(np.sqrt(np.mean(np.square(samples)))) if samples.size else 0.0
        self.pending_vision_tokens = len(frames) * max(1, max_slice_nums) * VISION_TOKENS_PER_SLICE

    def generate(self, force_listen: bool) -> GenerateResult:
        self._check_open()
        if self.pending_rms is None:
            raise RuntimeError("generate without a prefilled unit")  # before spending on it
        return self._decide(force_listen, self._busy(0.5))

    def _decide(self, force_listen: bool, spent: float) -> GenerateResult:
        """The prefilled unit's result (its compute aside: `spent` ms of it)."""
        if self.pending_rms is None:
            raise RuntimeError("generate without a prefilled unit")
        speech = self.pending_rms > SPEECH_RMS
        self.pending_rms = None
        self.needs_finalize = True
        self.units += 1
        if self.engine.fail_unit is not None and self.units == self.engine.fail_unit:
            raise RuntimeError(f"injected failure on unit {self.units}")
        if self.engine.hang_unit is not None and self.units == self.engine.hang_unit:
            # Like a stuck kernel: the calling thread does not come back for a long time.
            time.sleep(self.engine.hang_s)
        startup = self.units <= self._force_listen_count()

        if self.reply_part and (force_listen or speech):
            # force_listen or barge-in: close the turn at once; speech starts a new user turn.
            self.reply_part = 0
            self.heard_speech = speech
            return self._listen(spent, end_of_turn=True)
        if self.reply_part:
            return self._speak(spent)
        if force_listen or startup or speech:
            self.heard_speech = self.heard_speech or speech
            return self._listen(spent, end_of_turn=False)
        if self.heard_speech:
            self.heard_speech = False
            call = self._duplex_call()
            if call is not None:  # the reply is a call; its output starts the spoken one
                self.awaiting = call.call_id
                result = self._listen(spent, end_of_turn=True)
                return replace(result, tool_calls=(call,))
            self.reply_number += 1
            self.reply_part = 1
            self.reply_samples = 0
            return self._speak(spent)
        return self._listen(spent, end_of_turn=False)

    def finalize(self) -> None:
        self._check_open()
        if self.engine.finalize_ms:
            time.sleep(self.engine.finalize_ms / 1000.0)
        self.needs_finalize = False

    def _check_ready(self) -> None:
        """The real model's order: open, and the previous unit finalized."""
        self._check_open()
        if self.needs_finalize:
            raise RuntimeError("prefill before the previous unit was finalized")

    def stop(self) -> None:
        self.reply_part = 0

    def close(self) -> None:
        self.closed = True
        self.pending_rms = None

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("engine session is closed")

    def _force_listen_count(self) -> int:
        configured = self.settings.force_listen_count
        return self.engine.force_listen_count if configured is None else configured

    def _listen(self, spent: float, end_of_turn: bool) -> GenerateResult:
        self._account(LISTEN_UNIT_TOKENS, "")
        return self._result(True, "", np.zeros(0, dtype=np.float32), end_of_turn, spent, 0)

    def _speak(self, spent: float) -> GenerateResult:
        part, total = self.reply_part, self.engine.reply_units
        last = part >= total
        text = f"reply {self.reply_number} part {part} "[:MAX_TEXT_CHARS]
        if part == 1 and self.answer:  # a function's output, said whole
            text, self.answer = f"The result: {self.answer} ", ""
        if last:
            samples = LAST_PIECE_SAMPLES
        elif part == 1:
            samples = FIRST_PIECE_SAMPLES
        else:
            samples = OUTPUT_RATE
        audio = np.zeros(0, dtype=np.float32)
        if self.settings.tts_enabled is not False:
            audio = _tone(self.reply_number, self.reply_samples, samples)
        self.reply_samples += samples
        self.reply_part = 0 if last else part + 1
        self._account(SPEAK_UNIT_TOKENS, text)
        n_tokens = len(text.split())
        return self._result(False, text, audio, last, spent, n_tokens)

    def _result(
        self,
        is_listen: bool,
        text: str,
        audio: np.ndarray,
        end_of_turn: bool,
        spent: float,
        n_tokens: int,
    ) -> GenerateResult:
        vision, self.pending_vision_tokens = self.pending_vision_tokens, 0
        return GenerateResult(
            is_listen=is_listen,
            text=text,
            audio=audio,
            end_of_turn=end_of_turn,
            kv_cache_length=self.kv_cache_length,
            costs_ms={"llm": spent, "tts": 0.0, "all": spent},
            n_tokens=n_tokens,
            n_tts_tokens=audio.size // AUDIO_SAMPLES_PER_TTS_TOKEN,
            input_audio_tokens=AUDIO_TOKENS_PER_UNIT,
            input_vision_tokens=vision,
        )


def _spend(seconds: float, cpu_bound: bool) -> float:
    """Be busy `seconds`; returns the ms spent, as measured (a sleep overshoots by ~0.1 ms
    here: that is compute, not the fabric's overhead)."""
    if seconds <= 0:
        return 0.0
    started = time.perf_counter()
    if cpu_bound:
        # This thread's CPU time, as a model's forward spends it: a busy neighbour on the
        # same core slows it down (a sleep would not notice).
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            pass
    else:
        time.sleep(seconds)
    return (time.perf_counter() - started) * 1000.0


class SyntheticStepper(Stepper):
    """The synthetic engine's batched entry: a step of N sessions is busy for one unit's
    compute times 1 + batch_share x (N - 1) (a batched model's step: its weights read once,
    each row adding a little), and every row gets what it would alone."""

    def __init__(self, engine: SyntheticEngine, share: float) -> None:
        self.engine = engine
        self.share = share

    def _scale(self, n: int) -> float:
        return 1.0 + self.share * (n - 1)

    def step(self, rows: Sequence[StepRow]) -> StepOutcome:
        engine = self.engine
        seconds = engine.compute_ms * self._scale(len(rows)) / 1000.0
        half = _spend(seconds / 2, engine.cpu_bound)
        ready: list[SyntheticSession | Exception] = []
        for row in rows:
            try:
                session = _synthetic(row.session)
                session._check_ready()
                session._take(row.pcm, row.frames, row.max_slice_nums)
                ready.append(session)
            except Exception as exc:  # noqa: BLE001 - this row's failure alone
                ready.append(exc)
        spent = _spend(seconds / 2, engine.cpu_bound)
        out: list[tuple[dict[str, float], GenerateResult] | Exception] = []
        for row, taken in zip(rows, ready, strict=True):
            if isinstance(taken, Exception):
                out.append(taken)
                continue
            try:
                out.append(({"prefill": half}, taken._decide(row.force_listen, spent)))
            except Exception as exc:  # noqa: BLE001 - this row's failure alone
                out.append(exc)
        return StepOutcome(out, {"prefill": half, "generate": spent})

    def finalize(self, sessions: Sequence[EngineSession]) -> list[Exception | None]:
        if self.engine.finalize_ms:
            time.sleep(self.engine.finalize_ms * self._scale(len(sessions)) / 1000.0)
        failed: list[Exception | None] = []
        for engine_session in sessions:
            try:
                session = _synthetic(engine_session)
                session._check_open()
                session.needs_finalize = False
                failed.append(None)
            except Exception as exc:  # noqa: BLE001 - this session's failure alone
                failed.append(exc)
        return failed

    def added_cost(self, session_cost: float) -> float:
        """Exactly known: one more row adds batch_share of a unit's compute and finalize."""
        return (self.engine.compute_ms + self.engine.finalize_ms) / 1000.0 * self.share


def _synthetic(session: EngineSession) -> SyntheticSession:
    if not isinstance(session, SyntheticSession):
        raise TypeError(f"not a synthetic engine session: {type(session).__name__}")
    return session


def _tone(reply_number: int, start: int, count: int) -> np.ndarray:
    """`count` samples of the reply's tone from sample `start` (phase-continuous)."""
    freq = 220.0 + 20.0 * (reply_number % 10)
    n = np.arange(start, start + count, dtype=np.float64)
    return (0.2 * np.sin(2.0 * math.pi * freq * n / OUTPUT_RATE)).astype(np.float32)


def _tool_outputs(turn: ChatTurn) -> str:
    """The text of the function outputs that end the turn (several: joined by a space)."""
    outputs: list[str] = []
    for message in reversed(turn.messages):
        if message.role != "tool":
            break
        outputs.insert(0, "".join(p for p in message.parts if isinstance(p, str)))
    return " ".join(outputs)


def _called(turn: ChatTurn, text: str) -> ToolSpec | None:
    """The function the reply calls: required, the first; function, the named one; auto, the
    first whose name has a word of 4+ letters (split on "_") among the user's words."""
    if not turn.tools or not turn.tool_choice.allows_calls():
        return None
    choice = turn.tool_choice
    if choice.kind == REQUIRED:
        return turn.tools[0]
    if choice.kind == FUNCTION:
        return next((t for t in turn.tools if t.name == choice.name), None)
    said = set(re.findall(r"[a-z0-9]+", text.lower()))
    for spec in turn.tools:
        if any(len(w) >= 4 and w in said for w in spec.name.lower().split("_")):
            return spec
    return None


def _tool_call(
    spec: ToolSpec, turn: ChatTurn, said: list[str]
) -> tuple[ToolCall | None, list[str]]:
    """The call of ``spec``, its required arguments filled from their schemas (the user's
    last word for a string), checked: (None, the problems) when they do not fit."""
    arguments = json.dumps(_arguments(spec.parameters, _last_word(said)))
    problems = argument_errors(spec, arguments)
    if problems:
        return None, [f"tool {spec.name}: {p}" for p in problems]
    key = f"{len(turn.messages)}:{spec.name}:{arguments}:{' '.join(said)}"
    call_id = "call_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    return ToolCall(call_id, spec.name, arguments), []


def _last_word(said: list[str]) -> str:
    """The user's last word of 3+ characters, punctuation stripped; "synthetic" if none."""
    words = [w.strip(string.punctuation) for w in " ".join(said).split()]
    return next((w for w in reversed(words) if len(w) >= 3), "synthetic")


def _arguments(schema: dict[str, Any], word: str) -> dict[str, Any]:
    """Each required property of an object schema, filled deterministically."""
    properties = schema.get("properties") or {}
    return {name: _value(properties.get(name) or {}, word) for name in schema.get("required", [])}


def _value(schema: dict[str, Any], word: str) -> Any:
    """A value for one property: its enum's first, else by its (first) type."""
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type", "string")
    kind = (kind[0] if kind else "string") if isinstance(kind, list) else kind
    return {
        "integer": 1,
        "number": 1,
        "boolean": True,
        "array": [],
        "object": {},
        "null": None,
    }.get(kind, word)


class SyntheticEngine(Engine):
    """No model: deterministic replies, `compute_ms` of busy time per unit."""

    name = "synthetic"
    modes = frozenset({"audio", "video", "chat"})
    session_class: type[SyntheticSession] = SyntheticSession

    def __init__(
        self,
        compute_ms: float = 40.0,
        slots: int = 4,
        finalize_ms: float = 0.0,
        threads: int | None = None,
        cpu_bound: bool = False,
        force_listen_count: int = 3,
        reply_units: int = 3,
        fail_unit: int | None = None,
        hang_unit: int | None = None,
        hang_s: float = 3600.0,
        batch_share: float | None = None,
    ) -> None:
        self.compute_ms = compute_ms
        self.finalize_ms = finalize_ms
        """Busy time of each deferred finalize (after the unit's result went out)."""
        self.fail_unit = fail_unit
        """Fault injection for tests: generate() raises on this unit (1-based) of each session."""
        self.hang_unit = hang_unit
        """Fault injection for tests: generate() blocks `hang_s` seconds on this unit."""
        self.hang_s = hang_s
        self.default_slots = slots
        self.concurrency = threads or slots
        """Engine threads: one per slot unless given (fewer time-slice the sessions)."""
        self.cpu_bound = cpu_bound
        """Compute spends CPU time (a spin) instead of sleeping."""
        self.force_listen_count = force_listen_count
        self.reply_units = max(1, reply_units)
        self.batch_share = batch_share
        """Not None: sessions may be stepped together (stepper), each extra one adding this
        share of a unit's compute to the step."""

    def stepper(self) -> SyntheticStepper | None:
        """Batched steps when a batch share was given."""
        return None if self.batch_share is None else SyntheticStepper(self, self.batch_share)

    def load(self) -> None:
        """Nothing to load."""

    def cost_estimate(self, mode: str, warmup_s: float) -> float:
        """Exactly known: a unit's compute and its finalize per second of audio (units of
        1 s); a chat turn holds a thread."""
        if mode == "chat":
            return super().cost_estimate(mode, warmup_s)
        return (self.compute_ms + self.finalize_ms) / 1000.0

    def chat(self, turn: ChatTurn) -> Iterator[ChatChunk]:
        """Deterministic chat: echoes the last user message ("You said: ..."; audio parts
        as their length, images as their size) in pieces of <= 16 characters, each with
        0.25 s of tone when speech is on; `compute_ms` of busy time before the reply.

        With functions (turn.tools, a choice other than none) the reply may call one
        instead (``_tool_call``); after a function's output it answers "The result: ..."
        with the output verbatim."""
        if not turn.messages or turn.messages[-1].role not in ("user", "tool"):
            raise ValueError("the last message must be the user's (or a function's output)")
        input_tokens = sum(len(str(p).split()) for m in turn.messages for p in m.parts)
        time.sleep(self.compute_ms / 1000.0)
        yield ChatChunk(prefilled=True, input_tokens=input_tokens)
        if turn.messages[-1].role == "tool":
            yield from self._stream(f"The result: {_tool_outputs(turn)}", turn, input_tokens)
            return
        said = []
        for part in turn.messages[-1].parts:
            if isinstance(part, str):
                said.append(part)
            elif isinstance(part, bytes):
                said.append(f"[image {len(part)} bytes]")
            else:
                said.append(f"[audio {part.size / 16000:.1f} s]")
        spec = _called(turn, " ".join(p for p in said if p))
        if spec is None:
            yield from self._stream(
                " ".join(f"You said: {' '.join(said)}".split()), turn, input_tokens
            )
            return
        call, problems = _tool_call(spec, turn, said)
        if call is None:
            text = f"I could not call {spec.name}."
            yield from self._stream(text, turn, input_tokens, tuple(problems))
            return
        yield ChatChunk(tool_calls=(call,))
        tokens = len(call.arguments.split()) + 1
        yield ChatChunk(done=True, input_tokens=input_tokens, output_tokens=tokens)

    def _stream(
        self, text: str, turn: ChatTurn, input_tokens: int, ignored: tuple[str, ...] = ()
    ) -> Iterator[ChatChunk]:
        """``text`` in pieces of <= 16 characters (whole words, whitespace kept as it is),
        a word a token, cut at max_new_tokens; then the done chunk."""
        produced, piece, cut = 0, "", False
        for word in re.findall(r"\S+\s*", text):
            if produced >= turn.max_new_tokens:
                cut = True
                break
            produced += 1
            if piece and len(piece.rstrip()) + len(word.rstrip()) + 1 > 16:
                yield self._chat_piece(piece, turn.speech, produced)
                piece = ""
            piece += word
        if piece:
            yield self._chat_piece(piece.rstrip() if cut else piece, turn.speech, produced)
        yield ChatChunk(
            done=True, input_tokens=input_tokens, output_tokens=produced, cut=cut, ignored=ignored
        )

    @staticmethod
    def _chat_piece(text: str, speech: bool, n: int) -> ChatChunk:
        audio = _tone(n, 0, OUTPUT_RATE // 4) if speech else np.zeros(0, np.float32)
        return ChatChunk(text=text, audio=audio)

    def open_session(self, session_id: str, mode: str) -> SyntheticSession:
        if mode not in self.modes:
            raise ValueError(f"mode {mode!r} not served")
        return self.session_class(self, session_id, mode)
