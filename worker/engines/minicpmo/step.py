"""The batched duplex step of the minicpmo engine (issue 38): one call serves one unit of
every session that has one, with one LLM forward per decode step for all of them.

Each session alone goes through the model's public code (prefill, generate, deferred
finalize; engine.py). Here the same unit is computed for several sessions at once, with our
own loops over the model's modules, written to give each session exactly what its solo run
gives (token for token; see docs/design/minicpmo-batched-step.md, "the design doc" below):

- the LLM KV cache of a batched session lives in a row of one SlotCache (slots.py), claimed
  when the session first enters a step (its prompt's cache is copied in) and released when
  it closes, or handed back to the decoder when a unit of it goes through the serial path;
- per session: mel and audio embedding (the public per-session streaming path, under the
  session's swapped state: `_audio_embeddings`, one place to put a batched encoder);
- vision: every frame of the step in one `get_vision_embedding` call, split back by session;
- one LLM forward for the prefill of all rows: each row's deferred `[terminator, </unit>]` of
  its previous unit, the outputs of its function calls if they came (calls.CallWatch, as the
  serial path feeds them), `<unit>`, its vision ops, its audio embeddings (and `<|turn_eos|>` when a
  forced listen closes an open turn), ragged, the row's pending logits from its last real
  prefill position;
- the decode loop over the rows still speaking, one forward per step for all of them, every
  per-row rule of the public decoder (decode.py), the host reading each forward's tokens
  before the next or, on CUDA, behind the device (decode.ahead);
- TTS over the speakers and the vocoder per speaker (tts.py); a session offered functions
  speaks only what comes before a call (its duplex's TTS condition is cut there; a unit
  inside a call has no speech), and its results carry the calls (MiniCPMOSession.watched).

The per-session bookkeeping the public code keeps (total ids, turn flags, generate count,
decoder history, pending finalize, TTS cache position...) is kept on each session's own
duplex object, so the serial path, kv_length, usage and close keep working.

Where this differs from the public code, and why:
- forwards are merged (the previous unit's `[terminator, </unit>]`, `<unit>`, each vision
  op, the audio, a closing `<|turn_eos|>`: one forward instead of up to 3 + 3 per image or
  slice + 1), and the LM head runs on the last real position only: the same math up to
  float rounding (logits within ~1e-6 of the solo run in fp32 on CPU);
- the duplex class feeds its terminator and `</unit>` in generate; here they wait for the
  session's next prefill like the unified class's deferred finalize (its ids, unit history
  and kv_length count them at once, as the public code does);
- a session with a seed (DuplexSettings.seed) draws from its own torch.Generator seeded
  from it, in the public order, one draw call per row: equal to a solo run whose global
  RNG was seeded the same; the sessions without one draw together from the worker's
  generator, one call for all their rows (decode.py): the same distribution, not the same
  stream; the serial path keeps drawing from the global RNG;
- a unit with too little audio fails its row before anything is fed (the public prefill
  has fed `<unit>` and the frames when it finds out; the engine fails the unit either way);
- not reproduced: the unified class's tts_pad suppression (dead code: tts_pad is always
  forbidden), its debug traces, prints and session logs; the context window and the HF
  `as_duplex` layout go through the serial path.

A session with a basic window (the model's own sliding window, set on its decoder at
prepare) slides where the public code slides it: right after the unit's `[terminator,
</unit>]` (the unified class in its finalize, the duplex class in its generate). Those
tokens wait for the next step's prefill here, so a session whose context (them counted)
passes its high watermark gets them fed at once, in one forward for every such session,
and then the decoder's own enforce_window runs over its slot's context (taken out as a
DynamicCache, put back as enforce_window leaves it: the oldest units dropped, the keys
after them re-rotated). A slot then never holds more than the high watermark and a unit,
and the worker sizes its slots for that (engine.slot_tokens). The context window
(dropping units and carrying their text forward, re-fed) stays on the serial path: a
context-windowed session never enters a slot (_batchable) and its cache stays the
decoder's own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.profiler import record_function

from omnifabric.worker.engine import (
    EngineSession,
    GenerateResult,
    StepOutcome,
    Stepper,
    StepRow,
)
from omnifabric.worker.engines.minicpmo import audio_batch, decode, layouts
from omnifabric.worker.engines.minicpmo.audio_batch import AudioRow
from omnifabric.worker.engines.minicpmo.engine import (
    FORCE_LISTEN_COUNT,
    MiniCPMOEngine,
    MiniCPMOSession,
    _images,
)
from omnifabric.worker.engines.minicpmo.graphs import GraphSet, StaticDecode
from omnifabric.worker.engines.minicpmo.mel import MelJob, StreamingMel
from omnifabric.worker.engines.minicpmo.rows import Row, unit_end
from omnifabric.worker.engines.minicpmo.slots import (
    FeedResult,
    NoFreeSlot,
    SlotCache,
    dynamic,
    feed,
    to_device,
)

if TYPE_CHECKING:
    from omnifabric.worker.engines.minicpmo.tts import BatchedTTS

#: Tokens one unit may add at most besides its vision: merged finalize (2), <unit>, audio
#: (10), a closing turn_eos, the speak tokens (max 20) and the next finalize (2).
UNIT_HEADROOM = 40
log = logging.getLogger(__name__)
#: The unified layout's limit on the characters of one unit's text.
CHAR_LIMIT = 28
#: EMA weight of the newest step in the added-cost estimate.
EMA = 0.1


def _audio_row(feature: Any, cache: Any) -> AudioRow:
    """A session's unit for the batched audio encoder, from its streaming mel feature (the
    public processor's batch feature) and its encoder cache."""
    lens = getattr(feature, "audio_feature_lens", None)
    length = None
    if lens is not None and len(lens):
        first = lens[0]
        length = int(first.reshape(-1)[0]) if isinstance(first, torch.Tensor) else int(first[0])
    return AudioRow(
        features=feature.audio_features,
        cache=cache,
        prefix_extra_frames=int(feature.prefix_extra_frames),
        suffix_extra_frames=int(feature.suffix_extra_frames),
        feature_len=length,
    )


class _RowFailed(Exception):
    """Wraps the exception that failed one row (kept apart from the others)."""


class MiniCPMOStepper(Stepper):
    """The minicpmo engine's batched entry (Engine.stepper)."""

    def __init__(self, engine: MiniCPMOEngine) -> None:
        self.engine = engine
        self._cache: SlotCache | None = None
        self._static: StaticDecode | None = None
        """The static-shape decode (graphs.py), once the first decode asks for it."""
        self._replays_before = 0
        self._mel_engine: StreamingMel | None = None
        """The incremental mel (mel.py), once the first step asks for it."""
        self._mel_public = False
        """The incremental mel cannot run here: the public processor runs per session."""
        self._deferred: dict[int, list[int]] = {}
        """id(session) -> KV tokens of its last unit not fed yet (fed with its next step)."""
        self._ema: list[float] | None = None
        """EMAs of (rows, seconds, rows^2, rows*seconds) of the steps, for added_cost."""
        self.prefill_logits: dict[str, torch.Tensor] = {}
        """session_id -> the pending logits of its unit in the last step (for checks)."""
        self.tts: BatchedTTS | None = None
        """The batched TTS (tts.py), built when a speaker first needs it."""

    # ---- the slot cache ---------------------------------------------------------------

    @property
    def cache(self) -> SlotCache:
        if self._cache is None:
            model = self.engine.model
            llm = model.llm
            weight = llm.model.embed_tokens.weight
            # Each slot holds engine.kv_slot_tokens; a session whose next unit would pass it
            # goes to the serial path.
            self._cache = SlotCache(
                llm.config,
                self.engine.slots,
                self.engine.kv_slot_tokens,
                device=weight.device,
                dtype=weight.dtype,
                scratch=self.engine.static_decode,
            )
        return self._cache

    def tts_cache(self) -> SlotCache | None:
        """The TTS's slot cache, allocated now (BatchedTTS; None where the model has no
        TTS): the worker takes its memory at start with the LLM's, not at the first step
        that speaks."""
        if getattr(self.engine.model, "tts", None) is None:
            return None
        if self.tts is None:
            from omnifabric.worker.engines.minicpmo.tts import BatchedTTS

            self.tts = BatchedTTS(self.engine)
        return self.tts.cache

    def reset_decode(self, graphs: str) -> None:
        """Sets the engine's cuda_graphs to `graphs` and drops the slot cache and the
        static decode built for the old setting (the next step builds them anew). Only
        between sessions: raises while a slot is claimed."""
        if self._cache is not None and self._cache.claimed():
            raise RuntimeError("the decode cannot change while sessions hold slots")
        self.engine.cuda_graphs = graphs
        self._cache = None
        if self.tts is not None and self.tts.cache.claimed():
            raise RuntimeError("the TTS cannot change while sessions hold its slots")
        self.tts = None  # its slot cache and static steps follow the setting too
        if self._static is not None:
            self._replays_before += self._static.replays
        self._static = None

    @property
    def graph_replays(self) -> int:
        """Decode forwards run as CUDA graph replays so far (hooks on the LLM do not see
        them: gpu_sessions adds them to its forward count)."""
        return self._replays_before + (self._static.replays if self._static else 0)

    def graph_sets(self) -> dict[str, GraphSet]:
        """The step's graph sets made so far: its static decode, the TTS's static steps, the
        batched vocoder's flow matching and HiFT decode (what each captured, replayed, or why
        it stopped)."""
        sets: dict[str, GraphSet | None] = {
            "decode": self._static,
            "tts": self.tts.static if self.tts is not None else None,
        }
        vocoder = self.engine._batched_vocoder
        if vocoder is not None:
            sets.update(flow=vocoder.flow, hift=vocoder.hift.decoder)
        return {name: part for name, part in sets.items() if part is not None}

    def decode_feed(self, rows: list[tuple[int, torch.Tensor]]) -> FeedResult:
        """One decode forward of the rows (slot, [1, hidden] embeddings): ragged, or in
        static shapes (replayed as CUDA graphs) when the engine asks for them."""
        static = self._static_decode()
        if static is None:
            return feed(self.engine.model.llm, self.cache, rows)
        return static.feed(rows)

    def _static_decode(self) -> StaticDecode | None:
        """The LLM's static-shape decode (None where the decode runs ragged), made once."""
        cache = self.cache
        if cache.scratch is None:
            return None
        if self._static is None:
            graphs = self.engine.cuda_graphs != "off"
            self._static = StaticDecode(self.engine.model.llm, cache, graphs)
        return self._static

    def capture_graphs(self) -> dict[str, int]:
        """Captures now the CUDA graphs of every bucket of the LLM's decode and of the TTS's
        token steps (StaticDecode.capture_all), so that no session's step pays for one
        (the worker's warm-up calls it). Per part, how many it captured (none without
        graphs: on a CPU, or `--cuda-graphs off`)."""
        done: dict[str, int] = {}
        static = self._static_decode()
        if static is not None:
            done["decode"] = static.capture_all()
        self.tts_cache()
        if self.tts is not None and self.tts.static is not None:
            done["tts"] = self.tts.static.capture_all()
        return done

    def _slot_in(self, session: MiniCPMOSession) -> None:
        """Move the session's LLM KV cache from its decoder into a slot of its own (and a
        seeded session's draws onto its own generator, decode.draws_from_serial)."""
        cache = self.cache
        slot = cache.claim()
        decoder = session.handle.duplex.decoder
        past = decoder.cache
        try:
            if past is not None and decoder.get_cache_length() > 0:
                keys = [k[0] for k in past.key_cache]
                values = [v[0] for v in past.value_cache]
                cache.put(slot, keys, values)
        except BaseException:
            cache.release(slot)
            raise
        decoder.cache = None
        session.kv_slot = slot
        if decode.seeded(session):
            with self.engine.using(session):
                decode.draws_from_serial(session, cache.device)

    def unslot(self, session: MiniCPMOSession) -> None:
        """The session's KV cache back into its decoder (a DynamicCache), its slot freed, and
        what the batched path deferred fed now: the serial path takes over."""
        with self.engine._lock:  # never inside another thread's step
            self._unslot(session)

    def _unslot(self, session: MiniCPMOSession) -> None:
        if self.tts is not None:  # its TTS past too (tts.py keeps it in a slot)
            self.tts.unslot(session)
        slot = session.kv_slot
        if slot is None:
            return
        cache = self.cache
        keys, values = cache.take(slot)
        past = dynamic(keys, values)
        d = session.handle.duplex
        with self.engine.using(session), torch.no_grad():
            decode.draws_to_serial(session)
            d.decoder.cache = past if keys and keys[0].shape[-2] else None
            cache.release(slot)
            session.kv_slot = None
            deferred = self._deferred.pop(id(session), [])
            if deferred:
                d.decoder.feed(d.decoder.embed_tokens(deferred))
            session.finalize_due = False

    def release(self, session: MiniCPMOSession) -> None:
        """The session leaves (close): its slot is freed."""
        with self.engine._lock:  # never inside another thread's step
            if session.kv_slot is not None and self._cache is not None:
                self._cache.release(session.kv_slot)
            session.kv_slot = None
            if self.tts is not None:
                self.tts.release(session)
            session.finalize_due = False
            self._deferred.pop(id(session), None)

    def kv_length(self, session: MiniCPMOSession) -> int:
        """The session's context length as its serial path would report it now."""
        if session.kv_slot is None:
            return session.handle.kv_length()
        return self.cache.length(session.kv_slot) + len(self._deferred.get(id(session), []))

    def _slide_due(self, session: MiniCPMOSession) -> bool:
        """The session's basic window slides now: its context, its deferred tokens counted,
        passes its high watermark (the public code checks right after a unit's end)."""
        if session.kv_slot is None or session.handle.window_mode != "basic":
            return False
        dec = session.handle.duplex.decoder
        return self.kv_length(session) > int(dec._window_config.basic_window_high_tokens)

    def _slide(self, sessions: Sequence[MiniCPMOSession]) -> None:
        """The basic window's slide of each session where due, where the public code makes
        it (right after the unit's `[terminator, </unit>]`): those deferred tokens fed now,
        in one forward for all of them, then the decoder's own enforce_window over the
        slot's context (taken out as a DynamicCache, put back as it leaves it: the oldest
        units dropped, the keys after them re-rotated to their new positions)."""
        due = [s for s in sessions if self._slide_due(s)]
        if not due:
            return
        cache = self.cache
        rows = []
        for session in due:
            ids = self._deferred.pop(id(session), [])
            if ids:
                assert session.kv_slot is not None
                rows.append((session.kv_slot, session.handle.duplex.decoder.embed_tokens(ids)))
        with torch.no_grad():
            if rows:
                feed(self.engine.model.llm, cache, rows)
            for session in due:
                slot = session.kv_slot
                assert slot is not None
                decoder = session.handle.duplex.decoder
                decoder.cache = dynamic(*cache.take(slot))
                try:
                    decoder.enforce_window()
                    kept = decoder.cache
                    cache.put(
                        slot, [k[0] for k in kept.key_cache], [v[0] for v in kept.value_cache]
                    )
                finally:
                    decoder.cache = None

    def _take_finalize(self, session: MiniCPMOSession) -> None:
        """The unified layout's finalize_unit, all but its forward: the bookkeeping now, its
        `[terminator, </unit>]` kept for the next step's prefill."""
        d = session.handle.duplex
        pending = getattr(d, "_pending_finalize", None)
        if pending is None:
            return
        close_id = d.tokenizer.convert_tokens_to_ids("</unit>")
        term = pending["terminator_id"]
        ids = [term, close_id] if term is not None else [close_id]
        d.total_ids.append(close_id)
        self._deferred[id(session)] = ids
        unit_end(d.decoder, pending, self.kv_length(session))
        d._pending_finalize = None

    # ---- Stepper ----------------------------------------------------------------------

    def added_cost(self, session_cost: float) -> float:
        """What one more row adds to a step: the slope of step time over rows (seconds per
        row per step, a step being one unit of ~1 s of input), fitted on the steps seen by
        exponentially weighted least squares (weight EMA per step); until the steps seen
        had different sizes, the whole session cost (the safe side). Never more than
        `session_cost`, never below 0."""
        if self._ema is None:
            return session_cost
        n, t, nn, nt = self._ema
        var = nn - n * n
        if var < 0.25:
            return session_cost
        slope = (nt - n * t) / var
        return float(min(session_cost, max(0.0, slope)))

    def _observe(self, rows: int, seconds: float) -> None:
        point = [float(rows), seconds, float(rows * rows), rows * seconds]
        if self._ema is None:
            self._ema = point
        else:
            self._ema = [(1 - EMA) * a + EMA * b for a, b in zip(self._ema, point, strict=True)]

    def finalize(self, sessions: Sequence[EngineSession]) -> list[Exception | None]:
        """A batched session's deferred finalize is fed with its next step's prefill: here
        it is only marked taken. Sessions on the serial path finalize as they are."""
        failed: list[Exception | None] = []
        taken: list[tuple[int, MiniCPMOSession]] = []
        for session in sessions:
            try:
                if isinstance(session, MiniCPMOSession) and session.kv_slot is not None:
                    if session.handle.layout == layouts.UNIFIED:
                        self._take_finalize(session)
                        taken.append((len(failed), session))
                    session.finalize_due = True
                else:
                    session.finalize()
                failed.append(None)
            except Exception as exc:  # noqa: BLE001 - the session's own failure
                failed.append(exc)
        if taken:
            with self.engine._lock:
                try:
                    self._slide([s for _, s in taken])  # the unified class slides here
                except Exception as exc:  # noqa: BLE001 - the sessions of the forward
                    for i, _ in taken:
                        failed[i] = exc
        return failed

    def step(self, rows: Sequence[StepRow]) -> StepOutcome:
        started = time.perf_counter()
        out: list[tuple[dict[str, float], GenerateResult] | Exception | None] = [None] * len(rows)
        phases = dict.fromkeys(
            ("mel", "audio", "vision", "llm_prefill", "decode", "tts", "vocoder"), 0.0
        ) | {"serial_prefill": 0.0, "serial_generate": 0.0}
        self.prefill_logits = {}
        engine = self.engine
        with engine._lock:
            batch: list[Row] = []
            serial: list[int] = []
            for i, step_row in enumerate(rows):
                try:
                    session = step_row.session
                    if not isinstance(session, MiniCPMOSession):
                        raise TypeError(f"not a minicpmo session: {type(session).__name__}")
                    row = self._begin(i, session, step_row)
                    if row is None:
                        serial.append(i)
                    else:
                        batch.append(row)
                except Exception as exc:  # noqa: BLE001 - this row's failure alone
                    out[i] = exc
            for i in serial:
                out[i] = self._serial(rows[i], phases)
            try:
                if batch:
                    self._batched(batch, out, phases)
            finally:
                for row in batch:
                    if row.speech is not None:
                        row.duplex.generate_audio = row.speech
        wall = time.perf_counter() - started
        self._observe(len(rows), wall)
        phases["prefill"] = sum(
            phases[k] for k in ("mel", "audio", "vision", "llm_prefill", "serial_prefill")
        )
        phases["generate"] = sum(phases[k] for k in ("decode", "tts", "vocoder", "serial_generate"))
        phases["all"] = wall * 1000.0
        done: list[tuple[dict[str, float], GenerateResult] | Exception] = [
            r if r is not None else RuntimeError("row not served") for r in out
        ]
        return StepOutcome(done, phases)

    # ---- one step ---------------------------------------------------------------------

    def _serial(
        self, step_row: StepRow, phases: dict[str, float]
    ) -> tuple[dict[str, float], GenerateResult] | Exception:
        """A unit through the session's own serial prefill and generate (a half-duplex
        call, a layout or state the batched path does not serve, no free slot)."""
        session = step_row.session
        t0 = time.perf_counter()
        try:
            costs = session.prefill(step_row.pcm, step_row.frames, step_row.max_slice_nums)
            phases["serial_prefill"] += _ms(t0)
            t0 = time.perf_counter()
            result = session.generate(step_row.force_listen)
            phases["serial_generate"] += _ms(t0)
            return costs or {}, result
        except Exception as exc:  # noqa: BLE001 - this row's failure alone
            return exc

    def _batchable(self, session: MiniCPMOSession) -> bool:
        d = session.handle.duplex
        if session.call is not None or session.closed:
            return False
        if session.handle.layout not in (layouts.UNIFIED, layouts.DUPLEX):
            return False
        if getattr(d, "ls_mode", "explicit") != "explicit":
            return False
        # A basic window slides in the slot (_slide); the context window: see the module doc.
        return session.handle.window_mode in ("off", "basic")

    def _begin(self, index: int, session: MiniCPMOSession, step_row: StepRow) -> Row | None:
        """The row's settings and what its prefill feeds first; None when the session goes
        through the serial path this time."""
        if not self._batchable(session):
            return None
        images = _images(step_row.frames) if step_row.frames else []
        slices = max(1, step_row.max_slice_nums)
        vision_tokens = self.engine.vision_tokens(images, slices)
        watch = session.watch
        extra = vision_tokens + (len(watch.results) if watch is not None else 0)
        # A context that would outgrow its slot goes on in the decoder's own cache.
        if self.kv_length(session) + extra + UNIT_HEADROOM > self.cache.max_len:
            self._unslot(session)
            return None
        # So does a TTS past that would outgrow its TTS slot (a reply spoken at length).
        if self.tts is not None and not self.tts.fits(session):
            self._unslot(session)
            return None
        if session.kv_slot is None:
            try:
                self._slot_in(session)
            except NoFreeSlot:
                return None
        d = session.handle.duplex
        if d.is_session_stop_set() or (
            session.handle.layout != layouts.UNIFIED and d.is_break_set()
        ):
            raise RuntimeError("prefill failed: the session was stopped")
        if not len(step_row.pcm) and not images:
            raise RuntimeError("prefill failed: no input")
        s = session.settings
        startup = s.force_listen_count if s.force_listen_count is not None else FORCE_LISTEN_COUNT
        capped = s.max_tokens is not None and 0 < s.max_tokens <= session.output_tokens
        called = watch is not None and watch.take_force()
        force = step_row.force_listen or session.units + 1 <= startup or capped or called
        if session.handle.layout == layouts.UNIFIED:
            self._take_finalize(session)  # a finalize not asked for: the unit closes here
            self._slide([session])
        deferred = list(self._deferred.get(id(session), []))
        session.vision_tokens = vision_tokens
        row = Row(
            index=index,
            session=session,
            step_row=step_row,
            duplex=d,
            args=session.sampling(),
            force=force,
            close_turn=force and not bool(getattr(d, "current_turn_ended", True)),
            deferred=deferred,
            images=images,
        )
        if watch is not None:
            row.results = watch.take_results()
            if watch.silent:  # the unit begins inside a call: no speech (as serial)
                row.speech, d.generate_audio = d.generate_audio, False
        return row

    def _batched(
        self,
        batch: list[Row],
        out: list[tuple[dict[str, float], GenerateResult] | Exception | None],
        phases: dict[str, float],
    ) -> None:
        # The record_function ranges name the phases in a profiler trace (gpu_sessions
        # --profile); without a profiler they cost a few microseconds.
        with record_function("minicpmo.prefill"):
            live = self._prefill_inputs(batch, out, phases)
            if not live:
                return
            try:
                self._prefill(live, phases)
            except Exception as exc:  # noqa: BLE001 - the shared forward failed every row
                for row in live:
                    out[row.index] = exc
                return
        t0 = time.perf_counter()
        try:
            with record_function("minicpmo.decode"):
                decode.run(self, live)
                # the duplex class slides in its generate, after the unit's end
                self._slide([r.session for r in live if r.session.handle.layout != layouts.UNIFIED])
        except Exception as exc:  # noqa: BLE001 - the shared forwards failed every row
            for row in live:
                out[row.index] = exc
            return
        phases["decode"] = _ms(t0)
        speakers = [r for r in live if not r.is_listen and r.duplex.generate_audio]
        if speakers:
            from omnifabric.worker.engines.minicpmo.tts import BatchedTTS

            if self.tts is None:
                self.tts = BatchedTTS(self.engine)
            self.tts.run(speakers, phases)
        n = len(live)
        for row in live:
            try:
                out[row.index] = self._result(row, phases, n)
            except Exception as exc:  # noqa: BLE001 - this row's failure alone
                out[row.index] = exc

    def _prefill_inputs(
        self,
        batch: list[Row],
        out: list[tuple[dict[str, float], GenerateResult] | Exception | None],
        phases: dict[str, float],
    ) -> list[Row]:
        """Images and audio of every row; rows that fail here leave the batch."""
        live: list[Row] = []
        model = self.engine.model
        processor = model.processor
        for row in batch:
            if not row.images:
                continue
            try:
                t0 = time.perf_counter()
                d = row.duplex
                slices = max(1, row.step_row.max_slice_nums)
                frames = processor.process_image(row.images, max_slice_nums=slices)
                if d.device:
                    frames = frames.to(d.device)
                row.frames = frames
                counts = []
                for image in row.images:
                    grid = processor.image_processor.get_sliced_grid(
                        image.size, slices, nerver_split=False
                    )
                    counts.append(1 + grid[0] * grid[1] if grid is not None else 1)
                row.slice_counts = counts
                row.costs["vision_process"] = _ms(t0)
                phases["vision"] += row.costs["vision_process"]
            except Exception as exc:  # noqa: BLE001 - this row's failure alone
                out[row.index] = exc
        batch = [r for r in batch if out[r.index] is None]
        t0 = time.perf_counter()
        try:
            self._vision_embeddings([r for r in batch if r.images])
        except Exception as exc:  # noqa: BLE001 - the shared call failed those rows
            for r in batch:
                if r.images:
                    out[r.index] = exc
        phases["vision"] += _ms(t0)
        batch = [r for r in batch if out[r.index] is None]
        audio_rows = [r for r in batch if len(r.step_row.pcm)]
        for row, got in zip(audio_rows, self._audio_embeddings(audio_rows, phases), strict=True):
            if isinstance(got, Exception):
                out[row.index] = got
            else:
                row.audio = got
        live = [r for r in batch if out[r.index] is None]
        return live

    def _vision_embeddings(self, rows: list[Row]) -> None:
        """Every frame (and slice) of the step in one vision call, split back per row."""
        if not rows:
            return
        data = {
            "pixel_values": [r.frames["pixel_values"][0] for r in rows],
            "tgt_sizes": [r.frames["tgt_sizes"][0] for r in rows],
        }
        with torch.no_grad():
            states = self.engine.model.get_vision_embedding(data)
        for row, embeds in zip(rows, states, strict=True):
            if not isinstance(embeds, torch.Tensor) or embeds.shape[0] != sum(row.slice_counts):
                raise RuntimeError("vision embeddings do not match the frames' slices")
            row.vision = embeds

    def _audio_embeddings(
        self, rows: list[Row], phases: dict[str, float]
    ) -> list[torch.Tensor | Exception]:
        """Each row's audio embeddings for its unit ([10, hidden]): its mel from its own
        streaming processor (per session, under its swapped state), then the streaming audio
        encoder over every row at once (audio_batch: each row with its own encoder cache and
        past), each row's cache put back where the session keeps it."""
        model = self.engine.model
        got: list[torch.Tensor | Exception | None] = [None] * len(rows)
        ready = self._mels(rows, got, phases)
        if ready:
            t0 = time.perf_counter()
            outs: list[audio_batch.AudioOut | Exception]
            try:
                with torch.no_grad():
                    outs = list(audio_batch.encode_streaming(model, [r for _, _, r in ready]))
            except Exception as exc:  # noqa: BLE001 - fails the rows of the call only
                outs = [exc] * len(ready)
            spent = _ms(t0)
            phases["audio"] += spent
            for (i, row, _), out in zip(ready, outs, strict=True):
                if isinstance(out, Exception):
                    got[i] = out
                    continue
                with self.engine.using(row.session):
                    model.audio_past_key_values = out.cache
                row.costs["audio_embed"] = spent / len(ready)
                got[i] = out.embeds
        return [g if g is not None else RuntimeError("no audio embedding") for g in got]

    def _mels(
        self, rows: list[Row], got: list[torch.Tensor | Exception | None], phases: dict[str, float]
    ) -> list[tuple[int, Row, AudioRow]]:
        """Every row's unit of log-mel (mel.py: only the frames that changed, all rows in
        one transform on the model's device; the public processor where that cannot run),
        with its audio encoder cache, as rows for the batched encoder."""
        model = self.engine.model
        t0 = time.perf_counter()
        planned: list[tuple[int, Row, MelJob, Any]] = []
        ready: list[tuple[int, Row, AudioRow]] = []
        streaming = self._streaming_mel()
        for i, row in enumerate(rows):
            try:
                with self.engine.using(row.session), torch.no_grad():
                    if streaming is None:
                        feature = self._mel(row, row.duplex, phases)
                        ready.append((i, row, _audio_row(feature, model.audio_past_key_values)))
                        continue
                    job = self._mel_job(streaming, row, row.duplex)
                    planned.append((i, row, job, model.audio_past_key_values))
            except Exception as exc:  # noqa: BLE001 - this row's failure alone
                got[i] = exc
        if planned and streaming is not None:
            try:
                with torch.no_grad():
                    done = streaming.run([job for _, _, job, _ in planned])
            except Exception as exc:  # noqa: BLE001 - the shared transform failed its rows
                for i, _, _, _ in planned:
                    got[i] = exc
                return ready
            spent = _ms(t0)
            phases["mel"] += spent
            for (i, row, _, cache), (features, mel_cache) in zip(planned, done, strict=True):
                row.session.mel_cache = mel_cache
                row.costs["audio_process"] = spent / len(planned)
                if features.shape[-1] == 0:
                    got[i] = RuntimeError("prefill failed: the streaming mel gave nothing")
                    continue
                first = row.duplex.audio_chunk_idx == 0
                audio = AudioRow(features, cache, 0 if first else 2, 2, int(features.shape[-1]))
                ready.append((i, row, audio))
        return ready

    def _streaming_mel(self) -> StreamingMel | None:
        """The incremental mel of the model's processor (None where it cannot run: a
        dithered extractor; the public processor then runs per session)."""
        if self._mel_engine is None and not self._mel_public:
            model = self.engine.model
            try:
                device = model.llm.model.embed_tokens.weight.device
                self._mel_engine = StreamingMel(model.processor, device)
            except (ValueError, AttributeError) as exc:
                log.warning("minicpmo: the public streaming mel per session: %s", exc)
                self._mel_public = True
        return self._mel_engine

    def _mel_job(self, streaming: StreamingMel, row: Row, d: Any) -> MelJob:
        """The session's unit for the incremental mel: its audio buffer consumed as the
        public unit consumes it, its processor advanced (under its swapped state)."""
        rate = int(d.SAMPLE_RATE)
        buffer, need = self._unit_audio(row, d)
        proc = self.engine.model.processor._streaming_mel_processor
        job = streaming.plan(proc, buffer[:need], row.session.mel_cache)
        self._consume(d, buffer, rate)
        return job

    def _unit_audio(self, row: Row, d: Any) -> tuple[np.ndarray, int]:
        """The session's buffered audio with the unit's, padded as the public first unit
        pads it, and the samples the processor takes now."""
        processor = self.engine.model.processor
        rate = int(d.SAMPLE_RATE)
        pcm = row.step_row.pcm.astype(np.float32, copy=False)
        buffer = np.concatenate([d.audio_buffer, pcm])
        if d.audio_chunk_idx == 0:
            first = int(d.FIRST_CHUNK_MS * rate / 1000)
            if len(buffer) < first:
                buffer = np.concatenate([np.zeros(first - len(buffer), np.float32), buffer])
        need = processor.get_streaming_chunk_size()
        if len(buffer) < need:
            raise RuntimeError(f"prefill failed: {need} samples needed, {len(buffer)} held")
        return buffer, need

    def _consume(self, d: Any, buffer: np.ndarray, rate: int) -> None:
        """What the public unit leaves of the buffer after its mel."""
        if d.audio_chunk_idx == 0:
            config = self.engine.model.processor._streaming_mel_processor.get_config()
            used_ms = int(config.get("effective_first_chunk_ms", d.FIRST_CHUNK_MS))
        else:
            used_ms = int(d.CHUNK_MS)
        d.audio_buffer = buffer[int(used_ms * rate / 1000) :]

    def _mel(self, row: Row, d: Any, phases: dict[str, float]) -> Any:
        """The unit's mel frames from the session's streaming processor (the session's state
        on the model), its audio buffer consumed as the public unit consumes it."""
        processor = self.engine.model.processor
        rate = int(d.SAMPLE_RATE)
        t0 = time.perf_counter()
        buffer, need = self._unit_audio(row, d)
        feature = processor.process_audio_streaming(
            buffer[:need], reset=False, return_batch_feature=True
        )
        if feature is None or feature.audio_features.shape[-1] == 0:
            raise RuntimeError("prefill failed: the streaming mel gave nothing")
        feature.prefix_extra_frames = 0 if d.audio_chunk_idx == 0 else 2
        feature.suffix_extra_frames = 2
        feature = feature.to(d.device)
        self._consume(d, buffer, rate)
        row.costs["audio_process"] = _ms(t0)
        phases["mel"] += row.costs["audio_process"]
        return feature

    def _prefill(self, rows: list[Row], phases: dict[str, float]) -> None:
        """One LLM forward: every row's deferred finalize, <unit>, vision ops, audio (and a
        closing turn_eos), with the public bookkeeping around it. Every token of every row
        is embedded in one lookup (the public decoder's embed_tokens makes a tensor on the
        device from a list, a copy the host waits for, and looks it up, per call), and the
        rows' pieces go into the padded batch as they are (slots.feed), not joined a row at
        a time."""
        t0 = time.perf_counter()
        llm = self.engine.model.llm
        cache = self.cache
        ids: list[int] = []
        plans = [self._pieces(row, ids) for row in rows]
        table = llm.model.embed_tokens
        with torch.no_grad():
            embedded = table(to_device(torch.tensor(ids), table.weight.device))
        feeds: list[tuple[int, list[torch.Tensor]]] = []
        for row, plan in zip(rows, plans, strict=True):
            slot = row.session.kv_slot
            assert slot is not None
            pieces = [embedded[p[0] : p[1]] if isinstance(p, tuple) else p for p in plan]
            feeds.append((slot, pieces))
        starts = [cache.length(slot) for slot, _ in feeds]
        with torch.no_grad():
            res = feed(llm, cache, feeds)
            pending = []
            for k, row in enumerate(rows):
                if row.close_turn:
                    last = res.hidden[k][row.n_pending - 1]
                    pending.append(llm.lm_head(last[None]))
                else:
                    pending.append(res.logits[k : k + 1])
        phases["llm_prefill"] = _ms(t0)
        for row, start, logits in zip(rows, starts, pending, strict=True):
            self._after_prefill(row, start, logits)

    def _pieces(self, row: Row, ids: list[int]) -> list[tuple[int, int] | torch.Tensor]:
        """The row's prefill in order: spans of `ids` (its tokens, appended there) and
        embeddings (vision, audio); sets its prefill_ids and n_pending (the closing
        turn_eos, fed last, not counted)."""
        d = row.duplex
        plan: list[tuple[int, int] | torch.Tensor] = []

        def tokens(more: list[int]) -> int:
            plan.append((len(ids), len(ids) + len(more)))
            ids.extend(more)
            return len(more)

        n = tokens([*row.deferred, *row.results, d.unit_token_id])
        schema: list[Any] = [d.unit_token_id]
        if row.vision is not None:
            k = 0
            for count in row.slice_counts:
                for i in range(count):
                    start, end = (
                        (d.image_start_token_id, d.image_end_token_id)
                        if i == 0
                        else (d.slice_start_token_id, d.slice_end_token_id)
                    )
                    emb = row.vision[k]
                    k += 1
                    n += tokens([start])
                    plan.append(emb)
                    n += int(emb.shape[0]) + tokens([end])
                    schema += [start, ("img", int(emb.shape[0])), end]
        if row.audio is not None:
            plan.append(row.audio)
            n += int(row.audio.shape[0])
            schema.append(("audio", int(row.audio.shape[0])))
        row.prefill_ids = schema
        row.n_pending = n
        if row.close_turn:
            tokens([d.turn_eos_token_id])
        return plan

    def _after_prefill(self, row: Row, start: int, logits: torch.Tensor) -> None:
        """The public prefill's (and merged finalize's) bookkeeping on the duplex."""
        d, session = row.duplex, row.session
        dec = d.decoder
        unit_start = start + len(row.deferred)
        self._deferred.pop(id(session), None)
        session.finalize_due = False
        d.pending_logits = None
        dec._pending_unit_id = dec._next_unit_id
        dec._pending_unit_start_cache_len = unit_start
        d._current_unit_prefill_tokens = list(row.prefill_ids)
        if row.audio is not None:
            d.audio_chunk_idx += 1
            mode = "OMNI" if row.vision is not None else "AUDIO"
        else:
            mode = "VISION"
        d.current_mode = mode
        if mode == "VISION":
            d.audio_chunk_idx += 1
        d.prefill_schema_tokens.append(d._current_unit_prefill_tokens)
        session.input_tokens = row.n_pending - len(row.deferred) - len(row.results)
        row.logits = logits
        self.prefill_logits[session.session_id] = logits

    def defer(self, row: Row, ids: list[int]) -> None:
        """KV tokens of the row's unit fed with its next prefill."""
        self._deferred[id(row.session)] = ids

    def _result(
        self, row: Row, phases: dict[str, float], n: int
    ) -> tuple[dict[str, float], GenerateResult]:
        session = row.session
        share = {k: v / n for k, v in phases.items()}
        prefill_costs = dict(row.costs)
        prefill_costs["llm_prefill"] = share["llm_prefill"]
        prefill_costs["vision_embed"] = share["vision"]
        prefill_costs["prefill_all"] = (
            row.costs.get("audio_process", 0.0)
            + row.costs.get("audio_embed", 0.0)
            + share["vision"]
            + share["llm_prefill"]
        )
        n_tokens = len(row.ids)
        session.output_tokens += n_tokens
        if row.is_listen:
            wave = np.zeros(0, np.float32)
        elif row.wave is not None and row.duplex.generate_audio:
            wave = np.asarray(row.wave, dtype=np.float32).reshape(-1)
        else:
            wave = np.zeros(0, np.float32)
        costs = {
            "llm": share["decode"],
            "tts": share["tts"],
            "token2wav": share["vocoder"],
            "generate_all": share["decode"] + share["tts"] + share["vocoder"],
        }
        text = "" if row.is_listen else row.text
        result = GenerateResult(
            is_listen=row.is_listen,
            text=text,
            audio=wave,
            end_of_turn=row.end_of_turn if not row.is_listen else False,
            kv_cache_length=session.kv_length(),
            costs_ms=costs,
            n_tokens=n_tokens,
            n_tts_tokens=int(row.tts_tokens.numel()) if row.tts_tokens is not None else 0,
            input_audio_tokens=max(0, session.input_tokens - session.vision_tokens),
            input_vision_tokens=session.vision_tokens,
        )
        return prefill_costs, session.watched(result, row.force)  # its calls taken out


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0
