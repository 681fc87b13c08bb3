"""The batched step's TTS: one TTS-backbone forward per TTS step for every speaking row, then
the vocoder: batched over the speakers (waveform.py), or per speaker through the public
method when the engine's `vocoder_batched` is off (design doc §5, §9).

The public `generate_chunk` serves one session (it asserts a batch of 1); this loop serves
the speakers of a step together and keeps each one's result as its solo run: its condition
(the public `_convert_results_to_tts_input` of its unit), positions from its own
`tts_text_start_pos`, its TTS cache, the public repetition processor over the tokens of its
own chunk (window 16), the eos masked below its own minimum, one draw per row per step (from
its session's generator where it has a seed; the unseeded rows' in one call, decode.py), its
own stop (at t = 0 on eos it gives nothing; otherwise the token
that stopped it, or the last one at the cap, is dropped and never fed). The host reads the
drawn codes only of steps where a row could stop on its eos (none mid-turn, where the
minimum is the cap), and with the device ahead (`--decode-ahead`) some steps later (_Chunk).

Each session's TTS cache lives in a row of a slot cache over the TTS backbone (a LlamaModel:
slots.py's trick works for it as for the LLM) from its first speaking step on, chunk after
chunk (`session.tts_slot`): emptied at a turn's start and end, where the public code drops its
past. The public code keeps it on the duplex object (a DynamicCache in
`tts_past_key_values`, None at a turn's start): where that holds a past (the serial path ran
last) it is loaded into the slot, and the stepper's `unslot` takes the slot's back there
before the serial path runs. (It was loaded and taken back every chunk: at the released
sizes 160 device ops and two 240 MiB clears of a slot a speaker and step.)
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from torch.profiler import record_function

from omnifabric.worker.engines.minicpmo import layouts
from omnifabric.worker.engines.minicpmo.decode import (
    Staged,
    device_ahead,
    generator,
    on_device,
    seeded,
    worker_generator,
)
from omnifabric.worker.engines.minicpmo.graphs import StaticDecode
from omnifabric.worker.engines.minicpmo.rows import Row
from omnifabric.worker.engines.minicpmo.slots import SlotCache, dynamic

if TYPE_CHECKING:
    from omnifabric.worker.engines.minicpmo.engine import MiniCPMOEngine, MiniCPMOSession

#: Tokens per chunk: the public max and (mid-turn) min of generate_chunk.
CHUNK_TOKENS = 25 + 1
#: A TTS slot's tokens (a session's TTS past within one turn: ~47 a second of speech),
#: unless the worker's --tts-slot-tokens or the backbone's config says otherwise.
TTS_TOKENS = 4096


class BatchedTTS:
    """TTS over the speaking rows of a step, then their audio."""

    def __init__(self, engine: MiniCPMOEngine) -> None:
        self.engine = engine
        tts = engine.model.tts
        self.tts = tts
        config = tts.model.config
        weight = tts.emb_text.weight
        wanted = engine.tts_slot_tokens or TTS_TOKENS
        tokens = min(wanted, int(getattr(config, "max_position_embeddings", wanted)))
        static = engine.static_decode
        self.cache = SlotCache(
            config, engine.slots, tokens, device=weight.device, dtype=weight.dtype, scratch=static
        )
        self.static = (
            StaticDecode(
                SimpleNamespace(model=tts.model, config=config, lm_head=None),
                self.cache,
                graphs=engine.cuda_graphs != "off",
                what="the TTS",
            )
            if static
            else None
        )
        """The TTS steps after the first (one token a row) in static shapes, replayed as CUDA
        graphs on CUDA (graphs.StaticDecode; the heads run after it), where the engine's
        decode is static (`--cuda-graphs`)."""
        self.gen_logits = sys.modules[type(tts).__module__].gen_logits
        self._made = _PerTensor()
        """A speaker's eos id and temperature row, made once per source tensor."""

    def run(self, rows: list[Row], phases: dict[str, float]) -> None:
        """TTS tokens, then audio, of every speaking row (row.tts_tokens, row.wave)."""
        t0 = time.perf_counter()
        with torch.no_grad(), record_function("minicpmo.tts"):
            self._generate(rows)
        phases["tts"] += (time.perf_counter() - t0) * 1000.0
        t0 = time.perf_counter()
        with record_function("minicpmo.vocoder"):
            if self.engine.audio_on and self.engine.vocoder_batched:
                from omnifabric.worker.engines.minicpmo import waveform

                flushes = [self._flushes(r) for r in rows]
                with torch.no_grad():
                    waveform.speak(self.engine, rows, flushes, self.engine.batched_vocoder())
            else:
                for row in rows:
                    self._vocoder(row)
        phases["vocoder"] += (time.perf_counter() - t0) * 1000.0

    def _generate(self, rows: list[Row]) -> None:
        mins: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        bases: list[int] = []
        try:
            conds = self._conditions(rows)
            for row in rows:
                mins.append(self._load(row, slots))
                bases.append(self.cache.length(slots[-1]))
                starts.append(int(row.duplex.tts_text_start_pos))
            # The static steps take each row's positions from its slot's length: where a
            # session's position and its cache's length differ, every step runs ragged.
            static = self.static is not None and all(
                start == self.cache.length(slot) for start, slot in zip(starts, slots, strict=True)
            )
            loop = _Chunk(self, rows, conds, mins, slots, starts, static)
            loop.run()
            codes = loop.tokens.tolist()  # one read for every speaker (the vocoder's plan)
            for i, row in enumerate(rows):
                kept = loop.kept[i]
                assert kept is not None
                row.tts_tokens = loop.tokens[i : i + 1, :kept].unsqueeze(-1)  # [1, T, vq]
                row.tts_codes = codes[i][:kept]
                fed = conds[i].shape[0] + kept
                # a row the device fed past its end goes back to what it kept
                self.cache.rewind(slots[i], loop.base[i] + fed)
                self._keep(row, slots[i], fed)
        except BaseException:
            # a chunk that failed leaves each speaker's slot as it was before the chunk
            for slot, length in zip(slots, bases, strict=False):
                if length <= self.cache.length(slot):
                    self.cache.rewind(slot, length)
            raise

    def _draw(
        self,
        logits: torch.Tensor,
        active: list[int],
        t: int,
        gens: list[Any],
        mins: list[int],
        eos: list[int],
        shared: torch.Generator,
    ) -> torch.Tensor:
        """The step's token of each active row [A, vq] from its logits (num_vq rows each,
        in `active`'s order): its eos masked below its minimum, then a seeded session's
        draw from its own generator, the unseeded rows' in one call (decode.py's rule)."""
        vq = self.tts.num_vq
        dev = logits.device
        low = [k for k, i in enumerate(active) if t < mins[i]]
        if low:
            logits = logits.clone()
            rows = on_device([k * vq + q for k in low for q in range(vq)], dev, torch.long)
            cols = on_device([eos[active[k]] for k in low for _ in range(vq)], dev, torch.long)
            logits[rows, cols] = float("-inf")
        picked = torch.empty((len(active), vq), dtype=torch.long, device=logits.device)
        free = [k for k, i in enumerate(active) if gens[i] is None]
        for k, i in enumerate(active):
            if gens[i] is not None:
                probs = torch.softmax(logits[k * vq : (k + 1) * vq], dim=-1)
                picked[k] = torch.multinomial(probs, 1, generator=gens[i])[:, 0]
        if free:
            rows = on_device([k * vq + q for k in free for q in range(vq)], dev, torch.long)
            probs = torch.softmax(logits[rows], dim=-1)
            drawn = torch.multinomial(probs, 1, generator=shared)
            where = on_device(free, dev, torch.long)
            picked[where] = drawn.reshape(len(free), vq)
        return picked

    def _conditions(self, rows: list[Row]) -> list[torch.Tensor]:
        """Each speaker's TTS condition [n + 1, h] (its unit's n spoken tokens, `_spoken`,
        then the audio bos): the public `_convert_results_to_tts_input` of each, for all
        speakers at once (one transfer of the token ids, one lookup, one projection and
        norm; the public method makes two blocking copies and ~12 ops a speaker)."""
        tts = self.tts
        device = tts.emb_text.weight.device
        bos = tts.emb_text(on_device([tts.audio_bos_token_id], device, torch.long))  # [1, h]
        units = [self._spoken(row) for row in rows]
        counts = [len(unit) for unit in units]
        if not sum(counts):
            return [bos for _ in rows]
        ids = on_device([item[0] for unit in units for item in unit], device, torch.long)
        hidden = torch.cat([item[1].squeeze(0) for unit in units for item in unit])
        semantic = F.normalize(tts.projector_semantic(hidden), p=2, dim=-1)
        spoken = (tts.emb_text(ids) + semantic).split(counts)
        return [torch.cat([part, bos]) for part in spoken]

    @staticmethod
    def _spoken(row: Row) -> list[Any]:
        """The entries of the speaker's unit ([token id, hidden, eot]) its TTS speaks: all,
        or where it was offered functions those before a call (calls.CallWatch.spoken, as
        the serial path's condition cuts them)."""
        watch = row.session.watch
        return row.hidden if watch is None else watch.spoken(row.hidden)

    def _load(self, row: Row, slots: list[int]) -> int:
        """A speaker's minimum length for its chunk; its slot appended to `slots`."""
        d = row.duplex
        row.tts_start_zero = d.tts_text_start_pos == 0
        low = 0 if row.end_of_turn or d.tts_text_start_pos == 0 else CHUNK_TOKENS
        if d.tts_current_turn_start_time is None:
            d.tts_current_turn_start_time = d.audio_chunk_idx
        slots.append(self._slot(row))
        return low

    def _slot(self, row: Row) -> int:
        """The speaker's TTS slot, holding its past: claimed at its first speaking step and
        kept (the stepper frees it when the session leaves the batched path or closes); the
        duplex object's past loaded into it where it holds one (the serial path ran last),
        emptied at a turn's start (the public code has no past there)."""
        session, d, cache = row.session, row.duplex, self.cache
        slot = session.tts_slot
        if slot is None:
            slot = session.tts_slot = cache.claim()
        past = d.tts_past_key_values
        if past is not None and past.get_seq_length() > 0:
            cache.put(slot, [k[0] for k in past.key_cache], [v[0] for v in past.value_cache])
        elif past is not None or d.tts_text_start_pos == 0:
            cache.rewind(slot, 0)
        d.tts_past_key_values = None  # the slot holds it from here
        return slot

    def _sampling(self, rows: list[Row], device: Any) -> tuple[list[Any], ...]:
        """Per row: its generator, temperature and eos; the public repetition processors."""
        gens = [generator(r.session, device) if seeded(r.session) else None for r in rows]
        made = self._made
        temps = [made.get(r.duplex.tts_temperature, _temperature_row, device) for r in rows]
        eos = [self._eos(r) for r in rows]
        processors = self.gen_logits(
            num_code=self.tts.config.num_audio_tokens,
            repetition_penalty=rows[0].duplex.tts_repetition_penalty,
        )[1]
        return gens, temps, eos, processors

    def _keep(self, row: Row, slot: int, fed: int) -> None:
        """A speaker's TTS state after its chunk: reset at a turn's end (its slot emptied),
        else its position moved by the `fed` tokens its slot now holds."""
        d = row.duplex
        if row.end_of_turn:
            d.tts_text_start_pos = 0
            d.tts_past_key_values = None
            d.tts_current_turn_start_time = None
            self.cache.rewind(slot, 0)
            return
        d.tts_text_start_pos += fed

    def unslot(self, session: MiniCPMOSession) -> None:
        """The session's TTS past from its slot back onto its duplex object (a DynamicCache;
        None where the slot is empty), the slot freed: the serial path goes on from there.
        Nothing where it holds no slot."""
        slot = session.tts_slot
        if slot is None:
            return
        cache = self.cache
        if cache.length(slot):
            session.handle.duplex.tts_past_key_values = dynamic(*cache.take(slot))
        self.release(session)

    def release(self, session: MiniCPMOSession) -> None:
        """The session's TTS slot freed (it leaves, or the serial path takes over)."""
        if session.tts_slot is not None:
            self.cache.release(session.tts_slot)
            session.tts_slot = None

    def fits(self, session: MiniCPMOSession) -> bool:
        """Whether a TTS slot holds the session's TTS past and the most its next chunk adds
        (its unit's speak tokens at their cap, the audio bos, CHUNK_TOKENS codes). A past
        that does not goes on on the serial path (the public code's own cache has no
        bound) until its turn ends and empties it."""
        slot = session.tts_slot
        if slot is not None:
            length = self.cache.length(slot)
        else:
            past = getattr(session.handle.duplex, "tts_past_key_values", None)
            length = int(past.get_seq_length()) if past is not None else 0
        cap = int(session.sampling()["max_new_speak_tokens_per_chunk"])
        return length + cap + 1 + CHUNK_TOKENS <= self.cache.max_len

    def _eos(self, row: Row) -> int:
        eos = getattr(row.duplex, "tts_eos_token", None)
        if eos is None:
            return int(self.tts.config.num_audio_tokens) - 1
        return self._made.get(eos, _first_int, None)

    def _forward(
        self, slots: list[int], embeds: list[torch.Tensor], positions: list[torch.Tensor]
    ) -> torch.Tensor:
        """One backbone forward over some slots, ragged; the last real hidden per row."""
        cache = self.cache
        step = cache.begin(slots, [e.shape[0] for e in embeds])
        try:
            batch = torch.nn.utils.rnn.pad_sequence(embeds, batch_first=True)
            pos = torch.nn.utils.rnn.pad_sequence(positions, batch_first=True)
            # padding continues each row's positions (never read)
            width = pos.shape[1]
            for k, p in enumerate(positions):
                if p.shape[0] < width:
                    pos[k, p.shape[0] :] = p[-1] + torch.arange(
                        1, width - p.shape[0] + 1, device=pos.device
                    )
            out = self.tts.model(
                inputs_embeds=batch,
                position_ids=pos,
                attention_mask=step.mask,
                past_key_values=cache,
                use_cache=True,
                output_attentions=False,
                return_dict=True,
            )
            hidden = out.last_hidden_state
            last = hidden[torch.arange(len(slots), device=hidden.device), step.last]
        except BaseException:
            cache.abort()
            raise
        cache.commit()
        return last

    @staticmethod
    def _flushes(row: Row) -> bool:
        """Whether the row's waveform step flushes: the unified class always does; the duplex
        class only at a turn's first chunk."""
        return row.session.handle.layout == layouts.UNIFIED or bool(row.tts_start_zero)

    def _vocoder(self, row: Row) -> None:
        """The public waveform step for one speaker, its vocoder state swapped in."""
        session, d = row.session, row.duplex
        with self.engine.using(session):
            wave: Any = d._generate_waveform_from_tokens(
                row.tts_tokens,
                row.args.get("prompt_wav_path"),
                row.end_of_turn,
                force_flush=self._flushes(row),
            )
            if row.end_of_turn:
                d._reset_token2wav_for_new_turn()
        row.wave = wave


class _PerTensor:
    """Values made from tensors that stay the same objects while the worker runs: the duplex
    object's TTS temperature and eos id, set once when it is built and shared by the clones
    of every slot (layouts.clone_duplex), never changed in place. Read from the device a
    speaker and chunk, they cost a blocking transfer each (a sync on a GPU: 64 a step at 64
    speakers); made once per tensor here (a tensor replaced is a new key)."""

    #: Entries kept before the memo starts over (one per distinct tensor: 1 in practice).
    LIMIT = 64

    def __init__(self) -> None:
        self._made: dict[tuple[int, Any], tuple[torch.Tensor, Any]] = {}

    def get(self, tensor: torch.Tensor, make: Any, device: Any) -> Any:
        """`make(tensor, device)`, made on the first call for this tensor object."""
        key = (id(tensor), device)
        hit = self._made.get(key)
        if hit is not None and hit[0] is tensor:
            return hit[1]
        if len(self._made) >= self.LIMIT:
            self._made.clear()
        value = make(tensor, device)
        self._made[key] = (tensor, value)  # the tensor held: its id is not reused meanwhile
        return value


def _temperature_row(temperature: torch.Tensor, device: Any) -> torch.Tensor:
    """A speaker's TTS temperature as the [1, 1] float32 row its logits divide by."""
    return temperature.to(device).reshape(1, 1).float()


def _first_int(tensor: torch.Tensor, _device: Any) -> int:
    return int(tensor.reshape(-1)[0])


@dataclass
class _Read:
    """What the host reads of one TTS step: the step, its rows and their first drawn
    code (staged: copied without waiting for the steps queued after it)."""

    t: int
    rows: list[int]
    first: Staged


class _Chunk:
    """One chunk's token loop over the speakers of a step: up to CHUNK_TOKENS backbone
    forwards, each row's draw, and its stop.

    A row can only stop on its eos from the step its minimum allows (a turn's first chunk or
    its last; mid-turn the minimum is the cap, so a chunk's length is known before it runs);
    the cap stops every row. The host reads a step's drawn codes only where a row could stop
    there, and with the engine's depth (decode.device_ahead) up to that many steps later: the
    device goes on meanwhile, feeding a row that drew its eos its next tokens. What the
    host then learns puts that row back: its slot to the tokens it kept (by the caller), its
    seeded generator to where its last draw left it; the codes drawn past its stop are never
    read. So each row's tokens, cache and generator are its solo run's at any depth."""

    def __init__(
        self,
        tts: BatchedTTS,
        rows: list[Row],
        conds: list[torch.Tensor],
        mins: list[int],
        slots: list[int],
        starts: list[int],
        static: bool,
    ) -> None:
        self.owner = tts
        self.conds, self.mins, self.slots, self.starts = conds, mins, slots, starts
        self.static = static
        n = len(rows)
        self.device = conds[0].device
        self.base = [tts.cache.length(slot) for slot in slots]
        """Each slot's length before the chunk."""
        self.tokens = torch.zeros((n, CHUNK_TOKENS), dtype=torch.long, device=self.device)
        self.kept: list[int | None] = [None] * n
        """Per row, the tokens it keeps, once the host knows."""
        self.gens, self.temps, self.eos, self.processors = tts._sampling(rows, self.device)
        self.shared = worker_generator(tts.engine, self.device)
        self.depth = device_ahead(tts.engine)
        self._rows: tuple[list[int], Any, torch.Tensor] | None = None
        """The last batch's index into `tokens` and its temperatures (made once a batch)."""
        self._pending: deque[_Read] = deque()
        self._undo: dict[tuple[int, int], torch.Tensor] = {}
        """(row, t): a seeded row's generator state before its draw at step t, kept while
        the host may still learn that the row stopped before t."""

    def run(self) -> None:
        # The heads' weight norm computed once for the chunk, not at each of its steps.
        with parametrize.cached():
            self._run()

    def _run(self) -> None:
        batch = list(range(len(self.kept)))  # the rows the host has not seen stop
        last = CHUNK_TOKENS - 1
        for t in range(CHUNK_TOKENS):
            picked = self._step(t, batch)
            if t == last:
                break  # the cap: every row still going keeps `last` tokens, drawn eos or not
            if any(t >= self.mins[i] for i in batch):
                self._pending.append(_Read(t, batch, Staged(picked[:, 0])))
            while len(self._pending) > self.depth:
                self._learn(self._pending.popleft())
            batch = [i for i in batch if self.kept[i] is None]
            if not batch:
                break
        while self._pending:
            self._learn(self._pending.popleft())
        self.kept = [last if k is None else k for k in self.kept]

    def _step(self, t: int, batch: list[int]) -> torch.Tensor:
        """Step t of the rows `batch`: the forward, the heads, the rules and the draw; the
        codes drawn [A, vq] (also written to `tokens`)."""
        owner, tts = self.owner, self.owner.tts
        conds, slots = self.conds, self.slots
        where, temps = self._index(batch)
        if t == 0:
            positions = [
                torch.arange(self.starts[i], self.starts[i] + conds[i].shape[0], device=self.device)
                for i in batch
            ]
            hidden = owner._forward([slots[i] for i in batch], [conds[i] for i in batch], positions)
        else:
            prev = self.tokens[where, t - 1 : t]  # [A, 1]
            step_embeds = tts.emb_code[0](prev)  # [A, 1, h]
            if self.static:
                assert owner.static is not None
                fed, _ = owner.static.feed_stacked([slots[i] for i in batch], step_embeds[:, 0])
                hidden = fed[:, 0]  # [A, h]
            else:
                embeds = [step_embeds[k] for k in range(len(batch))]
                at = [self.starts[i] + conds[i].shape[0] + t - 1 for i in batch]
                at_d = on_device(at, self.device, torch.long)
                positions = [at_d[k : k + 1] for k in range(len(batch))]
                hidden = owner._forward([slots[i] for i in batch], embeds, positions)
        logits = torch.stack(
            [tts.head_code[q](hidden) for q in range(tts.num_vq)], dim=-1
        )  # [A, V, vq]: weight-normed heads, their weights made once a chunk (run)
        logits = logits.float().permute(0, 2, 1).reshape(-1, logits.size(1))
        logits = logits / temps
        if t > 0:
            history = self.tokens[where, :t].reshape(len(batch) * tts.num_vq, -1)
            for processor in self.processors:
                logits = processor(history, logits)
        if self.depth:
            for i in batch:
                gen = self.gens[i]
                if gen is not None and t > self.mins[i]:  # it could have stopped before t
                    self._undo[(i, t)] = gen.get_state()
        picked = owner._draw(logits, batch, t, self.gens, self.mins, self.eos, self.shared)
        self.tokens[where, t] = picked[:, 0]
        return picked

    def _index(self, batch: list[int]) -> tuple[Any, torch.Tensor]:
        """The rows `batch` as an index into `tokens` (all of them: a slice; else a device
        tensor: a list would be copied to the device, and wait for it, at every use) and
        their temperatures, one per code row; made again only when the batch changes."""
        if self._rows is None or self._rows[0] != batch:
            where: Any = (
                slice(None)
                if len(batch) == len(self.kept)
                else on_device(batch, self.device, torch.long)
            )
            vq = self.owner.tts.num_vq
            temps = torch.cat([self.temps[i] for i in batch for _ in range(vq)])
            self._rows = (list(batch), where, temps)
        return self._rows[1], self._rows[2]

    def _learn(self, read: _Read) -> None:
        """The host's reading of step `read.t`: the rows that drew their eos there stop
        (keeping the tokens before it); a seeded one's generator goes back to before the
        draws the device made for it after."""
        first = read.first.values()
        for k, i in enumerate(read.rows):
            if self.kept[i] is not None or read.t < self.mins[i] or first[k] != self.eos[i]:
                continue
            self.kept[i] = read.t
            state = self._undo.get((i, read.t + 1))
            gen = self.gens[i]
            if state is not None and gen is not None:
                gen.set_state(state)
        for key in [key for key in self._undo if key[1] <= read.t + 1]:
            del self._undo[key]
