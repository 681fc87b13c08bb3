"""Function calling in the minicpmo engine's duplex sessions, the plumbing (opt-in, tiny
random checkpoint; see conftest): the functions go into the duplex system prompt through the
checkpoint's chat template, the model's "<tool_call>" text comes back as checked calls and
is never spoken, a call's output goes back into the session's context, alone (the serial
path, the public code) and in a batched step (step.py) beside sessions without functions.

The tiny model's words are random, so each scripted session's decoder is made to choose the
script's tokens, unit by unit (the logits it decides from get the script's next token
raised; every rule of the decoder still runs): alone through the decoder's own decode, in
a batched step through the step's decide.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pytest
import torch

from omnifabric.common.tools import NONE
from omnifabric.worker.engine import DuplexSettings, GenerateResult, StepRow, ToolChoice
from omnifabric.worker.engines import tool_text
from omnifabric.worker.engines.minicpmo import decode as decode_module
from omnifabric.worker.engines.minicpmo.calls import CALL_OPEN, tools_text
from tests.worker.minicpmo.conftest import LAYOUTS, ON, WEATHER, needs_code

pytestmark = [needs_code, pytest.mark.timeout(900)]

PROMPT = "Be brief."
OUTPUT = "18 C"
#: A unit the model listens in.
LISTEN = None
#: Speech before the call, then the call over three units (each under the unified layout's
#: 28 characters), the last ending the model's turn; the model listens after it.
CALL = [
    LISTEN,
    ("Let me see. <tool_call>", False),
    ('{"name": "get_weather", ', False),
    ('"arguments": {"city": ', False),
    ('"Paris"}}</tool_call>', True),
    LISTEN,
    LISTEN,
]


@pytest.fixture(scope="module", params=[layout for layout, _ in LAYOUTS] or ["none"])
def eng(request, tiny_dirs):
    """The engine with three slots and the batched step, per layout the code offers."""
    from omnifabric.worker.engines.minicpmo import MiniCPMOEngine
    from omnifabric.worker.engines.minicpmo.step import MiniCPMOStepper

    layout = request.param
    code = dict(LAYOUTS)[layout]
    engine = MiniCPMOEngine(
        str(tiny_dirs[code]), slots=3, api=layout, stepper_class=MiniCPMOStepper, **ON
    )
    engine.load()
    return engine


@pytest.fixture
def spoken(eng, monkeypatch) -> dict[int, list[list[int]]]:
    """The token ids each TTS condition was made of, per duplex object (a list a unit); the
    vocoder is replaced by silence (CPU), in both paths."""
    from omnifabric.worker.engines.minicpmo import tts

    duplex_class = type(eng._free[0].duplex)
    convert = duplex_class._convert_results_to_tts_input
    cut = tts.BatchedTTS._spoken  # the batched step's (its conditions made at once)
    seen: dict[int, list[list[int]]] = {}

    def recorded(self, results):
        seen.setdefault(id(self), []).append([int(r[0]) for r in results])
        return convert(self, results)

    def recorded_row(row):
        entries = cut(row)
        seen.setdefault(id(row.duplex), []).append([int(r[0]) for r in entries])
        return entries

    def silence(self, new_tokens, prompt_wav_path, is_last_chunk=False, force_flush=False):
        return np.zeros(240, np.float32)

    monkeypatch.setattr(duplex_class, "_convert_results_to_tts_input", recorded)
    monkeypatch.setattr(tts.BatchedTTS, "_spoken", staticmethod(recorded_row))
    monkeypatch.setattr(duplex_class, "_generate_waveform_from_tokens", silence)
    monkeypatch.setattr(eng, "vocoder_batched", False)
    return seen


class Script:
    """The tokens a session's decoder is made to choose: per unit, listen (None) or
    `<|speak|>`, the text's tokens (and `<|turn_eos|>` to end the turn), `<|chunk_eos|>`."""

    def __init__(self, engine, units: list[tuple[str, bool] | None]) -> None:
        tok = engine.tokenizer
        ids = tok.convert_tokens_to_ids
        self.units: list[list[int]] = []
        for unit in units:
            if unit is None:
                self.units.append([ids("<|listen|>")])
                continue
            text, ends = unit
            words = tok.encode(text, add_special_tokens=False)
            end = [ids("<|turn_eos|>")] if ends else []
            self.units.append([ids("<|speak|>"), *words, *end, ids("<|chunk_eos|>")])
        self.unit, self.at = -1, 0

    def next_unit(self) -> None:
        self.unit, self.at = self.unit + 1, 0

    def bias(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with the script's next token raised far above the others."""
        tokens = self.units[self.unit] if 0 <= self.unit < len(self.units) else []
        if self.at < len(tokens):
            logits = logits.clone()
            logits[..., tokens[self.at]] += 1e4
        self.at += 1
        return logits


@pytest.fixture
def scripts(monkeypatch) -> dict[int, Script]:
    """id(session) -> its Script, for the batched step's draws (whether the host reads each
    forward or the device runs ahead, every forward's decisions go through decode._draw)."""
    table: dict[int, Script] = {}
    draw = decode_module._draw

    def scripted(engine, rows, plans, logits, history):
        biased = [
            table[id(row.session)].bias(logits[k : k + 1])
            if id(row.session) in table
            else logits[k : k + 1]
            for k, row in enumerate(rows)
        ]
        return draw(engine, rows, plans, torch.cat(biased), history)

    monkeypatch.setattr(decode_module, "_draw", scripted)
    return table


def units(engine, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = [engine.first_unit_samples] + [engine.unit_samples] * (n - 1)
    return [(0.02 * rng.standard_normal(k)).astype(np.float32) for k in sizes]


class Session:
    """A session of a test: its engine session, script, units and results."""

    def __init__(self, engine, name, script=None, tools=(WEATHER,), choice=None, tts=False):
        s = engine.open_session(name, "audio")
        s.prepare(PROMPT, None, None, DuplexSettings(force_listen_count=0, temperature=0))
        self.offered_notes = s.offer_tools(tools, choice or ToolChoice())
        d = s.handle.duplex
        d.generate_audio = tts
        if tts:
            d.tts_eos_token = torch.tensor([engine.model.tts.config.num_audio_tokens - 1])
        self.s, self.script, self.results = s, script, []
        self.kv_after: list[int] = []
        if script is not None:
            decoder, own = d.decoder, d.decoder.decode

            def scripted(*args, logits, **kwargs):
                return own(*args, logits=script.bias(logits), **kwargs)

            decoder.decode = scripted

    def close(self) -> None:
        vars(self.s.handle.duplex.decoder).pop("decode", None)
        self.s.close()

    def took(self, result: GenerateResult, respond: bool) -> None:
        """The unit's result; a call is answered (the output before the next unit)."""
        self.results.append(result)
        self.kv_after.append(self.s.kv_length())
        for call in result.tool_calls if respond else ():
            self.s.tool_output(call.call_id, OUTPUT)


def alone(session: Session, pcm: list[np.ndarray], respond: bool = True) -> Session:
    """The session's units through its own serial path (the model's public code)."""
    try:
        for unit in pcm:
            if session.script is not None:
                session.script.next_unit()
            session.s.prefill(unit, [], 1)
            result = session.s.generate(False)
            session.s.finalize()
            session.took(result, respond)
    finally:
        session.close()
    return session


def together(engine, sessions, pcms, table, respond: bool = True) -> list[Session]:
    """The sessions' units in batched steps, one unit of each a step."""
    stepper = engine.stepper()
    for session in sessions:
        if session.script is not None:
            table[id(session.s)] = session.script
    try:
        for u in range(len(pcms[0])):
            for session in sessions:
                if session.script is not None:
                    session.script.next_unit()
            rows = [
                StepRow(x.s, pcm[u], [], 1, False) for x, pcm in zip(sessions, pcms, strict=True)
            ]
            outcome = stepper.step(rows)
            for got in outcome.rows:
                if isinstance(got, Exception):
                    raise got
            assert stepper.finalize([x.s for x in sessions]) == [None] * len(sessions)
            for session, got in zip(sessions, outcome.rows, strict=True):
                session.took(got[1], respond)
    finally:
        for session in sessions:
            session.close()
    return sessions


def summary(result: GenerateResult) -> tuple[Any, ...]:
    calls = [(c.name, json.loads(c.arguments)) for c in result.tool_calls]
    return (result.is_listen, result.text, result.end_of_turn, result.audio.size > 0, calls)


#: What the scripted call's session gives, unit by unit (listen, text, end of turn, audio,
#: calls): the words before the call spoken, the call's units silent, the call on the unit
#: that ends the turn.
CALLED = [
    (True, "", False, False, []),
    (False, "Let me see. ", False, True, []),
    (False, "", False, False, []),
    (False, "", False, False, []),
    (True, "", True, False, [("get_weather", {"city": "Paris"})]),
    (True, "", False, False, []),
    (True, "", False, False, []),
]


# ---- tests ---------------------------------------------------------------------------


def test_the_tools_block_goes_into_the_duplex_prompt(eng) -> None:
    bare = eng.open_session("bare", "audio")
    offered = eng.open_session("offered", "audio")
    prompts: list[str] = []
    own = offered.handle.prepare
    offered.handle.prepare = lambda prompt, *rest: (prompts.append(prompt), own(prompt, *rest))
    try:
        for s in (bare, offered):
            s.prepare(PROMPT, None, None, DuplexSettings())
        assert offered.offer_tools((WEATHER,), ToolChoice()) == ()
        block = tools_text(eng.tokenizer, (WEATHER,), ToolChoice())
        assert prompts == [PROMPT, f"{PROMPT}\n\n{block}"]
        assert "<tools>" in block and '"name": "get_weather"' in block
        assert offered.kv_length() > bare.kv_length() + 50
        assert offered.watch is not None and bare.watch is None
    finally:
        del offered.handle.prepare
        bare.close()
        offered.close()


@pytest.mark.parametrize("tools", [(), (WEATHER,)])
def test_without_functions_or_with_none_nothing_is_offered(eng, tools) -> None:
    s = eng.open_session("none", "audio")
    try:
        length = s.prepare(PROMPT, None, None, DuplexSettings())
        assert s.offer_tools(tools, ToolChoice(NONE)) == ()
        assert s.kv_length() == length and s.watch is None
        assert "_convert_results_to_tts_input" not in vars(s.handle.duplex)
    finally:
        s.close()


def test_a_scripted_call_becomes_a_checked_call_and_is_never_spoken(eng, spoken) -> None:
    session = Session(eng, "call", Script(eng, CALL), tts=True)
    duplex = session.s.handle.duplex
    alone(session, units(eng, len(CALL), 1), respond=False)
    assert [summary(r) for r in session.results] == CALLED
    (call,) = session.results[4].tool_calls
    assert call.call_id.startswith("call_")
    # Only the words before the call reached the TTS; the call's units ran without it.
    said = eng.tokenizer.encode("Let me see. ", add_special_tokens=False)
    assert spoken[id(duplex)] == [said]
    assert "_convert_results_to_tts_input" not in vars(duplex)  # closed: the code's own


@pytest.mark.parametrize(
    ("call", "problem"),
    [
        (['<tool_call>{"name": ', '"get_time", "arguments": ', "{}}</tool_call>"], "get_time"),
        (
            ['<tool_call>{"name": ', '"get_weather", ', '"arguments": {"town": ', '"P"}}'],
            "arguments.city is required",
        ),
    ],
)
def test_a_call_that_does_not_fit_is_not_passed_on(eng, caplog, call, problem) -> None:
    script = [LISTEN, *[(piece, False) for piece in call[:-1]], (call[-1], True), LISTEN]
    session = Session(eng, "bad", Script(eng, script))
    with caplog.at_level(logging.WARNING, "omnifabric.worker.minicpmo"):
        alone(session, units(eng, len(script), 2))
    assert all(not r.tool_calls for r in session.results)
    assert all(CALL_OPEN not in r.text and "get_" not in r.text for r in session.results)
    last = session.results[len(call)]
    assert last.end_of_turn and last.is_listen
    assert problem in caplog.text and "calls not made" in caplog.text


def test_an_output_goes_back_into_the_context(eng, spoken) -> None:
    pcm = units(eng, len(CALL), 3)
    answered = alone(Session(eng, "answered", Script(eng, CALL), tts=True), pcm)
    unanswered = Session(eng, "unanswered", Script(eng, CALL), tts=True)
    alone(unanswered, pcm, respond=False)
    assert [summary(r) for r in answered.results] == CALLED
    results = eng.tokenizer.encode(tool_text.results_text([OUTPUT]), add_special_tokens=False)
    grown = [a - b for a, b in zip(answered.kv_after, unanswered.kv_after, strict=True)]
    assert grown == [0] * 5 + [len(results)] * 2  # fed with the unit after the call
    # An output for a call not awaited (unknown, or given twice) changes nothing.
    s = eng.open_session("other", "audio")
    try:
        s.prepare(PROMPT, None, None, DuplexSettings())
        s.offer_tools((WEATHER,), ToolChoice())
        s.tool_output("call_unknown", OUTPUT)
        assert s.watch is not None and s.watch.results == []
    finally:
        s.close()


def test_batched_rows_equal_their_solo_runs(eng, spoken, scripts) -> None:
    pcms = [units(eng, len(CALL), 10 + k) for k in range(3)]

    def sessions(tag: str) -> list[Session]:
        return [
            Session(eng, f"{tag}-called", Script(eng, CALL), tts=True),
            Session(eng, f"{tag}-plain", tools=()),  # no functions: the model decides
            Session(eng, f"{tag}-none", tools=(WEATHER,), choice=ToolChoice(NONE)),
        ]

    solo, solo_spoken = [], []
    for x, pcm in zip(sessions("solo"), pcms, strict=True):
        solo.append(alone(x, pcm))
        solo_spoken.append(spoken.pop(id(x.s.handle.duplex), []))
    both = together(eng, sessions("batch"), pcms, scripts)
    both_spoken = [spoken.pop(id(x.s.handle.duplex), []) for x in both]
    assert [summary(r) for r in both[0].results] == CALLED
    for a, b in zip(solo, both, strict=True):
        assert [summary(r) for r in a.results] == [summary(r) for r in b.results]
        assert a.kv_after == b.kv_after
        assert [r.n_tokens for r in a.results] == [r.n_tokens for r in b.results]
    assert solo_spoken == both_spoken
    assert both_spoken[0] == [eng.tokenizer.encode("Let me see. ", add_special_tokens=False)]
