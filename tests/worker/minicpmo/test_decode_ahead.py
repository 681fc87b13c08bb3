"""The decode loop with the device ahead of the host (decode._run_ahead), without the model
code: a stand-in LLM whose logits follow from each slot's whole visible context, so a token
fed past a row's end and not taken back changes every later unit of that row.

For depths 1, 2 and 3 the greedy and seeded rows end every unit exactly as with the host
between forwards (depth 0): their tokens, terminators, histories, the contexts left in their
slots and their generators' states, over five units in a batch with unseeded rows, a forced
row and rows of other caps, with units ending by terminator, by the 28-character limit and
by the cap. A control that keeps the fed-past tokens must break that equality.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnifabric.worker.engines.minicpmo import decode, layouts
from omnifabric.worker.engines.minicpmo.rows import Row
from omnifabric.worker.engines.minicpmo.slots import FeedResult

VOCAB = 48
LISTEN, TTS_BOS, CHUNK_EOS, CHUNK_TTS_EOS, TURN_EOS, SPEAK, TTS_PAD, IM_END = range(1, 9)
SPECIAL = set(range(1, 9))


class _Tokenizer:
    """Each ordinary id reads as (id % 7) + 2 characters; the special ones as nothing."""

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join("x" * (t % 7 + 2) for t in ids if t not in SPECIAL)


class _Model:
    """The LLM stand-in: one-hot embeddings; the logits of a context are a hash of it."""

    def __init__(self) -> None:
        self.model = SimpleNamespace(embed_tokens=self._embed)
        self.device = torch.device("cpu")

    @staticmethod
    def _embed(ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(ids, VOCAB).float()

    @staticmethod
    def logits(context: list[int]) -> torch.Tensor:
        digest = hashlib.sha256(repr(context).encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        out = torch.randn(VOCAB, generator=g) * 1.5
        out[[CHUNK_EOS, LISTEN, TURN_EOS]] += torch.tensor([1.2, 1.0, 1.5])
        if context[-1:] == [TURN_EOS]:
            out[LISTEN] += 3.0  # after its turn the model mostly listens
        return out


class _Cache:
    """Slots as token lists: a fed token lands at the slot's length, like a KV write."""

    def __init__(self, slots: int) -> None:
        self.max_len = 10_000
        self.stored: list[list[int]] = [[] for _ in range(slots)]
        self.lengths = [0] * slots

    def length(self, slot: int) -> int:
        return self.lengths[slot]

    def rewind(self, slot: int, length: int) -> None:
        assert 0 <= length <= self.lengths[slot]
        self.lengths[slot] = length

    def visible(self, slot: int) -> list[int]:
        return self.stored[slot][: self.lengths[slot]]

    def write(self, slot: int, tid: int) -> None:
        at = self.lengths[slot]
        self.stored[slot][at:] = [tid]  # what lay past the length is overwritten
        self.lengths[slot] = at + 1


class _Stepper:
    def __init__(self, model: _Model, slots: int, ahead: int) -> None:
        self.engine = SimpleNamespace(draws={}, decode_ahead=ahead, device="cpu")
        self.cache = _Cache(slots)
        self.model = model
        self.forwards = 0
        self.fed_rows = 0

    def defer(self, row: Row, ids: list[int]) -> None:
        raise AssertionError("the unified layout defers nothing")

    def decode_feed(self, rows: list[tuple[int, torch.Tensor]]) -> FeedResult:
        self.forwards += 1
        self.fed_rows += len(rows)
        logits, hidden = [], []
        for slot, embeds in rows:
            self.cache.write(slot, int(embeds.argmax(-1)))
            logits.append(self.model.logits(self.cache.visible(slot)))
            hidden.append(embeds.clone())
        return FeedResult(logits=torch.stack(logits), hidden=hidden)


#: (decode mode, seed, cap) per row: greedy and seeded rows are compared; unseeded ones
#: are batch-mates that draw from the worker's generator.
ROWS = [
    ("greedy", None, 12),
    ("sampling", 7, 12),
    ("sampling", None, 12),
    ("greedy", None, 4),
    ("sampling", 99, 9),
    ("sampling", None, 3),
    ("greedy", None, 12),
]


def _row(model: _Model, index: int, mode: str, seed: int | None, cap: int) -> Row:
    decoder = SimpleNamespace(
        m=model,
        listen_id=IM_END,
        chunk_eos_id=CHUNK_EOS,
        turn_eos_id=TURN_EOS,
        special_token_ids=SPECIAL,
        forbidden_token_ids=[9],
        generated_tokens=[],
        generated_special_tokens=[],
        tokenizer=_Tokenizer(),
        context="",
    )
    duplex = SimpleNamespace(
        decoder=decoder,
        tokenizer=decoder.tokenizer,
        listen_token_id=LISTEN,
        tts_bos_token_id=TTS_BOS,
        chunk_eos_token_id=CHUNK_EOS,
        turn_eos_token_id=TURN_EOS,
        tts_pad_id=TTS_PAD,
        chunk_terminator_token_ids=[LISTEN, CHUNK_EOS, CHUNK_TTS_EOS],
        turn_terminator_token_ids=[TURN_EOS],
        chunk_speak_token_ids=[SPEAK],
        total_ids=[],
        total_hidden=[],
        res_ids=[],
        speak_count=0,
        current_turn_ended=True,
        _streaming_generate_count=0,
        current_mode="audio",
    )
    session = SimpleNamespace(
        settings=SimpleNamespace(seed=seed),
        generator=None,
        handle=SimpleNamespace(layout=layouts.UNIFIED),
        kv_slot=index,
        units=0,
    )
    args = {
        "max_new_speak_tokens_per_chunk": cap,
        "decode_mode": mode,
        "temperature": 0.9,
        "top_k": 10,
        "top_p": 0.9,
        "listen_prob_scale": 1.0,
        "listen_top_k": None,
        "text_repetition_penalty": 1.3,
        "text_repetition_window_size": 4,
        "length_penalty": 1.1,
    }
    return Row(index, session, None, duplex, args, force=False, close_turn=False, deferred=[])


def _unit(stepper: _Stepper, rows: list[Row], unit: int) -> None:
    """A unit's prefill (a token of its own into each slot) and its decode."""
    for row in rows:
        slot = row.session.kv_slot
        stepper.cache.write(slot, 10 + unit)
        row.logits = stepper.model.logits(stepper.cache.visible(slot))[None]
        row.ids, row.hidden, row.terminator = [], [], None
        row.force = row is rows[-1] and unit == 1  # one row listens, forced, once
    decode.run(stepper, rows)


def _outcomes(ahead: int, units: int = 5) -> tuple[list[Any], _Stepper]:
    model = _Model()
    stepper = _Stepper(model, len(ROWS), ahead)
    rows = [_row(model, k, *spec) for k, spec in enumerate(ROWS)]
    seen: list[Any] = []
    for unit in range(units):
        _unit(stepper, rows, unit)
        for row in rows:
            if row.args["decode_mode"] == "sampling" and row.session.settings.seed is None:
                continue
            d = row.duplex
            state = row.session.generator.get_state() if row.session.generator else None
            seen.append(
                (
                    row.index,
                    unit,
                    list(row.ids),
                    row.terminator,
                    row.end_of_turn,
                    list(d.total_ids),
                    list(d.decoder.generated_tokens),
                    stepper.cache.visible(row.session.kv_slot),
                    [h[1].argmax().item() for h in row.hidden],
                    None if state is None else hashlib.sha256(state.numpy().tobytes()).hexdigest(),
                )
            )
    return seen, stepper


@pytest.fixture(scope="module")
def in_step() -> list[Any]:
    seen, stepper = _outcomes(0)
    assert stepper.fed_rows > 0
    return seen


def _ends(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts how the units of the compared rows end, from the loop's own rules."""
    ends = {"terminator": 0, "characters": 0, "cap": 0}
    host, capped = decode._host, decode._capped

    def compared(row: Row) -> bool:
        return row.args["decode_mode"] == "greedy" or row.session.settings.seed is not None

    def counted_host(row: Row, tid: int, j: int, limit: bool) -> bool:
        fed = host(row, tid, j, limit)
        if not fed and compared(row):
            terminal = tid in row.duplex.chunk_terminator_token_ids
            ends["terminator" if terminal else "characters"] += 1
        return fed

    def counted_cap(row: Row, plan: Any, j: int) -> bool:
        out = capped(row, plan, j)
        ends["cap"] += int(out and compared(row))
        return out

    monkeypatch.setattr(decode, "_host", counted_host)
    monkeypatch.setattr(decode, "_capped", counted_cap)
    return ends


def test_the_scenario_ends_units_every_way(monkeypatch):
    ends = _ends(monkeypatch)
    _outcomes(0)
    assert all(n > 0 for n in ends.values()), ends


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_rows_end_their_units_as_with_the_host_between_forwards(ahead, in_step, monkeypatch):
    used = []
    real = decode._run_ahead
    monkeypatch.setattr(decode, "_run_ahead", lambda *a: used.append(a[3]) or real(*a))
    seen, stepper = _outcomes(ahead)
    assert used and set(used) == {ahead}
    for got, want in zip(seen, in_step, strict=True):
        assert got == want
    _, baseline = _outcomes(0)
    assert stepper.fed_rows > baseline.fed_rows  # rows were fed past their ends, then undone


def test_control_tokens_fed_past_an_end_and_kept_change_later_units(in_step, monkeypatch):
    monkeypatch.setattr(_Cache, "rewind", lambda self, slot, length: None)
    seen, _ = _outcomes(2)
    assert seen != in_step


def test_a_seeded_row_with_listen_top_k_keeps_the_host_between_forwards():
    model = _Model()
    rows = [_row(model, k, *spec) for k, spec in enumerate(ROWS)]
    plans = {id(r): decode._Plan(r) for r in rows}
    engine = SimpleNamespace(decode_ahead=2, device="cpu")
    assert decode.ahead(engine, rows, plans) == 2
    rows[1].args["listen_top_k"] = 3
    plans = {id(r): decode._Plan(r) for r in rows}
    assert decode.ahead(engine, rows, plans) == 0
    assert decode.ahead(SimpleNamespace(decode_ahead=None, device="cpu"), rows[:1], plans) == 0
    cuda = SimpleNamespace(decode_ahead=None, device="cuda:0")
    assert decode.ahead(cuda, rows[:1], plans) == decode.CUDA_AHEAD
