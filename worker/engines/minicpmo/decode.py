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
brought to the host once per step for the whole batch.

Draws: a session with a seed draws from its own generator, one call per row in the public
order, so its tokens equal its solo run and never depend on its batch-mates. The sessions
without one draw together: each rule's op and one multinomial over all their rows, from the
worker's generator (`worker_generator`): the same distribution per row, in a fixed number
of torch ops a forward where a draw per row took ~30 (each a kernel launch on a GPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from omnifabric.worker.engines.minicpmo import layouts
from omnifabric.worker.engines.minicpmo.rows import Row, Steps, unit_end

if TYPE_CHECKING:
    from omnifabric.worker.engines.minicpmo.engine import MiniCPMOEngine, MiniCPMOSession

#: The duplex class's decoder call takes no length penalty: the decoder's default applies.
DECODER_LENGTH_PENALTY = 1.1
#: The unified layout's limit on one unit's text, in characters.
CHAR_LIMIT = 28


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
    public generate keeps, and each row's outcome on the row."""
    plans = {id(r): _Plan(r) for r in rows}
    for row in rows:
        _start(stepper, row)
    active = list(rows)
    j = 0
    while active:
        going = []
        for row in active:
            plan = plans[id(row)]
            d = row.duplex
            if j >= plan.cap:
                continue  # no speak tokens allowed: the unit ends without a terminator
            if j == plan.cap - 1:
                row.terminator = d.chunk_eos_token_id
                d.total_ids.append(d.chunk_eos_token_id)
                continue
            going.append(row)
        if not going:
            break
        decided = _decide(stepper.engine, [r for r in going if not r.force], plans, j)
        fed: list[tuple[Row, int]] = []
        for row in going:
            d = row.duplex
            tid = d.listen_token_id if row.force else decided.pop(0)
            if not row.force and tid == d.listen_token_id and not d.current_turn_ended:
                tid = d.tts_bos_token_id
            keep = _host(row, tid, j, plans[id(row)].unified)
            if keep:
                fed.append((row, tid))
        if not fed:
            break
        embeds = _embed(fed)
        res = stepper.decode_feed([(_slot(r), embeds[k]) for k, (r, _) in enumerate(fed)])
        for k, (row, tid) in enumerate(fed):
            d = row.duplex
            row.logits = res.logits[k : k + 1]
            eot = tid in d.turn_terminator_token_ids
            row.end_of_turn = eot
            if eot:
                d.current_turn_ended = True
            if j != 0:
                row.hidden.append([tid, res.hidden[k][None], eot])
                row.ids.append(tid)
        active = [r for r, _ in fed]
        j += 1
    for row in rows:
        _finish(stepper, row, plans[id(row)])


def on_device(values: list[Any], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A short host list as a tensor on `device`, copied without waiting for the work the
    device has queued (a plain copy to a GPU syncs the host with it first: once per row
    and rule, that kept the GPU idle between its kernels)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


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


def _decide(engine: MiniCPMOEngine, rows: list[Row], plans: dict[int, _Plan], j: int) -> list[int]:
    """One token per row by the public decoder's rules; one host sync for the batch. The
    logit rules run as a few indexed ops over all rows (_adjust); a seeded row draws from
    its session's generator, the unseeded rows draw together (the module's docstring)."""
    if not rows:
        return []
    logits = torch.cat([r.logits for r in rows if r.logits is not None])
    raw_max = logits.argmax(-1)
    pre: list[torch.Tensor] = []
    saved: list[Any] = []
    gens: list[torch.Generator | None] = []
    free: list[int] = []
    for k, row in enumerate(rows):
        plan = plans[id(row)]
        if plan.greedy or not seeded(row.session):
            pre.append(raw_max[k])
            gens.append(None)
            if not plan.greedy:
                free.append(k)
        else:
            g = generator(row.session, logits.device)
            probs = torch.softmax(logits[k], dim=-1)
            pre.append(torch.multinomial(probs, 1, generator=g)[0])
            gens.append(g)
        saved.append(gens[-1].get_state() if gens[-1] is not None else None)
    first = torch.stack(pre).long()
    shared = worker_generator(engine, logits.device) if free else None
    where = on_device(free, logits.device, torch.long) if free else None
    if where is not None:
        probs = torch.softmax(logits[where].float(), dim=-1)
        first[where] = torch.multinomial(probs, 1, generator=shared)[:, 0]
    masked = _adjust(logits, rows, plans)
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
    host = torch.stack([first, final.long(), ranks.long()]).tolist()
    out = []
    for k, row in enumerate(rows):
        plan = plans[id(row)]
        dec = row.duplex.decoder
        first_id, chosen, rank = host[0][k], host[1][k], host[2][k]
        gen = gens[k]
        if first_id == dec.chunk_eos_id:
            if gen is not None:
                gen.set_state(saved[k])  # the public code never drew the second time
            out.append(first_id)
            continue
        if plan.listen_top_k is not None and rank < plan.listen_top_k:
            if gen is not None:
                gen.set_state(saved[k])
            word = dec.tokenizer.decode([dec.listen_id])
            dec.context += " " if word == "<|listen|>" else word
            out.append(dec.listen_id)
            continue
        if chosen not in dec.special_token_ids:
            dec.generated_tokens.append(chosen)
        else:
            dec.generated_special_tokens.append(chosen)
        out.append(chosen)
    return out


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


def _adjust(logits: torch.Tensor, rows: list[Row], plans: dict[int, _Plan]) -> torch.Tensor:
    """The rows' logits after the public decoder's rules, in its order: forbidden ids to
    -inf, the sign-blind repetition penalty over the recent history, the length penalty on
    `<|turn_eos|>`, listen_prob_scale on the listen id."""
    vocab = logits.shape[-1]
    forbidden, penalty, length, listen = _Entries(), _Entries(), _Entries(), _Entries()
    for k, row in enumerate(rows):
        plan = plans[id(row)]
        dec = row.duplex.decoder
        if dec.forbidden_token_ids:
            forbidden.add(0.0, k, [t for t in dec.forbidden_token_ids if t < vocab])
        history = dec.generated_tokens
        if plan.penalty != 1.0 and history:
            recent = [t for t in set(history[-plan.window :]) if t < vocab]
            if recent:
                penalty.add(plan.penalty, k, recent)
        if plan.length_penalty != 1.0:
            length.add(plan.length_penalty, k, [dec.turn_eos_id])
        if plan.listen_prob_scale != 1.0:
            listen.add(plan.listen_prob_scale, k, [dec.listen_id])
    masked = logits.clone()
    dev = logits.device
    for _, where in forbidden.indexed(dev):
        masked[where] = float("-inf")
    for p, where in penalty.indexed(dev):
        masked[where] = masked[where] / p if p > 1.0 else masked[where] * (1.0 / p)
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
