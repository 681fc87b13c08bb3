"""The reference engine: a cascaded duplex model from packaged models (CPU, or CUDA for ASR).

Per unit, silero-vad flags 32 ms windows and the turn tracker (``turns.py``) decides when the
user's turn has ended: at a unit's end with >= 0.2 s of silence when the transcript reads as
a finished sentence, else after 0.9 s of silence. The unit that ends the turn transcribes it
(Whisper base and Moonshine base-en, the likelier of their transcripts: ``hearing.py``),
prefills it into the session's reply model (Qwen2.5-Coder-1.5B-Instruct in
llama.cpp, one server slot per session, history kept across turns; the words of an
unfinished utterance are prefilled ahead in spare time) and already speaks the reply's
first piece (~12 characters). Each speaking unit's finalize, run after its result has gone
out, makes the next second of speech in pieces of ~16 characters (Piper, espeak-ng as the
fallback), generating just enough tokens for it, so the next unit sends it at once. Speech
over the reply (barge-in) and force_listen close the turn at once. Context is accounted
like MiniCPM-o's: 13 tokens per unit plus the real text tokens, so context_full at 8192
comes for real (~10 minutes), unless the session has a context window
(``DuplexSettings.window()``): a unit's finalize then slides it (``_slide``). basic: once
the accounted context passes high_tokens, the oldest units leave the accounting and the
oldest whole exchanges (a user turn and the replies to it, those whose units are gone
first) leave the reply model's history until it is at most low_tokens; context: at most
``units`` units stay, and an exchange whose units are all gone leaves the history, the end
of what the model said in the dropped ones (at most previous_tokens tokens) carried in the
system message. The system prompt always stays; the llama.cpp slot gets the shortened
context at once, the kept turns' KV shifted into place rather than computed again, so it
forgets the dropped turns too and a slide costs a unit little (``Conversation.forget``).

With functions offered (``offer_tools``), the end of a user's turn first asks the model
whether to call them (the chat path's rule, ``functions``); a call ends the model's turn in
a unit of its own and the session listens until the outputs come (``tool_output``), then
speaks the reply that answers with them. That work goes where a reply's start goes: in the
unit when it fits, else in finalize (the arguments in a finalize of their own).

On CUDA (``device="cuda"``) the recognizers run on the GPU in fp32, as on CPU; the reply model
(CPU build of llama.cpp), VAD and TTS stay on the CPU.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from omnifabric.common.resample import resample
from omnifabric.common.session_types import WINDOW_MARGIN_TOKENS, ContextWindow
from omnifabric.common.stats import percentile
from omnifabric.worker.config import ASR_CHOICES, ASR_PRECISIONS
from omnifabric.worker.engine import (
    INPUT_RATE,
    OUTPUT_RATE,
    ChatChunk,
    ChatMessage,
    ChatTurn,
    DuplexSettings,
    Engine,
    EngineSession,
    GenerateResult,
    ToolCall,
    ToolChoice,
    ToolSpec,
)
from omnifabric.worker.engines.reference import functions
from omnifabric.worker.engines.reference.tts import split_for_speech
from omnifabric.worker.engines.reference.turns import (
    TurnRules,
    cut_at_limit,
    looks_finished,
    reply_cut,
)
from omnifabric.worker.engines.vad import WINDOW, WINDOW_S, TurnTracker, VoiceActivity

if TYPE_CHECKING:  # loaded by ReferenceEngine.load (they import torch models)
    from omnifabric.worker.engines.reference.asr import Transcriber
    from omnifabric.worker.engines.reference.hearing import Ears
    from omnifabric.worker.engines.reference.llm_gguf import (
        Conversation,
        ConversationState,
        ReplyModel,
    )
    from omnifabric.worker.engines.reference.tts import TextToSpeech

log = logging.getLogger("omnifabric.worker.reference")

#: Context tokens a unit adds in MiniCPM-o 4.5 (<unit>, ~10 audio tokens, a state token, </unit>).
UNIT_TOKENS = 13
AUDIO_TOKENS_PER_UNIT = 10
#: Output audio tokens per second of speech (MiniCPM-o's speech tokenizer rate), for usage.
TTS_TOKENS_PER_SECOND = 25


#: What the engine says when it heard speech but could not make out words it trusts.
REPAIR_TEXT = "Sorry, I did not catch that. Could you say it again?"
#: Added to every session's system prompt: the reply is spoken, so it must be short, and
#: complete sentences ("It is cold.") are heard better than a lone word ("Cold").
SPOKEN_STYLE = "Reply in one or two short, complete spoken sentences, without lists or markup."
#: How a context window (mode context) carries what the model said in the dropped turns:
#: this line in the system message, then those replies a line each (as they are in the
#: reply model's cache, so llama.cpp shifts them into place: Conversation.forget).
CARRIED_NOTE = "Earlier in this conversation you said:"


@dataclass
class Calling:
    """A user's turn whose reply calls functions, their arguments not yet written: what the
    user said (and how sure the words were), the functions chosen, the plan's tokens so far."""

    text: str
    logprob: float
    chosen: tuple[ToolSpec, ...]
    plan: functions.Plan


@dataclass
class Guess:
    """A reply begun on a guess (``ReferenceSession._guess``): in a finalize, the words heard
    so far read as a finished turn, but the unit ended in too little silence to end it. When
    the next unit adds only silence the turn ends with the same words (``key``) and this
    reply's first piece goes out at once, instead of a unit later."""

    key: tuple[int, int]
    """TurnTracker.key() of the speech the guess heard."""
    text: str
    logprob: float
    state: ConversationState
    """The dialogue with the reply begun (its first piece chosen)."""
    slides: int
    """The session's slide count then: a context window that slid since voids the guess."""
    base: int
    """The dialogue's context tokens before the reply begun: one that changed since (a
    reply, a turn added) voids the guess."""
    said: list[str]
    tokens: int
    audio: np.ndarray
    pending_text: str
    reply_finished: bool
    reply_tokens: int


class ReferenceSession(EngineSession):
    """One conversation: its own VAD state, utterance tracker and LLM context."""

    #: Tokens a unit may take a basic window past its high watermark before the unit itself
    #: slides it (else its finalize does, after the result went out).
    OVERSHOOT = WINDOW_MARGIN_TOKENS // 2

    def __init__(self, engine: ReferenceEngine, session_id: str, mode: str) -> None:
        self.engine = engine
        self.rules = engine.rules
        self.session_id = session_id
        self.mode = mode
        self.vad: VoiceActivity | None = VoiceActivity(engine.vad_path)
        """None once closed (the model's state is let go)."""
        self.turn = TurnTracker(engine.rules, WINDOW)
        self.settings = DuplexSettings()
        self.conversation: Conversation | None = None
        """The reply model's dialogue: from prepare until close."""
        self.system = ""
        """The reply model's system message (prepare)."""
        self.prompt_tokens = 0
        self.units = 0
        """Units generated so far (the kept ones are the last ``units - dropped_units``)."""
        self.window = ContextWindow()
        self.dropped_units = 0
        """Units the context window dropped from the accounting (the oldest)."""
        self.exchange_ends: list[int] = []
        """The unit each closed exchange of the conversation ended in, oldest first."""
        self.carried = ""
        """Context window (mode context): what the model said in the dropped exchanges, a
        reply a line (the latest, at most previous_tokens tokens)."""
        self.slides = 0
        """How often the context window slid (basic: each time it passed high_tokens;
        context: each time exchanges left the reply model's history)."""
        self.speaking = False
        self.pending_text = ""
        self.reply_finished = False
        self.reply_tokens = 0
        self.scripted = False
        """The reply is fixed text (a repair), not the model's."""
        self.audio = np.zeros(0, np.float32)
        """Synthesized reply speech not yet sent (24 kHz)."""
        self.ahead: list[str] = []
        self.ahead_tokens = 0
        """Reply text (and its tokens) that finalize made ahead, said with the next unit."""
        self.unit_speech_s = 0.0
        self.heard: tuple[tuple[int, int], str, float] | None = None
        """(TurnTracker key, transcript, mean log-probability) of the current utterance's
        speech, kept so the unit that ends the turn does not transcribe it again."""
        self.unit_started = 0.0
        self.unit_s = 1.0
        """When this unit's prefill began (perf_counter) and how long its input is."""
        self.turn_later = False
        """The user's turn may have ended with this unit, but its work did not fit in the
        unit: finalize does it, and the next unit speaks (TurnRules.turn_work)."""
        self.warm_due = False
        """Finalize may prefill the words heard so far (TurnRules.warm_ahead)."""
        self._begin_turn_state()
        self.opening = ""
        """What the user said, when finalize started the reply to it (or decided its calls):
        the next unit says it (input_transcript) with the reply's first piece (or the calls)."""
        self.first_ready = False
        """Finalize started a reply: the next unit sends its first piece alone."""
        self.offer = functions.Offer()
        """The functions the model may call, and how (offer_tools)."""
        self._begin_words_state()
        self.calling: Calling | None = None
        """The functions the checks chose at the end of the user's turn, their arguments not
        yet written (``_write_calls``)."""
        self.calls_due: tuple[ToolCall, ...] = ()
        """Calls a finalize wrote: the next unit makes them."""
        self.awaiting: dict[str, str | None] = {}
        """The calls made whose outputs the session waits for: call id -> output (None until
        tool_output gives it), in the order made."""
        self.answer_due = False
        """Every awaited output came: the reply that answers with them starts (the next
        unit, or its finalize when that does not fit: TurnRules.turn_work)."""
        self.called = False
        """This unit made calls: its finalize prefills their turns ahead (``_warm_calls``)."""
        self.finalize_costs: dict[str, float] = {}
        """What the last finalize spent, by part (ms), like a result's costs_ms."""
        self.needs_finalize = False
        self.closed = False
        self.transcripts: list[str] = []
        self.notes: tuple[str, ...] = ()

    def _begin_words_state(self) -> None:
        """What the session keeps of the user's words beyond the dialogue (__init__'s part
        for it): the names its recognizer hears with, the turns its function checks quote."""
        self.client_prompt = ""
        """The client's system prompt (prepare), for ``heard_with``."""
        self.heard_with = HEARING_PRIMER
        """What the recognizer hears this session with (``hearing_context``)."""
        self.recent: tuple[functions.Earlier, ...] = ()
        """The user's latest turns and the calls they got: the function checks and the
        arguments quote them, so a follow-up ("And in London?") is understood."""

    def _begin_turn_state(self) -> None:
        """The state of how a reply starts (__init__'s part for it)."""
        self.start: tuple[str, dict[str, float]] | None = None
        """How the reply being begun started and its parts (REPLY_START_PARTS), until the
        result that carries its first piece reports them."""
        self.endpoint_s = 0.0
        """Silence after the user's last words when the engine took the turn."""
        self.in_finalize = False
        """finalize() is running (a reply begun there starts "finalize", else "inline")."""
        self.guess: Guess | None = None
        """A reply its finalize began on the words heard so far (``_guess``): the next
        unit sends its first piece when that unit ends the turn with the same words."""
        self.sent_short = False
        """The last result carried less than a second of a reply that goes on (a first
        piece): its listener runs out before the next unit's second comes."""
        self.passed_guess: Guess | None = None
        """The guess the next unit did not take up (it brought more sound, or did not end
        the turn): when the turn ends heard as the same words after all, its reply is the
        guessed one, whose first piece is made already (``_respond``)."""

    # ---- prepare / prefill -------------------------------------------------------

    def prepare(
        self,
        system_prompt: str,
        ref_audio: np.ndarray | None,
        tts_ref_audio: np.ndarray | None,
        config: DuplexSettings,
    ) -> int:
        self.settings = config
        # The session's voice-activity turn-taking (half-duplex `config.vad`, or the keys
        # of the same names in a Realtime config).
        self.rules = self.turn.rules = self.engine.rules.tuned(
            config.min_speech_ms, config.end_of_turn_silence_ms
        )
        if self.vad is not None and config.vad_threshold is not None:
            self.vad.threshold = config.vad_threshold
        self.client_prompt = system_prompt
        self.heard_with = hearing_context(system_prompt, self.offer.tools)
        prompt = system_prompt.strip() or self.engine.default_prompt
        self.system = f"{prompt}\n{SPOKEN_STYLE}"
        conversation = self.engine.llm.conversation(self.system)
        self.conversation = conversation
        self.prompt_tokens = conversation.context_tokens
        self.window = config.window()
        self.exchange_ends = []
        self.carried = ""
        voice = tts_ref_audio if tts_ref_audio is not None else ref_audio
        self.notes = self.engine.voice_notes(voice)
        return self.prompt_tokens

    # ---- functions ---------------------------------------------------------------------

    def offer_tools(self, tools: tuple[ToolSpec, ...], choice: ToolChoice) -> tuple[str, ...]:
        """Duplex sessions call functions as chat turns do (``functions``): the end of a
        user's turn may be calls (``_respond``), the session then listens until their outputs
        came (``tool_output``), and the reply that answers with them is spoken. The system
        message says how results come (RESULT_NOTE, as in chat): the conversation, empty
        before the first unit, is begun again with it."""
        self.offer = functions.Offer(tuple(tools), choice)
        self.heard_with = hearing_context(self.client_prompt, self.offer.tools)
        if self.offer.calls() and self.conversation is not None and not self.units:
            self.conversation = None  # its server slot is free for the new one
            self.conversation = self.engine.llm.conversation(
                f"{self.system}\n{functions.RESULT_NOTE}"
            )
            self.prompt_tokens = self.conversation.context_tokens
        return ()

    def tool_output(self, call_id: str, output: str) -> None:
        """The output of a call the session waits for; once all have come, the reply that
        answers with them starts (``answer_due``). Others (an unknown id, a call a newer user
        turn replaced) are ignored."""
        if call_id not in self.awaiting or self.awaiting[call_id] is not None:
            log.debug("session %s: output of %r ignored (not awaited)", self.session_id, call_id)
            return
        self.awaiting[call_id] = output
        self.answer_due = all(o is not None for o in self.awaiting.values())

    def prefill(
        self, pcm: np.ndarray, frames: list[bytes], max_slice_nums: int
    ) -> dict[str, float]:
        if self.needs_finalize:
            raise RuntimeError("prefill before the previous unit was finalized")
        if self.vad is None:
            raise RuntimeError("prefill after close")
        t0 = self.unit_started = time.perf_counter()
        self.unit_s = pcm.size / INPUT_RATE
        flags = self.vad.windows(pcm)
        self.unit_speech_s = float(flags.sum()) * WINDOW_S
        self.turn.feed(pcm, flags)
        return {"vad": (time.perf_counter() - t0) * 1000.0}

    # ---- generate ----------------------------------------------------------------

    def generate(self, force_listen: bool) -> GenerateResult:
        if self.conversation is None:
            raise RuntimeError("generate before prepare")
        with self.engine.running():
            return self._generate(force_listen)

    def _generate(self, force_listen: bool) -> GenerateResult:
        self.units += 1
        self.needs_finalize = True
        costs: dict[str, float] = {}
        if self.calls_due:  # a finalize wrote the turn's calls
            return self._called(costs)
        if self.speaking:
            heard, self.opening = self.opening, ""
            first, self.first_ready = self.first_ready, False
            if force_listen or self.unit_speech_s >= self.rules.barge_in_s:
                return self._close_turn(costs, heard)
            if first:  # finalize started the reply: its first piece is ready
                return self._speak(costs, heard=heard, pieces=0)
            return self._speak(costs)
        startup = self.units <= self._force_listen_count()
        if force_listen or startup:
            self.guess = None
            return self._result(is_listen=True, costs=costs)
        if self.calling is not None:
            return self._calls_unit(costs)
        if self.answer_due:
            return self._answer(costs)
        guess, self.guess = self.guess, None
        due = self._turn_due()
        if guess is not None and due is not None and self._guessed_right(guess, due):
            return self._speak(costs, heard=guess.text, pieces=0)
        self.passed_guess = guess or self.passed_guess
        if due is not None and not self._fits_in_unit(due):
            self.turn_later = True
            return self._result(is_listen=True, costs=costs)
        turn = self._user_turn(costs)
        if turn is None:
            self.warm_due = True
            return self._result(is_listen=True, costs=costs)
        text, logprob = turn
        if self._respond(text, logprob, costs):
            self.opening = text
            return self._calls_unit(costs)
        return self._speak(costs, heard=text, pieces=0)

    def _turn_due(self) -> tuple[np.ndarray, tuple[int, int], bool] | None:
        """What may end the user's turn now: (its audio, its TurnTracker key, whether it ends
        the turn whatever it says); None while the user goes on."""
        turn = self.turn
        if turn.ended is not None and turn.ended_key is not None:
            return turn.ended, turn.ended_key, True
        if turn.may_end():
            return turn.audio(), turn.key(), False
        return None

    def _fits_in_unit(self, due: tuple[np.ndarray, tuple[int, int], bool]) -> bool:
        """Whether ending the turn (transcribing what is not yet, the function checks when
        the session may call, prefilling it, the reply's first piece) fits in this unit's
        real-time budget (TurnRules.turn_work)."""
        if self._early_start():
            return False  # its finalize sends the reply's start as soon as it is made
        audio, key, _ = due
        heard = self.heard is not None and self.heard[0] == key
        hear_s = 0.0 if heard else audio.size / INPUT_RATE
        drafted = bool(self._draft_for(key))
        return self._fits(lambda: self.engine.turn_estimate(hear_s, self.offer.calls(), drafted))

    def _early_start(self) -> bool:
        """Whether the turn's work is left to the finalize whatever it costs ("auto"): the
        sender takes results between units, so the finalize sends what it makes as soon as
        it is made, as soon as inline would, and no unit waits for it: the reply's start
        (``_send_early``), and in a session that may call functions, the calls it writes
        (``_send_calls``) and the reply to their outputs."""
        return self.early_sink is not None and self.rules.turn_work == "auto"

    def _fits(self, estimate: Callable[[], float | None]) -> bool:
        """Whether work of the ``estimate``d seconds (None: not yet measured) fits in this
        unit's real-time budget (TurnRules.turn_work)."""
        where = self.rules.turn_work
        if where != "auto":
            return where == "inline"
        seconds = estimate()
        if seconds is None:
            return False
        spent = time.perf_counter() - self.unit_started
        return spent + seconds <= self.rules.inline_share * self.unit_s

    def _force_listen_count(self) -> int:
        # The reference engine needs no warm-up units (MiniCPM-o's first 3 are forced to
        # listen); a client's force_listen_count is honoured.
        count = self.settings.force_listen_count
        return 0 if count is None else count

    def _user_turn(self, costs: dict[str, float]) -> tuple[str, float] | None:
        """The user's finished turn as (transcript, mean log-probability), taken from the
        tracker; None while the user has not finished (or said nothing the recognizer could
        make words of)."""
        due = self._turn_due()
        if due is None:
            return None
        audio, key, ended = due
        text, logprob = self._transcribe(audio, key, costs)
        if not ended and not looks_finished(text):
            return None
        self._take_turn(ended)
        self.heard = None
        if not text:
            return None
        return text, logprob

    def _take_turn(self, ended: bool) -> None:
        """Take the user's turn from the tracker: the one the end-of-turn silence ended, or
        (the quick end) the one going on; the silence after its words is noted."""
        if ended:
            self.endpoint_s = self.rules.end_silence_s
            self.turn.take_ended()
        else:
            self.endpoint_s = self.turn.silence_s
            self.turn.take_current()

    def _may_guess(self, text: str, logprob: float) -> bool:
        """Whether a finalize may begin the reply to the words heard so far (``_guess``):
        they read as a finished turn, sure enough to answer, with no functions to choose
        from (their checks are too costly to make on a guess) and speech on; and, where the
        sender cuts units where speech stops (``speech_cuts``), the unit did not end in
        speech: the cut after it comes within a few tenths of a second with the words' end,
        and guesses then. (Measured, `turn_starts --paced`, 24 questions: 17 guesses at the
        end of a unit ending in speech, 4 taken up; each ~0.45 s of a finalize that the
        cut, arriving meanwhile, waited for: first audio p50 1.04 -> 1.00 s.)"""
        return (
            self.rules.guess_ahead
            and not (self.speech_cuts and self.turn.silence_s == 0.0)
            and looks_finished(text)
            and logprob >= self.engine.repair_below
            and not self.offer.calls()
            and self.settings.tts_enabled is not False
        )

    def _guess_in_time(self) -> bool:
        """Whether a finalize may spend a guess's cost now (``_may_guess`` said it may
        guess). A unit that ended in speech is a long shot (whole-second units end inside a
        question's words, which often read as finished: "How many days are there?"), and
        the next unit waits for this finalize whatever it brings: that guess is made only
        where it ends before the next unit is due (this unit's length after it began), by
        the slow end of the measured reply starts (``TurnRules.guess_in_time``). A unit
        that ended in silence, too little to end the turn, is guessed at whatever it costs:
        the next unit seldom brings more words. A host that starts a reply in ~0.5 s makes
        these guesses as before; on one that takes ~1-1.4 s (docs/performance.md, "A
        slower 2-core host") they held the next unit, and the turn's end with it: units
        answered late in `turn_starts --early`'s 24 questions 14, 14, 10 -> 3, 6, 6, first
        audio p90 2.47-3.07 -> 2.13-2.27 s in three pairs."""
        if self.turn.silence_s > 0.0 or not self.rules.guess_in_time:
            return True
        cost = self.engine.reply_start_s
        if cost is None:
            return True
        return time.perf_counter() - self.unit_started + cost <= self.unit_s

    def _guess(
        self, key: tuple[int, int], text: str, logprob: float, costs: dict[str, float]
    ) -> None:
        """Begin the reply to ``text`` (its first piece made, as ``_begin_reply`` would) and
        keep it as ``guess``, the dialogue and the session taken back to listening: when the
        next unit ends the turn with these words it sends that piece at once. A guess made
        before on the same words (more speech heard since, the words unchanged) is kept for
        the new speech instead of being made again: the same reply, to the sample."""
        kept = self.guess or self.passed_guess
        if kept is not None and self._still_holds(kept, text):
            self.guess, self.passed_guess = replace(kept, key=key, logprob=logprob), None
            costs["guess"] = 0.0
            return
        conversation = self._dialogue()
        base = conversation.context_tokens
        before = conversation.snapshot()
        t0 = time.perf_counter()
        parts: dict[str, float] = {}
        self._open_reply()
        conversation.add_user_turn(text)
        # As short as the unit that ends the turn would make it: the reply is the same
        # whether guessed or not, to the sample.
        said, used = self._fill(1, self.rules.first_piece_chars, parts, look_ahead=False)
        self.ahead, self.ahead_tokens = said, used
        self._top_up(parts)
        said, used = self.ahead, self.ahead_tokens
        self.guess = Guess(
            key=key,
            text=text,
            logprob=logprob,
            state=conversation.snapshot(),
            slides=self.slides,
            base=base,
            said=said,
            tokens=used,
            audio=self.audio,
            pending_text=self.pending_text,
            reply_finished=self.reply_finished,
            reply_tokens=self.reply_tokens,
        )
        conversation.restore(before)
        self._open_reply()
        self.speaking = False
        costs["guess"] = (time.perf_counter() - t0) * 1000.0

    def _still_holds(self, guess: Guess, text: str) -> bool:
        """Whether ``guess`` is a reply to ``text`` in the dialogue as it stands (no turn
        added and no window slid since it was made)."""
        return (
            guess.text == text
            and guess.slides == self.slides
            and guess.base == self._dialogue().context_tokens
        )

    def _guessed_right(self, guess: Guess, due: tuple[np.ndarray, tuple[int, int], bool]) -> bool:
        """When the user's turn ends now with the words ``guess`` heard (only silence came
        since), take it up: the turn is taken and the guessed reply is the session's, its
        first piece ready to send; else False (the guess is dropped)."""
        _, key, ended = due
        if key != guess.key or guess.slides != self.slides:
            return False
        self._take_turn(ended)
        self.heard = None
        self._take_guess(guess, {})
        return True

    def _take_guess(self, guess: Guess, costs: dict[str, float]) -> None:
        """The user's turn (taken) was heard as ``guess``'s words: the guessed reply is the
        session's, its first piece ready to send."""
        self.passed_guess = None
        self.transcripts.append(guess.text)
        self.recent = functions.remembered(self.recent, guess.text)
        log.info("session %s: user said %r (as guessed)", self.session_id, guess.text)
        self._dialogue().restore(guess.state)
        self._open_reply()
        self.ahead, self.ahead_tokens = guess.said, guess.tokens
        self.audio = guess.audio
        self.pending_text, self.reply_finished = guess.pending_text, guess.reply_finished
        self.reply_tokens = guess.reply_tokens
        parts = {"endpoint": self.endpoint_s * 1000.0}
        if "asr" in costs:  # the turn's end heard the words again before taking it up
            parts["asr"] = costs["asr"]
        self.start = ("guess", parts)

    def _warm(self, costs: dict[str, float]) -> None:
        """Inside an utterance: prefill the words heard so far, so the unit that ends the
        turn prefills only the rest of it. The last word too, though the unit may have cut
        it off: the reply model's slot keeps what the whole turn shares with them, so a word
        heard whole saves its tokens at the turn's end and a cut one costs only the warm's
        spare time (`turn_starts --paced`, 24 questions: 8.75 -> 7.96 tokens computed at the
        turn's end, 230 -> 202 ms)."""
        turn = self.turn
        if not self.rules.warm_ahead or not turn.started or turn.speech_s < self.rules.min_speech_s:
            return
        if self.engine.busy():
            return  # spare time only: another session's unit is being computed
        text, logprob = self._transcribe(turn.audio(), turn.key(), costs)
        if self._may_guess(text, logprob) and self._guess_in_time():
            self._guess(turn.key(), text, logprob, costs)
            return
        if text.strip():
            t0 = time.perf_counter()
            self._dialogue().warm(text.strip())
            costs["llm_warm"] = (time.perf_counter() - t0) * 1000.0

    def _warm_calls(self, costs: dict[str, float]) -> None:
        """After the unit that made calls: prefill the user's turn, the calls and the start
        of the outputs' turn (spare time only), so the answer's start computes little more
        than the outputs (measured on a busy 2-core host: 1.1 -> 0.65 s, a reply to a user
        turn starting in 0.85 s there)."""
        if self.engine.busy() or not self.awaiting:
            return
        t0 = time.perf_counter()
        self._dialogue().warm(functions.RESULT_OPEN)
        costs["llm_warm"] = (time.perf_counter() - t0) * 1000.0

    def _transcribe(
        self, audio: np.ndarray, key: tuple[int, int], costs: dict[str, float]
    ) -> tuple[str, float]:
        """Transcript of the current utterance's audio (its TurnTracker ``key``), reused
        while only silence was added; where the utterance was heard before it went on, that
        transcript is the recognizers' draft (the same words, fewer decoding passes)."""
        if self.heard is not None and self.heard[0] == key:
            return self.heard[1], self.heard[2]
        draft = self._draft_for(key)
        t0 = time.perf_counter()
        # On every core where no other unit is being computed (hearing.Ears.hear).
        spread = not self.engine.busy()
        text, logprob = self.engine.asr.hear(audio, self.heard_with, draft, spread=spread)
        took = time.perf_counter() - t0
        costs["asr"] = costs.get("asr", 0.0) + took * 1000.0
        self.engine.learn_hearing(took, audio.size / INPUT_RATE, bool(draft))
        self.heard = (key, text, logprob)
        return text, logprob

    def _draft_for(self, key: tuple[int, int]) -> str:
        """What the utterance of TurnTracker ``key`` was heard as before it went on (the
        recognizers' draft), or "" where it was not."""
        if self.heard is None or self.heard[0][0] != key[0] or self.heard[0] == key:
            return ""
        return self.heard[1]

    def _respond(self, text: str, logprob: float, costs: dict[str, float]) -> bool:
        """What the user's finished turn gets: calls of the functions the model chooses for
        it (the chat path's rule: ``functions.choose``), their arguments written next
        (``calling``: ``_write_calls``), returning True; else (none chosen, no functions
        offered, words too unsure to answer) the spoken reply, begun here. A new turn
        replaces the calls still awaited."""
        self.awaiting, self.answer_due = {}, False
        guess, self.passed_guess = self.passed_guess, None
        if (
            guess is not None
            and self._still_holds(guess, text)
            and logprob >= self.engine.repair_below
            and not self.offer.calls()
        ):
            self._take_guess(guess, costs)  # heard as guessed: that reply, its piece made
            return False
        if not self.offer.calls() or logprob < self.engine.repair_below:
            self._begin_reply(text, logprob, costs)
            return False
        t0 = time.perf_counter()
        plan = functions.Plan()
        chosen = functions.choose(self.engine.llm, self.offer, text, plan, self.recent)
        took = time.perf_counter() - t0
        costs["tools"] = took * 1000.0
        self.engine.learn_checks(took)
        if chosen:
            self.calling = Calling(text, logprob, tuple(chosen), plan)
            return True
        self._begin_reply(text, logprob, costs)
        self.ahead_tokens += plan.output_tokens
        return False

    def _calls_unit(self, costs: dict[str, float]) -> GenerateResult:
        """The chosen functions' arguments, written in this unit when they fit (it makes the
        calls), else in its finalize (it listens; the next unit makes them, or the finalize
        sends them where the sender takes results between units)."""
        if self._early_start() or not self._fits(lambda: self.engine.arguments_s):
            return self._result(is_listen=True, costs=costs)
        self._write_calls(costs)
        if self.calls_due:
            return self._called(costs)
        heard, self.opening = self.opening, ""
        return self._speak(costs, heard=heard, pieces=0)

    def _write_calls(self, costs: dict[str, float]) -> None:
        """The calls of the chosen functions, their arguments written by the model
        (``functions.fill``), recorded and due (``calls_due``); when none could be made,
        the reply that says so begins."""
        calling, self.calling = self.calling, None
        assert calling is not None
        t0 = time.perf_counter()
        plan = calling.plan
        functions.fill_all(self.engine.llm, calling.text, calling.chosen, plan, self.recent)
        took = time.perf_counter() - t0
        costs["tool_arguments"] = took * 1000.0
        self.engine.learn_arguments(took)
        if plan.problems:
            log.info("session %s: calls not made: %s", self.session_id, "; ".join(plan.problems))
        if plan.calls:
            self._record_calls(calling.text, plan.calls)
            self.calls_due, self.ahead_tokens = tuple(plan.calls), plan.output_tokens
            return
        self._begin_reply(calling.text, calling.logprob, costs, functions.CANNOT)
        self.ahead_tokens += plan.output_tokens

    def _record_calls(self, text: str, calls: list[ToolCall]) -> None:
        """The user's turn and the model's calls, in the conversation as the model's template
        writes them; the session waits for the calls' outputs."""
        self.transcripts.append(text)
        self.recent = functions.remembered(self.recent, text, calls)
        log.info(
            "session %s: user said %r: calls %s",
            self.session_id,
            text,
            ", ".join(f"{c.name}({c.arguments})" for c in calls),
        )
        conversation = self._dialogue()
        conversation.add_history("user", text)
        conversation.add_history("assistant", functions.calls_text(calls))
        self.awaiting = {c.call_id: None for c in calls}

    def _called(self, costs: dict[str, float]) -> GenerateResult:
        """The unit that makes the turn's calls (``calls_due``): it listens and ends the
        model's turn, with what the user said and the checks' tokens."""
        calls, self.calls_due = self.calls_due, ()
        heard, self.opening = self.opening, ""
        tokens, self.ahead_tokens = self.ahead_tokens, 0
        self.called = True
        return self._result(
            is_listen=True,
            end_of_turn=True,
            n_tokens=tokens,
            costs=costs,
            heard=heard,
            tool_calls=calls,
        )

    def _answer(self, costs: dict[str, float]) -> GenerateResult:
        """Every awaited output came: the reply that answers with them starts in this unit
        when it fits (its first piece goes out now), else in its finalize (the next unit
        speaks), as a user turn's reply does (TurnRules.turn_work)."""
        if self._early_start() or not self._fits(lambda: self.engine.turn_estimate(0.0)):
            return self._result(is_listen=True, costs=costs)
        self._begin_answer(costs)
        return self._speak(costs, pieces=0)

    def _begin_answer(self, costs: dict[str, float]) -> None:
        """Start the reply that answers with the awaited outputs (a user turn of them, as the
        chat path writes it: ``functions.answer_turn``) and make its first piece."""
        outputs = [o or "" for o in self.awaiting.values()]
        self.awaiting, self.answer_due = {}, False
        self.endpoint_s = 0.0  # no user speech before this reply: the outputs came
        t0 = time.perf_counter()
        self._open_reply()
        self._dialogue().add_user_turn(functions.answer_turn(outputs))
        costs["llm_prefill"] = (time.perf_counter() - t0) * 1000.0
        self._first_piece(costs, t0)

    def _begin_reply(
        self, text: str, logprob: float, costs: dict[str, float], fixed: str = ""
    ) -> None:
        """Start the reply to what the user said (``fixed`` words, when given) and make its
        first short piece (text, and its speech), which the next _speak sends."""
        t0 = time.perf_counter()
        self._start_reply(text, logprob, costs, fixed)
        self._first_piece(costs, t0)

    def _first_chars(self) -> int:
        """How long a reply's first piece is made: short (``first_piece_chars``) in the unit
        that ends the turn, which sends it as soon as it is made (and on a guess: the same
        reply either way); a whole piece (``piece_chars``) in the finalize of that unit,
        whose piece waits for the next unit anyway and plays until the unit after it
        brings more (turn_starts, 24 questions: 19 replies with gaps, 4.33 s in all, at 12
        characters there; 12 replies, 1.23 s, at 16, for first audio p50 1.70 -> 1.75 s)."""
        waits = self.in_finalize and self.early_sink is None
        return self.rules.piece_chars if waits else self.rules.first_piece_chars

    def _first_piece(self, costs: dict[str, float], t0: float) -> None:
        """The started reply's first piece (``_first_chars``), made ahead for the next
        _speak; the reply's start (since ``t0``) is learned when the model made it. Made in
        a finalize, it is topped up (``_top_up``)."""
        said, used = self._fill(1, self._first_chars(), costs, look_ahead=False)
        self.ahead, self.ahead_tokens = said, used
        if not self.scripted:
            self.engine.learn_reply_start(time.perf_counter() - t0)
        self._note_start(costs)
        if self.early_sink is None:
            self._top_up(costs)

    def _top_up(self, costs: dict[str, float]) -> None:
        """In a finalize, a reply's first piece goes out with the next unit and the second
        after it with the unit after that: the piece is topped up to a second of speech, so
        it plays until then (a short piece alone left a gap of ~0.3 s), when that fits
        before the next unit is due: a finalize still running then holds the next unit,
        and with it the first audio (measured: +0.4-0.7 s)."""
        cost = self.engine.reply_cost
        due = self.unit_started + self.unit_s * self.rules.inline_share
        if self.in_finalize and cost is not None and time.perf_counter() + cost <= due:
            said, used = self._fill(1, self.rules.piece_chars, costs)
            self.ahead += said
            self.ahead_tokens += used

    def _note_start(self, costs: dict[str, float]) -> None:
        """How the reply being begun started, and its parts so far (``start``)."""
        self.start = (
            "finalize" if self.in_finalize else "inline",
            {
                "endpoint": self.endpoint_s * 1000.0,
                "asr": costs.get("asr", 0.0),
                "llm": costs.get("llm_prefill", 0.0) + costs.get("llm", 0.0),
                "tts": costs.get("tts", 0.0),
            },
        )

    def _open_reply(self) -> None:
        """A new reply begins: the session speaks, nothing of it made yet."""
        self.speaking = True
        self.pending_text = ""
        self.reply_finished = False
        self.reply_tokens = 0
        self.audio = np.zeros(0, np.float32)
        self.ahead, self.ahead_tokens = [], 0
        self.scripted = False

    def _start_reply(
        self, text: str, logprob: float, costs: dict[str, float], fixed: str = ""
    ) -> None:
        """Begin the reply to what the user said: the model's, or fixed words: ``fixed``
        (a call that could not be made), or a request to say it again when the words are
        too unsure to answer."""
        self.transcripts.append(text)
        self.recent = functions.remembered(self.recent, text)
        self._open_reply()
        fixed = REPAIR_TEXT if logprob < self.engine.repair_below else fixed
        self.scripted = bool(fixed)
        log.info("session %s: user said %r (logprob %.2f)", self.session_id, text, logprob)
        if self.scripted:
            self.pending_text = fixed
            self.reply_finished = True
            # The context keeps what was heard and the request to say it again, so a
            # follow-up is answered from what the user actually got (measured: "What is my
            # name?" after an unsure "My name is Anor." got "My name is John." without it,
            # "Your name is Anor." with it).
            conversation = self._dialogue()
            conversation.add_history("user", text)
            conversation.add_history("assistant", fixed)
            return
        t1 = time.perf_counter()
        self._dialogue().add_user_turn(text)
        costs["llm_prefill"] = (time.perf_counter() - t1) * 1000.0

    def _speak(self, costs: dict[str, float], heard: str = "", pieces: int = 2) -> GenerateResult:
        """Emit up to 1 s of the reply's speech: what was made ahead, topped up with up to
        ``pieces`` new pieces while it is under 1 s; the turn ends with the unit that empties
        the last audio. The reply's first unit sends its short first piece alone (pieces=0):
        finalize makes the next second of speech right after it."""
        said, n_tokens = self.ahead, self.ahead_tokens
        self.ahead, self.ahead_tokens = [], 0
        new, used = self._fill(pieces, self.rules.piece_chars, costs)
        said, n_tokens = said + new, n_tokens + used
        take = OUTPUT_RATE
        if self.reply_finished and not self.pending_text.strip():
            # A sliver of tail (< 0.1 s) rides with this chunk rather than a unit of its own.
            take = OUTPUT_RATE if self.audio.size > OUTPUT_RATE * 1.1 else self.audio.size
        chunk, self.audio = self.audio[:take], self.audio[take:]
        end = self.reply_finished and not self.pending_text.strip() and self.audio.size == 0
        self.sent_short = not end and chunk.size < OUTPUT_RATE
        if end:
            self._end_reply()
        result = self._result(
            is_listen=False,
            text="".join(said),
            audio=chunk,
            end_of_turn=end,
            n_tokens=n_tokens,
            costs=costs,
            heard=heard,
        )
        if self.start is not None:  # the reply's first piece: how it started
            result.reply_start_how, result.reply_start_ms = self.start
            self.start = None
        return result

    def _fill(
        self, pieces: int, chars: int, costs: dict[str, float], look_ahead: bool = True
    ) -> tuple[list[str], int]:
        """Generate up to ``pieces`` pieces of ~``chars`` characters while the speech ready
        to send is under 1 s (with speech off: the pieces); returns their text and tokens.
        ``look_ahead`` False: no token is chosen beyond what the pieces need (a reply's
        first piece: it goes out one token's time sooner)."""
        said: list[str] = []
        n_tokens = 0
        tts_on = self.settings.tts_enabled is not False
        while (self.audio.size < OUTPUT_RATE or not tts_on) and len(said) < pieces:
            t0 = time.perf_counter()
            piece, used = self._next_piece(chars, look_ahead)
            costs["llm"] = costs.get("llm", 0.0) + (time.perf_counter() - t0) * 1000.0
            n_tokens += used
            if not piece:
                break
            said.append(piece)
            if tts_on and piece.strip():
                t1 = time.perf_counter()
                self.audio = np.concatenate([self.audio, self.engine.tts.synthesize(piece.strip())])
                costs["tts"] = costs.get("tts", 0.0) + (time.perf_counter() - t1) * 1000.0
        return said, n_tokens

    def _next_piece(self, chars: int, look_ahead: bool = True) -> tuple[str, int]:
        """The next piece of reply text as generated (spacing kept), about ``chars`` long, and
        the tokens it took; ("", n) when the reply is done."""
        used = 0
        rules = self.rules
        while not self.reply_finished and len(self.pending_text) <= chars:
            if used >= rules.max_tokens_per_unit:
                break
            conversation = self._dialogue()
            reply = conversation.reply_text
            if self.reply_tokens >= rules.max_reply_tokens:
                self._cut_reply(cut_at_limit(reply))
                break
            before = conversation.context_tokens
            ahead = rules.tokens_per_request if look_ahead else 1
            delta, finished = conversation.next_tokens(1, look_ahead=look_ahead, ahead=ahead)
            step = conversation.context_tokens - before
            used += step
            self.reply_tokens += step
            self.pending_text += delta
            self.reply_finished = finished
            cut = reply_cut(conversation.reply_text, finished, rules)
            if cut is not None:
                self._cut_reply(cut)
        if not self.pending_text.strip():
            self.pending_text = "" if self.reply_finished else self.pending_text
            return "", used
        if self.reply_finished and len(self.pending_text) <= chars * 1.5:
            piece, self.pending_text = self.pending_text, ""  # no short orphan piece at the end
            return piece, used
        _, rest = split_for_speech(self.pending_text, chars)
        cut = len(self.pending_text) - len(rest)
        piece, self.pending_text = self.pending_text[:cut], rest
        return piece, used

    def _cut_reply(self, end: int) -> None:
        """End the reply at ``end`` (a position in the whole reply text): what is not yet
        said beyond it is dropped."""
        said = len(self._dialogue().reply_text) - len(self.pending_text)
        self.pending_text = self.pending_text[: max(0, end - said)]
        self.reply_finished = True

    def _end_reply(self) -> None:
        if not self.scripted:
            self._dialogue().end_turn()
        self.speaking = False
        self.scripted = False

    def _dialogue(self) -> Conversation:
        """The conversation, which prepare made and close lets go."""
        if self.conversation is None:
            raise RuntimeError("no conversation: before prepare or after close")
        return self.conversation

    def _close_turn(self, costs: dict[str, float], heard: str = "") -> GenerateResult:
        """force_listen or barge-in: stop the reply now; the turn closes in the context.
        ``heard``: what the user said, when finalize had started the reply to it."""
        self._end_reply()
        self.pending_text = ""
        self.audio = np.zeros(0, np.float32)
        self.ahead, self.ahead_tokens = [], 0
        return self._result(is_listen=True, end_of_turn=True, costs=costs, heard=heard)

    def _result(
        self,
        is_listen: bool,
        text: str = "",
        audio: np.ndarray | None = None,
        end_of_turn: bool = False,
        n_tokens: int = 0,
        costs: dict | None = None,
        heard: str = "",
        tool_calls: tuple[ToolCall, ...] = (),
    ) -> GenerateResult:
        audio = np.zeros(0, np.float32) if audio is None else audio
        costs = {} if costs is None else costs
        window = self.window
        if window.mode == "basic" and self.kv_cache_length > window.high_tokens + self.OVERSHOOT:
            # A long turn went far past the high watermark in this unit: slide now, not in
            # finalize, so the context cap (>= high + WINDOW_MARGIN_TOKENS) is never reached.
            self._slide(costs)
        return GenerateResult(
            is_listen=is_listen,
            text=text,
            audio=audio,
            end_of_turn=end_of_turn,
            kv_cache_length=self.kv_cache_length,
            costs_ms=costs,
            n_tokens=n_tokens,
            n_tts_tokens=int(round(audio.size / 24000 * TTS_TOKENS_PER_SECOND)),
            input_audio_tokens=AUDIO_TOKENS_PER_UNIT,
            input_transcript=heard,
            tool_calls=tool_calls,
        )

    @property
    def kv_cache_length(self) -> int:
        """Like MiniCPM-o: system prompt, 13 tokens per kept unit, plus the real text tokens
        (the conversation's: the system message and the history it keeps)."""
        text_tokens = self.conversation.context_tokens if self.conversation else self.prompt_tokens
        return UNIT_TOKENS * self.kept_units + text_tokens

    @property
    def kept_units(self) -> int:
        """Units in the accounted context (all of them, unless a context window slid)."""
        return self.units - self.dropped_units

    # ---- context window -------------------------------------------------------------

    def _slide(self, costs: dict[str, float]) -> None:
        """Slide the context window when it is due (module docstring): the oldest units
        leave the accounting, the oldest exchanges the reply model's history."""
        window, conversation = self.window, self.conversation
        if not window.on or conversation is None:
            return
        exchanges = conversation.exchanges()
        self.exchange_ends += [self.units] * (len(exchanges) - len(self.exchange_ends))
        before = self.kv_cache_length
        if window.mode == "basic":
            if before <= window.high_tokens:
                return
            units, count = self._basic_cut([e.tokens for e in exchanges], before, window)
            note = None
        else:
            if self.kept_units <= window.units:
                return
            units = self.kept_units - window.units
            first = self.dropped_units + units + 1  # the oldest unit kept
            count = sum(1 for end in self.exchange_ends if end < first)
            if not count:  # the history is as it was: only units leave the accounting
                self.dropped_units += units
                return
            said = [e.said for e in exchanges[:count] if e.said]
            self.carried = self._carry([*self.carried.splitlines(), *said], window)
            note = f"{CARRIED_NOTE}\n{self.carried}" if self.carried else ""
        self.dropped_units += units
        t0 = time.perf_counter()
        computed = conversation.forget(count, note) if count else 0
        took = (time.perf_counter() - t0) * 1000.0
        del self.exchange_ends[:count]
        self.slides += 1
        if count:  # what the reply model's context took to prefill again
            costs["slide"] = costs.get("slide", 0.0) + took
        log.info(
            "session %s: context window (%s) slid from %d to %d tokens: %d units and %d "
            "exchanges dropped, %d tokens prefilled again in %.0f ms",
            self.session_id,
            window.mode,
            before,
            self.kv_cache_length,
            units,
            count,
            computed,
            took,
        )

    def _carry(self, replies: list[str], window: ContextWindow) -> str:
        """The latest ``replies`` in at most previous_tokens tokens, a line each: whole
        replies, the oldest going first (their tokens stay as the reply model's cache holds
        them), the latest one's end alone when it is longer than that."""
        llm, budget = self.engine.llm, window.previous_tokens
        lines = [r.strip() for r in replies if r.strip()]
        while lines and len(llm.encode("\n".join(lines))) > budget:
            if len(lines) == 1:
                return llm.last_tokens(lines[0], budget)
            lines.pop(0)
        return "\n".join(lines)

    def _basic_cut(
        self, exchanges: list[int], length: int, window: ContextWindow
    ) -> tuple[int, int]:
        """Basic window: (units, exchanges) to drop, oldest first, so that the accounted
        ``length`` is at most low_tokens. An exchange goes with the last of its units
        (before it when units alone cannot make room)."""
        units = count = 0
        while length > window.low_tokens:
            first = self.dropped_units + units + 1
            if count < len(exchanges) and self.exchange_ends[count] < first:
                length -= exchanges[count]
                count += 1
            elif units < self.kept_units:
                length -= UNIT_TOKENS
                units += 1
            elif count < len(exchanges):
                length -= exchanges[count]
                count += 1
            else:
                break  # the system prompt and an open reply are all there is
        return units, count

    # ---- unit end and session end ---------------------------------------------------

    def finalize(self) -> None:
        """After a unit's result has gone out: the work it left (the end of the user's turn
        when that did not fit in the unit: the next unit speaks or calls; the chosen calls'
        arguments; the reply to the calls' outputs), the call's turns prefilled ahead, the
        next second of speech (so the next unit sends it at once), or the words heard so far
        prefilled ahead."""
        self.needs_finalize = False
        costs: dict[str, float] = {}
        self.in_finalize = True
        try:
            with self.engine.running():
                self._finalize_work(costs)
                self._slide(costs)
        finally:
            self.warm_due = self.called = self.in_finalize = False
        self.finalize_costs = costs

    def _finalize_work(self, costs: dict[str, float]) -> None:
        """finalize's work, the one that applies (see finalize)."""
        if self.turn_later:
            self.turn_later = False
            heard = self._user_turn(costs)
            if heard is not None:
                calling = self._respond(*heard, costs)
                self.opening, self.first_ready = heard[0], not calling
            else:
                self._warm(costs)
        elif self.calling is not None:
            self._write_calls(costs)
            self.first_ready = self.speaking  # none could be made: the reply says so
            if self.calls_due and self.early_sink is not None:
                self._send_calls(costs)
        elif self.answer_due and not self.speaking:
            self._begin_answer(costs)
            self.first_ready = True
        elif self.called:
            self._warm_calls(costs)
        elif self.speaking:
            self._speech_ahead(costs)
            if self.sent_short and self.early_sink is not None and self.ahead:
                self._send_early(costs)  # the short piece before it runs out sooner
        elif self.warm_due and not self.speaking:
            self._warm(costs)
        if self.first_ready and self.early_sink is not None:
            self._send_early(costs)

    def _speech_ahead(self, costs: dict[str, float]) -> None:
        """The reply's next second of speech, made for the next unit to send at once."""
        if self.settings.tts_enabled is not False:
            said, used = self._fill(2, self.rules.piece_chars, costs)
            self.ahead += said
            self.ahead_tokens += used

    def _send_early(self, costs: dict[str, float]) -> None:
        """What this finalize made goes out now (``early_sink``) as a result of its own, not
        with the next unit's, which sends the second of speech made next: the first piece of
        the reply it began (the first audio leaves ``c`` after the unit that ended the turn
        instead of a whole unit after it, and no unit waits for the turn's work, which is not
        done inline), or the speech after a short piece (a guess's, an inline start's), which
        would run out before the next unit brought more."""
        sink = self.early_sink
        assert sink is not None
        self.first_ready = False
        heard, self.opening = self.opening, ""
        result = self._speak(dict(costs), heard=heard, pieces=0)
        result.input_audio_tokens = 0  # no unit of input: the finalized unit counted it
        sink(result)
        if self.speaking:
            self._speech_ahead(costs)

    def _send_calls(self, costs: dict[str, float]) -> None:
        """The calls this finalize wrote go out now (``early_sink``) as a result of their
        own, not with the next unit's: the caller runs the functions a unit sooner at most;
        the outputs' turn is warmed after, as the finalize after a calling unit does."""
        sink = self.early_sink
        assert sink is not None
        result = self._called(dict(costs))
        result.input_audio_tokens = 0  # no unit of input: the finalized unit counted it
        sink(result)
        self._warm_calls(costs)

    @property
    def replying(self) -> bool:
        return self.speaking

    def stop(self) -> None:
        if self.speaking and self.conversation is not None:
            self._end_reply()
        self.speaking = False
        self.opening = ""
        self.turn_later = self.warm_due = self.first_ready = self.answer_due = False
        self.calling, self.calls_due, self.awaiting = None, (), {}
        self.guess, self.start = None, None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.conversation = None
        self.turn.reset()
        self.vad = None


#: Words, with what ends each (a sentence end or not): names are found among them.
_WORDS = re.compile(r"([A-Za-z][\w'&-]*)([.!?]?)")
#: Capitalized words that are not names.
_NOT_NAMES = frozenset({"I", "I'm", "I'll", "I've", "I'd", "OK"})
#: The most names given to the recognizer (its prompt is short).
MOST_NAMES = 24


#: Markdown a text reply may hold that a voice should not read out: emphasis and code marks,
#: heading marks, and list bullets at a line's start.
_FORMATTING = re.compile(r"[*`]+|^\s*#+\s*|^\s*[-+]\s+", re.M)


def unformatted(text: str) -> str:
    """``text`` as it is spoken: without markdown's marks ("**Density**: ..." is said
    "Density: ...")."""
    return _FORMATTING.sub("", text)


#: Whisper's prompt where the session names nothing (``hearing_context``). A plain line of
#: what is said gains on robotic voices and costs nothing: on tools/eval_hearing's 300
#: espeak-ng utterances every key word survived in 215 (WER 12.7 %) against 207 (13.9 %)
#: without a prompt, 12 gained and 4 lost; on its 150 Piper ones 133 against 132 (WER
#: 4.5 % both); "Someone talks to a voice assistant." gave 212 (espeak).
HEARING_PRIMER = "A caller asks a short question."


def hearing_context(system_prompt: str, tools: Sequence[ToolSpec] = ()) -> str:
    """What the recognizer hears a session with (Ears.hear's ``context``): the names its
    words hold (``hearing_names``), else ``HEARING_PRIMER``."""
    return hearing_names(system_prompt, tools) or HEARING_PRIMER


def hearing_names(system_prompt: str, tools: Sequence[ToolSpec] = ()) -> str:
    """The names a session's words already hold, for the recognizer's prompt (Ears.hear's
    ``context``): the capitalized words of the client's system prompt that do not begin a
    sentence, the same in the functions' descriptions and their parameters' ("the
    restaurant, e.g. Nobu or Sakura"), and the string values the parameters enumerate. On
    tools/eval_hearing's names this kept every key word in 93 % of Piper utterances against
    88 % without, 72 % of espeak ones against 69 %; descriptions as a whole did no better
    than nothing, so only names go. "" when there are none."""
    names = _capitalized(system_prompt)
    for tool in tools:
        for text in [tool.description, *_descriptions(tool.parameters)]:
            names += _capitalized(text)
        names += _enum_values(tool.parameters)
    unique = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    return ", ".join(unique[:MOST_NAMES])


def _capitalized(text: str) -> list[str]:
    """The runs of capitalized words in ``text`` that do not begin a sentence (a line's
    first word or one after a sentence end; a single letter's period, as in "e.g.", ends
    none), a run as one name ("Chez Marie")."""
    names: list[str] = []
    for line in text.splitlines():
        starts, run = True, []
        for word, end in _WORDS.findall(line):
            if word[0].isupper() and not starts and word not in _NOT_NAMES:
                run.append(word)
            elif run:
                names.append(" ".join(run))
                run = []
            starts = bool(end) and len(word) > 1
            if end and run:
                names.append(" ".join(run))
                run = []
        if run:
            names.append(" ".join(run))
    return names


def _descriptions(schema: object) -> list[str]:
    """The ``description`` strings anywhere in a JSON schema."""
    if isinstance(schema, dict):
        own = schema.get("description")
        found = [own] if isinstance(own, str) else []
        return found + [d for v in schema.values() for d in _descriptions(v)]
    if isinstance(schema, list):
        return [d for item in schema for d in _descriptions(item)]
    return []


def _enum_values(schema: object) -> list[str]:
    """The string ``enum`` values anywhere in a JSON schema."""
    if isinstance(schema, dict):
        found = [v for v in schema.get("enum", ()) if isinstance(v, str)]
        for value in schema.values():
            found += _enum_values(value)
        return found
    if isinstance(schema, list):
        return [v for item in schema for v in _enum_values(item)]
    return []


def _timed(work: Callable[[], None]) -> float:
    """Seconds ``work`` took."""
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def check_device(device: str) -> torch.device:
    """``device`` as a torch.device; ValueError when it is malformed, not cpu/cuda, or CUDA
    (or that CUDA index) is not available here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device: {exc}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device {device!r}: the reference engine runs on cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but torch.cuda.is_available() is False")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"device {device!r} requested but only {count} CUDA device(s) exist")
    return dev


class ReferenceEngine(Engine):
    """VAD + Whisper base and Moonshine base-en + a GGUF reply model in llama.cpp + Piper,
    loaded once; the recognizers on ``device`` (cpu, cuda, cuda:N), the rest on the CPU."""

    name = "reference"
    modes = frozenset({"audio", "video", "chat"})
    default_prompt = "You are a helpful voice assistant. Answer in English."
    spoken_prompt = (
        "You are a helpful voice assistant. Answer in English, briefly: one to three plain "
        "spoken sentences, without lists, headings or formatting."
    )
    """A chat turn that is spoken and brings no system message of its own: its answer is
    heard, not read (the duplex path's replies keep to two sentences by its rules)."""
    repair_below = -1.0
    """A transcript whose mean token log-probability (over both recognizers, or Whisper's
    alone) is below this is too unsure to answer: the engine asks the user to say it again
    (Whisper's own threshold for a failed decode; on 238 espeak questions it caught 19
    misheard ones and 2 heard right)."""

    def __init__(
        self,
        slots: int = 5,
        threads: int | None = None,
        rules: TurnRules | None = None,
        device: str = "cpu",
        llm_threads: int | None = None,
        llm_model: str | None = None,
        asr: str = "both",
        asr_precision: str = "auto",
    ) -> None:
        # Checked here, before any weights load, so a bad device fails the worker at once.
        self._torch_device = check_device(device)
        self.device = device
        self.default_slots = slots
        if self._torch_device.type == "cpu":
            # One torch thread per engine thread keeps outputs bit-identical run to run;
            # two engine threads use both cores of a small machine.
            self.concurrency = threads or max(1, min(2, os.cpu_count() or 1))
        else:
            # One GPU: a second engine thread would only queue kernels behind the first.
            self.concurrency = threads or 1
        self.rules = rules or TurnRules()
        self.llm_threads = llm_threads
        self.llm_model = llm_model
        if asr not in ASR_CHOICES:
            raise ValueError(f"asr {asr!r}: choose one of {', '.join(ASR_CHOICES)}")
        self.asr_choice = asr
        if asr_precision not in ASR_PRECISIONS:
            raise ValueError(
                f"asr_precision {asr_precision!r}: choose one of {', '.join(ASR_PRECISIONS)}"
            )
        self.asr_precision = asr_precision
        self._running = 0
        self._running_lock = threading.Lock()
        self.vad_path: Path | None = None
        self._asr: Transcriber | Ears | None = None
        self._llm: ReplyModel | None = None
        self._tts: TextToSpeech | None = None
        self._lock = threading.Lock()
        self.reply_cost: float | None = None
        """A spoken reply's compute per second of its speech, measured at warm-up."""
        self._recent: dict[str, deque[float]] = {
            kind: deque(maxlen=self.RECENT)
            for kind in ("hearing", "drafted", "start", "checks", "arguments")
        }
        self.hearing_cost: float | None = None
        """Seconds the recognizers take per second of their window (``asr.window_seconds``),
        hearing an utterance for the first time: the slow end (``SLOW_END``) of the recent
        measurements, from warm-up on."""
        self.drafted_hearing_cost: float | None = None
        """The same for an utterance heard before it went on (``hear``'s draft: fewer
        decoding passes); from the first such hearing, until then ``hearing_cost``."""
        self.reply_start_s: float | None = None
        """Seconds from a transcript to its reply's first piece, with speech (likewise)."""
        self.checks_s: float | None = None
        """Seconds a duplex turn's function checks take (likewise, from their first turn)."""
        self.arguments_s: float | None = None
        """Seconds the model takes to write a duplex turn's calls (likewise)."""

    def load(self) -> None:
        from omnifabric.worker.engines.reference.llm_gguf import DEFAULT_MODEL, ReplyModel
        from omnifabric.worker.engines.reference.tts import make_speaker
        from omnifabric.worker.engines.vad import model_path

        check_device(self.device)  # CUDA may have gone away between __init__ and load
        if self._torch_device.type == "cpu":
            torch.set_num_threads(1)
        t0 = time.perf_counter()
        # VAD stays on the CPU on every device: the model is ~2 MB, keeps recurrent state per
        # session and runs 32 ms windows one by one, so a GPU would only add transfers.
        self.vad_path = model_path()
        self._tts, why = make_speaker("piper", start=True)
        if why:
            log.warning("reference engine speech: %s", why)
        self._asr = self._load_recognizers()
        t1 = time.perf_counter()
        # Qwen2.5-Coder-0.5B-Instruct in llama.cpp: one server slot (KV cache) per session.
        self._llm = ReplyModel(
            device=self.device,
            model=self.llm_model or DEFAULT_MODEL,
            slots=self.default_slots + 1,
            threads=self.llm_threads,
        )
        t2 = time.perf_counter()
        log.info(
            "reference engine loaded on %s (hearing in %s): asr+tts %.1fs, llm %.1fs",
            self.device,
            self.hearing_precision(),
            t1 - t0,
            t2 - t1,
        )

    def hearing_precision(self) -> str:
        """What the loaded recognizers compute in: "bfloat16" where ``asr_precision`` "auto"
        found a CPU that computes it natively (both recognizers' encoders), else "fp32"."""
        from omnifabric.worker.engines.reference.asr import Transcriber
        from omnifabric.worker.engines.reference.linears import in_bf16

        asr = self.asr
        whisper = asr if isinstance(asr, Transcriber) else asr.whisper
        return "bfloat16" if in_bf16(whisper.encoder) else "fp32"

    def _load_recognizers(self) -> Transcriber | Ears:
        """Whisper base, with Moonshine base-en beside it unless ``asr`` is "whisper" (or its
        package is missing: then said in the log, and Whisper hears alone)."""
        from omnifabric.worker.engines.reference import moonshine
        from omnifabric.worker.engines.reference.asr import Transcriber
        from omnifabric.worker.engines.reference.hearing import Ears

        whisper = Transcriber(device=self.device, precision=self.asr_precision)
        if self.asr_choice == "whisper":
            return whisper
        if not moonshine.model_installed():
            log.warning(
                "reference engine: moonshine-cpp is not installed (pip install "
                "moonshine-cpp==0.1.4): Whisper base hears alone"
            )
            return whisper
        return Ears(whisper, moonshine.Moonshine(device=self.device, precision=self.asr_precision))

    @property
    def asr(self) -> Transcriber | Ears:
        """The recognizer (Whisper base and Moonshine base-en, or Whisper alone), once loaded."""
        if self._asr is None:
            raise RuntimeError("the reference engine is not loaded")
        return self._asr

    @property
    def llm(self) -> ReplyModel:
        """The reply model (llama.cpp), once loaded."""
        if self._llm is None:
            raise RuntimeError("the reference engine is not loaded")
        return self._llm

    @property
    def tts(self) -> TextToSpeech:
        """The speaker (Piper, or espeak-ng as the fallback), once loaded."""
        if self._tts is None:
            raise RuntimeError("the reference engine is not loaded")
        return self._tts

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Counts a unit being generated (on any engine thread) while the block runs."""
        with self._running_lock:
            self._running += 1
        try:
            yield
        finally:
            with self._running_lock:
                self._running -= 1

    #: A turn's end is estimated from the slow end (this percentile) of the last ``RECENT``
    #: hearings, function checks, calls' arguments and reply starts, not their mean: it
    #: decides whether that work is done in its unit, and a unit must end in time whichever
    #: of them comes. Measured with the means (`omnifabric eval`, 24 questions, 2-core
    #: host): 6 units that ended a turn took 0.82-1.19 s, one past its second, for first
    #: audio p50 1.72 s against 1.75 s.
    SLOW_END = 90.0
    RECENT = 20

    def _learn(self, kind: str, value: float) -> float:
        """``value`` into the recent ``kind`` measurements; their slow end (``SLOW_END``)."""
        recent = self._recent[kind]
        recent.append(value)
        return percentile(list(recent), self.SLOW_END)

    def learn_hearing(self, seconds: float, audio_s: float, drafted: bool = False) -> None:
        """The recognizers took ``seconds`` for ``audio_s`` of audio, with a draft or not."""
        from omnifabric.worker.engines.reference.asr import window_seconds

        window = window_seconds(audio_s)
        if window <= 0:
            return
        if drafted:
            self.drafted_hearing_cost = self._learn("drafted", seconds / window)
        else:
            self.hearing_cost = self._learn("hearing", seconds / window)

    def learn_reply_start(self, seconds: float) -> None:
        """A reply's start (prefill, first piece, its speech) took ``seconds``."""
        self.reply_start_s = self._learn("start", seconds)

    def learn_checks(self, seconds: float) -> None:
        """A duplex turn's function checks (``functions.choose``) took ``seconds``."""
        self.checks_s = self._learn("checks", seconds)

    def learn_arguments(self, seconds: float) -> None:
        """Writing a duplex turn's calls (``functions.fill``) took ``seconds``."""
        self.arguments_s = self._learn("arguments", seconds)

    def turn_estimate(
        self, hear_s: float, choosing: bool = False, drafted: bool = False
    ) -> float | None:
        """Seconds the end of a user's turn takes: transcribing ``hear_s`` of audio (with a
        draft, when ``drafted``), the function checks when ``choosing``, then starting the
        reply; None before all of that was measured (the checks are measured at a session's
        first turn with functions)."""
        from omnifabric.worker.engines.reference.asr import window_seconds

        if self.hearing_cost is None or self.reply_start_s is None:
            return None
        if choosing and self.checks_s is None:
            return None
        checks = (self.checks_s or 0.0) if choosing else 0.0
        cost = (self.drafted_hearing_cost if drafted else None) or self.hearing_cost
        return cost * window_seconds(hear_s) + checks + self.reply_start_s

    def slowest_call_s(self) -> float | None:
        """A finalize that ends the longest user turn (``max_utterance_s``): hearing it, the
        function checks and the calls' arguments once a session has measured them, the
        reply's start, then its next second of speech; by the slow end of this host's
        measures (None before the warm-up made them). A context window's slide, which
        prefills the kept history again, is left out."""
        turn = self.turn_estimate(self.rules.max_utterance_s, choosing=self.checks_s is not None)
        if turn is None:
            return None
        return turn + (self.arguments_s or 0.0) + (self.reply_cost or 0.0)

    def busy(self) -> bool:
        """More than one unit is being generated now: work that only saves time later (the
        prefill ahead) is skipped, so it never delays another session's unit."""
        return self._running > 1

    def voice_notes(self, ref_audio: np.ndarray | None) -> tuple[str, ...]:
        """What a session's reference voice leads to, said once in session.created."""
        if ref_audio is None or not np.asarray(ref_audio).size:
            return ()
        return (
            "reference voice: the reference engine cannot clone a voice; it speaks with its "
            f"packaged voice {self.tts.voice_name}",
        )

    def chat(self, turn: ChatTurn) -> Iterator[ChatChunk]:
        """Turn-based chat: audio parts are transcribed, the history is prefilled in a fresh
        conversation, and the reply streams in pieces of ~16 characters (with speech when
        asked). With functions (turn.tools) the reply may call them instead (``functions``:
        the calls, then the done chunk); after their outputs it answers with them. Raises
        ValueError when the last message is neither the user's nor a function's output."""
        messages = turn.messages
        if not messages or messages[-1].role not in ("user", "tool"):
            raise ValueError("the last message must be the user's (or a function's output)")
        ignored = self._ignored(turn)
        request = self._request_of(turn) if messages[-1].role == "user" else ""
        plan = functions.Plan()
        if request and turn.tools and turn.tool_choice.allows_calls():
            recent = functions.earlier_turns(messages, self._text_of)
            chosen = functions.choose(self.llm, turn, request, plan, recent)
            if chosen:
                yield ChatChunk(prefilled=True, input_tokens=plan.prompt_tokens)
                yield from self._call(turn, request, chosen, plan, ignored, recent)
                return
        conversation = self._conversation(turn, request)
        input_tokens = conversation.context_tokens + plan.prompt_tokens
        yield ChatChunk(prefilled=True, input_tokens=input_tokens)
        produced, cut = yield from self._reply(conversation, turn)
        yield ChatChunk(
            done=True,
            input_tokens=input_tokens,
            output_tokens=produced + plan.output_tokens,
            cut=cut,
            ignored=ignored,
        )

    def _reply(
        self, conversation: Conversation, turn: ChatTurn
    ) -> Generator[ChatChunk, None, tuple[int, bool]]:
        """The open reply of ``conversation`` in pieces of ~16 characters (spoken when the
        turn asks); returns the tokens produced and whether max_new_tokens cut it."""
        pending, finished, produced, cut = "", False, 0, False
        while not finished or pending:
            while not finished and len(pending) <= self.rules.piece_chars:
                if produced >= turn.max_new_tokens:
                    finished = cut = True
                    break
                delta, finished = conversation.next_tokens(1, ahead=self.rules.tokens_per_request)
                produced += 1
                pending += delta
            _, rest = split_for_speech(pending, self.rules.piece_chars) if pending else ("", "")
            piece, pending = pending[: len(pending) - len(rest)], rest
            if finished and not pending.strip():
                piece, pending = piece + pending, ""
            if piece:
                yield self._said(piece, turn.speech)
        return produced, cut

    def _said(self, text: str, speech: bool) -> ChatChunk:
        """A piece of a reply, with its speech when asked."""
        audio = np.zeros(0, np.float32)
        words = unformatted(text).strip() if speech else ""
        if words:
            audio = self.tts.synthesize(words)
        return ChatChunk(text=text, audio=audio)

    def _call(
        self,
        turn: ChatTurn,
        request: str,
        chosen: list[ToolSpec],
        plan: functions.Plan,
        ignored: tuple[str, ...],
        recent: tuple[functions.Earlier, ...] = (),
    ) -> Iterator[ChatChunk]:
        """The calls of the ``chosen`` functions, their arguments written by the model (the
        user's ``recent`` turns quoted); when none could be made, a reply in words saying so
        (the problems in ``ignored``)."""
        functions.fill_all(self.llm, request, chosen, plan, recent)
        if plan.calls:
            yield ChatChunk(tool_calls=tuple(plan.calls))
        else:
            yield self._said(functions.CANNOT, turn.speech)
        yield ChatChunk(
            done=True,
            input_tokens=plan.prompt_tokens,
            output_tokens=plan.output_tokens,
            ignored=ignored + tuple(plan.problems),
        )

    def _conversation(self, turn: ChatTurn, request: str) -> Conversation:
        """A fresh conversation of the turn's messages, its last user turn open for the
        reply (``request``: the last message's words when it is the user's). Function calls
        and outputs are written as the model's template does (``functions``)."""
        messages = turn.messages
        system = [m for m in messages if m.role == "system"]
        default = self.spoken_prompt if turn.speech else self.default_prompt
        prompt = " ".join(self._text_of(m) for m in system) or default
        if functions.has_results(messages):
            prompt = f"{prompt}\n{functions.RESULT_NOTE}"
        conversation = self.llm.conversation(prompt)
        turns = self._turns([m for m in messages if m.role != "system"], request)
        for role, text in turns[:-1]:
            conversation.add_history(role, text)
        conversation.add_user_turn(turns[-1][1])
        return conversation

    def _turns(self, messages: list[ChatMessage], request: str) -> list[tuple[str, str]]:
        """The messages as ChatML turns (role, text): a run of function outputs is one user
        turn, and when it ends the messages it asks for the answer. ``request``: the last
        message's words when it is the user's (already transcribed)."""
        turns: list[tuple[str, str]] = []
        outputs: list[str] = []
        for i, message in enumerate(messages):
            if message.role == "tool":
                outputs.append(self._text_of(message))
                continue
            if outputs:
                turns.append(("user", functions.results_text(outputs)))
                outputs = []
            last = i == len(messages) - 1 and message.role == "user"
            said = request if last else self._text_of(message)
            if message.role == "assistant":
                said = functions.assistant_text(message, said)
            turns.append((message.role, said))
        if outputs:
            turns.append(("user", functions.answer_turn(outputs)))
        return turns

    @staticmethod
    def _ignored(turn: ChatTurn) -> tuple[str, ...]:
        """What this engine accepts but cannot use, for the response metrics."""
        notes = []
        if any(isinstance(p, bytes) for m in turn.messages for p in m.parts):
            notes.append("image: the reference engine cannot see")
        if turn.temperature is not None or turn.top_p is not None:
            notes.append("temperature/top_p: the reference engine decodes greedily")
        if turn.length_penalty is not None:
            notes.append("length_penalty: no beam search in the reference engine")
        if turn.max_slice_nums is not None or turn.use_image_id is not None:
            notes.append("image config: the reference engine has no vision")
        if turn.tts_mode != "default" or turn.voice is not None:
            notes.append("tts mode/voice: the reference engine has one fixed voice")
        if turn.language:
            notes.append("tts.language: the reference engine speaks English only")
        if turn.omni_mode:
            notes.append("omni_mode: the reference engine has no vision")
        if turn.enable_thinking:
            notes.append("enable_thinking: the reference reply model has no thinking mode")
        system_audio = any(
            isinstance(p, np.ndarray) for m in turn.messages if m.role == "system" for p in m.parts
        )
        if system_audio:
            notes.append("system audio: voice references are not used (one fixed voice)")
        return tuple(notes)

    def _text_of(
        self, message: ChatMessage, hear: Callable[[np.ndarray], str] | None = None
    ) -> str:
        """The message as text: text parts as they are, audio parts transcribed (in a system
        message audio is a voice reference, not speech to read), images left out. ``hear``:
        how its audio is heard (default: the recognizer's plain transcript)."""
        hear = hear or self.asr.transcribe
        pieces = []
        for part in message.parts:
            if isinstance(part, str):
                pieces.append(part)
            elif isinstance(part, np.ndarray) and message.role != "system":
                pieces.append(hear(part.astype(np.float32, copy=False)))
        return " ".join(p.strip() for p in pieces if p.strip())

    def _request_of(self, turn: ChatTurn) -> str:
        """The words of the turn's last message, the user's request. Its audio came whole
        (an input_audio item, not streamed units), so it is heard as ``hearing.hear_item``
        hears a clip: with quiet margins, the names the turn holds as the recognizer's
        context (``hearing_names``: the system prompt's, the functions'), and, when the
        turn may call functions, at the best decoding the recognizers allow: a name or
        number misheard there becomes a wrong call. A turn without functions keeps the
        plain decoding's time."""
        from omnifabric.worker.engines.reference.hearing import hear_item

        system = " ".join(
            p for m in turn.messages if m.role == "system" for p in m.parts if isinstance(p, str)
        )
        context = hearing_context(system, turn.tools)
        closely = bool(turn.tools) and turn.tool_choice.allows_calls()
        return self._text_of(
            turn.messages[-1], lambda audio: hear_item(self.asr, audio, context, closely)[0]
        )

    #: What warm-up asks to measure a spoken reply (a short answer, as a call's are).
    WARMUP_QUESTION = "In one short sentence: what is the capital of France?"

    def warmup(self) -> GenerateResult:
        """A unit through a full session, then a short spoken reply, timed: what a session
        costs while the model speaks (its reply's compute per second of speech), the
        session's cost that matters for real time (cost_estimate)."""
        result = super().warmup()
        turn = ChatTurn(
            messages=(ChatMessage("user", (self.WARMUP_QUESTION,)),),
            max_new_tokens=24,
            speech=True,
        )
        started, speech, first = time.perf_counter(), [], None
        for chunk in self.chat(turn):  # a first turn is no dearer (measured)
            if chunk.audio.size:
                speech.append(chunk.audio)
                first = first or time.perf_counter() - started
        if speech:
            spoken = np.concatenate(speech)
            replied_s = time.perf_counter() - started
            self.reply_cost = replied_s / (spoken.size / OUTPUT_RATE)
            self.learn_reply_start(first or 0.0)
            # What a turn's end costs to hear: the recognizers on the reply's own speech.
            heard = resample(spoken, OUTPUT_RATE, INPUT_RATE)
            t0 = time.perf_counter()
            self.asr.hear(heard, spread=True)  # alone, as a turn's end mostly is
            heard_s = time.perf_counter() - t0
            self.learn_hearing(heard_s, heard.size / INPUT_RATE)
            log.info(
                "reference engine: a turn's end costs %.3f s per s of the recognizers' "
                "window to hear and %.2f s to start the reply (warm-up); a unit does it "
                "when it fits in %.0f%% of the unit, else the unit's finalize does and the "
                "next unit speaks",
                self.hearing_cost or 0.0,
                self.reply_start_s or 0.0,
                self.rules.inline_share * 100,
            )
            self.parallel_units = self._measure_parallel(turn, heard, replied_s + heard_s)
        return result

    #: What each engine thread beyond the first must add, in work of one thread alone, to
    #: count for the headroom (two threads count when together they do 1.8 times one's work).
    PARALLEL_GAIN = 0.8

    def _measure_parallel(self, turn: ChatTurn, heard: np.ndarray, alone_s: float) -> int:
        """Units the engine computes at once at full speed: `concurrency` copies of the
        warm-up's reply and hearing, run together, against one alone. Each part runs several
        threads of its own (llama.cpp, the recognizers), so on a host of few cores two
        engine threads may give little more than one.

        One alone is the quickest of `alone_s` (the warm-up's first reply) and a run just
        before and just after the copies: the first reply alone may be slowed by what it
        is the first to touch, or by other work on the host, and a slow "alone" against a
        quick "together" counted a thread that was not there (2026-11-27, load 4-7 from
        other processes: 16.11 s alone, cold, against 5.59 s for two warm copies gave 5.76
        times one's work and 2 threads counted; the host's two cores did ~1.0 time)."""
        threads = self.concurrency
        if threads <= 1 or alone_s <= 0:
            return 1

        def one() -> None:
            for _ in self.chat(turn):
                pass
            self.asr.hear(heard)

        before = _timed(one)
        started = time.perf_counter()
        with ThreadPoolExecutor(threads, thread_name_prefix="warmup") as pool:
            for done in [pool.submit(one) for _ in range(threads)]:
                done.result()
        together_s = time.perf_counter() - started
        alone_s = min(alone_s, before, _timed(one))
        gain = threads * alone_s / together_s
        units = max(1, min(threads, 1 + math.floor((gain - 1) / self.PARALLEL_GAIN + 1e-9)))
        log.info(
            "reference engine: %d replies at once took %.2f s against %.2f s for one: %.2f "
            "times the work of one engine thread, so the real-time headroom counts %d",
            threads,
            together_s,
            alone_s,
            gain,
            units,
        )
        return units

    def cost_estimate(self, mode: str, warmup_s: float) -> float:
        """A duplex session's: its spoken reply's compute per second of speech, measured at
        warm-up (listening costs far less, but the admitted must keep real time while they
        speak)."""
        if mode == "chat" or self.reply_cost is None:
            return super().cost_estimate(mode, warmup_s)
        return self.reply_cost

    def open_session(self, session_id: str, mode: str) -> ReferenceSession:
        if mode not in self.modes:
            raise ValueError(f"mode {mode!r} not served")
        return ReferenceSession(self, session_id, mode)
