"""MiniCPM-o's vocoder over several sessions in one call: what `Token2wav.stream(tokens,
prompt_wav, last_chunk)` of minicpmo-utils 1.0.7 does for one session, done for the streaming
calls of many sessions at once (`BatchedVocoder.run`, one `VocoderJob` per session).

Each job carries its session's state: its flow caches (`stream_cache`, the dict that
`set_stream_cache` makes and `stream` replaces) and its HiFT cache (`hift_cache`, the
BoundedVocoder's tensor dict plus `first_chunk`). `run` leaves both as `stream` would leave
them for that session alone (the flow dict updated in place, its tensors owning their memory;
the HiFT dict's tensors replaced or filled in place, as the package does) and returns the same
int16 PCM. The DeviceToken2wav it is given lends its modules, its prepared voices (`cache`) and
its settings (n_timesteps, float16); its own session state (`stream_cache`,
`hift_cache_dict`, the package's scratch buffers) is neither read nor written.

What runs batched:
- The flow matching: every Euler step of the DiT estimator runs once over 2B rows (the B
  sessions' conditional rows, then their unconditional rows), each session with its own chunk
  length, key/value cache length, speaker embedding and noise (the package's noise table from
  the row's cache length on). The estimator's attention has no positional encoding and no mask,
  so a row's keys are [its chunk, its cache], right-padded to the longest of each and masked;
  every causal convolution's cache is taken at its own row's end; padded frames feed only
  padded frames (causal convolutions, masked keys) and are dropped (vocoder_flow.py, where
  it also runs in static shapes replayed as CUDA graphs).
- The conformer encoder (the package's `forward_chunk`, relative positions over each row's
  cache): rows with the same token count, last_chunk and cache shapes (sessions of one voice
  in steady state) run as one batch; the others run alone. Padding would shift a row's
  relative positions, so rows of different cache lengths are not mixed.
- The causal HiFT: each session's BoundedVocoder state machine (its integer offsets) steps per
  row in lockstep, internal block by internal block; its three models run once per group of
  rows of equal shapes: the float64 F0 predictor, the sine source (each row its own phase and
  noise-table offset) and the HiFT decode. In steady state every row's decode has the same
  shape (history + right context + 16 frames); first chunks, flushes and short chunks run in
  smaller groups. In static shapes the decode's groups are padded to row buckets and their
  convolutions replayed as CUDA graphs (`HiftDecoder`).
What stays per row: the input checks, the flow's cache trims (the conformer's by the package's
own function; the estimator's made with the copy of its new keys, vocoder_flow._joined),
the HiFT's buffers (appended to per internal block; trimmed once a call, where the package trims
after every block), the first-chunk silence. The int16 conversion runs once over all rows.

Equal to the package per session up to the rounding of the batched products. Measured
(random weights, the HiFT rescaled so that its audio depends on its input; 1-8 sessions over
several chunks, joining, flushing, three voices): CPU float32, tiny assets: int16 samples
within 1 LSB, caches within 5e-6; H200 float32 (TF32 off), released sizes: 1 LSB, caches
within 5e-5; float16 (the package's autocast, "cuda" as it hard-codes it): 3 LSB, caches
within 8e-3 (two float16 steps at their magnitude). With cuDNN's TF32 on (PyTorch's default
for convolutions) the batched and the lone call pick different kernels: 9 LSB, caches 6e-4.

Package behaviour reproduced as it is (not fixed here): the estimator's key/value cache holds
the newest chunk first ([chunk, cache]) while `_trim_estimator_cache` keeps the first
prompt-length frames and the last 100 as if the prompt came first, so after a few chunks it
keeps the newest frames and the prompt's last 100; its noise offset is the cache length, which
stops growing at prompt + 100 (every later chunk draws the same noise frames). A job that
`stream` would reject is rejected before any state changes (the package raises for an already
finalized stream only after advancing the flow).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from omnifabric.worker.engines.minicpmo.graphs import POWER_BUCKETS, GraphSet
from omnifabric.worker.engines.minicpmo.slots import to_device
from omnifabric.worker.engines.minicpmo.vocoder import precision
from omnifabric.worker.engines.minicpmo.vocoder_flow import FlowSolver

Tensor = torch.Tensor


@dataclass
class VocoderJob:
    """One session's `Token2wav.stream(tokens, prompt_wav, last_chunk)` call and its state."""

    tokens: list[int]
    last_chunk: bool
    #: The session's flow caches (as Token2wav.stream_cache); updated in place.
    stream_cache: dict[str, Tensor]
    #: The session's BoundedVocoder cache plus `first_chunk` (Token2wav.hift_cache_dict).
    hift_cache: dict[str, Tensor]
    #: The session's voice: its key in token2wav.cache (prepared by set_stream_cache).
    prompt_wav: str
    #: The voice as prepared (tokens, token lengths, speaker embedding, mel, mel lengths);
    #: None: token2wav.cache[prompt_wav]. The engine passes it: the prepared voices are a
    #: session's own state there, swapped like its caches.
    prompt: tuple[Any, ...] | None = None

    @classmethod
    def of(cls, tok: Any, prompt_wav: Any) -> VocoderJob:
        """The session now on the vocoder `tok` as a job (its cache dicts themselves: run()
        advances them in place, so the session's swapped state sees the new values; tokens
        to fill in). Raises ValueError where the package's stream() would."""
        prompt = tok._stream_prompt if prompt_wav is None else str(prompt_wav)
        if tok.stream_cache is None or prompt is None:
            raise ValueError("Call set_stream_cache(prompt_wav) before stream()")
        if prompt != tok._stream_prompt:
            raise ValueError("Prompt changed; call set_stream_cache() to start a new stream")
        return cls([], False, tok.stream_cache, tok.hift_cache_dict, prompt, tok.cache[prompt])


class BatchedVocoder:
    """`Token2wav.stream` for many sessions per call, over one DeviceToken2wav's modules."""

    def __init__(self, token2wav: Any, static: bool = False, graphs: bool = False) -> None:
        self.t2w = token2wav
        self.flow = FlowSolver(token2wav.flow.decoder, static=static, graphs=graphs)
        """The flow matching (vocoder_flow): static shapes, CUDA graphs where asked."""
        self.hift = _Hift(token2wav.bounded_vocoder, static=static, graphs=graphs)

    @torch.inference_mode()
    def run(self, jobs: Sequence[VocoderJob]) -> list[bytes]:
        """Each job's int16 PCM (as stream() returns it), its caches advanced."""
        self._validate(jobs)
        flowing = [job for job in jobs if job.tokens]
        mels = dict(zip(map(id, flowing), self._flow(flowing) if flowing else [], strict=True))
        live = [job for job in jobs if not int(job.hift_cache["finalized"].item())]
        speech = self.hift.stream(
            [job.hift_cache for job in live],
            [mels.get(id(job), job.hift_cache["mel"][:, :, :0]) for job in live],
            [job.last_chunk for job in live],
        )
        done = dict(zip(map(id, live), speech, strict=True))
        return self._pcm(jobs, [done.get(id(job)) for job in jobs])

    def _validate(self, jobs: Sequence[VocoderJob]) -> None:
        """The checks `stream` makes (before any job's state changes)."""
        lookahead = self.t2w.flow.pre_lookahead_len
        if len({id(job.hift_cache) for job in jobs}) != len(jobs):
            raise ValueError("one session per job: two jobs share a cache")
        for job in jobs:
            if job.prompt is None and job.prompt_wav not in (self.t2w.cache or {}):
                raise ValueError(f"voice {job.prompt_wav} is not prepared (set_stream_cache)")
            if not job.last_chunk and len(job.tokens) <= lookahead:
                raise ValueError("Non-final chunk requires fresh tokens plus lookahead tokens")
            if int(job.hift_cache["finalized"].item()) and (job.tokens or not job.last_chunk):
                raise ValueError("Stream already finalized; call reset() for a new utterance")

    def _voice(self, job: VocoderJob) -> tuple[Any, ...]:
        """The job's prepared voice."""
        return job.prompt if job.prompt is not None else self.t2w.cache[job.prompt_wav]

    def _pcm(self, jobs: Sequence[VocoderJob], speech: list[Tensor | None]) -> list[bytes]:
        """stream()'s finite check and int16 conversion for every job at once (one transfer),
        then _stream_vocode's first-chunk silence. None: an already finalized stream, whose
        flush the package answers empty."""
        had = [out for out in speech if out is not None and out.shape[-1]]
        flat = torch.cat(had, dim=1) if len(had) > 1 else had[0] if had else None
        if flat is not None and not torch.isfinite(flat).all():
            raise RuntimeError("Causal vocoder returned non-finite audio")
        pcm = pcm16(flat) if flat is not None else np.zeros(0, "<i2")
        out, at = [], 0
        for job, row in zip(jobs, speech, strict=True):
            n = 0 if row is None else row.shape[-1]
            data = pcm[at : at + n].tobytes()
            at += n
            first = job.hift_cache["first_chunk"]
            if n and bool(first.item()):
                first.zero_()
                if not job.last_chunk:
                    data = bytes(2 * self.t2w.source_cache_len) + data
            out.append(data)
        return out

    def _flow(self, jobs: list[VocoderJob]) -> list[Tensor]:
        """flow.inference_chunk for every job, then the package's cache trims; each job's mel."""
        t2w, flow = self.t2w, self.t2w.flow
        steps = t2w.n_timesteps
        # the flow's products in the vocoder's precision (vocoder.precision: TF32 where the
        # vocoder was made so), as its entry points run on the package's path
        with (
            precision(t2w),
            torch.amp.autocast("cuda", dtype=torch.float16, enabled=t2w.float16),
        ):
            spk = torch.cat([self._voice(job)[2] for job in jobs])
            spk = flow.spk_embed_affine_layer(F.normalize(spk, dim=1))
            encoded = _encode(flow, jobs, t2w.device)
            caches = [job.stream_cache for job in jobs]
            prompts = [self._voice(job)[3].shape[1] for job in jobs]
            mels, convs, keys = self.flow.solve(
                [h.transpose(1, 2) for h, _, _, _ in encoded],  # copied into the call
                spk,
                [c["estimator_cnn_cache"][:steps] for c in caches],
                [c["estimator_att_cache"][:steps] for c in caches],
                keep=prompts,  # the package's estimator trim, made with the keys' copy
            )
        trims = type(t2w)
        for job, (_, cnn, att, shared), conv, key, prompt_frames in zip(
            jobs, encoded, convs, keys, prompts, strict=True
        ):
            # A session's caches must not keep its whole group's tensors alive: a row of a
            # group keeps copies (the conformer's trim, where it cuts, makes one).
            cache = {
                "conformer_cnn_cache": cnn.clone() if shared else cnn,
                "conformer_att_cache": att,
                "estimator_cnn_cache": conv,
                "estimator_att_cache": key,
            }
            shim = SimpleNamespace(
                flow=flow, CONFORMER_HISTORY_FRAMES=t2w.CONFORMER_HISTORY_FRAMES, stream_cache=cache
            )
            trims._trim_conformer_cache(shim, prompt_frames)
            if shared and cache["conformer_att_cache"] is att:
                cache["conformer_att_cache"] = att.clone()
            job.stream_cache.update(cache)
        return mels


def pcm16(speech: Tensor) -> np.ndarray:
    """stream()'s int16 conversion (np.clip to [-1, 1], x 32767.0 in float32, cast toward
    zero) on the speech's device, one transfer: little-endian int16 samples, flattened."""
    scaled = speech.reshape(-1).float().clamp(-1.0, 1.0) * 32767.0
    return scaled.to(torch.int16).cpu().numpy().astype("<i2", copy=False)


def _encode(
    flow: Any, jobs: list[VocoderJob], device: Any
) -> list[tuple[Tensor, Tensor, Tensor, bool]]:
    """The token embedding, conformer encoder (forward_chunk) and projection of each job:
    (mel-rate hidden [1, T, 80], new conv cache, new attention cache, whether those are views
    of a group's tensors), jobs of equal shapes batched."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, job in enumerate(jobs):
        cache = job.stream_cache
        key = (
            len(job.tokens),
            job.last_chunk,
            tuple(cache["conformer_att_cache"].shape),
            tuple(cache["conformer_cnn_cache"].shape),
        )
        groups.setdefault(key, []).append(i)
    out: dict[int, tuple[Tensor, Tensor, Tensor, bool]] = {}
    for members in groups.values():
        rows = [jobs[i] for i in members]
        tokens = to_device(torch.tensor([job.tokens for job in rows], dtype=torch.int32), device)
        h, cnn, att = flow.encoder.forward_chunk(
            xs=flow.input_embedding(tokens),
            last_chunk=rows[0].last_chunk,
            cnn_cache=torch.cat([job.stream_cache["conformer_cnn_cache"] for job in rows]),
            att_cache=torch.cat([job.stream_cache["conformer_att_cache"] for job in rows], 1),
        )
        h = flow.encoder_proj(h)
        shared = len(members) > 1
        for g, i in enumerate(members):
            out[i] = (h[g : g + 1], cnn[g : g + 1], att[:, g : g + 1], shared)
    return [out[i] for i in range(len(jobs))]


def _grouped(fn: Callable[..., Tensor], inputs: list[tuple[Tensor, ...]]) -> list[Tensor]:
    """fn over the rows whose inputs have equal shapes at once: inputs[i] is row i's tuple of
    [1, ...] tensors; returns row i's [1, ...] slice of the result."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, args in enumerate(inputs):
        groups.setdefault(tuple(a.shape for a in args), []).append(i)
    out: list[Tensor] = [torch.empty(0)] * len(inputs)
    for members in groups.values():
        columns = zip(*(inputs[i] for i in members), strict=True)
        result = fn(*(torch.cat(col) if len(members) > 1 else col[0] for col in columns))
        for g, i in enumerate(members):
            out[i] = result[g : g + 1]
    return out


@dataclass
class _Row:
    """One session's HiFT state through a call: the package's offsets as plain ints (read once,
    written back once), its mel with the whole call's new frames appended at once and its
    source grown block by block, both trimmed once at the end. The package trims and clones
    both after every internal block; what it drops there is never read again, so the end's
    trim leaves the same tensors. `received` counts the frames the package would have
    buffered by now (it appends one internal block at a time)."""

    cache: dict[str, Tensor]
    mel: Tensor
    mel_start: int
    source: Tensor
    source_start: int
    phase: Tensor
    received: int
    mel_offset: int
    source_offset: int
    source_end: int
    emitted: int
    speech: list[Tensor]

    @classmethod
    def of(cls, cache: dict[str, Tensor], mel: Tensor, hop: int) -> _Row:
        offsets = {k: int(cache[k].item()) for k in _OFFSETS}
        mel_offset, source_offset = offsets["mel_offset"], offsets["source_offset"]
        old = cache["mel"]
        return cls(
            cache,
            torch.cat([old, mel.float()], dim=2) if mel.shape[-1] else old,
            mel_offset,
            cache["source"],
            source_offset,
            cache["phase"],
            mel_offset + old.shape[-1],
            mel_offset,
            source_offset,
            offsets["source_end"],
            offsets["speech_offset"] // hop,
            [],
        )

    def store(self, hop: int) -> None:
        """The package's state after this call: buffers trimmed (owning their memory), its
        offsets."""
        cache = self.cache
        cache["mel"] = self.frames(self.mel_offset, self.received).clone()
        cache["source"] = self.source[:, :, (self.source_offset - self.source_start) * hop :]
        cache["source"] = cache["source"].clone()
        if cache["phase"] is not self.phase:
            cache["phase"] = self.phase.clone()
        cache["mel_offset"].fill_(self.mel_offset)
        cache["source_offset"].fill_(self.source_offset)
        cache["source_end"].fill_(self.source_end)
        cache["speech_offset"].fill_(self.emitted * hop)

    def frames(self, start: int, end: int) -> Tensor:
        """Mel frames [start, end) (stream positions)."""
        return self.mel[:, :, start - self.mel_start : end - self.mel_start]


#: The BoundedVocoder's integer offsets (CPU long tensors in its cache).
_OFFSETS = ("mel_offset", "source_offset", "source_end", "speech_offset")


class _Hift:
    """BoundedVocoder.stream over many sessions' caches: each row's bookkeeping as the
    package's `_process` (on plain ints, `_Row`), its F0 predictor, sine source and decode
    batched by shape."""

    def __init__(self, bounded: Any, static: bool = False, graphs: bool = False) -> None:
        self.model = bounded.model
        self.decoder = HiftDecoder(bounded.model, static=static, graphs=graphs)
        self.hop, self.block = bounded.hop, bounded.block_frames
        self.f0_left, self.f0_right = bounded.f0_left, bounded.f0_right
        self.history, self.decoder_right = bounded.history, bounded.decoder_right
        self.limits = bounded.limits

    def _check(self, **values: int) -> None:
        """The package's buffer bounds (`_observe`), without its statistics."""
        for key, value in values.items():
            if value > self.limits[key]:
                raise RuntimeError(f"Bounded vocoder exceeded {key}: {value} > {self.limits[key]}")

    def stream(
        self, caches: list[dict[str, Tensor]], mels: list[Tensor], finals: list[bool]
    ) -> list[Tensor]:
        """BoundedVocoder.stream(mels[i], finalize=finals[i]) on caches[i], for every i (none
        finalized yet): new mel in internal blocks, then a final flush where asked."""
        for cache, mel in zip(caches, mels, strict=True):
            if mel.ndim != 3 or mel.shape[:2] != cache["mel"].shape[:2]:
                raise ValueError("Require fresh mel with shape [1, channels, frames]")
        blocks = [
            [min(self.block, m.shape[-1] - s) for s in range(0, m.shape[-1], self.block)]
            for m in mels
        ]
        with torch.amp.autocast(mels[0].device.type if mels else "cpu", enabled=False):
            rows = [_Row.of(c, m, self.hop) for c, m in zip(caches, mels, strict=True)]
            for r in range(max(map(len, blocks), default=0)):
                live = [row for row, sizes in zip(rows, blocks, strict=True) if r < len(sizes)]
                for row, sizes in zip(rows, blocks, strict=True):
                    if r < len(sizes):
                        row.received += sizes[r]
                        self._check(mel_buffer_frames=row.received - row.mel_offset)
                self._process(live, False)
            self._process([row for row, final in zip(rows, finals, strict=True) if final], True)
            for row, final in zip(rows, finals, strict=True):
                row.store(self.hop)
                if final:
                    row.cache["finalized"].fill_(1)
        return [
            torch.cat(row.speech, dim=1)
            if len(row.speech) > 1
            else row.speech[0]
            if row.speech
            else mel.new_zeros(1, 0)
            for row, mel in zip(rows, mels, strict=True)
        ]

    def _process(self, rows: list[_Row], finalize: bool) -> None:
        """BoundedVocoder._process on every row: new source, new speech, trimmed history."""
        if not rows:
            return
        self._extend_sources(rows, finalize)
        self._decode(rows, finalize)
        for row in rows:
            keep_mel = max(0, min(row.emitted - self.history, row.source_end - self.f0_left))
            row.mel_offset = keep_mel
            row.source_offset = max(0, row.emitted - self.history)
            self._check(
                mel_cache_frames=row.received - row.mel_offset,
                source_cache_frames=row.source_end - row.source_offset,
            )

    def _extend_sources(self, rows: list[_Row], finalize: bool) -> None:
        """F0 over each row's unseen mel (float64, rows of equal shapes at once), then its
        excitation source appended to the row's source."""
        want = [
            (row, max(0, row.source_end - self.f0_left))
            for row in rows
            if max(0, row.received - (0 if finalize else self.f0_right)) > row.source_end
        ]
        if not want:
            return
        feats = [row.frames(start, row.received) for row, start in want]
        for f in feats:
            self._check(f0_input_frames=f.shape[-1])

        def predict(x: Tensor) -> Tensor:
            return self.model.f0_predictor(x.double(), finalize=finalize).to(x)

        f0s = _grouped(predict, [(f,) for f in feats])
        f0s = [f0[:, row.source_end - start :] for (row, start), f0 in zip(want, f0s, strict=True)]
        sources = self._sources([row for row, _ in want], f0s)
        for (row, _), parts, f0 in zip(want, sources, f0s, strict=True):
            row.source = torch.cat([row.source, *parts], dim=2)
            row.source_end += f0.shape[1]
            self._check(source_buffer_frames=row.source_end - row.source_offset)

    def _sources(self, rows: list[_Row], f0s: list[Tensor]) -> list[list[Tensor]]:
        """Each row's F0 [1, F] in internal blocks through the sine source, in order (the
        phase carries over); the k-th blocks of all rows at once where their lengths agree."""
        parts = [list(f0.split(self.block, dim=1)) for f0 in f0s]
        offsets = [row.source_end for row in rows]
        out: list[list[Tensor]] = [[] for _ in f0s]
        for k in range(max(map(len, parts), default=0)):
            groups: dict[int, list[int]] = {}
            for i, p in enumerate(parts):
                if k < len(p):
                    groups.setdefault(p[k].shape[1], []).append(i)
            for members in groups.values():
                f0 = torch.cat([parts[i][k] for i in members])
                phase = torch.cat([rows[i].phase for i in members])
                self._check(cumsum_frames=f0.shape[1])
                source, phase = self._source(f0, phase, [offsets[i] for i in members])
                for g, i in enumerate(members):
                    rows[i].phase = phase[g : g + 1]  # cloned when stored
                    out[i].append(source[g : g + 1])
                    offsets[i] += f0.shape[1]
        return out

    def _source(self, f0: Tensor, phase: Tensor, offsets: list[int]) -> tuple[Tensor, Tensor]:
        """BoundedVocoder._source for rows f0 [G, n] with phases [G, 1, H] (float64) at frame
        offsets: ([G, 1, n x hop] source, the new phases)."""
        oscillator = self.model.m_source.l_sin_gen
        harmonics = torch.arange(1, self.model.nb_harmonics + 2, device=f0.device, dtype=f0.dtype)
        increments = (f0[:, :, None] * harmonics / self.model.sampling_rate).remainder(1)
        cycles = increments.double().cumsum(dim=1) * self.hop + phase
        sine = (cycles.remainder(1) * (2 * math.pi)).sin().to(f0)
        sine = sine.repeat_interleave(self.hop, dim=1)
        voiced = (f0[:, :, None] > oscillator.voiced_threshold).to(f0)
        voiced = voiced.repeat_interleave(self.hop, dim=1)
        amplitude = voiced * oscillator.noise_std + (1 - voiced) * oscillator.sine_amp / 3
        table = oscillator.sine_waves  # [1, samples, H], on the device (vocoder.device_tables)
        first = to_device(torch.tensor(offsets), table.device)[:, None] * self.hop
        positions = (first + torch.arange(sine.shape[1], device=table.device)) % table.shape[1]
        noise = table[0][positions].to(f0)
        excitation = sine * oscillator.sine_amp * voiced + amplitude * noise
        source = self.model.m_source.l_tanh(self.model.m_source.l_linear(excitation))
        return source.transpose(1, 2), cycles[:, -1:].remainder(1)

    def _decode(self, rows: list[_Row], finalize: bool) -> None:
        """The HiFT decode of each row's newly available speech (rows of equal shapes at
        once), appended to the row's speech."""
        want: list[tuple[_Row, int, int]] = []
        inputs: list[tuple[Tensor, ...]] = []
        for row in rows:
            available = max(0, row.source_end - (0 if finalize else self.decoder_right))
            if available > row.emitted:
                start = max(0, row.emitted - self.history)
                mel = row.frames(start, row.source_end)
                self._check(decoder_input_frames=mel.shape[-1])
                source = row.source[:, :, (start - row.source_start) * self.hop :]
                want.append((row, start, available))
                inputs.append((mel, source))
        decoded = self.decoder.run(inputs, finalize)
        for (row, start, available), out in zip(want, decoded, strict=True):
            out = out[:, (row.emitted - start) * self.hop :]
            if out.shape[-1] != (available - row.emitted) * self.hop:
                raise RuntimeError("Bounded vocoder returned an unexpected sample count")
            row.emitted = available
            row.speech.append(out)


@dataclass
class _DecodeShape:
    """A static decode shape's inputs (rows padded), and its graph once captured."""

    mel: Tensor
    source: Tensor
    graph: Any = None
    outputs: tuple[Tensor, Tensor] | None = None


class HiftDecoder(GraphSet):
    """The causal HiFT's decode (CausalHiFTGenerator.decode) over groups of rows of equal
    shapes. Ragged: the package's decode per group. Static: a group padded to a row bucket
    (graphs.POWER_BUCKETS) in tensors kept per shape, its spectrum (every convolution, up to the
    ISTFT's magnitude and phase: `_spectrum`, the package's modules called in its order) on
    CUDA with graphs captured as a CUDA graph per shape and replayed (one launch for ~950);
    the ISTFT and the clamp stay eager (the ISTFT's overlap-add check reads a value on the
    host, which a capture cannot). In steady state every row's decode has one shape (history,
    right context and 16 new frames), so few graphs serve; past MAX_SHAPES shapes the rest run
    ragged. A capture that fails turns graphs off with a warning, never a crash."""

    #: A turn meets 7 shapes a row bucket (its history grows for four chunks); the warm-up
    #: makes them for every row bucket up to the slots (49 at 64 slots).
    MAX_SHAPES = 96

    def __init__(self, model: Any, static: bool = False, graphs: bool = False) -> None:
        super().__init__("the HiFT", next(model.parameters()).device, static, graphs)
        self.model = model
        self.shapes: dict[tuple[Any, ...], _DecodeShape] = {}

    @property
    def captured(self) -> int:
        return sum(shape.graph is not None for shape in self.shapes.values())

    def run(self, inputs: list[tuple[Tensor, ...]], finalize: bool) -> list[Tensor]:
        """Each row's new speech [1, n] from its (mel, source), rows of equal shapes at once."""
        return _grouped(lambda mel, source: self._group(mel, source, finalize), inputs)

    def _group(self, mel: Tensor, source: Tensor, finalize: bool) -> Tensor:
        rows = mel.shape[0]
        key = (rows, tuple(mel.shape[1:]), tuple(source.shape[1:]), mel.dtype, finalize)
        if not self.static or (key not in self.shapes and len(self.shapes) >= self.MAX_SHAPES):
            return self.model.decode(mel, source, finalize=finalize)
        padded = next((b for b in POWER_BUCKETS if b >= rows), rows)
        key = (padded, *key[1:])
        shape = self.shapes.get(key)
        if shape is None:
            shape = self.shapes[key] = _DecodeShape(
                mel.new_zeros((padded, *mel.shape[1:])),
                source.new_zeros((padded, *source.shape[1:])),
            )
        shape.mel[:rows].copy_(mel)
        shape.source[:rows].copy_(source)
        magnitude, phase = self._spectrum(shape, finalize)
        model = self.model
        speech = model._istft(magnitude[:rows], phase[:rows])
        if not finalize:
            lookahead = int(np.prod(model.upsample_rates) * model.istft_params["hop_len"])
            speech = speech[:, :-lookahead]
        return torch.clamp(speech, -model.audio_limit, model.audio_limit)

    def _spectrum(self, shape: _DecodeShape, finalize: bool) -> tuple[Tensor, Tensor]:
        """The shape's magnitude and phase: a graph replay where graphs are on (captured on
        the shape's first call), else eagerly."""
        model = self.model
        if not self.graphs:
            return _spectrum(model, shape.mel, shape.source, finalize)
        if shape.graph is None:
            captured = self.capture(lambda: _spectrum(model, shape.mel, shape.source, finalize))
            if captured is None:
                return _spectrum(model, shape.mel, shape.source, finalize)
            shape.graph, shape.outputs = captured
        shape.graph.replay()
        self.replays += 1
        assert shape.outputs is not None
        return shape.outputs


def _spectrum(model: Any, x: Tensor, s: Tensor, finalize: bool) -> tuple[Tensor, Tensor]:
    """CausalHiFTGenerator.decode up to its ISTFT: the magnitude and phase of mel `x`
    [rows, 80, F] with source `s` [rows, 1, samples]."""
    real, imag = model._stft(s.squeeze(1))
    if finalize:
        x = model.conv_pre(x)
    else:
        right = model.conv_pre_look_right
        x = model.conv_pre(x[:, :, :-right], x[:, :, -right:])
        cut = int(np.prod(model.upsample_rates) * right)
        real, imag = real[:, :, :-cut], imag[:, :, :-cut]
    source = torch.cat([real, imag], dim=1)
    for i in range(model.num_upsamples):
        x = model.ups[i](F.leaky_relu(x, model.lrelu_slope))
        if i == model.num_upsamples - 1:
            x = model.reflection_pad(x)
        x = x + model.source_resblocks[i](model.source_downs[i](source))
        kernels = model.resblocks[i * model.num_kernels : (i + 1) * model.num_kernels]
        xs = kernels[0](x)
        for block in kernels[1:]:
            xs += block(x)
        x = xs / model.num_kernels
    x = model.conv_post(F.leaky_relu(x))
    bins = model.istft_params["n_fft"] // 2 + 1
    return torch.exp(x[:, :bins, :]), torch.sin(x[:, bins:, :])
