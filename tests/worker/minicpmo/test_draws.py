"""The batched step's draws (decode.py, tts.py), without the model code: a seeded session
draws from its own generator whatever its batch-mates, the sessions without a seed draw
together from the worker's generator, one call for all their rows, with each row's own
top-k, top-p and temperature.

The rules over rows are checked against the per-row rule they replace (_top_k_top_p, the
public code's order), token for token; the draws against the distribution that per-row rule
gives, over thousands of draws; a control with another row's settings must differ.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omnifabric.worker.engines.minicpmo import decode, layouts
from omnifabric.worker.engines.minicpmo import tts as tts_module
from omnifabric.worker.engines.minicpmo.engine import SAMPLING_DEFAULTS
from omnifabric.worker.engines.minicpmo.tts import BatchedTTS

VOCAB = 64
LISTEN, CHUNK_EOS, TURN_EOS = 60, 61, 62


def kept(logits: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(logits)


def ties(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random logits with ties (values on a coarse grid), as top-k must keep them all."""
    g = torch.Generator().manual_seed(seed)
    return torch.round(torch.randn(rows, vocab, generator=g) * 4) / 4


SETTINGS = [(0, 0.0), (1, 0.8), (5, 0.0), (20, 0.8), (20, 0.3), (0, 0.5), (VOCAB * 2, 1.0)]


def test_top_k_top_p_over_rows_keeps_what_each_row_keeps_alone():
    logits = ties(len(SETTINGS) * 3, VOCAB, 7)
    ks = [k for k, _ in SETTINGS] * 3
    ps = [p for _, p in SETTINGS] * 3
    together = decode.top_k_top_p_rows(logits, ks, ps)
    for r in range(logits.size(0)):
        alone = decode._top_k_top_p(logits[r : r + 1], ks[r], ps[r])[0]
        assert torch.equal(kept(together[r]), kept(alone)), (r, ks[r], ps[r])
        assert torch.equal(together[r][kept(alone)], alone[kept(alone)])
    # ties at the k-th value are all kept, as the per-row rule keeps them
    tied = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0], [3.0, 2.0, 2.0, 2.0, 1.0]])
    assert kept(decode.top_k_top_p_rows(tied, [2, 0], [0.0, 0.0])).sum(-1).tolist() == [4, 5]


def test_top_k_top_p_over_rows_control_another_rows_settings_differ():
    logits = ties(2, VOCAB, 8)
    right = decode.top_k_top_p_rows(logits, [5, 20], [0.0, 0.8])
    wrong = decode.top_k_top_p_rows(logits, [5, 5], [0.0, 0.0])
    alone = decode._top_k_top_p(logits[1:2], 20, 0.8)[0]
    assert torch.equal(kept(right[1]), kept(alone))
    assert not torch.equal(kept(wrong[1]), kept(alone))


class _Tokenizer:
    def decode(self, ids: list[int], **_: Any) -> str:
        return "<|listen|>" if ids == [LISTEN] else "x" * len(ids)


def row(logits: torch.Tensor, *, seed: int | None, **args: Any) -> Any:
    # the server's sampling defaults, without the penalties (the draws alone are tested)
    neutral = {"text_repetition_penalty": 1.0, "length_penalty": 1.0}
    settings = SAMPLING_DEFAULTS | {"max_new_speak_tokens_per_chunk": 20} | neutral | args
    decoder = SimpleNamespace(
        listen_id=LISTEN,
        chunk_eos_id=CHUNK_EOS,
        turn_eos_id=TURN_EOS,
        special_token_ids={LISTEN, CHUNK_EOS, TURN_EOS},
        forbidden_token_ids=[],
        generated_tokens=[],
        generated_special_tokens=[],
        tokenizer=_Tokenizer(),
        context="",
    )
    session = SimpleNamespace(
        settings=SimpleNamespace(seed=seed),
        generator=None,
        handle=SimpleNamespace(layout=layouts.UNIFIED),
    )
    return SimpleNamespace(
        session=session, args=settings, duplex=SimpleNamespace(decoder=decoder), logits=logits
    )


def decide(engine: Any, rows: list[Any]) -> list[int]:
    plans = {id(r): decode._Plan(r) for r in rows}
    return decode._decide(engine, rows, plans, 1)


def engine() -> Any:
    return SimpleNamespace(draws={})


def test_a_seeded_row_draws_the_same_whatever_its_batch_mates():
    logits = ties(5, VOCAB, 9)
    logits[:, CHUNK_EOS] = -9.0  # the pre-check rarely ends the unit: the second draw counts
    alone, mates_a, mates_b = [], [], []
    eng = engine()
    for want, mates in ((alone, []), (mates_a, [1, 2]), (mates_b, [3, 4, 1])):
        me = row(logits[0:1], seed=1234)
        for _ in range(30):
            others = [row(logits[m : m + 1], seed=None) for m in mates]
            got = decide(eng, [*others[:1], me, *others[1:]])
            want.append(got[min(1, len(others))])
    assert alone == mates_a == mates_b
    assert len(set(alone)) > 1  # it samples
    other = row(logits[0:1], seed=4321)
    assert [decide(eng, [other])[0] for _ in range(30)] != alone  # the seed matters


def test_unseeded_rows_draw_from_the_workers_generator_in_one_call(monkeypatch):
    eng = engine()
    rows = [row(ties(1, VOCAB, 10 + k), seed=None) for k in range(6)]
    calls = []
    real = torch.multinomial

    def counted(probs, n, **kw):
        calls.append(tuple(probs.shape))
        return real(probs, n, **kw)

    monkeypatch.setattr(torch, "multinomial", counted)
    decide(eng, rows)
    assert calls == [(6, VOCAB), (6, VOCAB)]  # the pre-check's draw and the token's
    assert all(r.session.generator is None for r in rows)
    assert list(eng.draws) == ["cpu"]


def expected(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The public order on one row: P(first draw = chunk_eos) ends the unit, else the token
    drawn after temperature, top-k and top-p (the per-row rule)."""
    q = torch.softmax(logits, -1)[0, CHUNK_EOS]
    final = torch.softmax(decode._top_k_top_p(logits / temperature, top_k, top_p), -1)[0]
    out = (1 - q) * final
    out[CHUNK_EOS] += q
    return out


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 20, 0.8), (1.3, 3, 0.0)])
def test_unseeded_draws_follow_the_public_rule(temperature, top_k, top_p):
    logits = ties(1, VOCAB, 11) / 2
    logits[0, CHUNK_EOS] = logits.max() - 1.5  # the pre-check ends some units
    want = expected(logits, temperature, top_k, top_p)
    eng = SimpleNamespace(draws={"cpu": torch.Generator().manual_seed(0)})  # reproducible
    counts = torch.zeros(VOCAB)
    batch, rounds = 64, 60
    for _ in range(rounds):
        rows = [
            row(logits, seed=None, temperature=temperature, top_k=top_k, top_p=top_p)
            for _ in range(batch)
        ]
        for tid in decide(eng, rows):
            counts[tid] += 1
    n = batch * rounds
    got = counts / n
    assert torch.all(got[want == 0] == 0), "a token the rules drop was drawn"
    sigma = torch.sqrt(want * (1 - want) / n)
    assert torch.all((got - want).abs() <= 5 * sigma + 1e-9), (got, want)
    # the control: the row's settings swapped for another's give another distribution
    other = expected(logits, temperature, 1, 0.0)
    assert ((got - other).abs() > 5 * torch.sqrt(other * (1 - other) / n) + 1e-9).any()


def tts(vq: int) -> BatchedTTS:
    t = object.__new__(BatchedTTS)
    t.tts = SimpleNamespace(num_vq=vq)
    return t


@pytest.mark.parametrize("vq", [1, 2])
def test_tts_draws_seeded_rows_alone_and_the_others_together(vq):
    n, vocab, eos = 5, 40, 39
    logits = ties(n * vq, vocab, 12)
    logits[:, eos] = 50.0  # unmasked, the eos is all but certain
    gens = [torch.Generator().manual_seed(100 + i) if i in (1, 3) else None for i in range(n)]
    mins = [0, 26, 26, 0, 26]  # rows 1, 2, 4 below their minimum: eos masked
    active = list(range(n))
    shared = torch.Generator().manual_seed(5)
    shared_copy = torch.Generator().manual_seed(5)
    copies = [
        None if g is None else torch.Generator().manual_seed(100 + i) for i, g in enumerate(gens)
    ]
    picked = tts(vq)._draw(logits, active, 3, gens, mins, [eos] * n, shared)
    assert picked.shape == (n, vq)
    masked = logits.clone()
    for k in (1, 2, 4):
        masked[k * vq : (k + 1) * vq, eos] = float("-inf")
    for k in (1, 3):  # seeded: the draw its own generator gives on its own rows
        alone = torch.multinomial(
            torch.softmax(masked[k * vq : (k + 1) * vq], -1), 1, generator=copies[k]
        )[:, 0]
        assert torch.equal(picked[k], alone)
    free = [0, 2, 4]
    rows = [k * vq + q for k in free for q in range(vq)]
    together = torch.multinomial(torch.softmax(masked[rows], -1), 1, generator=shared_copy)
    assert torch.equal(picked[free], together.reshape(len(free), vq))
    assert (picked[[1, 2, 4]] != eos).all() and (picked[[0, 3]] == eos).all()


class _Model(torch.nn.Module):
    """What `_embed` uses of the public StreamDecoder's model: `.device`, `.model.embed_tokens`."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(VOCAB, 8)
        self.lookups = 0
        self.model.embed_tokens.register_forward_hook(lambda *_: self._count())

    def _count(self) -> None:
        self.lookups += 1

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


class _Decoder:
    def __init__(self, m: _Model) -> None:
        self.m = m

    def embed_tokens(self, ids: list[int]) -> torch.Tensor:  # the public method's lookup
        return self.m.model.embed_tokens(torch.tensor(ids))


def test_the_fed_tokens_are_embedded_in_one_lookup():
    m = _Model()
    fed = [(SimpleNamespace(duplex=SimpleNamespace(decoder=_Decoder(m))), t) for t in (3, 9, 3, 41)]
    want = [r.duplex.decoder.embed_tokens([t]) for r, t in fed]
    m.lookups = 0
    got = decode._embed(fed)
    assert m.lookups == 1
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    # rows of another model (never in one engine) are looked up on their own
    other = _Model()
    mixed = [*fed[:2], (SimpleNamespace(duplex=SimpleNamespace(decoder=_Decoder(other))), 5)]
    m.lookups = other.lookups = 0
    got = decode._embed(mixed)
    assert (m.lookups, other.lookups) == (2, 1)
    assert torch.equal(got[2], other.model.embed_tokens(torch.tensor([5])))


def test_the_repetition_penalty_over_rows_is_each_rows_own():
    """decode._adjust's penalty (the device's history of each row, gathered) against the
    public rule row by row: the ids of set(history[-window:]) divided by the penalty (or
    multiplied by its inverse below 1), whatever the window (0: all), the history (empty,
    ids past the vocabulary) and the rows' mix of penalties."""
    g = torch.Generator().manual_seed(5)
    rows, want = [], []
    logits = torch.randn(12, VOCAB, generator=g)
    for k in range(12):
        history = torch.randint(0, VOCAB, (k * 7 % 30,), generator=g).tolist()
        if k == 4:
            history.append(VOCAB + 3)
        penalty, window = (1.3, 0.8, 1.0)[k % 3], (4, 0, 50, 1)[k % 4]
        r = row(logits[k : k + 1], seed=None, text_repetition_penalty=penalty)
        r.args["text_repetition_window_size"] = window
        r.duplex.decoder.generated_tokens = history
        rows.append(r)
        alone = logits[k].clone()
        recent = [t for t in set(history[-window:]) if t < VOCAB] if history else []
        if penalty != 1.0 and recent:
            ids = torch.tensor(recent)
            alone[ids] = alone[ids] / penalty if penalty > 1 else alone[ids] * (1 / penalty)
        want.append(alone)
    plans = {id(r): decode._Plan(r) for r in rows}
    history = decode._History(rows, plans, VOCAB, logits.device, 0)
    got = decode._adjust(logits, rows, plans, history)
    assert torch.equal(got, torch.stack(want))
    assert not torch.equal(got, logits)  # the penalty did something


class _Reads(TorchDispatchMode):
    """Counts device values read on the host (`.item()`, `int()` of a tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_tts_reads_each_speakers_eos_and_temperature_once_per_tensor():
    t = object.__new__(BatchedTTS)
    t.tts = SimpleNamespace(num_vq=1, config=SimpleNamespace(num_audio_tokens=40))
    t.gen_logits = lambda num_code, repetition_penalty: ([], [])
    t._made = tts_module._PerTensor()
    first = SimpleNamespace(
        tts_temperature=torch.tensor([0.7]),
        tts_eos_token=torch.tensor([39]),
        tts_repetition_penalty=1.05,
    )
    clones = [copy.copy(first) for _ in range(6)]  # the slots' duplex objects share them
    session = SimpleNamespace(settings=SimpleNamespace(seed=None))
    rows = [SimpleNamespace(duplex=d, session=session) for d in clones]
    with _Reads() as counted:
        _, temps, eos, _ = t._sampling(rows, torch.device("cpu"))
    assert counted.reads == 1 and eos == [39] * 6
    assert all(torch.equal(x, torch.tensor([[0.7]])) for x in temps)
    with _Reads() as counted:
        for _ in range(3):  # later chunks read nothing
            _, temps_again, eos, _ = t._sampling(rows, torch.device("cpu"))
    assert counted.reads == 0 and eos == [39] * 6
    assert all(a is b for a, b in zip(temps, temps_again, strict=True))
    # A duplex object given other tensors gets its own values, the others keep theirs.
    clones[2].tts_eos_token = torch.tensor([7])
    clones[2].tts_temperature = torch.tensor([0.3])
    _, temps, eos, _ = t._sampling(rows, torch.device("cpu"))
    assert eos == [39, 39, 7, 39, 39, 39]
    assert temps[2].item() == pytest.approx(0.3) and temps[1].item() == pytest.approx(0.7)
