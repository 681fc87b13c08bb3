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
that stopped it, or the last one at the cap, is dropped and never fed).

Each session's TTS cache stays on its duplex object as the public code keeps it (a
DynamicCache in `tts_past_key_values`, None at a turn's start): for a step it is loaded into
a row of a slot cache over the TTS backbone (a LlamaModel: slots.py's trick works for it as
for the LLM) and taken back afterwards, so the serial path can continue it.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.utils.parametrize as parametrize
from torch.profiler import record_function
from transformers.cache_utils import DynamicCache

from omnifabric.worker.engines.minicpmo import layouts
from omnifabric.worker.engines.minicpmo.decode import (
    generator,
    on_device,
    seeded,
    worker_generator,
)
from omnifabric.worker.engines.minicpmo.graphs import StaticDecode
from omnifabric.worker.engines.minicpmo.rows import Row
from omnifabric.worker.engines.minicpmo.slots import SlotCache

if TYPE_CHECKING:
    from omnifabric.worker.engines.minicpmo.engine import MiniCPMOEngine

#: Tokens per chunk: the public max and (mid-turn) min of generate_chunk.
CHUNK_TOKENS = 25 + 1
#: A session's TTS context within one turn, unless the backbone's config says less.
TTS_TOKENS = 4096


class BatchedTTS:
    """TTS over the speaking rows of a step, then their audio."""

    def __init__(self, engine: MiniCPMOEngine) -> None:
        self.engine = engine
        tts = engine.model.tts
        self.tts = tts
        config = tts.model.config
        weight = tts.emb_text.weight
        tokens = min(TTS_TOKENS, int(getattr(config, "max_position_embeddings", TTS_TOKENS)))
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
        tts = self.tts
        conds: list[torch.Tensor] = []
        mins: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        try:
            for row in rows:
                cond, low = self._load(row, slots)
                conds.append(cond)
                mins.append(low)
                starts.append(int(row.duplex.tts_text_start_pos))
            # The static steps take each row's positions from its slot's length: where a
            # session's position and its cache's length differ, every step runs ragged.
            static = self.static is not None and all(
                start == self.cache.length(slot) for start, slot in zip(starts, slots, strict=True)
            )
            n = len(rows)
            device = conds[0].device
            tokens = torch.zeros((n, CHUNK_TOKENS), dtype=torch.long, device=device)
            ended = [False] * n
            kept = [0] * n
            active = list(range(n))
            gens, temps, eos, processors = self._sampling(rows, device)
            shared = worker_generator(self.engine, device)
            for t in range(CHUNK_TOKENS):
                if t == 0:
                    embeds = conds
                    positions = [
                        torch.arange(starts[i], starts[i] + conds[i].shape[0], device=device)
                        for i in active
                    ]
                    hidden = self._forward([slots[i] for i in active], embeds, positions)
                else:
                    prev = tokens[active, t - 1 : t]  # [A, 1]
                    step_embeds = tts.emb_code[0](prev)  # [A, 1, h]
                    embeds = [step_embeds[k] for k in range(len(active))]
                    if static:
                        assert self.static is not None
                        fed = self.static.feed(
                            [(slots[i], embeds[k]) for k, i in enumerate(active)]
                        )
                        hidden = torch.cat(fed.hidden)
                    else:
                        at = [starts[i] + conds[i].shape[0] + t - 1 for i in active]
                        where = on_device(at, device, torch.long)
                        positions = [where[k : k + 1] for k in range(len(active))]
                        hidden = self._forward([slots[i] for i in active], embeds, positions)
                with parametrize.cached():
                    logits = torch.stack(
                        [tts.head_code[q](hidden) for q in range(tts.num_vq)], dim=-1
                    )  # [A, V, vq]
                logits = logits.float().permute(0, 2, 1).reshape(-1, logits.size(1))
                logits = logits / torch.cat([temps[i] for i in active for _ in range(tts.num_vq)])
                if t > 0:
                    history = tokens[active, :t].reshape(len(active) * tts.num_vq, -1)
                    for processor in processors:
                        logits = processor(history, logits)
                picked = self._draw(logits, active, t, gens, mins, eos, shared)  # [A, vq]
                tokens[active, t] = picked[:, 0]
                host = picked.tolist()
                going = []
                for k, i in enumerate(active):
                    if host[k][0] == eos[i]:
                        ended[i] = True
                        kept[i] = t
                    elif t == CHUNK_TOKENS - 1:
                        kept[i] = t
                    else:
                        going.append(i)
                active = going
                if not active:
                    break
            for i, row in enumerate(rows):
                row.tts_tokens = tokens[i : i + 1, : kept[i]].unsqueeze(-1)  # [1, T, vq]
                self._keep(row, slots[i], conds[i].shape[0] + kept[i])
        finally:
            for slot in slots:
                self.cache.release(slot)

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

    def _load(self, row: Row, slots: list[int]) -> tuple[torch.Tensor, int]:
        """A speaker's TTS condition and minimum length; its TTS cache put into a slot it
        claims (appended to `slots`, which the caller releases)."""
        d = row.duplex
        cond = d._convert_results_to_tts_input(row.hidden)[0]  # [n + 1, h]
        row.tts_start_zero = d.tts_text_start_pos == 0
        low = 0 if row.end_of_turn or d.tts_text_start_pos == 0 else CHUNK_TOKENS
        if d.tts_current_turn_start_time is None:
            d.tts_current_turn_start_time = d.audio_chunk_idx
        slot = self.cache.claim()
        slots.append(slot)
        past = d.tts_past_key_values
        if past is not None and past.get_seq_length() > 0:
            self.cache.put(slot, [k[0] for k in past.key_cache], [v[0] for v in past.value_cache])
        return cond, low

    def _sampling(self, rows: list[Row], device: Any) -> tuple[list[Any], ...]:
        """Per row: its generator, temperature and eos; the public repetition processors."""
        gens = [generator(r.session, device) if seeded(r.session) else None for r in rows]
        temps = [r.duplex.tts_temperature.to(device).reshape(1, 1).float() for r in rows]
        eos = [self._eos(r) for r in rows]
        processors = self.gen_logits(
            num_code=self.tts.config.num_audio_tokens,
            repetition_penalty=rows[0].duplex.tts_repetition_penalty,
        )[1]
        return gens, temps, eos, processors

    def _keep(self, row: Row, slot: int, fed: int) -> None:
        """A speaker's TTS state after its chunk: reset at a turn's end, else its cache taken
        back from `slot` onto its duplex object and its position moved by `fed` tokens."""
        d = row.duplex
        if row.end_of_turn:
            d.tts_text_start_pos = 0
            d.tts_past_key_values = None
            d.tts_current_turn_start_time = None
            return
        keys, values = self.cache.take(slot)
        past = DynamicCache()
        for layer, (key, value) in enumerate(zip(keys, values, strict=True)):
            past.update(key[None], value[None], layer)
        d.tts_past_key_values = past
        d.tts_text_start_pos += fed

    def _eos(self, row: Row) -> int:
        eos = getattr(row.duplex, "tts_eos_token", None)
        if eos is None:
            return int(self.tts.config.num_audio_tokens) - 1
        return int(eos.reshape(-1)[0])

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
