"""The incremental, batched streaming mel (worker/engines/minicpmo/mel.py) against the public
streaming mel processor, unit by unit (opt-in: OMNI_MINICPMO_CODE_DIR, see conftest).

Three sessions of 55 one-second units each (two units of digital silence then quiet noise,
a loud burst that moves the window's maximum, speech-like tones), run through one
StreamingMel.run per unit for all three and, each on its own copy of the processor, through
the public process(): every unit's emitted frames within ATOL, and the processors' state
the same (window, pointers, counters, the extractor's normalization mode). The units pass 5 s
(the fixed floor, which only silence reaches, gives way to the dynamic range) and 30 s (the
window slides by 10 s, three times). A control nudges one cached frame and must fail the
comparison; a stale cache (the public path ran in between) is dropped and the frames
computed again.
"""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omnifabric.worker.engines.minicpmo.mel import StreamingMel
from tests.worker.minicpmo.conftest import DEVICE, needs_code

pytestmark = [needs_code, pytest.mark.timeout(600)]

UNITS = 55
ATOL = 1e-5 if DEVICE == "cpu" else 1e-4
STATE = ("last_emitted_T", "base_T", "chunk_count", "total_samples_processed", "is_first")


def processor(engine):
    """A fresh copy of the model's processor in the duplex class's streaming mode."""
    d = engine._free[0].duplex
    proc = copy.deepcopy(engine.model.processor)
    proc.set_streaming_mode(
        mode="exact",
        chunk_ms=d.CHUNK_MS,
        first_chunk_ms=d.FIRST_CHUNK_MS,
        cnn_redundancy_ms=d.CNN_REDUNDANCY_MS,
        enable_sliding_window=True,
        slide_trigger_seconds=30.0,
        slide_stride_seconds=10.0,
    )
    proc.reset_streaming()
    return proc


def audio(kind: int, samples: int, unit: int) -> np.ndarray:
    rng = np.random.default_rng(100 * kind + unit)
    x = 0.01 * rng.standard_normal(samples)
    if kind == 0 and unit < 2:  # digital silence first (a muted caller): the fixed floor
        x *= 0.0
    if kind == 1 and unit in (12, 33):  # a burst: the window's maximum jumps, then slides out
        x *= 40
    if kind == 2:
        t = np.arange(samples) / 16000
        x += 0.2 * np.sin(2 * np.pi * (180 + 20 * unit) * t) * (unit % 3 != 0)
    return x.astype(np.float32)


class Pair:
    """One session: the public processor and ours (same settings, same audio)."""

    def __init__(self, engine, kind: int) -> None:
        self.kind = kind
        self.public = processor(engine)
        self.ours = processor(engine)
        self.cache = None

    @property
    def mel(self):
        return self.ours._streaming_mel_processor

    def chunk(self, unit: int) -> np.ndarray:
        return audio(self.kind, self.public._streaming_mel_processor.get_chunk_size(), unit)


def step(streaming: StreamingMel, pairs: list[Pair], unit: int, nudge=None) -> list[float]:
    """One unit of every pair: ours batched, the public one by one; per pair the largest
    difference of the emitted frames (their shapes and the states must match)."""
    chunks = [p.chunk(unit) for p in pairs]
    jobs = []
    for p, chunk in zip(pairs, chunks, strict=True):
        jobs.append(streaming.plan(p.mel, chunk, p.cache))
    if nudge is not None:
        nudge(jobs)
    done = streaming.run(jobs)
    # each row's cache owns its window: a view of the step's tensors would keep every row's
    # window alive for as long as any one session keeps its cache
    storages = [cache.raw.untyped_storage().data_ptr() for _, cache in done]
    assert len(set(storages)) == len(storages)
    gaps = []
    for p, chunk, (mel, cache) in zip(pairs, chunks, done, strict=True):
        want, _ = p.public.process_audio_streaming(chunk)
        p.cache = cache
        assert tuple(mel.shape) == tuple(want.shape), (unit, mel.shape, want.shape)
        pub, own = p.public._streaming_mel_processor, p.mel
        assert np.array_equal(pub.buffer, own.buffer)
        assert [getattr(pub, k) for k in STATE] == [getattr(own, k) for k in STATE]
        fe_pub, fe_own = p.public.audio_processor, p.ours.audio_processor
        assert fe_pub.dynamic_log_norm == fe_own.dynamic_log_norm
        gaps.append(float((mel.cpu() - want).abs().max()) if want.numel() else 0.0)
    return gaps


@pytest.fixture
def streaming(engine):
    return StreamingMel(
        SimpleNamespace(audio_processor=engine.model.processor.audio_processor), DEVICE
    )


def test_incremental_batched_mel_equals_the_public_processor(engine, streaming):
    pairs = [Pair(engine, k) for k in range(3)]
    worst = 0.0
    slides = 0
    dynamic = False
    ours_s = public_s = 0.0
    for unit in range(UNITS):
        base = pairs[0].mel.base_T
        gaps = step(streaming, pairs, unit)
        worst = max(worst, *gaps)
        slides += pairs[0].mel.base_T != base
        dynamic |= pairs[0].ours.audio_processor.dynamic_log_norm
    assert slides == 3 and dynamic  # at 30, 40 and 50 s
    print(f"max |d mel| over {UNITS} units x 3 sessions: {worst:.2e}")
    assert worst <= ATOL
    # timing, for the record (not asserted): one session's unit at a full window
    chunk = pairs[0].chunk(UNITS)
    t0 = time.perf_counter()
    pairs[0].public.process_audio_streaming(chunk)
    public_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    job = streaming.plan(pairs[0].mel, chunk, pairs[0].cache)
    streaming.run([job])
    ours_s = time.perf_counter() - t0
    print(
        f"a unit at a {len(pairs[0].mel.buffer) / 16000:.0f} s window: public "
        f"{public_s * 1000:.1f} ms, incremental {ours_s * 1000:.1f} ms"
    )


def test_control_a_nudged_cached_frame_fails(engine, streaming):
    pair = Pair(engine, 2)
    for unit in range(8):  # past 5 s: the dynamic range reads the whole window
        assert max(step(streaming, [pair], unit)) <= ATOL

    def nudge(jobs):
        job = jobs[0]
        assert job.kept is not None
        job.kept = job.kept.clone()
        job.kept[:, 3] += 5.0  # a frame louder than any: the threshold moves

    assert max(step(streaming, [pair], 8, nudge)) > 100 * ATOL


def test_a_stale_cache_is_dropped(engine, streaming):
    pair = Pair(engine, 0)
    for unit in range(3):
        step(streaming, [pair], unit)
    # the serial path takes a unit: the public process() advances our processor too
    chunk = pair.chunk(3)
    pair.public.process_audio_streaming(chunk)
    pair.ours.process_audio_streaming(chunk)
    job = streaming.plan(pair.mel, pair.chunk(4), pair.cache)
    assert job.kept is None and job.ranges == [(0, job.frames)]
    pair.ours = copy.deepcopy(pair.public)  # back in step; the rest must still agree
    pair.cache = None
    for unit in range(4, 9):
        assert max(step(streaming, [pair], unit)) <= ATOL


def test_state_and_frames_on_a_device_tensor(engine, streaming):
    pair = Pair(engine, 1)
    step(streaming, [pair], 0)
    assert isinstance(pair.cache.raw, torch.Tensor)
    assert pair.cache.raw.device.type == torch.device(DEVICE).type
