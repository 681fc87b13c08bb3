"""The batched step's waveform stage: each speaking row's vocoder calls, planned as the public
`_generate_waveform_from_tokens` makes them (both layouts' copies agree), run a round at a time
for every speaker together (vocoder_batch.BatchedVocoder: one flow-matching pass and one HiFT
pass per round), then assembled into each row's 24 kHz float32 audio the way that method
assembles it.

The public method keeps a token buffer per session (`token2wav_buffer`, on its duplex object)
and calls `Token2wav.stream` while the buffer holds a chunk (25 tokens plus 3 of lookahead),
more eagerly when the new tokens end a chunk or the caller flushes, and once more with
`last_chunk` at a turn's end. Those calls of one row depend on each other (each continues the
row's caches), so the k-th call of every row forms round k. A row's caches (flow, HiFT, its
voice) live on the shared vocoder object and are swapped per session by the engine; here they
are taken off for the rounds and put back after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from omnifabric.worker.engines.minicpmo.rows import Row

if TYPE_CHECKING:
    from omnifabric.worker.engines.minicpmo.engine import MiniCPMOEngine
    from omnifabric.worker.engines.minicpmo.vocoder_batch import BatchedVocoder

#: Fresh tokens a vocoder call turns into audio (the public CHUNK_SIZE).
CHUNK = 25
#: Fewest tokens a flushing call takes beyond the lookahead (the public `pre_lookahead + 5`).
FLUSH_MIN = 5
#: A non-final unit's audio is left-padded to this many samples (1 s at 24 kHz).
MIN_SAMPLES = 24000


@dataclass
class Plan:
    """One row's vocoder calls for this unit: (tokens, last_chunk) each, and the buffer left."""

    calls: list[tuple[list[int], bool]]
    rest: list[int]
    pcm: list[bytes] = field(default_factory=list)


def plan_calls(
    buffer: list[int],
    tokens: list[int],
    terminators: Any,
    lookahead: int,
    last: bool,
    flush: bool,
) -> Plan:
    """The calls the public method makes for `tokens` on top of `buffer`, in order."""
    buf = list(buffer) + list(tokens)
    calls: list[tuple[list[int], bool]] = []
    if flush or any(t in terminators for t in tokens):
        while len(buf) >= lookahead + FLUSH_MIN:
            n = min(CHUNK + lookahead, len(buf))
            calls.append((buf[:n], False))
            buf = buf[min(CHUNK, n - lookahead) :]
    else:
        while len(buf) >= CHUNK + lookahead:
            calls.append((buf[: CHUNK + lookahead], False))
            buf = buf[CHUNK:]
    if last and buf:
        calls.append((buf, True))
        buf = []
    return Plan(calls, buf)


def assemble(pcm: list[bytes], last: bool) -> np.ndarray | None:
    """A row's audio from its calls' int16 bytes, as the public method returns it."""
    data = b"".join(pcm)
    if not data:
        return None
    wave = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    if not last and wave.size < MIN_SAMPLES:
        wave = np.pad(wave, (MIN_SAMPLES - wave.size, 0))
    return wave


def speak(
    engine: MiniCPMOEngine, rows: list[Row], flushes: list[bool], vocoder: BatchedVocoder
) -> None:
    """Audio of every speaking row (row.wave), the vocoder batched round by round."""
    from omnifabric.worker.engines.minicpmo.vocoder_batch import VocoderJob

    tok = engine.model.tts.audio_tokenizer
    plans: list[Plan | None] = []
    jobs: list[VocoderJob | None] = []
    for row, flush in zip(rows, flushes, strict=True):
        d = row.duplex
        if not getattr(d, "token2wav_initialized", False):
            plans.append(None)
            jobs.append(None)
            continue
        assert row.tts_codes is not None  # a speaker's TTS ran before its waveform
        tokens = row.tts_codes
        plans.append(
            plan_calls(
                d.token2wav_buffer,
                tokens,
                d.chunk_terminator_token_ids,
                int(d.pre_lookahead),
                row.end_of_turn,
                flush,
            )
        )
        with engine.using(row.session):
            jobs.append(VocoderJob.of(tok, row.args.get("prompt_wav_path")))
    rounds = max((len(p.calls) for p in plans if p is not None), default=0)
    for k in range(rounds):
        here = [i for i, p in enumerate(plans) if p is not None and k < len(p.calls)]
        batch = []
        for i in here:
            job = jobs[i]
            plan = plans[i]
            assert job is not None and plan is not None
            job.tokens, job.last_chunk = plan.calls[k]
            batch.append(job)
        for i, pcm in zip(here, vocoder.run(batch), strict=True):
            plan = plans[i]
            assert plan is not None
            plan.pcm.append(pcm)
    for row, plan, job in zip(rows, plans, jobs, strict=True):
        if plan is None or job is None:
            row.wave = None
            continue
        d = row.duplex
        d.token2wav_buffer = plan.rest
        if row.end_of_turn:
            with engine.using(row.session):
                d._reset_token2wav_for_new_turn()
        row.wave = assemble(plan.pcm, row.end_of_turn)
