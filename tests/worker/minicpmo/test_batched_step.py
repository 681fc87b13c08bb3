"""The batched duplex step (worker/engines/minicpmo/step.py) against each session's solo run
through the public code, on the same loaded tiny checkpoint (opt-in: OMNI_MINICPMO_CODE_DIR,
see conftest).

Per session and unit: the text token ids (the duplex's whole id history and the decoder's
penalty history), the result (listen, text, end of turn, token counts, context length), the
pending logits of its prefill (within 1e-4) and the context length after its finalize are
those of the session run alone; with TTS on, its TTS token stream too; and its audio (the
tiny checkpoint carries random vocoder assets, so sessions speak): for seeded sessions (the TTS
samples), the same length, samples within AUDIO_ATOL of the solo run's (the batched vocoder's
products round differently).
Sessions differ in prompt, audio, frames, caps and penalties, join and leave mid-stream,
and are forced to listen on some units; seeded sampling gives a session the same tokens
whatever its batch-mates. Controls perturb the batched positions, and one row's vocoder
cache, and the comparison must fail.
"""

from __future__ import annotations

import dataclasses
import io
import types
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omnifabric.worker.engine import DuplexSettings, StepRow
from omnifabric.worker.engines.minicpmo import layouts
from omnifabric.worker.engines.minicpmo import slots as slots_module
from tests.worker.minicpmo.conftest import LAYOUTS, LOGITS_ATOL, ON, needs_code

pytestmark = [needs_code, pytest.mark.timeout(900)]

UNITS = 3
#: Audio of a batched row against its solo run: 2 int16 steps (the vocoder's products over
#: several rows round differently from one row's; int16 output quantizes them).
AUDIO_ATOL = 2.5 / 32768
#: Where a hidden state's first feature passes this, a test's hook makes <|turn_eos|> the
#: model's choice (random weights rarely end a turn).
TURN_END_FEATURE = 1.0


@pytest.fixture(scope="module", params=[layout for layout, _ in LAYOUTS] or ["none"])
def eng16(request, tiny_dirs):
    """The engine on the tiny checkpoint with 16 slots (a batched worker's), per layout."""
    from omnifabric.worker.engines.minicpmo import MiniCPMOEngine

    layout = request.param
    code = dict(LAYOUTS)[layout]
    from omnifabric.worker.engines.minicpmo.step import MiniCPMOStepper

    eng = MiniCPMOEngine(
        str(tiny_dirs[code]), slots=16, api=layout, stepper_class=MiniCPMOStepper, **ON
    )
    eng.load()
    assert eng.layout == layout
    eng._solo_cache = {}  # plan key -> solo records (shared by the tests of a layout)
    eng._duplex_class = type(eng._free[0].duplex)
    return eng


def jpeg(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(
        out, format="JPEG"
    )
    return out.getvalue()


@dataclasses.dataclass
class Plan:
    """One session: its prompt, settings and units (pcm, frames, slices, force)."""

    key: str
    prompt: str
    settings: DuplexSettings
    units: list[tuple[np.ndarray, list[bytes], int, bool]]
    tts: bool = False


def plan(engine, k: int, *, seed: int | None = None, tts: bool = False) -> Plan:
    """Session k's plan: everything differs a little from one k to the next."""
    rng = np.random.default_rng(1000 + k)
    amplitude = 0.01 + 0.012 * (k % 7)
    units = []
    for u in range(UNITS):
        n = engine.first_unit_samples if u == 0 else engine.unit_samples
        pcm = (amplitude * rng.standard_normal(n)).astype(np.float32)
        frames: list[bytes] = []
        slices = 1
        if u == 1 and k % 4 == 1:
            frames = [jpeg(64, 64, k)]
        elif u == 1 and k % 4 == 2:
            frames, slices = [jpeg(900, 450, k)], 2  # 1 + 2 slices
        force = (u == 2 and k % 3 == 0) or (u == 1 and k % 5 == 4)
        units.append((pcm, frames, slices, force))
    sampling: dict[str, Any] = (
        {"temperature": 0} if seed is None else {"seed": seed, "temperature": 0.9, "top_k": 40}
    )
    settings = DuplexSettings(
        force_listen_count=0,
        max_new_speak_tokens_per_chunk=(20, 4, 6, 3)[k % 4],
        length_penalty=(1.1, 1.6, 0.8)[k % 3],
        listen_prob_scale=(1.0, 1.0, 3.0, 0.5)[k % 4],
        **sampling,
    )
    prompts = ("Be brief.", "You are a helpful assistant.", "Describe what you hear.")
    return Plan(f"{k}-{seed}-{tts}", f"{prompts[k % 3]} #{k}", settings, units, tts)


# ---- records ---------------------------------------------------------------------------


def _prepare(engine, name: str, p: Plan):
    s = engine.open_session(name, "audio")
    s.prepare(p.prompt, None, None, p.settings)  # a seed seeds the session's own RNG
    if p.tts:  # speech on without the vocoder (capture_tts takes its place)
        d = s.handle.duplex
        d.generate_audio = True
        d.tts_eos_token = torch.tensor([engine.model.tts.config.num_audio_tokens - 1])
    return s


def _record(s, result, logits, tts: list) -> dict[str, Any]:
    d = s.handle.duplex
    return {
        "listen": result.is_listen,
        "text": result.text,
        "eot": result.end_of_turn,
        "n_tokens": result.n_tokens,
        "kv": result.kv_cache_length,
        "in_audio": result.input_audio_tokens,
        "in_vision": result.input_vision_tokens,
        "n_tts": result.n_tts_tokens,
        "tts": tts,
        "total_ids": list(d.total_ids),
        "history": list(d.decoder.generated_tokens),
        "kv_after": s.kv_length(),
        "tts_pos": getattr(d, "tts_text_start_pos", 0),
        "audio": None if result.audio is None else np.asarray(result.audio).copy(),
        # Unseeded, the TTS draws from the worker's generator batched and from the
        # global RNG alone: its tokens (their count, an early end, the next chunk's start),
        # so its audio, differ.
        "seeded": s.settings.seed is not None,
        "turn_open": not d.current_turn_ended,
        "logits": logits.detach().clone(),
    }


@pytest.fixture
def capture_tts(eng16, monkeypatch):
    """Vocoder off on CPU: the waveform step of both paths (the public method, which the
    batched step calls too) records the TTS tokens instead, per duplex object."""
    captured: dict[int, list[list[int]]] = {}

    def fake(self, new_tokens, prompt_wav_path, is_last_chunk=False, force_flush=False):
        tokens = [int(t) for t in new_tokens.reshape(-1).tolist()]
        captured.setdefault(id(self), []).append([*tokens, -int(is_last_chunk), int(force_flush)])
        return np.zeros(240, np.float32)

    monkeypatch.setattr(eng16._duplex_class, "_generate_waveform_from_tokens", fake)
    monkeypatch.setattr(eng16, "vocoder_batched", False)  # the step calls the method too
    return captured


def solo(engine, p: Plan, captured: dict | None = None) -> list[dict[str, Any]]:
    """The session alone through the serial path (the public code), cached per plan."""
    cache = engine._solo_cache
    if p.key in cache and len(cache[p.key]) >= len(p.units):
        return cache[p.key][: len(p.units)]  # a unit's records depend on the units before
    s = _prepare(engine, f"solo-{p.key}", p)
    out = []
    try:
        for pcm, frames, slices, force in p.units:
            s.prefill(pcm, frames, slices)
            logits = s.handle.duplex.pending_logits.clone()
            result = s.generate(force)
            s.finalize()
            tts = captured.pop(id(s.handle.duplex), []) if captured is not None else []
            out.append(_record(s, result, logits, tts))
    finally:
        s.close()
    cache[p.key] = out
    return out


def batched(
    engine,
    plans: list[Plan],
    starts: list[int] | None = None,
    captured: dict | None = None,
    slots_seen: dict | None = None,
) -> list[list[dict[str, Any]]]:
    """All plans through the stepper: session i joins at step starts[i], runs its units one
    per step, and leaves (closes) after its last; finalizes between steps."""
    stepper = engine.stepper()
    starts = starts or [0] * len(plans)
    out: list[list[dict[str, Any]]] = [[] for _ in plans]
    open_: dict[int, Any] = {}
    step = 0
    try:
        while any(len(o) < len(p.units) for o, p in zip(out, plans, strict=True)):
            for i, p in enumerate(plans):
                if starts[i] == step:
                    open_[i] = _prepare(engine, f"b{i}-{p.key}", p)
            here = [i for i in open_ if len(out[i]) < len(plans[i].units)]
            rows = []
            for i in here:
                pcm, frames, slices, force = plans[i].units[len(out[i])]
                rows.append(StepRow(open_[i], pcm, frames, slices, force))
            if rows:
                outcome = stepper.step(rows)
                assert {"prefill", "generate", "llm_prefill", "decode"} <= set(outcome.phases_ms)
                sessions = [open_[i] for i in here]
                results = []
                for i, got in zip(here, outcome.rows, strict=True):
                    if isinstance(got, Exception):
                        raise got
                    results.append(got[1])
                    if slots_seen is not None:
                        slots_seen.setdefault(i, open_[i].kv_slot)
                assert stepper.finalize(sessions) == [None] * len(sessions)
                for i, result in zip(here, results, strict=True):
                    s = open_[i]
                    if s.tts_slot is not None:  # its slot holds its turn's TTS past, no more
                        held = stepper.tts.cache.length(s.tts_slot)
                        assert held == s.handle.duplex.tts_text_start_pos, (i, held)
                    tts = captured.pop(id(s.handle.duplex), []) if captured is not None else []
                    out[i].append(_record(s, result, stepper.prefill_logits[s.session_id], tts))
            for i in list(open_):
                if len(out[i]) == len(plans[i].units):
                    open_.pop(i).close()
            step += 1
    finally:
        for s in open_.values():
            s.close()
    # every session left (some with their last finalize still deferred): no slot is held
    assert stepper.cache.claimed() == []
    assert stepper.tts is None or stepper.tts.cache.claimed() == []
    return out


def compare(want: list[dict[str, Any]], got: list[dict[str, Any]], who: str) -> None:
    assert len(want) == len(got), who
    for u, (a, b) in enumerate(zip(want, got, strict=True)):
        for key in a:
            if key == "logits":
                delta = (a[key] - b[key]).abs().max().item()
                assert delta <= LOGITS_ATOL, f"{who} unit {u}: logits differ by {delta}"
            elif key in ("audio", "n_tts", "tts_pos") and not a["seeded"]:
                continue  # drawn from another generator batched than alone (see _record)
            elif key == "audio":
                compare_audio(a[key], b[key], f"{who} unit {u}")
            else:
                assert a[key] == b[key], f"{who} unit {u}: {key} {a[key]!r} != {b[key]!r}"


def compare_audio(a: np.ndarray | None, b: np.ndarray | None, who: str) -> None:
    """The same audio: both none or of one length, samples within AUDIO_ATOL."""
    assert (a is None or a.size == 0) == (b is None or b.size == 0), f"{who}: audio on one side"
    if a is None or b is None or not a.size:
        return
    assert a.shape == b.shape, f"{who}: audio {a.shape} != {b.shape}"
    delta = float(np.abs(a - b).max())
    assert delta <= AUDIO_ATOL, f"{who}: audio differs by {delta * 32768:.1f} int16 steps"


def spoken_seconds(records: list[list[dict[str, Any]]]) -> float:
    """Seconds of audio the speaking units of the records carry."""
    return sum(
        0 if u["audio"] is None else u["audio"].size / 24000
        for r in records
        for u in r
        if not u["listen"]
    )


def check(engine, plans, starts=None, slots_seen=None, captured=None):
    want = [solo(engine, p, captured) for p in plans]
    got = batched(engine, plans, starts, captured, slots_seen)
    for p, w, g in zip(plans, want, got, strict=True):
        compare(w, g, f"session {p.key}")
    return want


def kinds(records: list[list[dict[str, Any]]]) -> tuple[int, int]:
    units = [u for r in records for u in r]
    return sum(u["listen"] for u in units), sum(not u["listen"] for u in units)


# ---- tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
def test_greedy_equals_solo(eng16, n):
    plans = [plan(eng16, k) for k in range(n)]
    if n == 1:  # audio only
        plans[0].units = [(pcm, [], 1, force) for pcm, _, _, force in plans[0].units]
        plans[0].key += "-audio"
    want = check(eng16, plans)
    listens, speaks = kinds(want)
    assert speaks > 0
    if n >= 4:
        assert listens > 0


def test_join_leave_vision_force_listen_8(eng16):
    plans = [plan(eng16, k) for k in range(8)]
    # 7 joins when 0 has left: it gets a slot released mid-stream.
    starts = [0, 0, 1, 0, 2, 0, 1, 3]
    seen: dict[int, int] = {}
    want = check(eng16, plans, starts, slots_seen=seen)
    listens, speaks = kinds(want)
    assert listens > 0 and speaks > 0
    if eng16.audio_on:  # rows joined and left mid-reply, each one's speech its solo speech
        assert spoken_seconds(want) >= speaks * 0.9
    assert seen[7] == seen[0]  # the slot session 0 released
    assert any(frames for p in plans for _, frames, slices, _ in p.units if slices == 2)


def test_sixteen_sessions(eng16):
    plans = [plan(eng16, k) for k in range(16)]
    for p in plans:  # 0-7: their solo runs are known already; 8-15 leave after one unit
        p.units = p.units[: 2 if int(p.key.split("-")[0]) < 8 else 1]
    want = check(eng16, plans)
    listens, speaks = kinds(want)
    assert listens > 0 and speaks > 0


def test_seeded_sampling_does_not_depend_on_batch_mates(eng16):
    me = plan(eng16, 1, seed=1234)
    mates_a = [plan(eng16, k, seed=50 + k) for k in (2, 3)]
    mates_b = [plan(eng16, k, seed=90 + k) for k in (5, 6)]
    for mate in (*mates_a, *mates_b):
        mate.units = mate.units[:2]
    want = solo(eng16, me)
    first = batched(eng16, [me, *mates_a])[0]
    second = batched(eng16, [*mates_b, me], starts=[0, 1, 0])[2]
    compare(want, first, "seeded, mates A")
    compare(want, second, "seeded, mates B")
    assert any(not u["listen"] for u in want)
    # and a different seed gives other tokens
    other = dataclasses.replace(me, key=me.key + "-other")
    other.settings = dataclasses.replace(me.settings, seed=4321)
    other.units = other.units[:1]
    assert batched(eng16, [other])[0][0]["total_ids"] != want[0]["total_ids"]


def test_unseeded_sampling_draws_together_beside_seeded_rows(eng16, monkeypatch):
    """Sessions without a seed sample (temperature 0.9, top-k 40) through the real step,
    drawing together from the worker's generator (decode.py): no generator of their own,
    every unit within its rules; seeded sessions in the same steps still equal their solo
    runs."""
    from omnifabric.worker.engines.minicpmo import decode

    seeded = [plan(eng16, k, seed=1300 + k) for k in (1, 2)]
    free = []
    for k in range(3, 9):
        p = plan(eng16, k)
        p.key += "-unseeded"
        p.settings = dataclasses.replace(p.settings, temperature=0.9, top_k=40)
        free.append(p)
    per_session = []
    real = decode.generator

    def counted(session, device):
        per_session.append(session.settings.seed)
        return real(session, device)

    monkeypatch.setattr(decode, "generator", counted)
    want = [solo(eng16, p) for p in seeded]
    per_session.clear()
    got = batched(eng16, [seeded[0], *free, seeded[1]])
    compare(want[0], got[0], "seeded beside unseeded rows")
    compare(want[1], got[-1], "seeded beside unseeded rows")
    assert set(per_session) <= {1301, 1302}  # only the seeded rows draw on their own
    assert str(torch.device(ON["device"])) in eng16.draws
    units = [u for r in got[1:-1] for u in r]
    assert any(not u["listen"] for u in units)
    for p, records in zip(free, got[1:-1], strict=True):
        for u in records:
            assert u["n_tokens"] <= p.settings.max_new_speak_tokens_per_chunk, (p.key, u)


def test_control_shifted_positions_fail(eng16, monkeypatch):
    plans = [plan(eng16, k) for k in range(2)]
    for p in plans:
        p.units = p.units[:2]
    want = [solo(eng16, p) for p in plans]
    original = slots_module.SlotCache.begin

    def shifted(self, slots, counts):
        step = original(self, slots, counts)
        positions = step.positions.clone()
        positions[0] += 1
        return dataclasses.replace(step, positions=positions)

    monkeypatch.setattr(slots_module.SlotCache, "begin", shifted)
    got = batched(eng16, plans)
    with pytest.raises(AssertionError):
        compare(want[0], got[0], "shifted row")
    monkeypatch.undo()
    compare(want[1], batched(eng16, plans[1:])[0], "unshifted")


@pytest.mark.parametrize("shapes", ["ragged", "static"])
def test_tts_tokens_equal_solo(eng16, capture_tts, request, shapes):
    """Each speaker's TTS tokens, positions and lengths are its solo run's: ragged, and with
    the TTS's steps after the first as static decode forwards (tts.py; graphs on CUDA)."""
    stepper = request.getfixturevalue("static_shapes") if shapes == "static" else None
    plans = []
    for k in range(4):
        p = plan(eng16, 20 + k, seed=700 + k, tts=True)
        p.settings = dataclasses.replace(p.settings, temperature=0)  # the TTS draws anyway
        plans.append(p)
    want = check(eng16, plans, starts=[0, 0, 1, 0], captured=capture_tts)
    spoken = [u for r in want for u in r if not u["listen"]]
    assert spoken and all(u["tts"] for u in spoken)
    assert sum(u["n_tts"] for u in spoken) > 0
    assert any(u["tts_pos"] > 0 for u in spoken)  # a turn went on over units (TTS cache kept)
    listens, speaks = kinds(want)
    assert listens > 0 and speaks > 0
    if stepper is not None:
        assert stepper.tts is not None and stepper.tts.static is not None
        assert stepper.tts.static.calls > 0


def test_tts_conditions_of_all_speakers_at_once_are_the_public_ones(
    eng16, capture_tts, monkeypatch
):
    """The TTS conditions the batched step makes for all speakers at once equal the public
    `_convert_results_to_tts_input` of each speaker's unit (float32: within 1e-6)."""
    from omnifabric.worker.engines.minicpmo import tts as tts_module

    made = tts_module.BatchedTTS._conditions
    seen: list[int] = []

    def checked(self, rows):
        conds = made(self, rows)
        for row, cond in zip(rows, conds, strict=True):
            public = row.duplex._convert_results_to_tts_input(row.hidden)[0]
            assert cond.shape == public.shape
            assert (cond - public).abs().max().item() <= 1e-6
            seen.append(len(row.hidden))
        return conds

    monkeypatch.setattr(tts_module.BatchedTTS, "_conditions", checked)
    plans = [plan(eng16, 30 + k, seed=800 + k, tts=True) for k in range(3)]
    batched(eng16, plans, captured=capture_tts)
    assert len(seen) >= 3 and max(seen) > 0  # speakers with spoken tokens were checked


@pytest.mark.parametrize("shapes", ["ragged", "static"])
def test_tts_ahead_of_the_host_equals_solo(eng16, capture_tts, request, monkeypatch, shapes):
    """The TTS's token loop with the device two steps beyond the host's reading (tts._Chunk,
    decode_ahead 2; CUDA's default is 1), its eos made likely (a hook on the code head, in
    both paths alike) so rows stop early at a turn's first chunk: each speaker's TTS tokens,
    positions and lengths, and the chunks its generator draws after, equal its solo run;
    rows were fed past their stop and their slots taken back."""
    from omnifabric.worker.engines.minicpmo import tts as tts_module

    if shapes == "static":
        request.getfixturevalue("static_shapes")
    tts = eng16.model.tts
    eos = int(tts.config.num_audio_tokens) - 1

    def likely_eos(module, args, out):
        # where the hidden state's first feature is high: the same in both paths
        boost = (args[0][..., 0] > 1.0).to(out.dtype) * 40.0
        out = out.clone()
        out[..., eos] += boost
        return out

    hook = tts.head_code[0].register_forward_hook(likely_eos)
    request.addfinalizer(hook.remove)
    monkeypatch.setattr(eng16, "decode_ahead", 2)
    back: list[int] = []
    depths: list[int] = []
    caches: set[int] = set()
    rewind, init = slots_module.SlotCache.rewind, tts_module._Chunk.__init__

    def spied_rewind(self, slot, length):
        if id(self) in caches:  # the TTS's (the LLM's decode rewinds its own too)
            back.append(self.length(slot) - length)
        return rewind(self, slot, length)

    def spied_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        depths.append(self.depth)
        caches.add(id(self.owner.cache))

    monkeypatch.setattr(slots_module.SlotCache, "rewind", spied_rewind)
    monkeypatch.setattr(tts_module._Chunk, "__init__", spied_init)
    plans = []
    for k in range(4):
        p = plan(eng16, 30 + k, seed=900 + k, tts=True)
        p.key += "-eos"
        p.settings = dataclasses.replace(p.settings, temperature=0)
        plans.append(p)
    want = check(eng16, plans, starts=[0, 1, 0, 0], captured=capture_tts)
    spoken = [u for r in want for u in r if not u["listen"]]
    assert spoken and all(u["tts"] for u in spoken)
    lengths = [len(chunk) - 2 for u in spoken for chunk in u["tts"]]
    cap = tts_module.CHUNK_TOKENS - 1
    assert any(n < cap for n in lengths), f"no chunk stopped early: {lengths}"
    assert any(n == cap for n in lengths), lengths  # mid-turn chunks run to the cap
    assert depths and set(depths) == {2}
    assert max(back) > 0, "no row was fed past its stop"


def test_a_failing_row_fails_alone(eng16):
    p = plan(eng16, 0)
    want = solo(eng16, p)
    stepper = eng16.stepper()
    good = _prepare(eng16, "good", p)
    bad = _prepare(eng16, "bad", plan(eng16, 1))
    try:
        bad.handle.duplex.set_session_stop()
        pcm, frames, slices, force = p.units[0]
        outcome = stepper.step(
            [StepRow(bad, pcm, [], 1, False), StepRow(good, pcm, frames, slices, force)]
        )
        assert isinstance(outcome.rows[0], RuntimeError)
        assert not isinstance(outcome.rows[1], Exception)
        assert stepper.finalize([good]) == [None]
        got = _record(good, outcome.rows[1][1], stepper.prefill_logits["good"], [])
        compare(want[:1], [got], "the good row")
    finally:
        good.close()
        bad.close()
    assert stepper.cache.claimed() == []


def _stepped(stepper, s, unit) -> Any:
    """One unit of session `s` alone through the stepper, finalized; its result."""
    pcm, frames, slices, force = unit
    outcome = stepper.step([StepRow(s, pcm, frames, slices, force)])
    got = outcome.rows[0]
    assert not isinstance(got, Exception)
    assert stepper.finalize([s]) == [None]
    return got[1]


@pytest.mark.parametrize("seed", [None, 77])
def test_serial_path_between_steps(eng16, seed):
    """A batched session's unit through the serial path (its KV cache goes back to the
    decoder, the deferred finalize is fed), then batched again: still its solo run; a
    sampling session's draws too (its generator's state goes to its global RNG and back)."""
    p = plan(eng16, 0, seed=seed)
    want = solo(eng16, p)
    stepper = eng16.stepper()
    s = _prepare(eng16, "mixed", p)
    got = []
    try:
        for u, (pcm, frames, slices, force) in enumerate(p.units):
            if u == 1:
                s.prefill(pcm, frames, slices)
                assert s.kv_slot is None
                logits = s.handle.duplex.pending_logits.clone()
                result = s.generate(force)
                s.finalize()
            else:
                result = _stepped(stepper, s, (pcm, frames, slices, force))
                assert s.kv_slot is not None
                logits = stepper.prefill_logits["mixed"]
            got.append(_record(s, result, logits, []))
    finally:
        s.close()
    compare(want, got, "batched, serial, batched")
    assert stepper.cache.claimed() == []


@pytest.mark.parametrize("shapes", ["ragged", "static"])
def test_a_speakers_next_turn_starts_from_an_empty_tts_slot(eng16, capture_tts, request, shapes):
    """A speaker keeps its TTS slot over turns (tts.py): the slot is emptied where a turn
    ends, so the next turn's TTS starts from no past, as the public code's does; every
    unit's TTS tokens are still its solo run's."""
    if shapes == "static":
        request.getfixturevalue("static_shapes")
    # Random weights rarely say <|turn_eos|>: its logit is made the largest wherever the
    # hidden state's first feature is high, in every path alike (a forward hook on the head).
    eos = eng16.tokenizer.convert_tokens_to_ids("<|turn_eos|>")

    def turn_ends(_module, args, logits):
        high = args[0][..., :1] > TURN_END_FEATURE
        boosted = logits.max(dim=-1, keepdim=True).values + 1.0
        out = logits.clone()
        out[..., eos : eos + 1] = torch.where(high, boosted, logits[..., eos : eos + 1])
        return out

    hook = eng16.model.llm.lm_head.register_forward_hook(turn_ends)
    request.addfinalizer(hook.remove)
    found = None
    for k in range(64, 96):
        p = plan(eng16, k, seed=1100 + k, tts=True)
        p.settings = dataclasses.replace(p.settings, temperature=0)
        rng = np.random.default_rng(k)
        for _ in range(5):  # eight units: room for a turn to end and another to begin
            pcm = (0.02 * rng.standard_normal(eng16.unit_samples)).astype(np.float32)
            p.units.append((pcm, [], 1, False))
        p.key += "-8-turn-ends"
        want = solo(eng16, p, capture_tts)
        ends = [u for u, r in enumerate(want) if r["eot"] and r["tts"]]
        if ends and any(not r["listen"] for r in want[ends[0] + 1 :]):
            found = p
            break
    assert found is not None, "no plan of the tiny checkpoint speaks again after a turn's end"
    check(eng16, [found], captured=capture_tts)


def _speaking_on(engine, captured) -> tuple[Plan, list[dict[str, Any]]]:
    """A greedy plan whose solo run speaks one turn from unit 0 through unit 2 (its TTS
    past goes on from chunk to chunk), and that run."""
    for k in range(40, 64):
        p = plan(engine, k, seed=900 + k, tts=True)
        p.settings = dataclasses.replace(p.settings, temperature=0)
        want = solo(engine, p, captured)
        if all(not u["listen"] for u in want) and all(u["tts_pos"] > 0 for u in want[:2]):
            return p, want
    raise AssertionError("no plan of the tiny checkpoint speaks over three units")


def test_a_speaker_through_the_serial_path_mid_turn_keeps_its_tts_past(eng16, capture_tts):
    """A speaking session's TTS past lives in its TTS slot from chunk to chunk (tts.py): a
    unit through the serial path mid-turn gets it back on the duplex object and goes on
    from it, the next batched unit loads it into a slot again, and closing frees the slot.
    Every unit is its solo run's, its TTS codes too: a seeded session's draws go on from
    its generator to its global RNG state and back where it changes paths
    (decode.draws_to_serial, draws_from_serial)."""
    stepper = eng16.stepper()
    p, want = _speaking_on(eng16, capture_tts)
    s = _prepare(eng16, "mixed-tts", p)
    d = s.handle.duplex
    got = []
    try:
        for u, (pcm, frames, slices, force) in enumerate(p.units):
            if u == 1:
                s.prefill(pcm, frames, slices)
                assert s.tts_slot is None and d.tts_past_key_values is not None
                logits = d.pending_logits.clone()
                result = s.generate(force)
                s.finalize()
                # the chunk went on from the slot's past: it holds the whole turn so far
                assert d.tts_past_key_values.get_seq_length() == d.tts_text_start_pos > 0
            else:
                result = _stepped(stepper, s, (pcm, frames, slices, force))
                assert s.tts_slot is not None and d.tts_past_key_values is None
                assert stepper.tts.cache.length(s.tts_slot) == d.tts_text_start_pos
                logits = stepper.prefill_logits["mixed-tts"]
            got.append(_record(s, result, logits, capture_tts.pop(id(d), [])))
    finally:
        s.close()
    compare(want, got, "batched, serial, batched (speaking)")
    assert stepper.cache.claimed() == [] and stepper.tts.cache.claimed() == []


def test_added_cost_is_the_fitted_slope():
    from omnifabric.worker.engines.minicpmo.step import MiniCPMOStepper

    stepper = MiniCPMOStepper(None)  # type: ignore[arg-type]  # no model needed
    assert stepper.added_cost(0.5) == 0.5  # nothing seen: the safe side
    for _ in range(5):
        stepper._observe(4, 1.4)
    assert stepper.added_cost(0.5) == 0.5  # one size only: no slope yet
    for _ in range(20):
        for rows in (2, 4, 8):
            stepper._observe(rows, 1.0 + 0.1 * rows)
    assert stepper.added_cost(0.5) == pytest.approx(0.1, rel=1e-6)
    assert stepper.added_cost(0.05) == 0.05  # never more than a whole session


def test_a_context_outgrowing_its_slot_goes_serial(eng16, monkeypatch):
    from omnifabric.worker.engines.minicpmo.step import UNIT_HEADROOM

    p = plan(eng16, 0)
    want = solo(eng16, p)
    stepper = eng16.stepper()
    s = _prepare(eng16, "big", p)
    # room for the first unit only: the next ones go through the serial path
    monkeypatch.setattr(stepper.cache, "max_len", s.kv_length() + UNIT_HEADROOM + 1)
    got, where = [], []
    try:
        for pcm, frames, slices, force in p.units:
            outcome = stepper.step([StepRow(s, pcm, frames, slices, force)])
            row = outcome.rows[0]
            assert not isinstance(row, Exception)
            where.append(s.kv_slot is not None)
            assert stepper.finalize([s]) == [None]
            logits = stepper.prefill_logits.get("big")
            if logits is None:  # the serial path's prefill kept none for the stepper
                logits = want[len(got)]["logits"]
            got.append(_record(s, row[1], logits, []))
    finally:
        s.close()
    assert where == [True, False, False]
    compare(want, got, "outgrown")


def test_a_tts_past_outgrowing_its_slot_goes_serial(eng16, capture_tts, monkeypatch):
    """A reply spoken past what a TTS slot holds (--tts-slot-tokens) goes on on the serial
    path, where the public code's own cache has no bound, instead of failing its step;
    every unit, its TTS codes too, is still its solo run's, and no slot is left claimed."""
    from omnifabric.worker.engines.minicpmo.tts import CHUNK_TOKENS

    stepper = eng16.stepper()
    p, want = _speaking_on(eng16, capture_tts)
    s = _prepare(eng16, "long-reply", p)
    got, where = [], []
    try:
        for u, unit in enumerate(p.units):
            if u == 1:
                # the first chunk's past fits; with it, another chunk at its cap does not
                cap = s.sampling()["max_new_speak_tokens_per_chunk"]
                room = stepper.tts.cache.length(s.tts_slot) + cap + 1 + CHUNK_TOKENS - 1
                monkeypatch.setattr(stepper.tts.cache, "max_len", room)
            result = _stepped(stepper, s, unit)
            where.append((s.kv_slot is not None, s.tts_slot is not None))
            logits = stepper.prefill_logits.get("long-reply")
            if u and logits is None:  # the serial path's prefill kept none for the stepper
                logits = want[u]["logits"]
            got.append(_record(s, result, logits, capture_tts.pop(id(s.handle.duplex), [])))
    finally:
        s.close()
    assert where == [(True, True), (False, False), (False, False)]
    compare(want, got, "a reply past its TTS slot")
    assert stepper.cache.claimed() == [] and stepper.tts.cache.claimed() == []


def test_the_tts_slot_follows_the_setting_within_the_backbones_positions(eng16, monkeypatch):
    from omnifabric.worker.engines.minicpmo.tts import TTS_TOKENS, BatchedTTS

    positions = int(eng16.model.tts.model.config.max_position_embeddings)
    for setting, want in ((300, min(300, positions)), (None, min(TTS_TOKENS, positions))):
        monkeypatch.setattr(eng16, "tts_slot_tokens", setting)
        cache = BatchedTTS(eng16).cache
        assert (cache.slots, cache.max_len) == (eng16.slots, want)


def speaking_plan(engine, k: int) -> Plan:
    """Plan k, seeded: the TTS samples its tokens whatever the text temperature, the batched
    step from the session's own generator, the solo run from the global RNG seeded alike."""
    p = plan(engine, k, seed=900 + k)
    p.settings = dataclasses.replace(p.settings, temperature=0)
    return p


def test_after_the_warm_up_a_new_session_compiles_nothing(eng16):
    """The vocoder's warm-up compiles every variant of the package's compiled conformer
    (torch.compile) that a session meets: with torch's compiled code dropped and the
    warm-up run again, a new session speaking through the serial path (its first chunk from
    plain-tensor copies of the voice's caches, as the public code starts a session) makes
    torch recompile nothing. A recompile there took over 5 s on a CPU: past the worker's
    unit watchdog."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    if not eng16.audio_on:
        pytest.skip("the checkpoint has no vocoder assets (minicpmo-utils missing)")
    torch._dynamo.reset()
    eng16._warm_vocoder()
    compiled = counters["frames"]["total"]
    assert compiled > 0  # the warm-up compiled the conformer
    p = speaking_plan(eng16, 60)
    p.key += "-after-warm-up"
    records = solo(eng16, p)
    assert kinds([records])[1] > 0 and spoken_seconds([records]) > 0
    assert counters["frames"]["total"] == compiled, "a session recompiled the vocoder"


@pytest.mark.parametrize("n", [2, 8])
def test_speech_of_a_batched_step_equals_solo(eng16, n):
    """Every speaker's audio out of the batched vocoder (one call for all speakers a round)
    is its solo audio (the public waveform method, one session at a time)."""
    if not eng16.audio_on:
        pytest.skip("the checkpoint has no vocoder assets (minicpmo-utils missing)")
    plans = [speaking_plan(eng16, 30 + k) for k in range(n)]
    want = check(eng16, plans, starts=[k % 2 for k in range(n)])
    _, speaks = kinds(want)
    assert speaks > 0 and spoken_seconds(want) >= 0.9 * speaks


def test_control_a_broken_vocoder_cache_fails(eng16, monkeypatch):
    """The comparison sees one row's vocoder state off: its flow cache nudged before the
    batched vocoder runs makes that row's audio differ from its solo audio."""
    if not eng16.audio_on:
        pytest.skip("the checkpoint has no vocoder assets (minicpmo-utils missing)")
    from omnifabric.worker.engines.minicpmo import vocoder_batch

    plans = [speaking_plan(eng16, 30 + k) for k in range(2)]
    want = [solo(eng16, p) for p in plans]
    real = vocoder_batch.BatchedVocoder.run

    def nudged(self, jobs):
        cache = jobs[0].stream_cache
        cache["conformer_att_cache"] = cache["conformer_att_cache"] + 0.5
        return real(self, jobs)

    monkeypatch.setattr(vocoder_batch.BatchedVocoder, "run", nudged)
    got = batched(eng16, plans)
    with pytest.raises(AssertionError, match="audio"):
        compare(want[0], got[0], "nudged row")


# ---- static shapes (graphs.py) -----------------------------------------------------------


@pytest.fixture
def static_shapes(eng16, monkeypatch):
    """The stepper's decode forwards in static shapes (eager on a CPU, CUDA graphs on
    CUDA), on a slot cache with the scratch row; the ragged cache back afterwards."""
    from omnifabric.worker.engines.minicpmo import graphs

    stepper = eng16.stepper()
    assert stepper.cache.claimed() == []
    monkeypatch.setattr(eng16, "cuda_graphs", "on")
    monkeypatch.setattr(graphs, "MIN_WIDTH", 16)  # widths change from unit to unit
    saved = stepper._cache, stepper._static, stepper.tts
    stepper._cache = stepper._static = stepper.tts = None
    yield stepper
    stepper._cache, stepper._static, stepper.tts = saved


def sixteen_joining_and_leaving(engine, seeds: int) -> None:
    """Sixteen sessions, greedy and seeded sampling (seeds from `seeds`), with caps that
    stop rows at different tokens, joining mid-reply and leaving: each equals its solo run,
    and some listen and some speak."""
    plans = [plan(engine, k, seed=None if k % 3 else seeds + k) for k in range(16)]
    for k, p in enumerate(plans):
        p.units = p.units[: 3 if k < 4 else 2 if k < 10 else 1]
    starts = [0, 0, 1, 0, 2, 0, 1, 3, 0, 1, 2, 0, 1, 2, 3, 1]
    want = check(engine, plans, starts)
    listens, speaks = kinds(want)
    assert listens > 0 and speaks > 0


def test_static_shape_decode_equals_solo(eng16, static_shapes):
    """Sixteen sessions (greedy and seeded sampling, caps that stop rows at different
    tokens, joining mid-reply and leaving) through padded, bucketed decode forwards: each
    session's tokens, results and next prefill logits are its solo run's."""
    sixteen_joining_and_leaving(eng16, 300)
    static = static_shapes._static
    shapes = set(static._shapes)
    assert len({rows for rows, _ in shapes}) > 2 and len({w for _, w in shapes}) > 1, shapes
    if eng16.device.startswith("cuda"):  # there the forwards were graph replays
        assert static.failure is None and static.captured == len(shapes)
        assert static.replays > 0


def test_speech_in_static_shapes_equals_solo(eng16, static_shapes):
    """With static shapes the TTS's steps after the first run as static decode forwards
    (tts.py) and the batched vocoder's flow matching padded to buckets of rows, chunk frames
    and cached keys (vocoder_flow; CUDA graphs on CUDA): every speaker's audio is still its
    solo audio, sessions starting at different units."""
    if not eng16.audio_on:
        pytest.skip("the checkpoint has no vocoder assets (minicpmo-utils missing)")
    plans = [speaking_plan(eng16, 40 + k) for k in range(6)]
    want = check(eng16, plans, starts=[k % 3 for k in range(6)])
    _, speaks = kinds(want)
    assert speaks > 0 and spoken_seconds(want) >= 0.9 * speaks
    vocoder = eng16.batched_vocoder()
    flow, decoder = vocoder.flow, vocoder.hift.decoder
    assert flow.static and len(flow.buckets) > 1, flow.buckets
    assert decoder.static and decoder.shapes
    tts = static_shapes.tts.static
    assert tts is not None and tts.calls > 0
    if eng16.device.startswith("cuda"):  # there the flow's steps and HiFT spectra replayed
        assert tts.failure is None and tts.captured > 0 and tts.replays > 0
        assert flow.failure is None and flow.captured > 0 and flow.replays > 0
        assert decoder.failure is None and decoder.captured > 0 and decoder.replays > 0


def test_graphs_captured_at_the_warm_up_leave_none_to_sessions(eng16, static_shapes, capture_tts):
    """The worker's warm-up captures every bucket of the decode and of the TTS's steps over
    padding rows (MiniCPMOStepper.capture_graphs): on CUDA one graph per bucket, and
    sessions then speak (each equal to its solo run) replaying them without a capture; on
    a CPU nothing is captured and nothing changes."""
    from omnifabric.worker.engines.minicpmo import graphs

    done = static_shapes.capture_graphs()
    decode, tts = static_shapes._static, static_shapes.tts.static
    cuda = eng16.device.startswith("cuda")
    cache, tts_cache = static_shapes.cache, static_shapes.tts.cache
    listed = {
        "decode": len(graphs.buckets(cache.slots, cache.max_len)),
        "tts": len(graphs.buckets(tts_cache.slots, tts_cache.max_len)),
    }
    assert done == (listed if cuda else {"decode": 0, "tts": 0})
    assert static_shapes.capture_graphs() == {"decode": 0, "tts": 0}  # all there already
    assert (decode.captured, tts.captured) == (done["decode"], done["tts"])
    plans = [plan(eng16, 50 + k, seed=950 + k, tts=True) for k in range(4)]
    check(eng16, plans, starts=[0, 1, 0, 2], captured=capture_tts)
    assert decode.calls > 0 and tts.calls > 0
    assert (decode.captured, tts.captured) == (done["decode"], done["tts"])
    if cuda:
        assert decode.replays == decode.calls and tts.replays == tts.calls


def test_the_warm_up_makes_the_vocoders_steady_buckets(eng16, static_shapes, monkeypatch):
    """MiniCPMOEngine.warm_vocoder_rows (the warm-up runs it where the vocoder's graphs are
    on) takes each row bucket of the batched vocoder through a turn of the default voice:
    afterwards sessions speaking 1 to 6 at once (joining and leaving, each still equal to
    its solo audio) run every call whose chunk and cache lengths a warm-up call had in a
    bucket the warm-up made (every full chunk at every cache length: the flow's cache and
    the HiFT's history reach their trimmed lengths within four chunks, the same after nine);
    only other lengths (last chunks, flushes) make new ones."""
    from omnifabric.worker.engines.minicpmo import vocoder_flow

    if not eng16.audio_on:
        pytest.skip("the checkpoint has no vocoder assets (minicpmo-utils missing)")
    monkeypatch.setattr(eng16, "_batched_vocoder", None)  # a vocoder of this test's own
    monkeypatch.setattr(eng16, "_vocoders", {})
    assert eng16.warm_vocoder_rows() == [1, 2, 4, 8, 16]
    vocoder = eng16.batched_vocoder()
    flow = vocoder.flow
    assert flow.static

    def kept() -> set[tuple[int, int, int]]:  # the buckets whose tensors (and graphs) live
        return {shape.bucket for shape in flow._shapes.values()}

    flow_warm, hift_warm = kept(), set(vocoder.hift.decoder.shapes)
    assert flow_warm == flow.buckets  # nothing made was dropped (the arena never grew after)
    assert {rows for rows, _, _ in flow_warm} == {1, 2, 4, 8, 16}
    decoder = vocoder.hift.decoder
    if eng16.device.startswith("cuda"):  # there every kept bucket has its graph
        assert flow.failure is None and flow.captured == len(flow._shapes)
        assert decoder.failure is None and decoder.captured == len(decoder.shapes)
    met: list[tuple[int, int, int]] = []
    shape = vocoder_flow.FlowSolver._shape

    def spied(self, key, *args, **kwargs):
        met.append(key)
        return shape(self, key, *args, **kwargs)

    monkeypatch.setattr(vocoder_flow.FlowSolver, "_shape", spied)
    plans = [speaking_plan(eng16, 70 + k) for k in range(6)]
    want = check(eng16, plans, starts=[0, 0, 1, 1, 1, 2])
    assert kinds(want)[1] > 0
    full = max(frames for _, frames, _ in flow_warm)  # a full chunk's frames
    steady = [key for key in met if key[1] == full]
    assert steady, f"no full chunk: {sorted(set(met))}"
    # every full chunk a session ran, at each of its cache lengths, was in a warm bucket
    assert all(key in flow_warm for key in steady), sorted(set(steady) - flow_warm)
    assert kept() >= flow_warm  # and the warm buckets are still there
    warm_shapes = {key[1:] for key in hift_warm}
    new_hift = set(vocoder.hift.decoder.shapes) - hift_warm
    assert not [key for key in new_hift if key[1:] in warm_shapes], new_hift


def test_a_failure_warming_the_vocoders_buckets_leaves_the_warm_up_going(
    eng16, monkeypatch, caplog
):
    """Where making the vocoder's buckets ahead fails (say, out of memory at the largest
    row count), the warm-up says so and goes on: the buckets are made at first use."""
    if not eng16.audio_on:
        pytest.skip("the checkpoint has no vocoder assets (minicpmo-utils missing)")

    def failing():
        raise RuntimeError("CUDA out of memory (a stand-in)")

    graphs_on = types.SimpleNamespace(flow=types.SimpleNamespace(graphs=True))
    monkeypatch.setattr(eng16, "batched_vocoder", lambda: graphs_on)
    monkeypatch.setattr(eng16, "_speak_batched", lambda *args: None)
    monkeypatch.setattr(eng16, "warm_vocoder_rows", failing)
    with caplog.at_level("WARNING"):
        eng16._warm_vocoder()
    assert "the batched vocoder's buckets were not made ahead (RuntimeError" in caplog.text


def test_static_shape_control_shifted_position_fails(eng16, static_shapes, monkeypatch):
    plans = [plan(eng16, k) for k in range(3)]
    for p in plans:
        p.units = p.units[:2]
    want = [solo(eng16, p) for p in plans]
    original = slots_module.SlotCache.begin_decode

    def shifted(self, slots, reuse):
        step = original(self, slots, reuse)
        step.positions[0] += 1
        return step

    monkeypatch.setattr(slots_module.SlotCache, "begin_decode", shifted)
    got = batched(eng16, plans)
    with pytest.raises(AssertionError):
        for k in range(3):
            compare(want[k], got[k], f"shifted row, session {k}")


@pytest.mark.parametrize("shapes", ["ragged", "static"])
def test_decode_ahead_of_the_host_equals_solo(eng16, request, monkeypatch, shapes):
    """The device two forwards beyond the host's reading of their tokens (decode_ahead 2;
    CUDA's default is 1; decode._run_ahead), ragged and in static shapes: sixteen greedy and
    seeded sampling sessions with caps that stop rows at different tokens, joining
    mid-reply and leaving, each equal to its solo run; rows were fed past their ends and
    their slots taken back."""
    from omnifabric.worker.engines.minicpmo import decode

    if shapes == "static":
        request.getfixturevalue("static_shapes")
    monkeypatch.setattr(eng16, "decode_ahead", 2)
    depths: list[int] = []
    back: list[int] = []
    run_ahead, rewind = decode._run_ahead, slots_module.SlotCache.rewind

    def spied_run(stepper, rows, plans, depth, j):
        depths.append(depth)
        return run_ahead(stepper, rows, plans, depth, j)

    def spied_rewind(self, slot, length):
        back.append(self.length(slot) - length)
        return rewind(self, slot, length)

    monkeypatch.setattr(decode, "_run_ahead", spied_run)
    monkeypatch.setattr(slots_module.SlotCache, "rewind", spied_rewind)
    sixteen_joining_and_leaving(eng16, 400)
    assert depths and set(depths) == {2}
    if eng16.layout == layouts.UNIFIED:  # its 28-character limit ends units early
        assert max(back) > 0, "no row was fed past its end"
    # (the duplex layout's random-weight units here end at their caps or forced listens,
    # both known before the forward: nothing to take back)


def test_kv_figures_describe_the_slot_cache(eng16):
    """What the worker reports of the batched step's KV slots is its slot caches': the
    LLM's tokens a slot, the LLM's and the TTS's bytes a slot (the TTS's allocated with the
    LLM's when the stepper is built, not at the first step that speaks)."""
    stepper = eng16.stepper()
    cache = stepper.cache
    tts = stepper.tts_cache()
    assert tts is not None and tts is stepper.tts.cache and tts.slots == 16
    kv = eng16.kv_figures()
    assert kv is not None and kv.slots == 16 == cache.slots
    assert kv.slot_tokens == eng16.kv_slot_tokens == cache.max_len
    rows = cache.slots + (cache.scratch is not None)
    tts_rows = tts.slots + (tts.scratch is not None)
    assert cache.slot_bytes * rows == cache.nbytes and tts.slot_bytes * tts_rows == tts.nbytes
    assert kv.slot_bytes == cache.slot_bytes + tts.slot_bytes
    assert kv.more_slots == 0 if cache.device.type == "cpu" else kv.more_slots >= 0
