"""Context windows (issue 40) on tiny checkpoints of the real public code, per layout it
offers (opt-in: OMNI_MINICPMO_CODE_DIR, see conftest): the engine drives the model's own
sliding window, and a session that would fill its context slides instead of closing.

The reference is the public code's own solo run: its duplex class built by its own
constructor with the sliding-window arguments of the same DuplexWindowConfig, driven
prepare -> (streaming_prefill, streaming_generate, finalize_unit) per unit on the same
weights and the same audio. Per unit: listen, text, end of turn, the token ids, the context
length the unit reports and the length after its finalize; and how often it slid.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omnifabric.common.session_types import WINDOW_MARGIN_TOKENS, ContextWindow
from omnifabric.worker.engine import DuplexSettings, StepRow
from omnifabric.worker.engines.minicpmo import MiniCPMOEngine, layouts
from omnifabric.worker.engines.minicpmo.code import import_module
from omnifabric.worker.engines.minicpmo.engine import MiniCPMOSession, _ChatState
from omnifabric.worker.session import DuplexSession
from omnifabric.worker.session_types import CloseReason, SessionEnd, SessionLimits, SessionSpec
from omnifabric.worker.units import UnitInput
from tests.worker.minicpmo.conftest import LAYOUTS, needs_code

pytestmark = [needs_code, pytest.mark.timeout(900)]

PROMPT = "Be brief."
UNITS = 90
#: The context cap of these sessions: 90 units of the tiny model take ~1700 tokens.
CAP = 800
#: Basic: slides at 600 tokens (the worker's most, CAP less its margin) down to 400, every
#: ~11 units. Context: past 20 units, with 60 tokens of what was said carried forward.
BASIC = ContextWindow("basic", high_tokens=CAP - WINDOW_MARGIN_TOKENS, low_tokens=400)
CONTEXT = ContextWindow("context", units=20, previous_tokens=60)
#: Speak tokens per unit at most (the tiny duplex class speaks every unit, to the limit).
SPEAK_TOKENS = 8
#: Greedy, every streaming_generate argument explicit (what the engine passes for
#: DuplexSettings(temperature=0)); the unified class also takes length_penalty.
ARGS: dict[str, Any] = {
    "prompt_wav_path": None,
    "max_new_speak_tokens_per_chunk": SPEAK_TOKENS,
    "decode_mode": "greedy",
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
    "listen_prob_scale": 1.0,
    "listen_top_k": None,
    "text_repetition_penalty": 1.05,
    "text_repetition_window_size": 512,
}


def settings(window: ContextWindow) -> DuplexSettings:
    """Greedy settings with `window` resolved (as the worker hands them to the engine)."""
    return DuplexSettings(
        temperature=0,
        force_listen_count=0,
        max_new_speak_tokens_per_chunk=SPEAK_TOKENS,
        context_window=window.mode,
        window_high_tokens=window.high_tokens,
        window_low_tokens=window.low_tokens,
        window_units=window.units,
        window_previous_tokens=window.previous_tokens,
    )


def pcm_units(engine, count: int, seed: int = 0) -> list[np.ndarray]:
    """`count` model units of noise (the first 1.035 s, the rest 1 s)."""
    rng = np.random.default_rng(seed)
    sizes = [engine.first_unit_samples] + [engine.unit_samples] * (count - 1)
    return [(0.05 * rng.standard_normal(n)).astype(np.float32) for n in sizes]


# ---- the public code alone ------------------------------------------------------------


def public_duplex(engine, window: ContextWindow) -> Any:
    """The layout's duplex class built by its own constructor with the window's arguments
    (the unified class on the engine's model; the duplex class loads its own copy of the
    same weights, as the engine does: float32 here)."""
    kwargs = {
        "sliding_window_mode": window.mode,
        "basic_window_high_tokens": window.high_tokens,
        "basic_window_low_tokens": window.low_tokens,
        "context_max_units": window.units,
        "context_previous_max_tokens": window.previous_tokens,
    }
    root = Path(engine.model_path)
    if engine.layout == layouts.UNIFIED:
        module = import_module(root, "modeling_minicpmo_unified")
        return module.DuplexCapability(engine.model, generate_audio=False, device="cpu", **kwargs)
    assert engine.layout == layouts.DUPLEX
    built = engine.__dict__.setdefault("_public_duplex", {})  # one per window, reused
    if window in built:
        return built[window]
    module = import_module(root, "modeling_minicpmo")
    with layouts.suppressed(module.MiniCPMO, "init_tts"):  # text only, as the engine on CPU
        d = module.MiniCPMODuplex(
            name_or_path=str(root),
            device="cpu",
            generate_audio=False,
            attn_implementation=engine.attn,
            **kwargs,
        )
    d.model.to(torch.float32)
    built[window] = d
    return d


def public_run(engine, window: ContextWindow, pcms: list[np.ndarray]) -> list[dict[str, Any]]:
    """The session alone through the public code: one record per unit."""
    holder = _ChatState(engine.state.fresh())  # the engine's sessions keep their state
    with engine.using(holder):
        d = public_duplex(engine, window)
        unified = engine.layout == layouts.UNIFIED
        args = dict(ARGS, length_penalty=1.1, force_listen_override=False) if unified else ARGS
        try:
            d.prepare(
                prefix_system_prompt=layouts.PREFIX_TEMPLATE.format(text=PROMPT),
                suffix_system_prompt=layouts.SUFFIX,
                ref_audio=None,
                prompt_wav_path=None,
            )
            out = []
            for pcm in pcms:
                start = len(d.total_ids)
                d.streaming_prefill(audio_waveform=pcm, frame_list=None, max_slice_nums=1)
                got = d.streaming_generate(**args)
                kv = d.decoder.get_cache_length()
                if unified and getattr(d, "_pending_finalize", None) is not None:
                    d.finalize_unit()
                listen = bool(got.get("is_listen", True))
                out.append(
                    {
                        "listen": listen,
                        "text": "" if listen else str(got.get("text", "") or ""),
                        "eot": bool(got.get("end_of_turn", False)),
                        "ids": list(d.total_ids[start:]),
                        "kv": kv,
                        "kv_after": d.decoder.get_cache_length(),
                        "slides": d.decoder._sliding_event_count,
                    }
                )
            return out
        finally:
            d.decoder.reset()
            engine.state.clear()
            engine.forget(holder)


# ---- the engine ---------------------------------------------------------------------------


class Recorder:
    """Wraps the engine session's unit calls (on the class) to record, per unit, its token
    ids, the length after its finalize, the window's slides and the time of each call."""

    def __init__(self, monkeypatch) -> None:
        self.units: list[dict[str, Any]] = []
        prefill, generate, finalize = (
            MiniCPMOSession.prefill,
            MiniCPMOSession.generate,
            MiniCPMOSession.finalize,
        )
        units = self.units

        def rec_prefill(s, pcm, frames, slices):
            units.append({"start": len(s.handle.duplex.total_ids), "pcm": pcm.copy()})
            t0 = time.perf_counter()
            try:
                return prefill(s, pcm, frames, slices)
            finally:
                units[-1]["prefill_s"] = time.perf_counter() - t0

        def rec_generate(s, force):
            t0 = time.perf_counter()
            try:
                return generate(s, force)
            finally:
                units[-1]["generate_s"] = time.perf_counter() - t0

        def rec_finalize(s):
            t0 = time.perf_counter()
            try:
                return finalize(s)
            finally:
                unit = units[-1]
                unit["finalize_s"] = time.perf_counter() - t0
                dec = s.handle.duplex.decoder
                unit["ids"] = list(s.handle.duplex.total_ids[unit["start"] :])
                unit["kv_after"] = s.kv_length()
                unit["slides"] = dec._sliding_event_count

        monkeypatch.setattr(MiniCPMOSession, "prefill", rec_prefill)
        monkeypatch.setattr(MiniCPMOSession, "generate", rec_generate)
        monkeypatch.setattr(MiniCPMOSession, "finalize", rec_finalize)


def through_the_unit_loop(engine, window: ContextWindow, pcms, monkeypatch):
    """The session through the worker's unit loop (DuplexSession, context cap CAP): its
    unit outputs, its end, and the recorder's units."""
    recorder = Recorder(monkeypatch)

    async def main():
        spec = SessionSpec("w", "l", "audio", system_prompt=PROMPT, settings=settings(window))
        session = DuplexSession(spec, engine, ThreadPoolExecutor(1), SessionLimits(3600, CAP))
        await session.open()
        notes = session.notes
        task = asyncio.ensure_future(session.run())
        outs, sent = [], 1
        session.submit(UnitInput(1, pcms[0]))
        async for event in session.journal.events():
            if isinstance(event, SessionEnd):
                await task
                return outs, event, notes
            outs.append(event)
            if event.seq == sent and sent < len(pcms):
                sent += 1
                session.submit(UnitInput(sent, pcms[sent - 1]))
            elif len(outs) == len(pcms):
                session.close(CloseReason.USER_STOP)
        raise AssertionError("no session end")

    outs, end, notes = asyncio.run(main())
    return outs, end, notes, recorder.units


def records(outs, units) -> list[dict[str, Any]]:
    return [
        {
            "listen": o.result.is_listen,
            "text": o.result.text,
            "eot": o.result.end_of_turn,
            "ids": u["ids"],
            "kv": o.result.kv_cache_length,
            "kv_after": u["kv_after"],
            "slides": u["slides"],
        }
        for o, u in zip(outs, units, strict=True)
    ]


def first_difference(a: list[dict], b: list[dict]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            keys = [k for k in x if x[k] != y.get(k)]
            return f"unit {i}: {keys}: {[x[k] for k in keys]} != {[y[k] for k in keys]}"
    return ""


@pytest.mark.parametrize("window", [BASIC, CONTEXT], ids=["basic", "context"])
def test_a_long_session_slides_and_matches_the_public_code(engine, window, monkeypatch):
    """90 units, twice what the context cap holds: the session slides several times, never
    closes, and every unit is what the public code gives alone with the same window."""
    pcms = pcm_units(engine, UNITS)
    outs, end, notes, units = through_the_unit_loop(engine, window, pcms, monkeypatch)
    assert isinstance(end, SessionEnd) and end.reason is CloseReason.USER_STOP, end
    assert end.units_served == UNITS and not notes
    assert all(not o.buffered for o in outs)
    got = records(outs, units)
    assert max(r["kv"] for r in got) < CAP
    slides = got[-1]["slides"]
    assert slides >= 5, slides
    # The public code hears what the engine heard (the worker's model units).
    want = public_run(engine, window, [u["pcm"] for u in units])
    assert want[-1]["slides"] == slides
    assert got == want, first_difference(got, want)
    if window.mode == "basic":
        # A slide leaves at most low_tokens; the unit that slid reports the length after it
        # (the duplex class slides in generate) or the next one does (the unified class
        # slides in its deferred finalize).
        slid = [i for i in range(1, UNITS) if got[i]["slides"] > got[i - 1]["slides"]]
        assert all(got[i]["kv_after"] <= window.low_tokens for i in slid)
        if engine.layout == layouts.DUPLEX:
            assert all(got[i]["kv"] == got[i]["kv_after"] for i in slid)
        else:
            # Before the slide: past the high watermark with the finalize's 2 tokens.
            assert all(got[i]["kv"] + 2 > window.high_tokens for i in slid)
            assert all(got[i + 1]["kv"] < got[i]["kv"] for i in slid if i + 1 < UNITS)
    else:
        # Past `units` units every unit slides one out.
        assert slides >= UNITS - window.units - 1


def test_without_a_window_the_same_session_closes_context_full(engine, monkeypatch):
    """The control: the same audio with the window off ends at the cap, before 2/3 of it."""
    pcms = pcm_units(engine, UNITS)
    outs, end, _, _ = through_the_unit_loop(engine, ContextWindow(), pcms, monkeypatch)
    assert end.reason is CloseReason.CONTEXT_FULL, end
    assert len(outs) < UNITS * 2 // 3 and outs[-1].result.kv_cache_length >= CAP


# ---- batched steps ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[layout for layout, _ in LAYOUTS] or ["none"])
def batched_engine(request, tiny_dirs):
    from omnifabric.worker.engines.minicpmo.step import MiniCPMOStepper

    layout = request.param
    eng = MiniCPMOEngine(
        str(tiny_dirs[dict(LAYOUTS)[layout]]),
        device="cpu",
        slots=3,
        api=layout,
        stepper_class=MiniCPMOStepper,
    )
    eng.load()
    return eng


def test_windowed_sessions_in_a_batched_step(batched_engine):
    """A basic-windowed session, one without a window and one with the context window,
    stepped together: the first two in slots (the basic window slides in its slot: its
    deferred `[terminator, </unit>]` fed at once, the decoder's own enforce_window over the
    slot's context), the context-windowed one on the serial path every unit; each gives what
    the public code gives it alone, the slides moving nothing of the others."""
    engine = batched_engine
    stepper = engine.stepper()
    windows = {
        "w": ContextWindow("basic", high_tokens=250, low_tokens=150),
        "b": ContextWindow(),
        "c": ContextWindow("context", units=8, previous_tokens=30),
    }
    count = 30
    pcms = {k: pcm_units(engine, count, seed=i + 1) for i, k in enumerate(windows)}
    sessions = {k: engine.open_session(k, "audio") for k in windows}
    got: dict[str, list[dict[str, Any]]] = {k: [] for k in windows}
    try:
        for k, window in windows.items():
            sessions[k].prepare(PROMPT, None, None, settings(window))
        for u in range(count):
            names = list(windows)
            starts = {k: len(sessions[k].handle.duplex.total_ids) for k in names}
            rows = [StepRow(sessions[k], pcms[k][u], [], 1, False) for k in names]
            outcome = stepper.step(rows)
            assert outcome.phases_ms["serial_generate"] > 0  # the context-windowed row
            assert sessions["c"].kv_slot is None
            assert sessions["w"].kv_slot is not None and sessions["b"].kv_slot is not None
            errors = stepper.finalize([sessions[k] for k in names])
            assert errors == [None] * len(names)
            for k, result in zip(names, outcome.rows, strict=True):
                assert not isinstance(result, Exception), result
                _, r = result
                s = sessions[k]
                got[k].append(
                    {
                        "listen": r.is_listen,
                        "text": r.text,
                        "eot": r.end_of_turn,
                        "ids": list(s.handle.duplex.total_ids[starts[k] :]),
                        "kv": r.kv_cache_length,
                        "kv_after": s.kv_length(),
                        "slides": s.handle.duplex.decoder._sliding_event_count,
                    }
                )
    finally:
        for s in sessions.values():
            s.close()
    assert stepper.cache.claimed() == []
    assert got["w"][-1]["slides"] >= 3 and got["c"][-1]["slides"] >= 3
    for k, window in windows.items():
        want = public_run(engine, window, pcms[k])
        assert got[k] == want, f"{k}: " + first_difference(got[k], want)
