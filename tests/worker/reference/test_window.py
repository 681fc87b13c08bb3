"""Context windows in the reference engine (issue 40): the reply model's history forgets
its oldest exchanges (scripted, then the real model), and sessions with a basic or a
context window slide instead of filling up (real models, the committed fixtures)."""

from __future__ import annotations

import time

import pytest

from omnifabric.worker.engine import DuplexSettings
from omnifabric.worker.engines.reference.engine import (
    CARRIED_NOTE,
    UNIT_TOKENS,
    ReferenceEngine,
    ReferenceSession,
)
from omnifabric.worker.engines.reference.llm_gguf import (
    SHIFT_MIN_TOKENS,
    Completion,
    Conversation,
    Exchange,
)
from tests.conftest import scaled
from tests.worker.reference.drive import load_fixture, units_of

pytestmark = pytest.mark.timeout(scaled(600))


# ---- Conversation.forget on a scripted model (no weights) --------------------------------------


class _Scripted:
    """A stand-in ReplyModel: turns as readable ids, completions from a script."""

    im_end_id = 2
    stop_ids = frozenset({2})
    special_ids = frozenset({2, 3})
    newline_ids = [10]

    def __init__(self) -> None:
        self.script: list[tuple[int, bytes]] = []
        self.requests: list[list[int]] = []
        self.shifts: list[int] = []

    def turn_ids(self, role: str, content: str) -> list[int]:
        return [1, ord(role[0]), *content.encode(), 2, 10]

    def encode(self, text: str) -> list[int]:
        return [1, 97, 10]  # the assistant header

    def slot_for(self, owner: object, slot: int | None) -> int:
        return 0

    def holds(self, owner: object, slot: int | None) -> bool:
        return slot == 0

    def complete(
        self, ids: list[int], n: int, penalty_window: int, slot: int, shift: int = 0
    ) -> Completion:
        self.requests.append(list(ids))
        self.shifts.append(shift)
        out = self.script[:n]
        del self.script[:n]
        return Completion(out, bool(out) and out[-1][0] == 2, len(ids), len(ids))


def _answer(model: _Scripted, conv: Conversation, question: str, reply: str) -> None:
    model.script = [(50 + i, c.encode()) for i, c in enumerate(reply)] + [(2, b"")]
    conv.add_user_turn(question)
    while not conv.next_tokens(1)[1]:
        pass
    conv.end_turn()


def test_forget_drops_the_oldest_whole_exchanges_and_keeps_the_system_message() -> None:
    model = _Scripted()
    conv = Conversation(model, "sys")  # type: ignore[arg-type]
    system = model.turn_ids("system", "sys")
    _answer(model, conv, "q1", "a1")
    conv.add_history("user", "q2")  # a repaired turn: history only
    conv.add_history("assistant", "again?")
    _answer(model, conv, "q3", "a3")
    assert conv.exchanges() == [
        Exchange(len(model.turn_ids("user", "q1")) + 3 + 2 + 2, "a1"),
        Exchange(
            len(model.turn_ids("user", "q2")) + len(model.turn_ids("assistant", "again?")), "again?"
        ),
        Exchange(len(model.turn_ids("user", "q3")) + 3 + 2 + 2, "a3"),
    ]
    total = conv.context_tokens
    first, second = (e.tokens for e in conv.exchanges()[:2])
    conv.forget(2)
    assert conv.context_tokens == total - first - second
    assert conv._ids[: len(system)] == system
    assert conv._ids[len(system) : len(system) + 3] == model.turn_ids("user", "q3")[:3]
    assert [e.said for e in conv.exchanges()] == ["a3"]
    # The slot gets the new context at once, its kept turns shifted into place (llama.cpp's
    # cache reuse) while it is still this conversation's; forget(shift=False) computes them.
    assert model.requests[-1] == conv._ids and model.shifts[-1] > 0
    conv.forget(0, shift=False)
    assert model.requests[-1] == conv._ids and model.shifts[-1] == 0
    # A note goes into the system message; the history stays.
    conv.forget(0, "Earlier: a1")
    noted = model.turn_ids("system", "sys\nEarlier: a1")
    assert conv._ids[: len(noted)] == noted and conv.note == "Earlier: a1"
    assert conv.context_tokens == total - first - second + len(noted) - len(system)
    assert [e.said for e in conv.exchanges()] == ["a3"]
    with pytest.raises(ValueError):
        conv.forget(2)


def test_an_open_reply_is_never_forgotten_and_goes_on_in_the_new_context() -> None:
    model = _Scripted()
    conv = Conversation(model, "sys")  # type: ignore[arg-type]
    _answer(model, conv, "q1", "a1")
    model.script = [(60, b"x"), (61, b"y"), (62, b"z"), (2, b"")]
    conv.add_user_turn("q2")
    assert conv.next_tokens(1) == ("x", False)
    assert len(conv.exchanges()) == 1  # the open one is not closed
    with pytest.raises(ValueError):
        conv.forget(2)
    # The next token ("y", chosen already) is chosen again after the shorter context, and
    # the reply goes on.
    model.script = [(61, b"y"), (62, b"z"), (2, b"")]
    conv.forget(1)
    assert conv.exchanges() == []
    assert model.requests[-1] == conv._ids
    text = conv.reply_text
    while not (step := conv.next_tokens(1))[1]:
        text += step[0]
    assert text + step[0] == "xyz" and conv.reply_text == "xyz"
    conv.end_turn()
    assert [e.said for e in conv.exchanges()] == ["xyz"]


# ---- real models ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(inline_engine: ReferenceEngine) -> ReferenceEngine:
    # As test_engine's, the same one (warmed up when test_engine ran first): the unit that
    # ends the turn does its work itself (exact timelines).
    return inline_engine


def _reply(conv: Conversation, limit: int = 60) -> str:
    for _ in range(limit):
        if conv.next_tokens(1)[1]:
            break
    conv.end_turn()
    return conv.reply_text


@pytest.mark.ci_long  # a conversation on the real reply model: ~8 s (tests/conftest.py)
def test_the_reply_model_forgets_dropped_turns_and_keeps_the_carried_note(engine) -> None:
    llm = engine.llm
    conv = llm.conversation("You are a helpful assistant. Reply in one short sentence.")
    for question in ("My name is Anna.", "What is the capital of France?", "Which animal barks?"):
        conv.add_user_turn(question)
        _reply(conv)
    t0 = time.perf_counter()
    computed = conv.forget(1)
    took = (time.perf_counter() - t0) * 1000.0
    # llama.cpp's slot holds exactly the new context; the kept exchanges were shifted into
    # place, not computed again.
    assert conv.last is not None and conv.last.prompt_tokens == conv.context_tokens
    assert computed <= SHIFT_MIN_TOKENS
    conv.add_user_turn("What is my name?")
    forgot = _reply(conv)
    assert "Anna" not in forgot, forgot
    conv.forget(len(conv.exchanges()), f"{CARRIED_NOTE}\nNice to meet you, Anna!")
    assert conv.context_tokens == len(llm.turn_ids("system", f"{conv._system}\n{conv.note}"))
    conv.add_user_turn("What is my name?")
    carried = _reply(conv)
    assert "Anna" in carried, carried
    print(f"\nforget 1 of 3 exchanges: {computed} tokens computed in {took:.0f} ms")


def _run(
    session: ReferenceSession, fixtures: list[str], high: int | None = None
) -> tuple[list[dict], str]:
    """Feed the fixtures, one after the other, through ``session``; per unit: the result's
    kv_cache_length, the text tokens its generate added, the length after its finalize
    and the kept units; and all the text said."""
    rows, said = [], ""
    for name in fixtures:
        for unit in units_of(load_fixture(name)):
            session.prefill(unit, [], 1)
            before = session.conversation.context_tokens
            result = session.generate(False)
            added = session.conversation.context_tokens - before
            session.finalize()
            said += result.text
            conv = session.conversation
            rows.append(
                {
                    "kv": result.kv_cache_length,
                    "text": added,
                    "after": session.kv_cache_length,
                    "kept": session.kept_units,
                    "slide_ms": session.finalize_costs.get("slide"),
                    # What llama.cpp's slot holds after the unit: the context's length.
                    "slot": conv.last.prompt_tokens if conv.last else -1,
                    "context": conv.context_tokens,
                }
            )
    return rows, said


@pytest.mark.ci_long  # a conversation of ~75 units on the real models: ~12-20 s (tests/conftest.py)
def test_basic_window_slides_below_the_high_watermark_and_keeps_answering(engine) -> None:
    high, low = 400, 250
    settings = DuplexSettings(
        context_window="basic", window_high_tokens=high, window_low_tokens=low
    )
    session = engine.open_session("window-basic", "audio")
    try:
        session.prepare("", None, None, settings)
        t0 = time.perf_counter()
        rows, said = _run(session, ["two_questions"] * 3)
        took = time.perf_counter() - t0
        conv = session.conversation
        ids = list(conv._ids)
        exchanges = len(conv.exchanges())
        slides = session.slides
    finally:
        session.close()
    # Never past the high watermark by more than one unit's tokens (13 and the text its
    # generate added); after every finalize, at or under it.
    for row in rows:
        assert row["kv"] <= high + UNIT_TOKENS + row["text"], rows
        assert row["after"] <= high, rows
    assert max(r["kv"] for r in rows) > high  # it did get there, more than once
    assert slides >= 2
    # Six questions were answered; the history kept fewer exchanges.
    assert exchanges < 6
    assert said.count("Paris") >= 3 and said.count("blue") >= 3, said
    # The accounting is the kept units and the real context; llama.cpp holds that context.
    assert rows[-1]["after"] == UNIT_TOKENS * rows[-1]["kept"] + len(ids)
    slid = [r for r in rows if r["slide_ms"] is not None]
    assert all(r["slot"] == r["context"] for r in slid), slid
    assert engine.llm.tokenizer.decode(ids).count("helpful voice assistant") == 1
    slide_ms = [r["slide_ms"] for r in rows if r["slide_ms"] is not None]
    print(
        f"\nbasic window: {len(rows)} units in {took:.1f} s, {slides} slides, slide ms "
        f"{[round(ms) for ms in slide_ms]}; kv max {max(r['kv'] for r in rows)}"
    )


@pytest.mark.ci_long  # a conversation of ~40 units on the real models: ~8-13 s
def test_context_window_keeps_its_units_and_carries_what_was_said(engine) -> None:
    units = 10
    settings = DuplexSettings(
        context_window="context", window_units=units, window_previous_tokens=24
    )
    session = engine.open_session("window-context", "audio")
    try:
        session.prepare("", None, None, settings)
        rows, said = _run(session, ["two_questions", "question"])
        conv = session.conversation
        ids = list(conv._ids)
        carried = session.carried
    finally:
        session.close()
    assert all(r["kept"] <= units for r in rows)
    assert rows[-1]["kept"] == units
    assert rows[-1]["after"] == UNIT_TOKENS * units + len(ids)
    # The first answer ("... Paris.") left the history and rides in the system message,
    # at most window_previous_tokens long; llama.cpp holds that context.
    context = engine.llm.tokenizer.decode(ids)
    system = context.split("<|im_end|>", 1)[0]
    assert CARRIED_NOTE in system and carried in system and carried, context
    assert len(engine.llm.encode(carried)) <= 24
    assert "blue" in carried.lower() or "paris" in carried.lower(), carried
    slid = [r for r in rows if r["slide_ms"] is not None]
    assert slid and all(r["slot"] == r["context"] for r in slid), slid
    assert said.count("Paris") == 2 and "blue" in said, said
