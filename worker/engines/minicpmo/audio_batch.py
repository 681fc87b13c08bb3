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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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


class _RaggedSelfAttention(Cache):
    """The self-attention cache the encoder layers write through during one call: `update`
    appends each row's real new keys and values to the row's own DynamicCache (as the
    public path's cache does, so the row's cache ends as the public call leaves it) and
    returns every row's whole keys and values, right-padded with zeros to the widest."""

    def __init__(self, caches: list[DynamicCache], counts: list[int], width: int) -> None:
        super().__init__()
        self.caches = caches
        self.counts = counts
        self.width = width

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, heads, _, head_dim = key_states.shape
        keys = key_states.new_zeros(rows, heads, self.width, head_dim)
        values = value_states.new_zeros(rows, heads, self.width, head_dim)
        for row, (cache, count) in enumerate(zip(self.caches, self.counts, strict=True)):
            new_k = key_states[row : row + 1, :, :count]
            new_v = value_states[row : row + 1, :, :count]
            if len(cache.key_cache) <= layer_idx:
                # An empty cache keeps what it is given: a copy, not a view that would hold
                # the whole batch's keys alive.
                new_k, new_v = new_k.clone(), new_v.clone()
            whole_k, whole_v = cache.update(new_k, new_v, layer_idx)
            length = whole_k.shape[-2]
            keys[row, :, :length] = whole_k[0]
            values[row, :, :length] = whole_v[0]
        return keys, values

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


def _positions(past: int, count: int, table: int, device: torch.device) -> torch.Tensor:
    """The positional rows of a row's new frames: past..past+count-1, the table's last row
    for any beyond its end (the encoder's rule for audio longer than the table)."""
    return torch.arange(past, past + count, device=device).clamp(max=table - 1)


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
    n_rows = len(rows)
    hidden = weight.new_zeros(n_rows, longest, table.shape[1])
    for r, (x, past, count) in enumerate(zip(frames, plan.pasts, plan.counts, strict=True)):
        hidden[r, :count] = x + table[_positions(past, count, table.shape[0], table.device)]
    mask = _mask(plan, longest, width, weight)

    layer_cache = _LayerCache(_RaggedSelfAttention(plan.caches, plan.counts, width))
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
    pooled = model.audio_avg_pooler(embeds.transpose(1, 2)).transpose(1, 2)
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
