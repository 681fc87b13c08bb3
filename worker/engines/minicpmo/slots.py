"""The LLM's KV cache as slots: one row per session, fed together in one forward per step.

A batched step (issue 38) runs the rows of several sessions through the stock LLM forward at
once, each row with its own past. SlotCache keeps every layer's keys and values in one
preallocated tensor, [slots, kv heads, max length, head dim], with a length per slot; a
session claims a slot when it joins and releases it when it leaves, and neither touches the
other rows. feed runs one forward over some of the slots, each with its own number of new
tokens: the batch is right-padded, every row gets positions from its own length onward, and a
4D mask hides the padded keys and keeps attention causal within the new tokens. The model's
code is used as it is: what makes it batched is the Cache subclass it writes through
(`update` puts each row at its own length and hands back the rows' keys and values
right-padded to the longest), the positions and the mask.

Written for the Qwen3 decoder of transformers 4.51 (MiniCPM-o 4.5's LLM), which passes a 4D
float mask through unchanged and asks the cache nothing but `update` and `get_seq_length`.
Checked against each row run alone on a DynamicCache in tests/worker/minicpmo/test_slots.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor (indices, positions) on `device` without the host waiting for the
    work queued there: a plain copy to a GPU synchronizes with its stream first (the host
    then idles until the device drains, and the device while the host issues what follows);
    this one goes through pinned memory, asynchronously. On a CPU, the tensor itself."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class NoFreeSlot(RuntimeError):
    """Every slot of the cache is claimed."""


@dataclass(frozen=True)
class SlotStep:
    """What one forward over some of the slots needs: made by SlotCache.begin from the slots'
    lengths, used by the model's forward (positions, mask) and by SlotCache.update (the
    write and read indices). Rows are in the order the caller gave them."""

    #: The slot of each row.
    slots: tuple[int, ...]
    #: New tokens of each row (at least 1).
    counts: tuple[int, ...]
    #: Each slot's length before the step: where its new tokens go.
    starts: tuple[int, ...]
    #: [rows, new tokens of the longest row], long: each row's positions from its length on
    #: (padding continues them; its outputs are never used).
    positions: torch.Tensor
    #: [rows, 1, new tokens, width] in the cache's dtype: 0 where a query may look, the
    #: dtype's minimum elsewhere.
    mask: torch.Tensor
    #: [rows], long: the index of each row's last real token in the padded batch.
    last: torch.Tensor
    #: Keys each row can see after the step, padded to the longest: max(start + count).
    width: int
    #: One entry per real new token (all rows together): its batch row, its index among the
    #: row's new tokens, its slot, its position in the slot.
    write_rows: torch.Tensor
    write_tokens: torch.Tensor
    write_slots: torch.Tensor
    write_positions: torch.Tensor
    #: The slots to read back, as a slice when they are consecutive and ascending (a view, no
    #: copy), else as an index tensor (a gather of `width` positions per row).
    read: slice | torch.Tensor
    #: A static decode's [2, rows] inputs, of which write_slots and read (row 0),
    #: write_positions and positions (row 1) are views: filled with one copy.
    packed: torch.Tensor | None = None
    #: A static decode's key indices [width] (arange), made once with its shape.
    keys: torch.Tensor | None = None


class SlotCache(Cache):
    """The KV cache of `slots` sessions of one LLM, up to `max_len` tokens each, preallocated
    on `device` in `dtype` (the LLM's). Shapes come from the LLM's config: num_hidden_layers,
    num_key_value_heads and head_dim (hidden_size // num_attention_heads where the config has
    no head_dim).

    Not thread-safe: the engine drives it from one thread. A slot's keys and values past its
    `length` are never seen (the mask hides them); release still zeroes the slot, so that a
    new occupant never multiplies a masked weight of 0 with a previous occupant's value (a
    NaN or inf there would poison its row).
    """

    def __init__(
        self,
        config: Any,
        slots: int,
        max_len: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        scratch: bool = False,
    ) -> None:
        super().__init__()
        if slots < 1 or max_len < 1:
            raise ValueError(
                f"a slot cache needs slots >= 1 and max_len >= 1 (got {slots}, {max_len})"
            )
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        # The scratch row (after the slots, never claimed) is where the padding rows of a
        # static-shape decode write and read (begin_decode).
        self.scratch = slots if scratch else None
        shape = (slots + int(scratch), config.num_key_value_heads, max_len, head_dim)
        layers = config.num_hidden_layers
        self.slots = slots
        self.max_len = max_len
        self.device = torch.device(device)
        self.dtype = dtype
        self.key_slots = [
            torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(layers)
        ]
        self.value_slots = [
            torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(layers)
        ]
        self._lengths = [0] * slots
        self._claimed = [False] * slots
        self._step: SlotStep | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the keys and values take (all layers, all slots), for the start-up log."""
        return sum(t.nbytes for t in (*self.key_slots, *self.value_slots))

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot's row takes (the scratch row is one more of them)."""
        return self.nbytes // (self.slots + (self.scratch is not None))

    def describe(self, what: str) -> str:
        """The start-up log's words for this cache, e.g. `LLM KV slot cache of 16 slots x
        5120 tokens (720 MiB a slot, and a scratch row): 11.95 GiB`."""
        scratch = ", and a scratch row" if self.scratch is not None else ""
        return (
            f"{what} KV slot cache of {self.slots} slots x {self.max_len} tokens "
            f"({self.slot_bytes / 2**20:.0f} MiB a slot{scratch}): {self.nbytes / 2**30:.2f} GiB"
        )

    def claim(self) -> int:
        """A free slot (the lowest), now claimed; its length is 0. Raises NoFreeSlot when all
        `slots` are taken."""
        for slot, taken in enumerate(self._claimed):
            if not taken:
                self._claimed[slot] = True
                self._lengths[slot] = 0
                return slot
        raise NoFreeSlot(f"all {self.slots} slots of the KV cache are taken")

    def release(self, slot: int) -> None:
        """Frees `slot`: its length goes back to 0 and its keys and values to zero. No other
        slot is touched."""
        self._check_claimed(slot)
        if self._step is not None:
            raise RuntimeError("a slot cannot be released during a step")
        for layer in (*self.key_slots, *self.value_slots):
            layer[slot].zero_()
        self._lengths[slot] = 0
        self._claimed[slot] = False

    def length(self, slot: int) -> int:
        """Tokens `slot` holds."""
        self._check_claimed(slot)
        return self._lengths[slot]

    def rewind(self, slot: int, length: int) -> None:
        """Takes `slot` back to its first `length` tokens (a decode that ran ahead of its
        rules fed tokens they end before): what lies past them is masked out and
        overwritten later, like an aborted step's writes."""
        self._check_claimed(slot)
        if self._step is not None:
            raise RuntimeError("a slot cannot be rewound during a step")
        if not 0 <= length <= self._lengths[slot]:
            raise ValueError(
                f"slot {slot} holds {self._lengths[slot]} tokens: it cannot go back to {length}"
            )
        self._lengths[slot] = length

    def put(self, slot: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Loads a past into claimed `slot` (its length becomes the past's): per layer the
        keys and values of one row, [kv heads, tokens, head dim] (a DynamicCache's row 0).
        What the slot held before is dropped."""
        self._check_claimed(slot)
        if self._step is not None:
            raise RuntimeError("a slot cannot be loaded during a step")
        if len(keys) != len(self.key_slots) or len(values) != len(self.value_slots):
            raise ValueError(f"a past of {len(keys)} layers for a cache of {len(self.key_slots)}")
        length = int(keys[0].shape[-2]) if len(keys) else 0
        if length > self.max_len:
            raise ValueError(f"a past of {length} tokens passes max_len {self.max_len}")
        pairs = (
            *zip(self.key_slots, keys, strict=True),
            *zip(self.value_slots, values, strict=True),
        )
        for store, new in pairs:
            store[slot].zero_()
            store[slot, :, :length] = new
        self._lengths[slot] = length

    def take(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of `slot`'s keys and values per layer, [kv heads, length, head dim] (the
        inverse of put); the slot is left as it is."""
        length = self.length(slot)
        return (
            [store[slot, :, :length].clone() for store in self.key_slots],
            [store[slot, :, :length].clone() for store in self.value_slots],
        )

    def claimed(self) -> list[int]:
        """The slots taken, ascending."""
        return [slot for slot, taken in enumerate(self._claimed) if taken]

    def _check_claimed(self, slot: int) -> None:
        if not 0 <= slot < self.slots or not self._claimed[slot]:
            raise ValueError(f"slot {slot} is not claimed (the cache has {self.slots} slots)")

    def begin(self, slots: Sequence[int], counts: Sequence[int]) -> SlotStep:
        """Opens a step that adds counts[i] tokens to slots[i]: checks it (distinct claimed
        slots, at least one token each, nothing past max_len) before anything is written, and
        builds its positions, mask and indices. Ends with commit (the forward went through)
        or abort."""
        starts = self._checked(slots, counts)
        rows, longest = len(slots), max(counts)
        width = max(s + c for s, c in zip(starts, counts, strict=True))
        # Small index tensors are built on the host, then moved in one copy (to_device).
        counts_h = torch.tensor(counts)
        starts_h = torch.tensor(starts)
        slots_h = torch.tensor(slots)
        row_of = torch.repeat_interleave(torch.arange(rows), counts_h)
        first = torch.cumsum(counts_h, 0) - counts_h
        total = int(sum(counts))
        token_of = torch.arange(total) - first[row_of]
        dev = self.device
        parts = (starts_h, counts_h, slots_h, row_of, token_of, slots_h[row_of])
        packed = to_device(torch.cat([*parts, starts_h[row_of] + token_of]), dev)
        start_d, count_d, slots_d, row_d, token_d, write_slots, write_positions = packed.split(
            [rows] * 3 + [total] * 4
        )
        query = torch.arange(longest, device=dev)
        positions = start_d[:, None] + query[None, :]
        # A query sees keys up to its own position; a padding query sees what its row's last
        # real token sees, so that no query row is fully masked (that gives NaN).
        limit = start_d[:, None] + torch.minimum(query[None, :], count_d[:, None] - 1) + 1
        visible = torch.arange(width, device=dev)[None, None, :] < limit[:, :, None]
        mask = torch.zeros((rows, 1, longest, width), device=dev, dtype=self.dtype)
        mask.masked_fill_(~visible[:, None], torch.finfo(self.dtype).min)
        consecutive = list(slots) == list(range(slots[0], slots[0] + rows))
        step = SlotStep(
            slots=tuple(slots),
            counts=tuple(counts),
            starts=tuple(starts),
            positions=positions,
            mask=mask,
            last=count_d - 1,
            width=width,
            write_rows=row_d,
            write_tokens=token_d,
            write_slots=write_slots,
            write_positions=write_positions,
            read=slice(slots[0], slots[0] + rows) if consecutive else slots_d,
        )
        self._step = step
        return step

    def _checked(self, slots: Sequence[int], counts: Sequence[int]) -> list[int]:
        """What begin checks before anything is written; the slots' lengths."""
        if self._step is not None:
            raise RuntimeError("a step is already open on this slot cache")
        if not slots or len(slots) != len(counts):
            raise ValueError("a step needs one token count per slot, and at least one slot")
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in one step: {list(slots)}")
        for slot, count in zip(slots, counts, strict=True):
            self._check_claimed(slot)
            if count < 1:
                raise ValueError(f"slot {slot}: a row feeds at least one token (got {count})")
            if self._lengths[slot] + count > self.max_len:
                raise ValueError(
                    f"slot {slot} holds {self._lengths[slot]} tokens: {count} more would pass "
                    f"max_len {self.max_len}"
                )
        return [self._lengths[slot] for slot in slots]

    def begin_decode(self, slots: Sequence[int], reuse: SlotStep) -> SlotStep:
        """Opens a step that adds one token to each of `slots` in the static shape of `reuse`
        (a step from decode_shape: its tensors are filled in place, so a CUDA graph captured
        over them replays this step): rows past len(slots) are padding on the scratch row at
        position 0, and every row reads `reuse.width` keys. Checked like begin; the width
        must hold every row's new token. Without slots, every row is padding (what a graph
        captured ahead of use runs: graphs.StaticDecode.capture_all). Ends with commit or
        abort."""
        if self.scratch is None:
            raise RuntimeError("a static-shape decode needs a slot cache made with scratch=True")
        rows = int(reuse.positions.shape[0])
        if not 0 <= len(slots) <= rows:
            raise ValueError(f"a decode of {len(slots)} rows in a shape of {rows}")
        if slots:
            starts = self._checked(slots, [1] * len(slots))
        elif self._step is not None:
            raise RuntimeError("a step is already open on this slot cache")
        else:
            starts = []
        if slots and max(starts) + 1 > reuse.width:
            raise ValueError(
                f"slot {slots[starts.index(max(starts))]} holds {max(starts)} tokens: a "
                f"decode shape {reuse.width} wide cannot take its next"
            )
        pad = rows - len(slots)
        host = torch.tensor([[*slots, *[self.scratch] * pad], [*starts, *[0] * pad]])
        assert reuse.packed is not None and reuse.keys is not None
        reuse.packed.copy_(to_device(host, self.device))  # slots, positions and reads at once
        visible = reuse.keys[None, :] <= reuse.write_positions[:, None]
        reuse.mask.copy_(torch.where(visible, 0.0, torch.finfo(self.dtype).min)[:, None, None, :])
        opened = dataclasses.replace(
            reuse, slots=tuple(slots), counts=(1,) * len(slots), starts=tuple(starts)
        )
        self._step = opened
        return opened

    def decode_shape(self, rows: int, width: int) -> SlotStep:
        """The tensors of a static-shape decode of `rows` rows over `width` keys (see
        begin_decode), allocated once; nothing is opened."""
        if self.scratch is None:
            raise RuntimeError("a static-shape decode needs a slot cache made with scratch=True")
        if not 0 < width <= self.max_len:
            raise ValueError(f"a decode width of {width} for slots of {self.max_len} tokens")
        dev = self.device
        zeros = torch.zeros(rows, dtype=torch.long, device=dev)
        packed = torch.zeros((2, rows), dtype=torch.long, device=dev)
        return SlotStep(
            slots=(),
            counts=(),
            starts=(),
            positions=packed[1].unsqueeze(1),
            mask=torch.zeros((rows, 1, 1, width), dtype=self.dtype, device=dev),
            last=zeros,
            width=width,
            write_rows=torch.arange(rows, device=dev),
            write_tokens=zeros,
            write_slots=packed[0],
            write_positions=packed[1],
            read=packed[0],
            packed=packed,
            keys=torch.arange(width, device=dev),
        )

    def commit(self) -> None:
        """Closes the open step: each of its slots now holds its new tokens."""
        step = self._open_step()
        for slot, count in zip(step.slots, step.counts, strict=True):
            self._lengths[slot] += count
        self._step = None

    def abort(self) -> None:
        """Closes the open step without counting its tokens (the forward failed); what it
        may have written past the slots' lengths is masked out and overwritten later."""
        self._step = None

    def _open_step(self) -> SlotStep:
        if self._step is None:
            raise RuntimeError("no step is open on this slot cache: feed rows through slots.feed")
        return self._step

    # The transformers Cache interface, as the Qwen3 forward uses it.

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the step's new keys and values ([rows, kv heads, new tokens, head dim], right-
        padded) of layer `layer_idx` into the slots at their lengths, padding left out, and
        returns every row's keys and values so far, [rows, kv heads, width, head dim]."""
        step = self._open_step()
        out = []
        for store, new in (
            (self.key_slots[layer_idx], key_states),
            (self.value_slots[layer_idx], value_states),
        ):
            store[step.write_slots, :, step.write_positions] = new[
                step.write_rows, :, step.write_tokens
            ]
            seen = store[:, :, : step.width]
            out.append(
                seen[step.read] if isinstance(step.read, slice) else seen.index_select(0, step.read)
            )
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """The longest past among the step's rows (among the claimed slots between steps).
        The forward asks it only to make default positions and a default mask, and feed
        passes both."""
        if self._step is not None:
            return max(self._step.starts, default=0)  # no rows: a capture over padding
        return max((self._lengths[s] for s in self.claimed()), default=0)

    def get_max_cache_shape(self) -> int | None:
        """Tokens one slot can hold."""
        return self.max_len


def dynamic(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> DynamicCache:
    """A DynamicCache of one row from per-layer [kv heads, tokens, head dim] tensors (what
    `SlotCache.take` gives): a slot's past as the public code keeps it."""
    past = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        past.update(k[None], v[None], layer)
    return past


@dataclass(frozen=True)
class FeedResult:
    """What a feed gives back per row, in the order of the rows given."""

    #: [rows, vocab]: the logits of each row's last real token.
    logits: torch.Tensor
    #: Per row [its new tokens, hidden]: the final layer's hidden states (after the final
    #: norm), what the TTS is conditioned on.
    hidden: list[torch.Tensor]


#: A row's embeddings for feed: one [tokens, hidden] tensor, or pieces of it in order.
Embeds = torch.Tensor | Sequence[torch.Tensor]


def feed(llm: Any, cache: SlotCache, rows: Sequence[tuple[int, Embeds]]) -> FeedResult:
    """Feeds each row's embeddings ([tokens, hidden], at least one token, lengths may differ;
    or the pieces that make them, joined in the batch) to the LLM after its slot's past, all
    rows in one forward, and adds them to the slots.

    `llm` is the causal LM (Qwen3ForCausalLM): its decoder (`llm.model`) runs the padded batch
    and its head (`llm.lm_head`) only the last real position of each row, which is what a
    single-row feed reads too, at a fraction of the full head's cost. The slots' lengths move
    only when the forward went through.
    """
    if not rows:
        raise ValueError("feed needs at least one row")
    pieces = [[e] if isinstance(e, torch.Tensor) else list(e) for _, e in rows]
    for (slot, _), parts in zip(rows, pieces, strict=True):
        if not parts or any(e.dim() != 2 for e in parts) or sum(e.shape[0] for e in parts) < 1:
            shapes = [tuple(e.shape) for e in parts]
            raise ValueError(f"slot {slot}: embeddings are [tokens >= 1, hidden], got {shapes}")
    counts = [sum(e.shape[0] for e in parts) for parts in pieces]
    step = cache.begin([slot for slot, _ in rows], counts)
    try:
        with torch.no_grad():
            batch = _padded(pieces, counts)
            out = llm.model(
                inputs_embeds=batch,
                position_ids=step.positions,
                attention_mask=step.mask,
                past_key_values=cache,
                use_cache=True,
                return_dict=True,
            )
            hidden = out.last_hidden_state
            last = hidden[torch.arange(len(rows), device=hidden.device), step.last]
            logits = llm.lm_head(last)
    except BaseException:
        cache.abort()
        raise
    cache.commit()
    return FeedResult(
        logits=logits, hidden=[hidden[row, :count] for row, count in enumerate(step.counts)]
    )


def _padded(pieces: list[list[torch.Tensor]], counts: list[int]) -> torch.Tensor:
    """[rows, the longest, hidden]: each row's pieces one after another, zeros after its end
    (pad_sequence's batch), put in with one call for every piece of every row (on CUDA a
    few kernels where the pieces are dense blocks, not one a piece)."""
    first = pieces[0][0]
    batch = first.new_zeros(len(pieces), max(counts), first.shape[1])
    dst, src = [], []
    for row, parts in enumerate(pieces):
        at = 0
        for part in parts:
            n = part.shape[0]
            if n:
                dst.append(batch[row, at : at + n])
                src.append(part)
            at += n
    torch._foreach_copy_(dst, src)
    return batch
