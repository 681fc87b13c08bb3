"""The reference engine's duplex sessions call functions (issue 53), with its real models: a
spoken request ends the user's turn in a call (the chat path's rule:
worker/engines/reference/functions.py), the session listens until the call's output comes
(tool_output), and the reply that answers with it is spoken as any reply."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from omnifabric.common.tools import NONE
from omnifabric.tools.eval_reference import render
from omnifabric.worker.engine import DuplexSettings, GenerateResult, ToolChoice, ToolSpec
from omnifabric.worker.engines.reference.engine import ReferenceEngine
from tests.worker.reference.drive import units_of

WEATHER = ToolSpec(
    "get_weather",
    "Get the current weather in a city.",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city's name."}},
        "required": ["city"],
    },
)
OUTPUT = '{"temperature_c": 17, "conditions": "light rain"}'
SILENCE = np.zeros(16000, np.float32)

#: Spoken sessions on the real models, ~2 minutes: CI's long group (tests/conftest.py).
pytestmark = pytest.mark.ci_long


@pytest.fixture(scope="module")
def question() -> list[np.ndarray]:
    """ "What's the weather in Paris?" in Piper's voice after 0.5 s of silence, in 1 s units."""
    spoken = render("piper", "joe", 1.0, "What's the weather in Paris?")
    return units_of(np.concatenate([np.zeros(8000, np.float32), spoken]))


class Duplex:
    """A duplex session of the engine with get_weather offered under ``choice``."""

    def __init__(
        self, engine: ReferenceEngine, choice: ToolChoice, turn_work: str | None = None
    ) -> None:
        """``turn_work``: the session's own (TurnRules.turn_work), else the engine's."""
        self.engine = engine
        self.session = engine.open_session("test-duplex-tools", "audio")
        rules = engine.rules
        if turn_work is not None:
            engine.rules = replace(rules, turn_work=turn_work)
        try:
            self.session.prepare("", None, None, DuplexSettings())
        finally:
            engine.rules = rules
        self.notes = self.session.offer_tools((WEATHER,), choice)
        self.finalized: list[dict[str, float]] = []

    def unit(self, pcm: np.ndarray = SILENCE) -> GenerateResult:
        self.session.prefill(pcm, [], 1)
        result = self.session.generate(False)
        self.session.finalize()
        self.finalized.append(dict(self.session.finalize_costs))
        return result

    def until(self, done: Callable[[GenerateResult], bool], units: list[np.ndarray], most: int):
        """Results of ``units`` then silence, up to the first that is ``done`` (at most
        ``most`` units in all)."""
        results: list[GenerateResult] = []
        for i in range(most):
            results.append(self.unit(units[i] if i < len(units) else SILENCE))
            if done(results[-1]):
                break
        return results

    def context(self) -> str:
        conversation = self.session.conversation
        assert conversation is not None
        return self.engine.llm.tokenizer.decode(conversation._ids)

    def close(self) -> None:
        self.session.stop()
        self.session.close()


def test_a_spoken_weather_question_is_a_call_and_its_output_the_spoken_reply(
    inline_engine, question
) -> None:
    s = Duplex(inline_engine, ToolChoice())
    try:
        assert s.notes == ()  # it calls: no note that it cannot
        heard = s.until(lambda r: bool(r.tool_calls), question, len(question) + 3)
        turn = heard[-1]
        (call,) = turn.tool_calls
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        # The unit that ends the user's turn makes the call (the checks and the arguments
        # ran in it: the engine's turn work is inline), says nothing, and ends the model's turn.
        assert turn.is_listen and turn.end_of_turn
        assert "tools" in turn.costs_ms and "tool_arguments" in turn.costs_ms
        assert "weather" in turn.input_transcript.lower() and turn.n_tokens > 0
        assert not any(r.text or r.audio.size for r in heard)
        # It listens while the function runs; an output of a call it did not make is ignored.
        s.session.tool_output("call_unknown", "sunny")
        waiting = [s.unit(), s.unit()]
        assert all(r.is_listen and not r.text and not r.tool_calls for r in waiting)
        s.session.tool_output(call.call_id, OUTPUT)
        reply = s.until(lambda r: r.end_of_turn, [], 30)
        said = "".join(r.text for r in reply)
        assert not reply[0].is_listen and "17" in said and "rain" in said.lower(), said
        assert reply[-1].end_of_turn and sum(r.audio.size for r in reply) > 24000
        # The call and its output are in the conversation as the model's template writes them.
        context = s.context()
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in context
        assert f"<tool_response>\n{OUTPUT}\n</tool_response>" in context
    finally:
        s.close()


def test_with_tool_choice_none_the_question_gets_a_spoken_reply(inline_engine, question) -> None:
    s = Duplex(inline_engine, ToolChoice(NONE))
    try:
        results = s.until(lambda r: not r.is_listen, question, len(question) + 3)
        spoken = s.unit()  # the reply's next second, made by the finalize before it
        assert not any(r.tool_calls for r in [*results, spoken])
        first = results[-1]
        assert "weather" in first.input_transcript.lower() and "tools" not in first.costs_ms
        assert first.text and first.audio.size and spoken.audio.size
    finally:
        s.close()


def test_in_finalize_the_checks_and_the_arguments_run_after_units(inline_engine, question) -> None:
    s = Duplex(inline_engine, ToolChoice(), turn_work="finalize")
    try:
        results = s.until(lambda r: bool(r.tool_calls), question, len(question) + 4)
        # The turn's end did not go in its unit: its finalize heard it and ran the checks,
        # the next unit listened and its finalize wrote the call, which the unit after makes
        # (every engine call stays short: the worker ends a session over its unit timeout).
        assert "tools" in s.finalized[-3] and "tool_arguments" in s.finalized[-2]
        assert results[-2].is_listen and not results[-2].input_transcript
        assert results[-1].input_transcript and results[-1].end_of_turn
        assert not any(r.costs_ms for r in results[-3:])
        s.session.tool_output(results[-1].tool_calls[0].call_id, OUTPUT)
        # The answer starts in a finalize too: the next unit sends its first piece.
        started = s.unit()
        assert started.is_listen and "llm_prefill" in s.finalized[-1]
        assert not s.unit().is_listen
    finally:
        s.close()


def test_where_the_sender_takes_results_between_units_calls_go_out_from_the_finalize(
    inline_engine, question
) -> None:
    # EngineSession.early_sink (the realtime dialects): the turn's work is in finalizes, as
    # above, and what they make goes out at once: the call from the finalize that wrote
    # it, the answer's first piece from the finalize that began it; no unit carries them.
    s = Duplex(inline_engine, ToolChoice(), turn_work="auto")
    sent: list[GenerateResult] = []
    s.session.early_sink = sent.append
    try:
        units = s.until(lambda r: any(e.tool_calls for e in sent), question, len(question) + 4)
        assert all(r.is_listen and not r.tool_calls and not r.text for r in units)
        (called,) = sent
        (call,) = called.tool_calls
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        assert called.is_listen and called.end_of_turn and called.input_audio_tokens == 0
        assert "weather" in called.input_transcript.lower()
        assert "tools" in s.finalized[-2] and "tool_arguments" in s.finalized[-1]
        sent.clear()
        s.session.tool_output(call.call_id, OUTPUT)
        assert s.unit().is_listen  # the answer begins in this unit's finalize ...
        first = sent[0]  # ... which sends its first piece at once
        assert not first.is_listen and first.text and first.audio.size
        said = [r.text for r in sent]
        for _ in range(30):
            sent.clear()
            r = s.unit()
            said += [r.text, *(e.text for e in sent)]
            if r.end_of_turn or any(e.end_of_turn for e in sent):
                break
        reply = "".join(said)
        assert "17" in reply and "rain" in reply.lower(), reply
    finally:
        s.close()


def test_the_turn_estimate_counts_the_checks_once_measured() -> None:
    engine = ReferenceEngine()  # not loaded: the estimate is arithmetic on what it learned
    engine.hearing_cost, engine.reply_start_s = 0.1, 0.3  # 2 s of audio: a 5 s window
    assert engine.turn_estimate(2.0) == pytest.approx(0.8)
    assert engine.turn_estimate(2.0, choosing=True) is None  # unknown: not in the unit
    engine.learn_checks(0.2)
    assert engine.turn_estimate(2.0, choosing=True) == pytest.approx(1.0)
    assert engine.turn_estimate(2.0) == pytest.approx(0.8)
