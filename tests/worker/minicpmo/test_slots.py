"""The slot KV cache: rows of several sessions fed in one LLM forward give what each gives
alone.

Every test runs a plan of steps (ragged prefill, one-token decodes, a session joining, one
leaving and its slot reused by a new one, rows in and out of slot order) through slots.feed
and, row by row, through the stock forward on a DynamicCache with plain positions, as the
public code's decoder feeds one session. Compared: each row's last logits and its hidden
states (within 1e-4, fp32), the argmax, and the lengths. The default suite uses a tiny random
Qwen3; the opt-in part (OMNI_MINICPMO_CODE_DIR, see conftest) the LLM of the tiny MiniCPM-o
checkpoint built from the public code, for every layout it offers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.cache_utils import DynamicCache

from omnifabric.worker.engines.minicpmo import graphs
from omnifabric.worker.engines.minicpmo.graphs import StaticDecode
from omnifabric.worker.engines.minicpmo.slots import (
    NoFreeSlot,
    SlotCache,
    SlotStep,
    feed,
)
from tests.worker.minicpmo.conftest import needs_code

TOLERANCE = 1e-4
ATTENTION = ["sdpa", "eager"]

#: Per step: what happens before it (sessions joining or leaving), then session -> new tokens
#: in row order. Session "d" joins after "a" left and gets its slot.
PLAN: list[tuple[list[str], dict[str, int]]] = [
    (["+a", "+b"], {"a": 9, "b": 2}),
    ([], {"a": 1, "b": 1}),
    (["+c"], {"a": 1, "b": 1, "c": 7}),
    ([], {"b": 1, "c": 1}),
    ([], {"c": 1, "a": 3, "b": 1}),
    (["-a", "+d"], {"d": 5, "b": 1, "c": 3}),
    ([], {"c": 1, "d": 1, "b": 1}),
    (["-b"], {"d": 1, "c": 1}),
    ([], {"c": 2, "d": 1}),
]


def tiny_qwen3(attn: str) -> Qwen3ForCausalLM:
    """A random 2-layer Qwen3, seeded; weights larger than the default init so attention is
    far from uniform and a wrong position shows in the logits."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.2,
        sliding_window=None,
        attn_implementation=attn,
    )
    model = Qwen3ForCausalLM(config).eval()
    assert model.config._attn_implementation == attn
    return model


@dataclasses.dataclass
class Outcome:
    logit_diff: float = 0.0
    hidden_diff: float = 0.0
    argmax_equal: bool = True
    lengths_equal: bool = True
    rows: int = 0
    static_rows: int = 0
    #: The (rows, keys) shapes the static-shape decode ran in.
    shapes: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    #: Session -> the slot it claimed.
    claims: dict[str, int] = dataclasses.field(default_factory=dict)


def solo_feed(
    llm: Any, past: DynamicCache, embeds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One session alone, as the public decoder feeds it: batch 1, positions from the cache's
    length, no mask; the head over the final hidden states, the last position's logits."""
    start = past.get_seq_length()
    positions = torch.arange(start, start + embeds.shape[0], device=embeds.device)[None]
    out = llm(
        inputs_embeds=embeds[None],
        position_ids=positions,
        past_key_values=past,
        use_cache=True,
        output_hidden_states=True,
        return_dict=True,
    )
    hidden = out.hidden_states[-1]
    return llm.lm_head(hidden)[0, -1], hidden[0]


def run_plan(
    llm: Any,
    make_embeds: Callable[[int], torch.Tensor],
    cache_type: type[SlotCache] = SlotCache,
    slots: int = 3,
    static: bool = False,
) -> Outcome:
    """PLAN through a slot cache and through a DynamicCache per session; the worst gaps.
    `static`: steps of one token per row go through the static-shape decode (graphs.py)."""
    weights = next(llm.parameters())
    cache = cache_type(
        llm.config, slots, 64, device=weights.device, dtype=weights.dtype, scratch=static
    )
    decoder = StaticDecode(llm, cache, graphs=False) if static else None
    where: dict[str, int] = {}
    solo: dict[str, DynamicCache] = {}
    outcome = Outcome()
    with torch.no_grad():
        for changes, step in PLAN:
            for change in changes:
                name = change[1:]
                if change[0] == "+":
                    where[name] = outcome.claims[name] = cache.claim()
                    solo[name] = DynamicCache()
                else:
                    cache.release(where.pop(name))
            embeds = {name: make_embeds(count) for name, count in step.items()}
            fed = [(where[name], embeds[name]) for name in step]
            if decoder is not None and set(step.values()) == {1}:
                got = decoder.feed(fed)
                outcome.static_rows += len(fed)
            else:
                got = feed(llm, cache, fed)
            for row, name in enumerate(step):
                logits, hidden = solo_feed(llm, solo[name], embeds[name])
                outcome.rows += 1
                outcome.logit_diff = max(
                    outcome.logit_diff, (got.logits[row] - logits).abs().max().item()
                )
                outcome.hidden_diff = max(
                    outcome.hidden_diff, (got.hidden[row] - hidden).abs().max().item()
                )
                outcome.argmax_equal &= bool(got.logits[row].argmax() == logits.argmax())
            if decoder is not None:
                outcome.shapes |= set(decoder._shapes)
            for name, slot in where.items():
                outcome.lengths_equal &= cache.length(slot) == solo[name].get_seq_length()
    return outcome


def random_embeds(hidden: int) -> Callable[[int], torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return lambda count: torch.randn(count, hidden, generator=generator)


class ShiftedSlotCache(SlotCache):
    """A control: positions one too far for every feed after a slot's first (a gap of one
    after the prefill). A shift of every position alike would go unseen: rotary attention
    depends on distances only."""

    def begin(self, slots: Sequence[int], counts: Sequence[int]) -> SlotStep:
        step = super().begin(slots, counts)
        later = torch.tensor([start > 0 for start in step.starts])
        return dataclasses.replace(step, positions=step.positions + later[:, None])


class SharedPositionsSlotCache(SlotCache):
    """A control: every row's positions from the longest past of the step, not its own."""

    def begin(self, slots: Sequence[int], counts: Sequence[int]) -> SlotStep:
        step = super().begin(slots, counts)
        shared = max(step.starts) - torch.tensor(step.starts)
        return dataclasses.replace(step, positions=step.positions + shared[:, None])


@pytest.fixture(scope="module", params=ATTENTION)
def llm(request):
    return tiny_qwen3(request.param)


def test_batched_rows_equal_each_row_alone(llm):
    outcome = run_plan(llm, random_embeds(llm.config.hidden_size))
    print(
        f"{llm.config._attn_implementation}: max|dlogit| {outcome.logit_diff:.2e}, "
        f"max|dhidden| {outcome.hidden_diff:.2e} over {outcome.rows} rows"
    )
    assert outcome.rows == sum(len(step) for _, step in PLAN)
    assert outcome.claims == {"a": 0, "b": 1, "c": 2, "d": 0}  # d reuses a's slot
    assert outcome.logit_diff < TOLERANCE
    assert outcome.hidden_diff < TOLERANCE
    assert outcome.argmax_equal
    assert outcome.lengths_equal


@pytest.mark.parametrize("control", [ShiftedSlotCache, SharedPositionsSlotCache])
def test_a_wrong_position_is_caught(llm, control):
    outcome = run_plan(llm, random_embeds(llm.config.hidden_size), control)
    print(
        f"{llm.config._attn_implementation} {control.__name__}: "
        f"max|dlogit| {outcome.logit_diff:.2e}, max|dhidden| {outcome.hidden_diff:.2e}"
    )
    assert outcome.logit_diff > 100 * TOLERANCE
    assert outcome.hidden_diff > 100 * TOLERANCE
    assert outcome.lengths_equal  # the lengths alone would not show it


@pytest.mark.parametrize("min_width", [8, 256])
def test_static_shape_decode_equals_each_row_alone(llm, monkeypatch, min_width):
    """One-token steps padded to row buckets on the scratch row, keys read up to a width
    bucket (8, 16, 32, 64 with min_width 8; the whole slot with 256): each row still what it
    gives alone, and the padding touches no slot."""
    monkeypatch.setattr(graphs, "MIN_WIDTH", min_width)
    outcome = run_plan(llm, random_embeds(llm.config.hidden_size), slots=4, static=True)
    print(f"static: max|dlogit| {outcome.logit_diff:.2e} over {outcome.static_rows} rows")
    assert outcome.static_rows == 9  # four one-token steps, of 2, 2, 3 and 2 rows
    assert {rows for rows, _ in outcome.shapes} == {2, 4}  # 3 rows padded to 4
    widths = {width for _, width in outcome.shapes}
    assert widths == ({8, 16} if min_width == 8 else {64})
    assert outcome.logit_diff < TOLERANCE
    assert outcome.hidden_diff < TOLERANCE
    assert outcome.argmax_equal
    assert outcome.lengths_equal


def test_static_shape_decode_control_shifted_position_fails(llm):
    class Shifted(SlotCache):
        def begin_decode(self, slots, reuse):
            step = super().begin_decode(slots, reuse)
            if step.starts[0] > 0:
                step.positions[0] += 1
            return step

    outcome = run_plan(llm, random_embeds(llm.config.hidden_size), Shifted, static=True)
    assert outcome.logit_diff > 100 * TOLERANCE


def test_buckets():
    assert graphs.bucket(3, 10, 64, 4096) == (4, 256)
    assert graphs.bucket(33, 257, 64, 4096) == (40, 512)  # steps of 8 up to 64 rows
    assert graphs.bucket(65, 257, 128, 4096) == (80, 512)  # then of 16
    assert graphs.bucket(9, 5000, 12, 4096) == (12, 4096)  # no more rows than slots
    assert graphs.bucket(1, 1, 1, 100) == (1, 100)
    # past WIDTH_STEP (1024) widths grow by it: a long context pads by at most 1,023 keys
    assert graphs.bucket(64, 1025, 64, 9216) == (64, 2048)
    assert graphs.bucket(64, 2049, 64, 9216) == (64, 3072)
    assert graphs.bucket(64, 4097, 64, 9216) == (64, 5120)
    assert graphs.bucket(64, 9000, 64, 9216) == (64, 9216)


def test_every_bucket_is_listed():
    """graphs.buckets (what a worker captures at its warm-up) holds every shape `bucket`
    gives, and nothing else."""
    assert graphs.buckets(64, 4096) == [
        (r, w)
        for r in (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
        for w in (256, 512, 1024, 2048, 3072, 4096)
    ]
    widths = [w for r, w in graphs.buckets(64, 9216) if r == 1]
    assert widths == [256, 512, 1024, *range(2048, 9217, 1024)]
    for slots, max_len in ((12, 1000), (1, 100), (3, 256), (5, 257), (2, 3500)):
        listed = graphs.buckets(slots, max_len)
        met = {
            graphs.bucket(n, need, slots, max_len)
            for n in range(1, slots + 1)
            for need in range(1, max_len + 1)
        }
        assert sorted(met) == listed, (slots, max_len)


def test_a_step_of_padding_only_touches_no_slot(llm, monkeypatch):
    """What a graph captured ahead of use runs (StaticDecode.capture_all: every row padding,
    graphs.buckets' every shape): no claimed slot's keys, values or length change, and a
    step after it still equals the ragged feed. On a CPU capture_all captures nothing."""
    monkeypatch.setattr(graphs, "MIN_WIDTH", 8)
    make = random_embeds(llm.config.hidden_size)
    cache = SlotCache(llm.config, 3, 40, scratch=True)
    decoder = StaticDecode(llm, cache, graphs=False)
    a, b = cache.claim(), cache.claim()
    with torch.no_grad():
        feed(llm, cache, [(a, make(7)), (b, make(3))])
        before = [store[: cache.slots].clone() for store in (*cache.key_slots, *cache.value_slots)]
        assert decoder.capture_all() == 0 and not decoder._shapes
        shapes = graphs.buckets(cache.slots, cache.max_len)
        assert shapes == [(r, w) for r in (1, 2, 3) for w in (8, 16, 32, 40)]
        for rows, width in shapes:
            shape = decoder._shape(rows, width)
            step = cache.begin_decode([], shape.step)
            with pytest.raises(RuntimeError, match="already open"):
                cache.begin_decode([], shape.step)
            shape.embeds.copy_(torch.randn(shape.embeds.shape))  # so its writes show
            decoder._forward(shape, step)
            cache.abort()
        for rows in (1, 2, 3):  # a row bucket's widths share its inputs and outputs
            first = decoder._shapes[(rows, 8)]
            for width in (16, 32, 40):
                assert decoder._shapes[(rows, width)].logits is first.logits
                assert decoder._shapes[(rows, width)].embeds is first.embeds
        after = [store[: cache.slots] for store in (*cache.key_slots, *cache.value_slots)]
        for old, new in zip(before, after, strict=True):
            assert torch.equal(old, new)
        assert (cache.length(a), cache.length(b)) == (7, 3)
        scratch = cache.key_slots[0][cache.scratch, :, 0]
        assert scratch.abs().sum() > 0  # the padding wrote where padding goes
        nxt = make(1)
        static = decoder.feed([(a, nxt), (b, nxt)]).logits
        cache.rewind(a, 7)
        cache.rewind(b, 3)
        ragged = feed(llm, cache, [(a, nxt), (b, nxt)]).logits
    torch.testing.assert_close(static, ragged, atol=TOLERANCE, rtol=0)


def test_a_failure_while_capturing_ahead_turns_graphs_off_and_serves_on(llm, caplog):
    """Whatever fails in StaticDecode.capture_all (here the capture itself, as an
    out-of-memory would) turns graphs off with the capture's warning: no exception reaches
    the warm-up, no step is left open, and the next decode runs eagerly."""
    cache = SlotCache(llm.config, 2, 16, scratch=True)
    decoder = StaticDecode(llm, cache, graphs=False)
    decoder.graphs = True  # as on CUDA

    def failing(shape, step):
        raise RuntimeError("CUDA out of memory (a stand-in)")

    decoder._capture = failing  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger=graphs.__name__):
        assert decoder.capture_all() == 0
    assert decoder.graphs is False and decoder.failure is not None
    assert "out of memory" in decoder.failure
    assert "CUDA graph capture failed, decode runs eagerly" in caplog.text
    a = cache.claim()
    make = random_embeds(llm.config.hidden_size)
    with torch.no_grad():
        feed(llm, cache, [(a, make(3))])
        decoder.feed([(a, make(1))])  # no step left open; eager
    assert cache.length(a) == 4 and decoder.captured == 0


def test_a_row_fed_in_pieces_is_the_row_fed_whole(llm):
    """feed takes a row as the pieces of its embeddings (the step's tokens, vision and audio
    as they are made): the same forward, to the bit, as the pieces joined first; a row
    whose pieces hold no token is refused before any slot moves."""
    make = random_embeds(llm.config.hidden_size)
    parts = [make(2), make(0), make(5), make(1)]
    other = make(3)
    results = []
    for joined in (True, False):
        cache = SlotCache(llm.config, 2, 16)
        a, b = cache.claim(), cache.claim()
        row = torch.cat(parts) if joined else parts
        with torch.no_grad():
            res = feed(llm, cache, [(a, other), (b, row)])
        results.append((res, cache))
    (whole, first), (pieces, second) = results
    assert torch.equal(whole.logits, pieces.logits)
    for one, two in zip(whole.hidden, pieces.hidden, strict=True):
        assert torch.equal(one, two)
    assert torch.equal(first.key_slots[0][:2], second.key_slots[0][:2])
    with pytest.raises(ValueError, match="tokens >= 1"):
        feed(llm, second, [(0, [make(0), make(0)])])
    assert second.length(0) == 3


def test_static_decode_refuses_what_it_cannot_take(llm):
    cache = SlotCache(llm.config, 2, 16, scratch=True)
    decoder = StaticDecode(llm, cache, graphs=True)  # a CPU cache: no graphs
    assert decoder.graphs is False
    a = cache.claim()
    make = random_embeds(llm.config.hidden_size)
    with pytest.raises(ValueError, match="one token"):
        decoder.feed([(a, make(2))])
    feed(llm, cache, [(a, make(16))])
    with pytest.raises(ValueError, match="would pass max_len 16"):
        decoder.feed([(a, make(1))])
    with pytest.raises(RuntimeError, match="scratch=True"):
        SlotCache(llm.config, 1, 8).decode_shape(1, 8)
    assert cache.length(a) == 16


def test_headless_static_decode_gives_the_ragged_hidden_states():
    """The TTS's backbone (a LlamaModel, its heads outside) through StaticDecode without a
    head: each one-token row's hidden state equals the ragged feed's, rows of different
    lengths, a row leaving; a position shifted by one in the static step does not."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        attn_implementation="sdpa",
    )
    model = LlamaModel(config).eval()
    ragged_llm = SimpleNamespace(model=model, config=config, lm_head=torch.nn.Identity())
    ragged = SlotCache(config, 3, 64, device="cpu", dtype=torch.float32)
    static = SlotCache(config, 3, 64, device="cpu", dtype=torch.float32, scratch=True)
    headless = SimpleNamespace(model=model, config=config, lm_head=None)
    decoder = StaticDecode(headless, static, graphs=False, what="the TTS")

    def steps(shift: bool) -> float:
        worst = 0.0
        slots = {name: (ragged.claim(), static.claim()) for name in "abc"}
        with torch.no_grad():
            first = [(name, torch.randn(n, 64)) for name, n in zip("abc", (5, 1, 9), strict=True)]
            for cache, k in ((ragged, 0), (static, 1)):
                feed(ragged_llm, cache, [(slots[name][k], e) for name, e in first])
            for t in range(4):
                names = "abc" if t < 2 else "ac"
                embeds = [torch.randn(1, 64) for _ in names]
                rows = list(zip(names, embeds, strict=True))
                want = feed(ragged_llm, ragged, [(slots[n][0], e) for n, e in rows])
                step = [(slots[n][1], e) for n, e in rows]
                if shift and t == 1:
                    static._lengths[slots["a"][1]] += 1  # one position on for row a
                got = decoder.feed(step)
                if shift and t == 1:
                    static._lengths[slots["a"][1]] -= 1
                assert got.logits.shape == (len(names), 0)
                for k in range(len(names)):
                    gap = (got.hidden[k] - want.hidden[k][-1:]).abs().max().item()
                    worst = max(worst, gap)
        for r, s in slots.values():
            ragged.release(r)
            static.release(s)
        return worst

    assert steps(shift=False) < TOLERANCE
    assert steps(shift=True) > 100 * TOLERANCE
    assert decoder.calls == 8


@pytest.mark.parametrize("static", [False, True])
def test_a_rewound_slot_reads_as_if_the_tokens_past_it_were_never_fed(llm, static):
    """What a decode running ahead of its rules leaves (decode._run_ahead): slot a gets
    three tokens more than b, is rewound, and both take the same next token: the same
    logits; without the rewind they differ (the control). A slot only goes back."""
    make = random_embeds(llm.config.hidden_size)
    prefix, junk, nxt = make(6), make(3), make(1)

    def run(rewind: bool) -> torch.Tensor:
        cache = SlotCache(llm.config, 2, 32, scratch=True)
        decoder = StaticDecode(llm, cache, graphs=False) if static else None
        a, b = cache.claim(), cache.claim()

        def step(rows):
            return decoder.feed(rows) if decoder else feed(llm, cache, rows)

        with torch.no_grad():
            feed(llm, cache, [(a, prefix), (b, prefix)])
            for k in range(3):
                step([(a, junk[k : k + 1])])
            if rewind:
                with pytest.raises(ValueError, match="holds 9 tokens: it cannot go back to 10"):
                    cache.rewind(a, 10)
                cache.rewind(a, 6)
            logits = step([(a, nxt), (b, nxt)]).logits
        assert cache.length(a) == (7 if rewind else 10)
        return logits

    rewound = run(True)
    torch.testing.assert_close(rewound[0], rewound[1], atol=TOLERANCE, rtol=0)
    kept = run(False)
    assert (kept[0] - kept[1]).abs().max() > 1e-3


def test_consecutive_and_gathered_rows_read_the_same(llm):
    """Rows in slot order read a view of the cache, rows out of it a gather: same numbers."""
    make = random_embeds(llm.config.hidden_size)
    first, second = make(4), make(3)
    step = {0: make(1), 1: make(2)}
    results = []
    for order in ([0, 1], [1, 0]):
        cache = SlotCache(llm.config, 2, 16)
        assert [cache.claim(), cache.claim()] == [0, 1]
        feed(llm, cache, [(0, first), (1, second)])
        got = feed(llm, cache, [(slot, step[slot]) for slot in order])
        results.append({slot: got.logits[row] for row, slot in enumerate(order)})
    for slot in (0, 1):
        assert (results[0][slot] - results[1][slot]).abs().max().item() < TOLERANCE


def test_max_len_is_checked_before_anything_is_written(llm):
    cache = SlotCache(llm.config, 2, 10)
    a, b = cache.claim(), cache.claim()
    make = random_embeds(llm.config.hidden_size)
    feed(llm, cache, [(a, make(9)), (b, make(3))])
    before = [t.clone() for t in (*cache.key_slots, *cache.value_slots)]
    with pytest.raises(ValueError, match=r"slot 0 holds 9 tokens: 2 more would pass max_len 10"):
        feed(llm, cache, [(b, make(1)), (a, make(2))])
    assert all(
        torch.equal(t, u)
        for t, u in zip(before, (*cache.key_slots, *cache.value_slots), strict=True)
    )
    assert (cache.length(a), cache.length(b)) == (9, 3)
    feed(llm, cache, [(a, make(1)), (b, make(7))])  # exactly full: fine, and no step was left open
    assert (cache.length(a), cache.length(b)) == (10, 10)


def test_claim_names_the_slots_when_none_is_free(llm):
    cache = SlotCache(llm.config, 2, 8)
    assert (cache.claim(), cache.claim()) == (0, 1)
    with pytest.raises(NoFreeSlot, match="all 2 slots"):
        cache.claim()
    cache.release(0)
    assert cache.claim() == 0 and cache.length(0) == 0


def test_release_touches_no_other_row(llm):
    cache = SlotCache(llm.config, 3, 16)
    slots = [cache.claim() for _ in range(3)]
    make = random_embeds(llm.config.hidden_size)
    feed(llm, cache, [(slot, make(3 + slot)) for slot in slots])
    feed(llm, cache, [(slot, make(1)) for slot in slots])
    before = [t.clone() for t in (*cache.key_slots, *cache.value_slots)]
    cache.release(1)
    for old, now in zip(before, (*cache.key_slots, *cache.value_slots), strict=True):
        assert torch.equal(old[0], now[0]) and torch.equal(old[2], now[2])
        assert not now[1].any()
        assert old[1].any()
    assert (cache.length(0), cache.length(2)) == (4, 6)
    assert cache.claimed() == [0, 2]
    with pytest.raises(ValueError, match="slot 1 is not claimed"):
        cache.length(1)
    with pytest.raises(ValueError, match="slot 1 is not claimed"):
        feed(llm, cache, [(1, make(1))])


def test_shapes_and_size(llm):
    cache = SlotCache(llm.config, 4, 32)
    assert cache.key_slots[0].shape == (4, 2, 32, 16) and len(cache.value_slots) == 2
    assert cache.nbytes == 2 * 2 * 4 * 2 * 32 * 16 * 4
    config = Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1
    )
    config.head_dim = None  # a config without it: hidden // heads
    assert SlotCache(config, 1, 8).key_slots[0].shape == (1, 2, 8, 16)


# Opt-in: the LLM of the tiny MiniCPM-o checkpoint, through the engine as it loads it.


@pytest.fixture
def real_llm(engine):
    return engine.model.llm


@needs_code
@pytest.mark.timeout(600)
@pytest.mark.parametrize("attn", ATTENTION)
def test_real_checkpoint_llm_batched_equals_alone(real_llm, attn):
    """Rows of token embeddings (random ids through the LLM's own input embeddings) followed
    by audio-like embeddings (random, at the embedding table's scale). The engine loads the
    LLM with sdpa; eager is switched on the config for the test (the attention layers read
    it at each forward) and switched back."""
    assert real_llm.model.layers[0].self_attn.config is real_llm.config
    loaded = real_llm.config._attn_implementation
    real_llm.config._attn_implementation = attn
    try:
        check_real_llm(real_llm)
    finally:
        real_llm.config._attn_implementation = loaded


def check_real_llm(real_llm: Any) -> None:
    table = real_llm.get_input_embeddings()
    scale = table.weight.std().item()
    generator = torch.Generator().manual_seed(2)
    dtype = next(real_llm.parameters()).dtype

    def make(count: int) -> torch.Tensor:
        with torch.no_grad():
            text = (count + 1) // 2
            ids = torch.randint(0, table.num_embeddings, (text,), generator=generator)
            audio = scale * torch.randn(count - text, table.embedding_dim, generator=generator)
            device = table.weight.device
            return torch.cat([table(ids.to(device)), audio.to(device, dtype)])

    outcome = run_plan(real_llm, make)
    print(
        f"real llm ({real_llm.config._attn_implementation}): max|dlogit| {outcome.logit_diff:.2e}, "
        f"max|dhidden| {outcome.hidden_diff:.2e} over {outcome.rows} rows"
    )
    assert outcome.logit_diff < TOLERANCE
    assert outcome.hidden_diff < TOLERANCE
    assert outcome.argmax_equal
    assert outcome.lengths_equal


def test_slots_follow_a_basic_window():
    """A worker whose sessions slide by a basic window sizes its slots for the window's high
    watermark (the engine adds its spare for the unit that crosses it), not the cap."""
    from omnifabric.worker.config import WorkerConfig
    from omnifabric.worker.engines.minicpmo.engine import MiniCPMOEngine, slot_tokens

    capped = WorkerConfig.from_env({}, max_context_tokens=8192)
    basic = capped.with_overrides(
        context_window="basic", window_high_tokens=3000, window_low_tokens=2000
    )
    context = capped.with_overrides(context_window="context")
    assert slot_tokens(capped) == 8192 and slot_tokens(context) == 8192
    assert slot_tokens(basic) == 3000
    engine = MiniCPMOEngine.from_config(basic.with_overrides(engine="minicpmo", slots=4))
    assert engine.kv_slot_tokens == 3000 + MiniCPMOEngine.SLOT_SPARE_TOKENS
