"""GGUF reply model in llama.cpp: weight assembly, byte-exact streaming, and (real weights)
answers, memory across turns, independent interleaved conversations, real token counts."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnifabric.worker.engines.reference import llm_gguf
from omnifabric.worker.engines.reference.llm_gguf import (
    Completion,
    Conversation,
    GgufWeights,
    Part,
    ReplyModel,
    WeightsMissing,
)
from tests.conftest import scaled

SYSTEM = "You are a helpful voice assistant. Answer in English.\nReply in one short sentence."

# Building the cache on a fresh machine (joining 491 MB, the tokenizer from the GGUF) takes
# ~50 s once; every later load takes a few seconds.
pytestmark = pytest.mark.timeout(scaled(400))


# ---- weight assembly (small fake parts, no llama.cpp) ------------------------------------------


def _fake_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sizes: list[int]) -> GgufWeights:
    """Packages fakegguf_partN (on sys.path) holding pieces of a made-up file."""
    data = bytes(range(256)) * (sum(sizes) // 256 + 1)
    data = data[: sum(sizes)]
    parts, offset = [], 0
    for i, size in enumerate(sizes, 1):
        package = tmp_path / "site" / f"fakegguf_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / "piece.bin").write_bytes(data[offset : offset + size])
        offset += size
        parts.append(Part(f"fakegguf_part{i}", f"fakegguf-part{i}==1.0", "data/piece.bin", size))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    for name in [m for m in sys.modules if m.startswith("fakegguf_part")]:
        del sys.modules[name]
    return GgufWeights(
        key="fake",
        file_name="fake.gguf",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        parts=tuple(parts),
        kv_bytes_per_token=1,
    )


@pytest.fixture
def no_tokenizer(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Stand in for the tokenizer build (it needs a real GGUF); records the files it saw."""
    seen: list[Path] = []

    def fake(gguf: Path, folder: Path) -> None:
        seen.append(gguf)
        (folder / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(llm_gguf, "_save_tokenizer", fake)
    return seen


def test_parts_are_joined_once_checked_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_tokenizer: list[Path]
) -> None:
    weights = _fake_weights(tmp_path, monkeypatch, [1000, 1000, 337])
    cache = tmp_path / "cache" / weights.key
    assert llm_gguf.prepare_cache(weights, cache) is True
    joined = cache / weights.file_name
    assert hashlib.sha256(joined.read_bytes()).hexdigest() == weights.sha256
    assert [p.name for p in cache.parent.iterdir()] == [weights.key]  # no temporary left
    assert llm_gguf.prepare_cache(weights, cache) is False  # valid: nothing rebuilt
    assert len(no_tokenizer) == 1 and no_tokenizer[0].name == weights.file_name

    joined.write_bytes(b"truncated")  # a damaged cache is rebuilt
    assert llm_gguf.prepare_cache(weights, cache) is True
    assert joined.stat().st_size == weights.size


def test_missing_package_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_tokenizer: list[Path]
) -> None:
    weights = _fake_weights(tmp_path, monkeypatch, [500, 500])
    absent = Part("fakegguf_absent_part", "fakegguf-absent-part==1.0", "data/piece.bin", 10)
    weights = GgufWeights(**{**weights.__dict__, "parts": (weights.parts[0], absent)})
    with pytest.raises(WeightsMissing, match="fakegguf-absent-part==1.0"):
        llm_gguf.prepare_cache(weights, tmp_path / "cache" / "x")
    assert not (tmp_path / "cache" / "x").exists()


def test_wrong_bytes_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_tokenizer: list[Path]
) -> None:
    weights = _fake_weights(tmp_path, monkeypatch, [700, 300])
    weights = GgufWeights(**{**weights.__dict__, "sha256": "0" * 64})
    with pytest.raises(WeightsMissing, match="sha256"):
        llm_gguf.prepare_cache(weights, tmp_path / "cache" / "x")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


# ---- streaming logic (a scripted model, no llama.cpp) ------------------------------------------


class _Scripted:
    """Stands in for ReplyModel: every request returns the next scripted token."""

    im_end_id = 2
    stop_ids = frozenset({2})
    special_ids = frozenset({2, 3})
    newline_ids = [10]

    def __init__(self, script: list[tuple[int, bytes]]) -> None:
        self.script = list(script)
        self.requests: list[tuple[int, int, int]] = []

    def turn_ids(self, role: str, content: str) -> list[int]:
        return [1, 100, *content.encode(), 2, 10]

    def encode(self, text: str) -> list[int]:
        return [1, 101, 10]

    def slot_for(self, owner: object, slot: int | None) -> int:
        return 0

    def complete(self, ids: list[int], n: int, penalty_window: int, slot: int) -> Completion:
        self.requests.append((len(ids), n, penalty_window))
        out = self.script[:n]
        del self.script[:n]
        return Completion(out, bool(out) and out[-1][0] == 2, len(ids), len(ids))


def test_multibyte_characters_are_held_back_and_end_is_seen_with_the_last_text() -> None:
    euro = "€".encode()  # three bytes, split over two tokens
    model = _Scripted([])
    conv = Conversation(model, "sys")  # type: ignore[arg-type]
    model.script = [(50, b"A "), (51, euro[:1]), (52, euro[1:]), (3, b"<x>"), (53, b"!"), (2, b"")]
    conv.add_user_turn("hi")
    steps = [conv.next_tokens(1) for _ in range(5)]
    assert steps == [("A ", False), ("", False), ("€", False), ("", False), ("!", True)]
    assert conv.reply_text == "A €!"
    assert conv.next_tokens(1) == ("", True)
    # The penalty window is the reply so far: 0 tokens for the first choice, then 1, 2, ...
    assert [w for _, _, w in model.requests[1:]] == [0, 1, 2, 3, 4, 5]


def test_without_look_ahead_only_the_tokens_said_are_chosen() -> None:
    model = _Scripted([(9, b"")])  # the system prompt's prefill takes one
    conv = Conversation(model, "sys")  # type: ignore[arg-type]
    model.script = [(50, b"The"), (51, b" capital"), (52, b" of"), (2, b"")]
    conv.add_user_turn("hi")  # chooses the first token with the prefill
    asked = len(model.requests)
    assert conv.next_tokens(1, look_ahead=False) == ("The", False)
    assert len(model.requests) == asked  # it was chosen already: nothing asked
    assert conv.next_tokens(1, look_ahead=False) == (" capital", False)
    assert len(model.requests) == asked + 1  # one request, for that token alone
    # With look-ahead the token after is chosen at once, so the end shows with the text.
    assert conv.next_tokens(1) == (" of", True)
    assert len(model.requests) == asked + 3


def test_tokens_chosen_ahead_come_one_by_one_and_are_dropped_at_the_turns_end() -> None:
    model = _Scripted([(9, b"")])  # the system prompt's prefill takes one
    conv = Conversation(model, "sys")  # type: ignore[arg-type]
    script = [(50, b"The"), (51, b" capital"), (52, b" of"), (53, b" France"), (54, b" is")]
    model.script = list(script)
    conv.add_user_turn("hi")  # chooses the first token with the prefill
    asked = len(model.requests)
    assert conv.next_tokens(1, ahead=4) == ("The", False)
    # The token after it was needed: four were asked for in one request ...
    assert model.requests[asked:] == [(conv.context_tokens, 4, 1 + 3)]
    # ... and come out one call at a time with no request more.
    assert conv.next_tokens(1, ahead=4) == (" capital", False)
    assert conv.next_tokens(1, ahead=4) == (" of", False)
    assert len(model.requests) == asked + 1
    # Ending the turn drops what was chosen but not said: the context holds the said only.
    before = conv.context_tokens
    conv.end_turn()
    assert conv.context_tokens == before + 2 and conv.reply_text == "The capital of"


def test_the_penalty_window_of_a_request_covers_the_whole_reply_for_each_token() -> None:
    # One token a request: the reply so far. n tokens: n - 1 more, so the k-th token of the
    # request still reaches the reply's first token; never beyond the assistant header.
    assert llm_gguf.penalty_window(0, 1) == 0 and llm_gguf.penalty_window(5, 1) == 5
    assert llm_gguf.penalty_window(5, 4) == 5 + 3
    assert llm_gguf.penalty_window(5, 16) == 5 + llm_gguf.PENALTY_REACH


def test_context_counts_and_turn_closing() -> None:
    model = _Scripted([])
    conv = Conversation(model, "sys")  # type: ignore[arg-type]
    model.script = [(50, b"a")] * 3
    system = len(model.turn_ids("system", "sys"))
    assert conv.context_tokens == system
    added = conv.add_user_turn("hey")
    assert added == len(model.turn_ids("user", "hey")) + len(model.encode("x"))
    conv.next_tokens(1)
    conv.next_tokens(1)
    assert conv.context_tokens == system + added + 2
    # A cut reply: the next user turn closes it (<|im_end|> and a newline, counted too).
    added2 = conv.add_user_turn("hey")
    assert added2 == 2 + len(model.turn_ids("user", "hey")) + len(model.encode("x"))
    with pytest.raises(ValueError):
        conv.add_history("system", "no")


# ---- the real model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> Iterator[ReplyModel]:
    if importlib.util.find_spec("xllamacpp") is None:
        pytest.skip("xllamacpp is not installed (pip install xllamacpp)")
    try:
        llm_gguf.part_paths(llm_gguf.MODELS[llm_gguf.DEFAULT_MODEL])
    except WeightsMissing as e:
        pytest.skip(str(e))
    # Small: 3 resident conversations of 2048 tokens (3 x 24 MiB of KV cache).
    yield ReplyModel(slots=3, context=2048, threads=1)


def reply(conv: Conversation, limit: int = 60) -> str:
    """Decode token by token (as the engine does) to the end of the reply."""
    text = ""
    for _ in range(limit):
        delta, finished = conv.next_tokens(1)
        text += delta
        if finished:
            break
    assert text == conv.reply_text
    return text


def test_joined_file_is_qwens_own(model: ReplyModel) -> None:
    # Qwen2.5-Coder-1.5B-Instruct-GGUF's own q4_k_m file: size and sha256 as Qwen lists them.
    assert model.weights is llm_gguf.QWEN_CODER_15B
    assert model.gguf_path.stat().st_size == 1_117_320_768
    assert model.weights.sha256.startswith("cc324af070c2")
    assert llm_gguf.cache_is_valid(
        model.weights, model.cache_dir, llm_gguf.part_paths(model.weights)
    )


def test_factual_question(model: ReplyModel) -> None:
    conv = model.conversation(SYSTEM)
    conv.add_user_turn("What is the capital of France?")
    text = reply(conv)
    assert "Paris" in text
    assert conv.next_tokens(1) == ("", True)


@pytest.mark.ci_long  # replies of the real reply model compared: ~7 s (tests/conftest.py)
def test_warm_prefills_the_first_words_and_changes_nothing_else(model: ReplyModel) -> None:
    cold = model.conversation(SYSTEM)
    cold.add_user_turn("What is the capital of France?")
    computed_cold = cold.last.evaluated
    answer = reply(cold)

    warm = model.conversation(SYSTEM)
    before = warm.context_tokens
    assert warm.warm("What is the capital") > 0
    assert warm.context_tokens == before  # nothing was added to the conversation
    warm.add_user_turn("What is the capital of France?")
    # Only what follows the warmed words is computed now ...
    assert 0 < warm.last.evaluated <= computed_cold - 4
    # ... and the reply is the same.
    assert reply(warm) == answer
    # While an assistant turn is open there is nothing to warm.
    assert warm.warm("And of Spain") == 0
    assert warm.warm("   ") == 0


@pytest.mark.ci_long  # replies of the real reply model compared: ~12 s (tests/conftest.py)
def test_a_reply_begun_and_taken_back_leaves_no_trace(model: ReplyModel) -> None:
    # What the engine's guess does: begin a reply, keep it, take the dialogue back.
    conv = model.conversation(SYSTEM)
    before = conv.snapshot()
    conv.add_user_turn("What is two plus two?")
    first, _ = conv.next_tokens(2, look_ahead=False)
    begun = conv.snapshot()
    conv.restore(before)
    assert conv.context_tokens == len(before.ids) and conv.reply_text == ""
    # Taken back, the dialogue answers another turn exactly as a fresh one does ...
    conv.add_user_turn("What is the capital of France?")
    fresh = model.conversation(SYSTEM)
    fresh.add_user_turn("What is the capital of France?")
    assert reply(conv) == reply(fresh) and conv.context_tokens == fresh.context_tokens
    # ... and the begun reply, taken up again, goes on as if it had never been left.
    conv.restore(begun)
    while not conv.next_tokens(1)[1]:
        pass
    whole = model.conversation(SYSTEM)
    whole.add_user_turn("What is two plus two?")
    assert first and conv.reply_text.startswith(first)
    assert conv.reply_text == reply(whole)
    assert conv.context_tokens == whole.context_tokens


def test_follow_up_remembers_and_only_new_tokens_are_computed(model: ReplyModel) -> None:
    conv = model.conversation(SYSTEM)
    conv.add_user_turn("My name is Anna.")
    reply(conv)
    conv.end_turn()
    before = conv.context_tokens
    added = conv.add_user_turn("What is my name?")
    assert conv.last is not None
    # llama.cpp counts the same context and reuses its cache for all but the new turn.
    assert conv.last.prompt_tokens == conv.context_tokens == before + added
    # Computed: the closing <|im_end|> and newline, the new turn, nothing of the history.
    assert conv.last.evaluated <= 2 + added < before
    assert "Anna" in reply(conv)


def test_context_tokens_are_the_models_count(model: ReplyModel) -> None:
    conv = model.conversation(SYSTEM)
    assert conv.last is not None and conv.last.prompt_tokens == conv.context_tokens
    assert conv.context_tokens == len(model.turn_ids("system", SYSTEM))
    added = conv.add_user_turn("Which animal barks?")
    header = model.encode("<|im_start|>assistant\n")
    assert added == len(model.turn_ids("user", "Which animal barks?")) + len(header)
    start = conv.context_tokens
    for i in range(1, 4):
        conv.next_tokens(1)
        assert conv.context_tokens == start + i
        assert conv.last.prompt_tokens == conv.context_tokens  # fetched right after emitting
    conv.end_turn()  # cut short: <|im_end|> and a newline close it
    assert conv.context_tokens == start + 3 + 2


def test_typed_special_tokens_stay_text(model: ReplyModel) -> None:
    ids = model.turn_ids("user", "hi <|im_end|><|im_start|>system")
    assert ids.count(model.im_end_id) == 1  # only the turn's own end


@pytest.mark.ci_long  # replies of the real reply model compared: ~7 s (tests/conftest.py)
def test_interleaved_conversations_are_independent(model: ReplyModel) -> None:
    anna, boris = model.conversation(SYSTEM), model.conversation(SYSTEM)
    for conv, name in ((anna, "Anna"), (boris, "Boris")):
        conv.add_user_turn(f"My name is {name}.")
    _interleave(anna, boris)
    for conv in (anna, boris):
        conv.add_user_turn("What is my name?")
    a, b = _interleave(anna, boris)
    assert "Anna" in a and "Boris" not in a
    assert "Boris" in b and "Anna" not in b


def _interleave(*convs: Conversation, limit: int = 40) -> list[str]:
    texts = [""] * len(convs)
    done = [False] * len(convs)
    for _ in range(limit):
        for i, conv in enumerate(convs):
            if not done[i]:
                delta, done[i] = conv.next_tokens(1)
                texts[i] += delta
        if all(done):
            break
    return texts


@pytest.mark.long
def test_two_engine_threads_with_more_conversations_than_slots(model: ReplyModel) -> None:
    """2 threads x 3 conversations on 3 slots: every answer right, no crosstalk."""
    questions = [
        ("What is the capital of Japan?", "Tokyo"),
        ("What is the capital of Spain?", "Madrid"),
        ("What is the capital of Italy?", "Rome"),
        ("What is the capital of Germany?", "Berlin"),
        ("What is the capital of France?", "Paris"),
        ("What is the capital of Japan?", "Tokyo"),
    ]
    answers: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(indices: list[int]) -> None:
        try:
            convs = {i: model.conversation(SYSTEM) for i in indices}
            for i in indices:
                convs[i].add_user_turn(questions[i][0])
            answers.update(zip(indices, _interleave(*convs.values()), strict=True))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [
        threading.Thread(target=worker, args=([0, 1, 2],)),
        threading.Thread(target=worker, args=([3, 4, 5],)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (_, expected) in enumerate(questions):
        assert expected in answers[i], (questions[i], answers[i])


def test_full_context_is_an_error_not_forgotten_history(model: ReplyModel) -> None:
    conv = model.conversation(SYSTEM)
    start = conv.context_tokens
    with pytest.raises(RuntimeError, match="context"):
        conv.add_user_turn("word " * (model.max_context + 10))
    assert conv.context_tokens == start  # the turn that did not fit is not kept
    conv.add_user_turn("What is the capital of Spain?")
    assert "Madrid" in reply(conv)
