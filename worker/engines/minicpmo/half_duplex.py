"""A half-duplex voice call on MiniCPM-o 4.5 through the model's turn-based streaming chat
path (DuplexSettings.half_duplex, `/ws/half_duplex`), the way the reference server runs it:

- silero-vad finds each user turn (threshold 0.7, 128 ms of speech, ended by 500 ms of
  silence: the reference server's defaults, or the call's `config.vad`);
- the turn's audio is prefilled as one user message (`streaming_prefill`, last chunk), after
  the system message the call started with, under one conversation id, so the model's
  context goes on from turn to turn;
- the answer streams from `streaming_generate`, one piece per unit; the units that come while
  it answers are not heard (the worker's unit loop feeds silence itself, as fast as the
  pieces come: worker/session.py);
- a force-listen unit (the external stop, the call's max_new_tokens: the worker's unit loop
  sets it) ends the answer: the model's next prefill closes the turn in its context.

The conversation lives on the shared model (its KV cache, turn flags, vocoder cache);
`state.SharedState` swaps it per session, so calls, chat turns and duplex sessions on one
worker never see each other's.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from omnifabric.worker.engine import DuplexSettings, GenerateResult
from omnifabric.worker.engines.minicpmo.chat import (
    ChatEngine,
    Reply,
    init_voice,
    prefill,
)
from omnifabric.worker.engines.vad import WINDOW, TurnTracker, UtteranceRules, VoiceActivity

#: The reference server's half-duplex VAD defaults (threshold; speech and silence in ms)
#: and its answer's sampling defaults.
VAD_THRESHOLD = 0.7
RULES = UtteranceRules(
    min_speech_s=0.128,
    end_silence_s=0.5,
    quick_silence_s=0.5,
    pre_roll_s=0.1,
    tail_s=0.1,
    max_utterance_s=30.0,
)
TEMPERATURE = 0.7
LENGTH_PENALTY = 1.1
#: An answer's tokens at most (the unit loop ends it sooner at the call's max_new_tokens).
MAX_ANSWER_TOKENS = 1024


class HalfDuplexCall:
    """One call's turns on the model (its engine calls it under the engine lock, with the
    call's state on the model)."""

    def __init__(self, engine: ChatEngine, conversation_id: str, settings: DuplexSettings):
        self.engine = engine
        self.conversation_id = conversation_id
        self.settings = settings
        self.speech = engine.audio_on and settings.tts_enabled is not False
        threshold = settings.vad_threshold
        self.vad = VoiceActivity(threshold=VAD_THRESHOLD if threshold is None else threshold)
        self.turns = TurnTracker(
            RULES.tuned(settings.min_speech_ms, settings.end_of_turn_silence_ms), WINDOW
        )
        self.reply: Reply | None = None
        self.heard_tokens = 0
        """Context tokens the last user turn took."""

    def prepare(
        self, system_prompt: str, ref_audio: np.ndarray | None, voice: np.ndarray | None
    ) -> int:
        """A new conversation: the system message (the prompt, then the reference audio when
        given) and the answer's voice; returns the context length."""
        model = self.engine.model
        model.reset_session(reset_token2wav_cache=True)
        content: list[Any] = [system_prompt]
        if ref_audio is not None and ref_audio.size:
            content.append(ref_audio.astype(np.float32, copy=False))
        self._prefill("system", content)
        if self.speech:
            init_voice(self.engine, voice)
        return self.kv_length()

    def hear(self, pcm: np.ndarray) -> dict[str, float]:
        """One unit of the user's audio (not heard while the model answers)."""
        if self.reply is not None:
            return {}
        t0 = time.perf_counter()
        self.turns.feed(pcm, self.vad.windows(pcm))
        return {"vad": (time.perf_counter() - t0) * 1000}

    def step(self, force_listen: bool) -> GenerateResult:
        """Listen, start the answer when the user's turn just ended, or speak its next piece;
        the unit after the last piece ends the turn."""
        costs: dict[str, float] = {}
        if self.reply is None:
            heard = None if force_listen else self.turns.take_ended()
            if heard is None:
                return self._listen(end_of_turn=False, costs=costs)
            t0 = time.perf_counter()
            before = self.kv_length()
            self._prefill("user", [heard])
            self.heard_tokens = self.kv_length() - before
            costs["prefill_turn"] = (time.perf_counter() - t0) * 1000
            self.reply = self._answer()
        elif force_listen:
            return self._end_answer(costs)
        t0 = time.perf_counter()
        piece = self.reply.next_piece()
        costs["generate_piece"] = (time.perf_counter() - t0) * 1000
        if piece is None:
            return self._end_answer(costs)
        n_tokens = len(self.engine.tokenizer.encode(piece.text, add_special_tokens=False))
        return GenerateResult(
            is_listen=False,
            text=piece.text,
            audio=piece.audio if self.speech else np.zeros(0, np.float32),
            kv_cache_length=self.kv_length(),
            costs_ms=costs,
            n_tokens=n_tokens,
            input_audio_tokens=self._take_heard(),
        )

    def close(self) -> None:
        if self.reply is not None:
            self.reply.close()
            self.reply = None

    # ---- parts --------------------------------------------------------------------------

    def kv_length(self) -> int:
        return int(self.engine.model._get_kv_cache_length())

    def _prefill(self, role: str, content: list[Any]) -> None:
        import torch

        with torch.no_grad():
            prefill(self.engine.model, self.conversation_id, role, content, speech=self.speech)

    def _answer(self) -> Reply:
        s = self.settings
        return Reply(
            self.engine,
            self.conversation_id,
            self.speech,
            MAX_ANSWER_TOKENS,
            temperature=TEMPERATURE if s.temperature is None else s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            length_penalty=LENGTH_PENALTY if s.length_penalty is None else s.length_penalty,
        )

    def _end_answer(self, costs: dict[str, float]) -> GenerateResult:
        self.close()
        self.vad.reset()
        self.turns.reset()
        return self._listen(end_of_turn=True, costs=costs)

    def _listen(self, end_of_turn: bool, costs: dict[str, float]) -> GenerateResult:
        return GenerateResult(
            is_listen=True,
            end_of_turn=end_of_turn,
            kv_cache_length=self.kv_length(),
            costs_ms=costs,
            input_audio_tokens=self._take_heard(),
        )

    def _take_heard(self) -> int:
        tokens, self.heard_tokens = self.heard_tokens, 0
        return tokens
