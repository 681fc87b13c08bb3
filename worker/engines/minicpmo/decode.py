"""The batched step's decode loop: every row still speaking gets one token per LLM forward,
each by the public decoder's rules for its own session (design doc §4, §5, §11).

Per row, in the public order: the chunk_eos pre-check on the raw logits (argmax, or a draw
without temperature), forbidden ids, the sign-blind repetition penalty over the decoder's
history, the length penalty on `<|turn_eos|>`, listen_prob_scale and listen_top_k on the
decoder's listen id (`<|im_end|>`, the tokenizer's eos: a quirk of the public code kept as
it is), then argmax or temperature / top-k (ties kept) / top-p / one draw. What the public
code appends to the decoder's history and what it leaves out is the same here. The host
rules (a listen inside an open turn becomes `<|tts_bos|>`, terminators, the forced
`<|chunk_eos|>` at the cap, the unified layout's 28-character limit, `<|speak|>` not
counted, end of turn from the last step, the first token fed but not kept) run on ids
brought to the host once per forward for the whole batch: before the next forward
(_run_in_step), or behind the device, which decides and feeds each row's token itself and
runs up to `ahead` forwards beyond the host's reading (_run_ahead: a row the host finds
ended is taken back to its length and left out of the forwards queued next).

Draws: a session with a seed draws from its own generator, one call per row in the public
order, so its tokens equal its solo run and never depend on its batch-mates. The sessions
without one draw together: each rule's op and one multinomial over all their rows, from the
worker's generator (`worker_generator`): the same distribution per row, in a fixed number
of torch ops a forward where a draw per row took ~30 (each a kernel launch on a GPU).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from omnifabric.worker.engines.minicpmo import layouts
from omnifabric.worker.engines.minicpmo.rows import Row, Steps, unit_end
from omnifabric.worker.engines.minicpmo.slots import to_device

if TYPE_CHECKING:
    from omnifabric.worker.engines.minicpmo.engine import MiniCPMOEngine, MiniCPMOSession

#: The duplex class's decoder call takes no length penalty: the decoder's default applies.
DECODER_LENGTH_PENALTY = 1.1
#: The unified layout's limit on one unit's text, in characters.
CHAR_LIMIT = 28
#: Decode forwards the device runs beyond the host's reading of their tokens on CUDA by
#: default (the engine's decode_ahead; 0, the host between forwards, elsewhere). One hides
#: the host's rules for a forward behind the next wherever they take less time than a
#: forward; each one more costs up to a forward per step past the last row's end.
CUDA_AHEAD = 1


def generator(session: MiniCPMOSession, device: torch.device) -> torch.Generator:
    """A seeded session's own sampling generator, seeded from its settings' seed (the
    sessions without one draw from `worker_generator`)."""
    seed = session.settings.seed
    if seed is None:
        raise ValueError("only a session with a seed draws from a generator of its own")
    g = session.generator
    if g is None or g.device != device:
        g = torch.Generator(device=device)
        g.manual_seed(int(seed))
        session.generator = g
    return g


def draws_to_serial(session: MiniCPMOSession) -> None:
    """A seeded session leaving the batched path: the global RNG of its generator's device,
    which the serial path (the public code) draws from, goes on from where the generator's
    draws left it. Call it inside `engine.using(session)` (the global RNG is then the
    session's own, state.py)."""
    g = session.generator
    if g is None:
        return
    if g.device.type == "cuda":
        torch.cuda.set_rng_state(g.get_state(), g.device)
    else:
        torch.set_rng_state(g.get_state())


def draws_from_serial(session: MiniCPMOSession, device: torch.device) -> None:
    """A seeded session entering the batched path: its generator on `device` goes on from
    its global RNG's state there (what prepare's seed and its serial draws left), so its
    draws are the ones it would make alone whichever path a unit takes. Inside
    `engine.using(session)`."""
    if not seeded(session):
        return
    g = generator(session, device)
    if device.type == "cuda":
        g.set_state(torch.cuda.get_rng_state(device))
    else:
        g.set_state(torch.get_rng_state())


def seeded(session: MiniCPMOSession) -> bool:
    """Whether the session's draws follow from its own seed (its own generator)."""
    return session.settings.seed is not None


def worker_generator(engine: MiniCPMOEngine, device: torch.device) -> torch.Generator:
    """The worker's generator on `device` (seeded at random once), for the draws of the
    sessions without a seed."""
    g = engine.draws.get(str(device))
    if g is None:
        g = torch.Generator(device=device)
        g.seed()
        engine.draws[str(device)] = g
    return g


class _Plan:
    """A row's decode settings for its unit."""

    def __init__(self, row: Row) -> None:
        args = row.args
        self.unified = row.session.handle.layout == layouts.UNIFIED
        self.cap = int(args["max_new_speak_tokens_per_chunk"])
        self.greedy = args["decode_mode"] == "greedy"
        self.temperature = float(args["temperature"])
        self.top_k = args["top_k"]
        self.top_p = args["top_p"]
        self.listen_prob_scale = float(args["listen_prob_scale"])
        self.listen_top_k = args["listen_top_k"]
        self.penalty = float(args["text_repetition_penalty"])
        self.window = int(args["text_repetition_window_size"])
        self.length_penalty = (
            float(args["length_penalty"]) if self.unified else DECODER_LENGTH_PENALTY
        )


def run(stepper: Steps, rows: list[Row]) -> None:
    """Decode one unit of every row: all LLM forwards of the loop, the bookkeeping the
    public generate keeps, and each row's outcome on the row. The host reads each forward's
    tokens before the next (_run_in_step); with the device allowed ahead, only the unit's
    first decision, where most units end (a listener's unit is its first token), and the
    device runs the rest up to `ahead` forwards beyond the host's reading (_run_ahead). The
    rows' outcomes are the same."""
    plans = {id(r): _Plan(r) for r in rows}
    for row in rows:
        _start(stepper, row)
    depth = ahead(stepper.engine, rows, plans)
    active, j = _run_in_step(stepper, rows, plans, 1 if depth > 0 else None)
    if active:
        _run_ahead(stepper, active, plans, depth, j)
    for row in rows:
        _finish(stepper, row, plans[id(row)])


def _run_in_step(
    stepper: Steps, rows: list[Row], plans: dict[int, _Plan], forwards: int | None
) -> tuple[list[Row], int]:
    """The loop with the host between forwards: each forward's tokens are read, the host
    rules run, and only the rows still speaking are fed; for `forwards` forwards at most
    (None: to the unit's end). The rows still speaking after them, and the next step."""
    active = [r for r in rows if not _capped(r, plans[id(r)], 0)]
    j = 0
    while active and (forwards is None or j < forwards):
        decided = _decide(stepper.engine, [r for r in active if not r.force], plans, j)
        fed: list[tuple[Row, int]] = []
        for row in active:
            d = row.duplex
            tid = d.listen_token_id if row.force else decided.pop(0)
            tid = _substituted(row, tid)
            if _host(row, tid, j, plans[id(row)].unified):
                fed.append((row, tid))
        if not fed:
            return [], j
        embeds = _embed(fed)
        res = stepper.decode_feed([(_slot(r), embeds[k]) for k, (r, _) in enumerate(fed)])
        for k, (row, tid) in enumerate(fed):
            row.logits = res.logits[k : k + 1]
            _fed(row, tid, res.hidden[k], j)
        j += 1
        active = [r for r, _ in fed if not _capped(r, plans[id(r)], j)]
    return active, j


def ahead(engine: MiniCPMOEngine, rows: list[Row], plans: dict[int, _Plan]) -> int:
    """How many forwards the device may run beyond the host's reading of their tokens in
    this step: the engine's setting (decode_ahead), or 0 where a row needs the host between
    its forwards: a seeded sampling row with listen_top_k (whether its generator goes back
    decides its next draw), a forced row whose listen would not end its unit at the first
    token, or rows whose decoders differ in the ids the device's rules use."""
    depth = device_ahead(engine)
    free = [r for r in rows if not r.force]
    if depth <= 0 or not free:
        return 0
    for row in rows:
        d = row.duplex
        if row.force and d.listen_token_id not in d.chunk_terminator_token_ids:
            return 0
        plan = plans[id(row)]
        if not plan.greedy and seeded(row.session) and plan.listen_top_k is not None:
            return 0
    ids = _Ids.of(free[0])
    if ids.model is None or any(_Ids.of(r) != ids for r in free[1:]):
        return 0
    return depth


def device_ahead(engine: MiniCPMOEngine) -> int:
    """The engine's depth for token loops that run on the device ahead of the host's
    reading (the decode's, the TTS's): its decode_ahead, by default CUDA_AHEAD on CUDA and 0
    (the host between forwards) elsewhere."""
    depth = engine.decode_ahead
    if depth is None:
        depth = CUDA_AHEAD if str(engine.device).startswith("cuda") else 0
    return depth


@dataclass(frozen=True)
class _Ids:
    """What the device's rules read of a row's decoder: the same for every row of an
    engine (one model, one tokenizer)."""

    model: Any
    chunk_eos: int
    decided_listen: int
    listen: int
    tts_bos: int
    turn_ends: tuple[int, ...]
    specials: frozenset[int]

    @classmethod
    def of(cls, row: Row) -> _Ids:
        d = row.duplex
        dec = d.decoder
        return cls(
            model=getattr(dec, "m", None),
            chunk_eos=int(dec.chunk_eos_id),
            decided_listen=int(dec.listen_id),
            listen=int(d.listen_token_id),
            tts_bos=int(d.tts_bos_token_id),
            turn_ends=tuple(int(t) for t in d.turn_terminator_token_ids),
            specials=frozenset(int(t) for t in dec.special_token_ids),
        )


@dataclass
class _Forward:
    """A forward the device ran ahead of the host: its rows, what the host will read
    (staged), the rows' hidden states, and the seeded rows' generator states."""

    j: int
    rows: list[Row]
    read: Staged
    hidden: list[torch.Tensor]
    draw: _Draw


class Staged:
    """A small device tensor copied to the host without waiting: on CUDA into pinned
    memory behind an event, so reading it waits for its own forward, not the ones queued
    after it."""

    def __init__(self, values: torch.Tensor) -> None:
        self.event: Any = None
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = values

    def values(self) -> list[list[int]]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class _Device:
    """The rows' state the device keeps between forwards when it runs ahead of the host:
    their logits, recent history, whether their turn ended, listen_top_k; in the order of
    `rows` (the rows of the last forward)."""

    def __init__(self, rows: list[Row], plans: dict[int, _Plan], cap: int) -> None:
        logits = torch.cat([r.logits for r in rows if r.logits is not None])
        dev = logits.device
        self.rows = rows
        self.ids = _Ids.of(rows[0])
        self.logits = logits
        self.history = _History(rows, plans, logits.shape[-1], dev, cap)
        self.ended = on_device([bool(r.duplex.current_turn_ended) for r in rows], dev, torch.bool)
        tops = [plans[id(r)].listen_top_k for r in rows]
        self.listen_top_k = on_device([t if t is not None else 0 for t in tops], dev, torch.long)
        self.specials = on_device(sorted(self.ids.specials), dev, torch.long)
        self.turn_ends = on_device(list(self.ids.turn_ends), dev, torch.long)

    def select(self, rows: list[Row]) -> None:
        """Narrows the state to `rows` (a subsequence of the last forward's rows)."""
        if len(rows) == len(self.rows):
            return
        where = {id(r): k for k, r in enumerate(self.rows)}
        index = on_device([where[id(r)] for r in rows], self.logits.device, torch.long)
        self.logits = self.logits[index]
        self.history.select(index)
        self.ended = self.ended[index]
        self.listen_top_k = self.listen_top_k[index]
        self.rows = rows

    def tokens(self, draw: _Draw) -> torch.Tensor:
        """The ids the rows feed, as the host will decide them (_pick, _substituted), and
        the state after them: the history the public code appends to, the turn's end."""
        ids = self.ids
        eos = draw.first == ids.chunk_eos
        listens = draw.ranks < self.listen_top_k
        decided = torch.where(
            eos, draw.first, torch.where(listens, ids.decided_listen, draw.final.long())
        )
        kept = ~eos & ~listens & ~torch.isin(draw.final.long(), self.specials)
        self.history.push(draw.final.long(), kept)
        opened = (decided == ids.listen) & ~self.ended
        tokens = torch.where(opened, ids.tts_bos, decided)
        self.ended = torch.isin(tokens, self.turn_ends)
        return tokens


def _run_ahead(
    stepper: Steps, rows: list[Row], plans: dict[int, _Plan], depth: int, j: int
) -> None:
    """The loop from step j with the device up to `depth` forwards beyond the host: each
    forward's tokens are decided and fed on the device (_Device.tokens), read by the host
    later (Staged) and run through the host rules in order. A row the host finds ended at
    a forward was fed on for up to `depth` more: its slot goes back to the length the rules
    give it, its seeded generator to where its draws stopped. The rows' outcomes, slots and
    generators equal _run_in_step's."""
    cache = stepper.cache
    lengths = {id(r): cache.length(_slot(r)) for r in rows}
    cap = max(plans[id(r)].cap for r in rows)
    state = _Device(rows, plans, cap)
    pending: deque[_Forward] = deque()
    ended: set[int] = set()
    try:
        while True:
            going = [r for r in rows if id(r) not in ended and j < plans[id(r)].cap - 1]
            full = any(cache.length(_slot(r)) >= cache.max_len for r in going)
            if going and not (full and pending):
                pending.append(_forward(stepper, state, going, plans, j))
                j += 1
            if not pending:
                break
            if len(pending) > depth or not going or full:
                _replay(pending.popleft(), pending, plans, lengths, ended)
    finally:
        for row in rows:
            cache.rewind(_slot(row), lengths[id(row)])


def _forward(
    stepper: Steps, state: _Device, rows: list[Row], plans: dict[int, _Plan], j: int
) -> _Forward:
    """Decides, stages and feeds the rows' tokens of step j, all on the device."""
    state.select(rows)
    draw = _draw(stepper.engine, rows, plans, state.logits, state.history)
    tokens = state.tokens(draw)
    read = Staged(torch.cat([draw.stacked(), tokens[None]]))
    embeds = state.ids.model.model.embed_tokens(tokens)
    res = stepper.decode_feed([(_slot(r), embeds[k : k + 1]) for k, r in enumerate(rows)])
    state.logits = res.logits
    return _Forward(j, rows, read, res.hidden, draw)


def _replay(
    forward: _Forward,
    later: deque[_Forward],
    plans: dict[int, _Plan],
    lengths: dict[int, int],
    ended: set[int],
) -> None:
    """The host's part of a forward the device ran ahead: each row's decision and host
    rules in order, as _run_in_step runs them; the rows ending here join `ended`."""
    host = forward.read.values()
    draw, j = forward.draw, forward.j
    for k, row in enumerate(forward.rows):
        if id(row) in ended:
            continue  # it ended at an earlier forward: what the device did after is void
        plan = plans[id(row)]
        gen = draw.gens[k]
        tid = _substituted(
            row, _pick(row, plan, host[0][k], host[1][k], host[2][k], gen, draw.middle[k])
        )
        if tid != host[3][k]:
            raise RuntimeError(
                f"step {j}: the device fed token {host[3][k]} where the host rules decide {tid}"
            )
        if _host(row, tid, j, plan.unified):
            lengths[id(row)] += 1
            _fed(row, tid, forward.hidden[k], j)
            if not _capped(row, plan, j + 1):
                continue
        ended.add(id(row))
        if gen is not None and host[0][k] != row.duplex.decoder.chunk_eos_id:
            _draws_undone(row, gen, later)


def _draws_undone(row: Row, gen: torch.Generator, later: deque[_Forward]) -> None:
    """A seeded row that ended: its generator back to where its first later forward began
    drawing (the draws the public code never made)."""
    for forward in later:
        for k, other in enumerate(forward.rows):
            if other is row:
                gen.set_state(forward.draw.start[k])
                return


def _capped(row: Row, plan: _Plan, j: int) -> bool:
    """Whether the row's unit ends at step j by its cap on speak tokens (at the cap, with no
    terminator; one before it, with a forced `<|chunk_eos|>`)."""
    if j >= plan.cap:
        return True
    if j == plan.cap - 1:
        d = row.duplex
        row.terminator = d.chunk_eos_token_id
        d.total_ids.append(d.chunk_eos_token_id)
        return True
    return False


def _substituted(row: Row, tid: int) -> int:
    """A listen decided inside an open turn becomes `<|tts_bos|>` (forced listens stay)."""
    d = row.duplex
    if not row.force and tid == d.listen_token_id and not d.current_turn_ended:
        return int(d.tts_bos_token_id)
    return tid


def _fed(row: Row, tid: int, hidden: torch.Tensor, j: int) -> None:
    """The row's bookkeeping once its token of step j is fed: end of turn, and from the
    second step on the token and its hidden state (what the TTS is conditioned on)."""
    d = row.duplex
    eot = tid in d.turn_terminator_token_ids
    row.end_of_turn = eot
    if eot:
        d.current_turn_ended = True
    if j != 0:
        row.hidden.append([tid, hidden[None], eot])
        row.ids.append(tid)


def on_device(values: list[Any], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A short host list as a tensor on `device`, copied without waiting for the work the
    device has queued (slots.to_device; a plain copy to a GPU syncs the host with it first:
    once per row and rule, that kept the GPU idle between its kernels)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def _embed(fed: list[tuple[Row, int]]) -> list[torch.Tensor]:
    """Each fed row's token embedding [1, hidden]: one lookup for all rows where they share
    the model (always, in one engine); the public decoder's `embed_tokens` is that lookup."""
    first = fed[0][0].duplex.decoder
    model = getattr(first, "m", None)
    if model is None or any(r.duplex.decoder.m is not model for r, _ in fed):
        return [r.duplex.decoder.embed_tokens([tid]) for r, tid in fed]
    ids = on_device([tid for _, tid in fed], model.device, torch.long)
    table = model.model.embed_tokens(ids)
    return [table[k : k + 1] for k in range(len(fed))]


def _slot(row: Row) -> int:
    slot = row.session.kv_slot
    if slot is None:
        raise RuntimeError("a batched row without a KV slot")
    return slot


def _start(stepper: Steps, row: Row) -> None:
    """The public generate's opening: the counters and a forced listen closing a turn."""
    session, d = row.session, row.duplex
    session.units += 1
    d._streaming_generate_count += 1
    if row.close_turn:
        d.total_ids.append(d.turn_eos_token_id)
        d.current_turn_ended = True
        if getattr(d, "token2wav_initialized", False):
            with stepper.engine.using(session):
                d._reset_token2wav_for_new_turn()


def _host(row: Row, tid: int, j: int, char_limit: bool) -> bool:
    """The host rules for the row's token at step j; True when it is fed."""
    d = row.duplex
    d.total_ids.append(tid)
    if tid == d.tts_pad_id:
        row.had_tts_pad = True
    row.is_listen = tid == d.listen_token_id
    if tid in d.chunk_terminator_token_ids:
        row.terminator = tid
        return False
    d.current_turn_ended = False
    if char_limit and j != 0:
        text = d.tokenizer.decode([*row.ids, tid], skip_special_tokens=True)
        if len(text) >= CHAR_LIMIT:
            d.total_ids.pop()
            row.terminator = d.chunk_eos_token_id
            d.total_ids.append(d.chunk_eos_token_id)
            return False
    if tid not in d.chunk_speak_token_ids:
        d.res_ids.append(tid)
        d.speak_count += 1
    return True


def _finish(stepper: Steps, row: Row, plan: _Plan) -> None:
    """The public generate's closing bookkeeping (pending finalize, or the duplex class's
    `</unit>` and unit end, its KV tokens deferred to the next prefill)."""
    d = row.duplex
    tokenizer = d.tokenizer
    text = tokenizer.decode(row.ids, skip_special_tokens=True) if row.ids else ""
    row.text = text
    input_type = d.current_mode.lower() if d.current_mode else "audio"
    if plan.unified:
        d._last_chunk_had_tts_pad = row.had_tts_pad
        d._pending_finalize = {
            "terminator_id": row.terminator,
            "total_ids_in_unit": row.ids,
            "is_listen": row.is_listen,
            "generated_text": text,
            "input_type": input_type,
        }
    else:
        close_id = tokenizer.convert_tokens_to_ids("</unit>")
        d.total_ids.append(close_id)
        deferred = ([row.terminator] if row.terminator is not None else []) + [close_id]
        stepper.defer(row, deferred)
        length = stepper.cache.length(_slot(row)) + len(deferred)
        unit_end(
            d.decoder,
            {
                "input_type": input_type,
                "total_ids_in_unit": row.ids,
                "is_listen": row.is_listen,
                "generated_text": text,
            },
            length,
        )
    d.total_hidden.append([] if row.is_listen else row.hidden)


@dataclass
class _Draw:
    """One forward's decisions on the device, [rows] each: the pre-check's token, the token
    after the rules, the listen id's rank; and the seeded rows' generators with their states
    before the forward's draws (start) and after the pre-check's (middle)."""

    first: torch.Tensor
    final: torch.Tensor
    ranks: torch.Tensor
    gens: list[torch.Generator | None]
    start: list[Any]
    middle: list[Any]

    def stacked(self) -> torch.Tensor:
        """[3, rows]: what the host reads of the forward."""
        return torch.stack([self.first, self.final.long(), self.ranks.long()])


def _decide(engine: MiniCPMOEngine, rows: list[Row], plans: dict[int, _Plan], j: int) -> list[int]:
    """One token per row by the public decoder's rules; one host read for the batch."""
    if not rows:
        return []
    logits = torch.cat([r.logits for r in rows if r.logits is not None])
    history = _History(rows, plans, logits.shape[-1], logits.device, 0)
    draw = _draw(engine, rows, plans, logits, history)
    host = draw.stacked().tolist()
    return [
        _pick(r, plans[id(r)], host[0][k], host[1][k], host[2][k], draw.gens[k], draw.middle[k])
        for k, r in enumerate(rows)
    ]


def _draw(
    engine: MiniCPMOEngine,
    rows: list[Row],
    plans: dict[int, _Plan],
    logits: torch.Tensor,
    history: _History,
) -> _Draw:
    """The device's part of a forward's decisions: the logit rules run as a few indexed ops
    over all rows (_adjust); a seeded row draws from its session's generator, the unseeded
    rows draw together (the module's docstring). Nothing waits for the device."""
    raw_max = logits.argmax(-1)
    pre: list[torch.Tensor] = []
    start: list[Any] = []
    middle: list[Any] = []
    gens: list[torch.Generator | None] = []
    free: list[int] = []
    for k, row in enumerate(rows):
        plan = plans[id(row)]
        if plan.greedy or not seeded(row.session):
            pre.append(raw_max[k])
            gens.append(None)
            start.append(None)
            if not plan.greedy:
                free.append(k)
        else:
            g = generator(row.session, logits.device)
            start.append(g.get_state())
            probs = torch.softmax(logits[k], dim=-1)
            pre.append(torch.multinomial(probs, 1, generator=g)[0])
            gens.append(g)
        middle.append(gens[-1].get_state() if gens[-1] is not None else None)
    first = torch.stack(pre).long()
    shared = worker_generator(engine, logits.device) if free else None
    where = on_device(free, logits.device, torch.long) if free else None
    if where is not None:
        probs = torch.softmax(logits[where].float(), dim=-1)
        first[where] = torch.multinomial(probs, 1, generator=shared)[:, 0]
    masked = _adjust(logits, rows, plans, history)
    final = masked.argmax(-1)
    drawn = [k for k, gen in enumerate(gens) if gen is not None]
    if drawn or where is not None:
        final = final.clone()
    for k in drawn:
        plan = plans[id(rows[k])]
        scaled = masked[k : k + 1] / plan.temperature
        scaled = _top_k_top_p(scaled, plan.top_k, plan.top_p)
        probs = torch.softmax(scaled, dim=-1)
        final[k] = torch.multinomial(probs, 1, generator=gens[k])[0, 0]
    if where is not None:
        kept = [plans[id(rows[k])] for k in free]
        temps = on_device([p.temperature for p in kept], masked.device, torch.float32)
        scaled = masked[where].float() / temps[:, None]
        scaled = top_k_top_p_rows(scaled, [p.top_k for p in kept], [p.top_p for p in kept])
        probs = torch.softmax(scaled, dim=-1)
        final[where] = torch.multinomial(probs, 1, generator=shared)[:, 0]
    listen = on_device([r.duplex.decoder.listen_id for r in rows], logits.device, torch.long)
    at_listen = masked.gather(1, listen[:, None])
    ranks = (masked > at_listen).sum(-1)
    return _Draw(first, final, ranks, gens, start, middle)


def _pick(
    row: Row, plan: _Plan, first_id: int, chosen: int, rank: int, gen: Any, middle: Any
) -> int:
    """The host's part of a row's decision from what the device drew: the pre-check's
    `<|chunk_eos|>`, listen_top_k, or the token after the rules, with the decoder's history
    kept as the public code keeps it. A seeded row's generator goes back to where the public
    code stopped drawing."""
    dec = row.duplex.decoder
    if first_id == dec.chunk_eos_id:
        if gen is not None:
            gen.set_state(middle)  # the public code never drew the second time
        return first_id
    if plan.listen_top_k is not None and rank < plan.listen_top_k:
        if gen is not None:
            gen.set_state(middle)
        word = dec.tokenizer.decode([dec.listen_id])
        dec.context += " " if word == "<|listen|>" else word
        return int(dec.listen_id)
    if chosen not in dec.special_token_ids:
        dec.generated_tokens.append(chosen)
    else:
        dec.generated_special_tokens.append(chosen)
    return chosen


class _History:
    """Each row's recent generated tokens on the device, for the repetition penalty: what
    the public code reads as `set(history[-window:])` of the decoder's generated_tokens,
    kept as [rows, width] ids (oldest first; the vocabulary size where nothing is), so the
    device can add a forward's tokens itself (push) when it runs ahead of the host. `more`
    is how many tokens may be pushed (a window of 0 or less keeps the whole history)."""

    def __init__(
        self,
        rows: list[Row],
        plans: dict[int, _Plan],
        vocab: int,
        device: torch.device,
        more: int,
    ) -> None:
        self.vocab = vocab
        tails: list[list[int]] = []
        windows: list[int] = []
        for row in rows:
            plan = plans[id(row)]
            history = row.duplex.decoder.generated_tokens
            tail = history[-plan.window :] if plan.penalty != 1.0 and history else []
            tails.append([t if 0 <= t < vocab else vocab for t in tail])
            windows.append(plan.window if plan.window > 0 else len(tail) + more)
        # wide enough for each row's window or for all it holds and may be given
        width = max([1, *(min(w, len(t) + more) for w, t in zip(windows, tails, strict=True))])
        self.ids = on_device([[vocab] * (width - len(t)) + t for t in tails], device, torch.long)
        # a row's window is its last places: an id pushed out of them is out of its window
        spans = on_device(windows, device, torch.long)
        self.inside = torch.arange(width, device=device)[None, :] >= (width - spans)[:, None]

    def entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, width] ids to penalize, each row's places outside its window (or empty)
        filled with its newest id (the same id, given the same value: the duplicates
        write what the set would), and [rows] whether a row has any id at all."""
        inside = self.inside & (self.ids < self.vocab)
        places = torch.arange(self.ids.shape[1], device=self.ids.device)
        newest = torch.where(inside, places, -1).max(dim=1).values
        some = newest >= 0
        fill = self.ids.gather(1, newest.clamp(min=0)[:, None])
        fill = torch.where(some[:, None], fill, 0)
        return torch.where(inside, self.ids, fill), some

    def push(self, tokens: torch.Tensor, where: torch.Tensor) -> None:
        """Adds each row's token where `where` [rows] holds (the rows whose token the
        public code appends to generated_tokens)."""
        moved = torch.cat([self.ids[:, 1:], tokens[:, None]], dim=1)
        self.ids = torch.where(where[:, None], moved, self.ids)

    def select(self, index: torch.Tensor) -> None:
        """Keeps the rows at `index` (the rows of the next forward), in that order."""
        self.ids = self.ids[index]
        self.inside = self.inside[index]


class _Entries:
    """(row, id) entries of the logits grouped by one value (a penalty, a scale): the rows
    sharing a value are changed by one indexed op, with that value as a Python number as
    the public code uses it (so the arithmetic is the same, division included)."""

    def __init__(self) -> None:
        self.groups: dict[float, tuple[list[int], list[int]]] = {}

    def add(self, value: float, row: int, ids: list[int]) -> None:
        rows, cols = self.groups.setdefault(value, ([], []))
        rows.extend([row] * len(ids))
        cols.extend(ids)

    def indexed(
        self, device: torch.device
    ) -> list[tuple[float, tuple[torch.Tensor, torch.Tensor]]]:
        out = []
        for value, (rows, cols) in self.groups.items():
            both = on_device([rows, cols], device, torch.long)
            out.append((value, (both[0], both[1])))
        return out


def _adjust(
    logits: torch.Tensor, rows: list[Row], plans: dict[int, _Plan], history: _History
) -> torch.Tensor:
    """The rows' logits after the public decoder's rules, in its order: forbidden ids to
    -inf, the sign-blind repetition penalty over the recent history, the length penalty on
    `<|turn_eos|>`, listen_prob_scale on the listen id."""
    vocab = logits.shape[-1]
    forbidden, length, listen = _Entries(), _Entries(), _Entries()
    penalties: dict[float, list[int]] = {}
    for k, row in enumerate(rows):
        plan = plans[id(row)]
        dec = row.duplex.decoder
        if dec.forbidden_token_ids:
            forbidden.add(0.0, k, [t for t in dec.forbidden_token_ids if t < vocab])
        if plan.penalty != 1.0:
            penalties.setdefault(plan.penalty, []).append(k)
        if plan.length_penalty != 1.0:
            length.add(plan.length_penalty, k, [dec.turn_eos_id])
        if plan.listen_prob_scale != 1.0:
            listen.add(plan.listen_prob_scale, k, [dec.listen_id])
    masked = logits.clone()
    dev = logits.device
    for _, where in forbidden.indexed(dev):
        masked[where] = float("-inf")
    if penalties:
        ids, some = history.entries()
        for p, group in penalties.items():
            index = on_device(group, dev, torch.long)
            where = (index[:, None], ids[index])
            x = masked[where]
            hit = x / p if p > 1.0 else x * (1.0 / p)
            # a row without history writes its fill column's own value back
            masked[where] = torch.where(some[index][:, None], hit, x)
    for lp, where in length.indexed(dev):
        x = masked[where]
        masked[where] = torch.where(x > 0, x / lp, x * lp)
    for scale, where in listen.indexed(dev):
        masked[where] = masked[where] * scale
    return masked


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k (every logit equal to the k-th kept) then top-p (drop where the probability
    mass before a token already passes p; the first always kept), on one row [1, V]."""
    if top_k > 0:
        k = min(int(top_k), logits.size(-1))
        threshold = torch.topk(logits, k)[0][..., -1, None]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if top_p > 0.0:
        ordered, order = torch.sort(logits, descending=True)
        mass = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = mass > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        # the same ids as indexing with order[drop], without a host sync
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def top_k_top_p_rows(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """_top_k_top_p over rows [N, V] with each row's own k and p, in a few ops for all of
    them: the same tokens kept in each row as _top_k_top_p on that row alone (k <= 0 or
    p <= 0 turns its rule off for the row)."""
    vocab = logits.size(-1)
    dev = logits.device
    each = [min(int(k), vocab) if k > 0 else vocab for k in top_k]
    if min(each) < vocab:
        # the k-th value of each row from the top max(k) values (sorted by topk)
        ks = on_device(each, dev, torch.long)
        highest = torch.topk(logits, max(each), dim=-1)[0]
        threshold = highest.gather(1, (ks - 1)[:, None])
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if max(float(p) for p in top_p) <= 0.0:
        return logits
    ps = on_device([float(p) for p in top_p], dev, logits.dtype)[:, None]
    ordered, order = torch.sort(logits, dim=-1, descending=True)
    mass = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    drop = mass > ps
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    drop &= ps > 0.0
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
