"""The streaming audio encoder of MiniCPM-o 4.5 over several sessions in one call.

Each duplex unit turns the session's new mel frames into ten audio embeddings: the Whisper
encoder (`model.apm`) runs over the chunk with the session's own self-attention cache (its
keys and values of every earlier unit since the last reset), then the projector and a
five-frame average pool. The public code does this for one session at a time
(`get_audio_embedding_streaming`: batch size 1, one past length, the cache on the model).
`encode_streaming` does it for N sessions at once, each row with its own mel chunk, its own
cache and so its own past length: sessions at their first unit (102 mel frames, no prefix
frame to cut) beside sessions at later units (104 frames, one encoder frame cut each side),
sessions just past the cache reset beside sessions about to reach it.

What is batched: conv1/conv2 over the rows whose mel chunks have the same length; every
encoder layer's projections, attention and MLP over all rows (right-padded to the longest new
chunk); the final layer norm, the projector and the pooling. What stays per row: the cache
reset rule, the cut of the extra context frames, the positional rows (`embed_pos` from the
row's past length on), appending the row's new keys and values to its own cache, and the
number of embeddings it keeps. The encoder layers are the model's own modules, called as the
model calls them; what makes them ragged is the cache object they write through (its `update`
appends each row's real new keys and values to that row's cache and hands back every row's
past plus new keys and values, right-padded to the widest) and a 4D mask that hides the
padded keys. A padded query row sees all its row's real keys (never a fully masked row); its
output is dropped.

Guarantee, per row, against the public call for that session alone (fp32, eval mode): the
same embeddings up to float rounding of the batched matmuls, and the session's cache left as
the public call leaves it: the same `DynamicCache` object, grown by the same keys and values
(a new one where the session had none, or where the reset rule dropped it). So a session can
go on through either path. Rules reproduced: the reset when the past plus the chunk's encoder
frames (before the cut) reaches the positional table's length (1500); the cut of
ceil(prefix/2) and ceil(suffix/2) encoder frames (the suffix only while frames remain); the
positional rows past..past+n, the last row repeated past the table's end; the states of
`model.audio_encoder_layer` (the final layer norm's output for -1); the kept count from the
chunk's feature length (`_get_feat_extract_output_lengths`).

Not reproduced (the duplex path never uses them): `cnn_min_length` padding, `return_debug`,
dropout/layer drop (raises in training mode), a cache given as an `EncoderDecoderCache`
(the public code keeps the self-attention `DynamicCache` that the encoder hands back; a
legacy tuple cache is converted as the encoder converts it).

Use (one unit of the sessions of a batched step): per session, its mel chunk comes from its
own streaming mel processor (`process_audio_streaming` with the session's state on the model,
as `state.SharedState` swaps it), its prefix from the duplex capability's `audio_chunk_idx`
(0 at the first unit), its cache from where the session's `audio_past_key_values` is: the
model's attribute while the session is resident, else `session.shared[":audio_past_key_values"]`.
Each `AudioOut.cache` goes back to the same place; advancing `audio_chunk_idx` and consuming
the session's audio buffer stay the caller's, as in the public unit.

Checked against the public per-session call, unit by unit, for 1 to 8 sessions joining at
different units, across the reset, for every layout the public code offers, in
tests/worker/minicpmo/test_audio_batch.py (opt-in: OMNI_MINICPMO_CODE_DIR).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache

from omnifabric.worker.engines.minicpmo.slots import to_device


@dataclass
class AudioRow:
    """One session's unit, as the public call gets it."""

    #: [1, mel bins, frames]: the mel chunk the session's streaming mel processor emitted
    #: (`process_audio_streaming(...).audio_features`).
    features: torch.Tensor
    #: The session's encoder cache: what the model keeps in `audio_past_key_values` for it
    #: (a DynamicCache after its first unit, None before; a legacy tuple is accepted).
    cache: Any
    #: Mel frames of extra context before the chunk's core: 0 at the session's first unit
    #: (`audio_chunk_idx == 0`), 2 after (the duplex capability's rule).
    prefix_extra_frames: int
    #: Mel frames of extra context after the core (2 in the duplex path).
    suffix_extra_frames: int = 2
    #: The chunk's feature length (`audio_feature_lens`); None: its frame count.
    feature_len: int | None = None
    #: Whether the chunk carries extra context frames to cut after the convolutions
    #: (True in the duplex path).
    use_extra_context: bool = True


@dataclass
class AudioOut:
    """One row's result."""

    #: [n, hidden]: the session's audio embeddings of the unit (10 per duplex unit): what the
    #: public call returns, concatenated.
    embeds: torch.Tensor
    #: The session's cache after the unit: put it back where the session keeps
    #: `audio_past_key_values`. The row's own cache object, grown, or a new one (first unit,
    #: reset).
    cache: DynamicCache
    #: Whether the reset rule dropped the row's cache before this unit.
    reset: bool = False


@dataclass
class _Plan:
    """Per-row numbers of one call."""

    caches: list[DynamicCache] = field(default_factory=list)
    pasts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    resets: list[bool] = field(default_factory=list)


#: A session's encoder keys and values grow in a buffer of its own by this many frames at a
#: time (2.6 s of audio; ~12 MiB at the released sizes in bfloat16).
STORE_STEP = 128
#: The attribute of a session's DynamicCache that holds its buffer (`_Store`).
STORE = "_omnifabric_audio_store"


@dataclass
class _Store:
    """A session's encoder keys and values: `buffer` [layers, 2, capacity, heads, head dim]
    (keys, then values; frame-major, so that a span of frames is one dense block), of which
    its DynamicCache's tensors are views ([1, heads, frames, head dim]: `keys`, `values`
    per layer as they were handed to it; a tensor the public path put there instead is
    not one of them)."""

    buffer: torch.Tensor
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def holds(self, cache: DynamicCache, need: int) -> bool:
        """Whether `cache`'s tensors are still this buffer's views and `need` frames fit."""
        return (
            self.buffer.shape[2] >= need
            and len(cache.key_cache) == len(self.keys) == self.buffer.shape[0]
            and all(map(operator.is_, cache.key_cache, self.keys))
            and all(map(operator.is_, cache.value_cache, self.values))
        )

    def seen(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values up to `end` as the DynamicCache holds them (views)."""
        k, v = self.buffer[layer, 0, :end], self.buffer[layer, 1, :end]
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]


class _RaggedSelfAttention(Cache):
    """The self-attention cache the encoder layers write through during one call: `update`
    appends each row's real new keys and values to the row's own DynamicCache (its tensors
    grown as DynamicCache.update grows them, so the row's cache ends as the public call
    leaves it) and returns every row's whole keys and values, right-padded with zeros to
    the widest.

    A row's keys and values live in a buffer of its session's (`_Store`, grown by
    STORE_STEP frames) whose views its DynamicCache holds, so a layer's update is two
    copies for all rows (torch._foreach_copy_ over dense blocks of equal strides: the new
    frames into each buffer, each buffer's frames into the padded batch; on CUDA a few
    kernels, not one a row), not a concatenation and two copies a row and layer (101 host
    ops a row and unit with the released encoder's 24 layers). A cache whose tensors are not
    its buffer's views (new, or grown by the public path since) gets a new buffer, its past
    copied in once. The padded batch is frame-major too; the layers get it as views in
    their [rows, heads, frames, head dim] order."""

    def __init__(self, plan: _Plan, width: int, layers: int, limit: int) -> None:
        super().__init__()
        self.caches = plan.caches
        self.pasts = plan.pasts
        self.counts = plan.counts
        self.width = width
        self.layers = layers
        self.limit = limit
        """The most frames a row holds (the positional table's length: the reset rule)."""
        self.stores: list[_Store] = []
        self.padded: torch.Tensor | None = None

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, heads, _, head_dim = key_states.shape
        if self.padded is None:
            # one zeroed batch for every layer: each layer writes the same real frames of it
            self.padded = key_states.new_zeros(2, rows, self.width, heads, head_dim)
            self.stores = [self._store(r, key_states) for r in range(rows)]
        # [rows, 2, frames, heads, head dim]: each row's new frames one dense block
        new = torch.stack((key_states, value_states), dim=1).transpose(2, 3).contiguous()
        spans = [
            (store.buffer[layer_idx], past, past + n)
            for store, past, n in zip(self.stores, self.pasts, self.counts, strict=True)
        ]
        torch._foreach_copy_(
            [b[kv, start:end] for b, start, end in spans for kv in (0, 1)],
            [new[r, kv, :n] for r, n in enumerate(self.counts) for kv in (0, 1)],
        )
        torch._foreach_copy_(
            [self.padded[kv, r, :end] for r, (_, _, end) in enumerate(spans) for kv in (0, 1)],
            [b[kv, :end] for b, _, end in spans for kv in (0, 1)],
        )
        rows_now = zip(self.caches, self.stores, spans, self.counts, strict=True)
        for cache, store, (_, _, end), n in rows_now:
            keys, values = store.seen(layer_idx, end)
            if layer_idx == 0:
                cache._seen_tokens += n
            if len(cache.key_cache) <= layer_idx:
                cache.key_cache.append(keys)
                cache.value_cache.append(values)
            else:
                cache.key_cache[layer_idx], cache.value_cache[layer_idx] = keys, values
            store.keys[layer_idx : layer_idx + 1] = [keys]
            store.values[layer_idx : layer_idx + 1] = [values]
        return self.padded[0].transpose(1, 2), self.padded[1].transpose(1, 2)

    def _store(self, r: int, like: torch.Tensor) -> _Store:
        """Row r's buffer: its session's where the cache still holds its views and the
        unit fits, else a new one (the past copied in: one call)."""
        cache, past = self.caches[r], self.pasts[r]
        need = past + self.counts[r]
        store = getattr(cache, STORE, None)
        if store is not None and store.holds(cache, need):
            return store
        layers = self.layers
        capacity = max(need, min(self.limit, -(-(need + STORE_STEP) // STORE_STEP) * STORE_STEP))
        _, heads, _, head_dim = like.shape
        buffer = like.new_empty(layers, 2, capacity, heads, head_dim)
        if past:
            if len(cache.key_cache) != layers:
                raise ValueError(f"an audio cache of {len(cache.key_cache)} layers, not {layers}")
            torch._foreach_copy_(
                [buffer[layer, kv, :past] for layer in range(layers) for kv in (0, 1)],
                [
                    held[layer][0].transpose(0, 1)
                    for layer in range(layers)
                    for held in (cache.key_cache, cache.value_cache)
                ],
            )
        store = _Store(buffer, list(cache.key_cache), list(cache.value_cache))
        setattr(cache, STORE, store)
        return store

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.width


class _LayerCache:
    """What an encoder layer's attention asks of the cache it is given (an encoder-decoder
    cache in the public path): its self-attention part and the cross-attention flags."""

    def __init__(self, self_attention_cache: _RaggedSelfAttention) -> None:
        self.self_attention_cache = self_attention_cache
        self.is_updated: dict[int, bool] = {}


def _as_dynamic(cache: Any) -> DynamicCache | None:
    if cache is None or isinstance(cache, DynamicCache):
        return cache
    if isinstance(cache, (list, tuple)):
        return DynamicCache.from_legacy_cache(tuple(cache))
    raise TypeError(
        f"an audio cache must be a DynamicCache, a legacy tuple or None, not {type(cache).__name__}"
    )


def _cut(prefix: int, suffix: int, use_extra_context: bool) -> tuple[int, int]:
    """Encoder frames cut before and after the core: conv2 halves the frames, rounding up."""
    if not use_extra_context:
        return 0, 0
    return (prefix + 1) // 2 if prefix > 0 else 0, (suffix + 1) // 2 if suffix > 0 else 0


def _convolve(apm: Any, rows: Sequence[AudioRow]) -> list[torch.Tensor]:
    """Each row's encoder frames [n, d] after conv1/conv2 and the cut of the context frames;
    rows with mel chunks of one shape go through the convolutions together."""
    weight = apm.conv1.weight
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, row in enumerate(rows):
        if row.features.dim() != 3 or row.features.shape[0] != 1:
            raise ValueError(
                f"row {i}: features must be [1, mel bins, frames], got {tuple(row.features.shape)}"
            )
        groups.setdefault(tuple(row.features.shape), []).append(i)
    out: list[torch.Tensor] = [weight.new_empty(0)] * len(rows)
    for members in groups.values():
        mel = torch.cat([rows[i].features for i in members]).to(
            dtype=weight.dtype, device=weight.device
        )
        frames = nn.functional.gelu(apm.conv2(nn.functional.gelu(apm.conv1(mel))))
        for j, i in enumerate(members):
            x = frames[j]
            before, after = _cut(
                rows[i].prefix_extra_frames, rows[i].suffix_extra_frames, rows[i].use_extra_context
            )
            if before > 0:
                x = x[:, before:]
            if 0 < after < x.shape[1]:
                x = x[:, :-after]
            out[i] = x.transpose(0, 1)
    return out


def _positions(plan: _Plan, longest: int, table: int, device: torch.device) -> torch.Tensor:
    """[rows, longest]: each row's positional rows from its past length on, past..past+n-1
    (padding continues them), the table's last row for any beyond its end (the encoder's
    rule for audio longer than the table); made on the host, one copy to the device."""
    at = np.asarray(plan.pasts)[:, None] + np.arange(longest)[None, :]
    return to_device(torch.from_numpy(np.minimum(at, table - 1)), device)


def _mask(plan: _Plan, longest: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """[rows, 1, longest, width] in `like`'s dtype: 0 on each row's past and new keys (every
    query, padded ones too, sees them all: the encoder attends both ways), the dtype's
    minimum on the padding."""
    keys = torch.arange(width, device=like.device)
    seen = to_device(
        torch.tensor([p + n for p, n in zip(plan.pasts, plan.counts, strict=True)]), like.device
    )
    hidden = keys[None, :] >= seen[:, None]
    mask = torch.zeros(len(seen), 1, longest, width, dtype=like.dtype, device=like.device)
    return mask.masked_fill(hidden[:, None, None, :], torch.finfo(like.dtype).min)


def _plan(apm: Any, rows: Sequence[AudioRow]) -> _Plan:
    """Each row's cache after the reset rule and its past length."""
    table = apm.embed_positions.weight.shape[0]
    plan = _Plan()
    for row in rows:
        cache = _as_dynamic(row.cache)
        frames = row.features.shape[-1]
        encoder_frames = (frames - 1) // 2 + 1
        past = cache.get_seq_length(0) if cache is not None else 0
        reset = cache is not None and past + encoder_frames >= table
        if reset or cache is None:
            cache, past = DynamicCache(), 0
        plan.caches.append(cache)
        plan.pasts.append(past)
        plan.resets.append(reset)
    return plan


def encode_streaming(model: Any, rows: Sequence[AudioRow]) -> list[AudioOut]:
    """The audio embeddings of one unit of each row's session, and each session's cache
    after it (see the module's docstring for what equals the public per-session call).

    `model`: the MiniCPM-o model (its `apm`, `audio_projection_layer`, `audio_avg_pooler`,
    `config.audio_pool_step`). Rows' caches are grown in place, as the public call grows the
    model's; a row's cache must not be given twice. Results are in the order of `rows`."""
    if not rows:
        return []
    apm = model.apm
    if apm.training:
        raise RuntimeError("encode_streaming runs the encoder in eval mode only")
    ids = [id(row.cache) for row in rows if row.cache is not None]
    if len(ids) != len(set(ids)):
        raise ValueError("the same audio cache is given for two rows")

    plan = _plan(apm, rows)
    frames = _convolve(apm, rows)
    plan.counts = [x.shape[0] for x in frames]
    if min(plan.counts) < 1:
        raise ValueError("a row has no encoder frame left after the cut")

    weight = apm.conv1.weight
    table = apm.embed_positions.weight
    longest = max(plan.counts)
    width = max(p + n for p, n in zip(plan.pasts, plan.counts, strict=True))
    # every row's positional rows in one gather, its frames added in one call (a padded
    # frame gets its position's row alone: its outputs and keys are never used)
    hidden = table[_positions(plan, longest, table.shape[0], table.device)]
    torch._foreach_add_([hidden[r, :n] for r, n in enumerate(plan.counts)], frames)
    mask = _mask(plan, longest, width, weight)

    attention = _RaggedSelfAttention(plan, width, len(apm.layers), table.shape[0])
    layer_cache = _LayerCache(attention)
    states: list[torch.Tensor] = []
    for layer in apm.layers:
        states.append(hidden)
        hidden = layer(
            hidden,
            mask,
            layer_head_mask=None,
            output_attentions=False,
            past_key_values=layer_cache,
            use_cache=True,
        )[0]
    states.append(apm.layer_norm(hidden))
    chosen = states[getattr(model, "audio_encoder_layer", -1)]

    embeds = model.audio_projection_layer(chosen)
    # contiguous: each row's embeddings a dense block, as the LLM's batch takes its pieces
    pooled = model.audio_avg_pooler(embeds.transpose(1, 2)).transpose(1, 2).contiguous()
    step = int(model.config.audio_pool_step)
    out: list[AudioOut] = []
    for r, row in enumerate(rows):
        count = plan.counts[r]
        made = (count - step) // step + 1
        mel_len = row.features.shape[-1] if row.feature_len is None else int(row.feature_len)
        keep = ((mel_len - 1) // 2 + 1 - step) // step + 1
        out.append(
            AudioOut(
                embeds=pooled[r, : max(0, min(made, keep))],
                cache=plan.caches[r],
                reset=plan.resets[r],
            )
        )
    return out
