"""The batched vocoder's flow matching: `CausalConditionalCFM.forward_chunk` (temperature 1) of
minicpmo-utils 1.0.7 for B sessions' chunks at once (`FlowSolver.solve`), each row with its own
chunk length, key/value cache length, speaker and noise offset.

Every Euler step runs the DiT estimator once over 2B rows (the B conditional rows, then their
unconditional rows). The estimator's attention has no positional encoding, so a row's keys are
[its chunk, its cache], right-padded to the widest of each and masked; every causal
convolution's cache is taken at its own row's end; padded frames feed only padded frames
(causal convolutions, masked keys) and are dropped. The blocks are the package's modules,
called block by block here, not patched. What a step's time gives the blocks (the timestep
embedding, each block's nine adaLN modulations, the final layer's two) is the same for every
call of a given step count, so it is computed once and kept (`_Times`).

Two ways to run a call:
- ragged (the reference): the call's own shape, rows B, frames the longest chunk, keys the
  longest cache; no mask when no row is padded (the package's unmasked attention).
- static: the call padded to a bucket (rows up to the next of graphs.POWER_BUCKETS, frames up
  to a multiple of FRAME_STEP, cached keys up to a multiple of KEY_STEP), its inputs copied
  into tensors kept per bucket (the keys into one arena shared by all buckets), padding rows
  masked to their own chunk. On CUDA with graphs on, the first call of a bucket runs the
  estimator eagerly twice on a side stream, then captures one Euler step's estimator as a
  CUDA graph; later steps of that bucket copy their inputs in and replay it: one launch
  instead of ~750 ops (the released 16 blocks) per step, ten steps a chunk. A capture that
  fails turns graphs off for the worker with a warning, never a crash; a call in a bucket
  past the first MAX_SHAPES runs ragged. On a CPU the static shapes run eagerly: what the
  CPU tests compare.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnifabric.worker.engines.minicpmo.graphs import POWER_BUCKETS, GraphSet
from omnifabric.worker.engines.minicpmo.slots import to_device

Tensor = torch.Tensor
log = logging.getLogger(__name__)

#: A static call's chunk frames round up to a multiple of FRAME_STEP (the steady chunk of 50
#: mel frames runs as 56), its cached key frames to a multiple of KEY_STEP.
FRAME_STEP, KEY_STEP = 8, 128
#: The most buckets one solver keeps (each its tensors and, on CUDA, its graph); a call in
#: another bucket runs ragged.
MAX_SHAPES = 48
#: The package's `_trim_estimator_cache` keeps a cache's first prompt frames and its last
#: KEPT_TAIL frames once it holds more than both.
KEPT_TAIL = 100

#: Per block its nine modulations (attention, MLP, convolution: shift, scale, gate each),
#: then the final layer's shift and scale.
Modulations = list[tuple[Tensor, ...]]


def bucket(rows: int, frames: int, keys: int) -> tuple[int, int, int]:
    """The static shape (rows, chunk frames, cached key frames) a call runs in."""
    rows_b = next((b for b in POWER_BUCKETS if b >= rows), rows)
    frames_b = -(-frames // FRAME_STEP) * FRAME_STEP
    keys_b = max(KEY_STEP, -(-keys // KEY_STEP) * KEY_STEP)
    return rows_b, frames_b, keys_b


@dataclass
class _Times:
    """The Euler steps of one step count: each step's dt and timestep embedding as the
    package computes them (its cosine schedule, t advanced by dt), and the modulations the
    embedding gives the blocks."""

    dts: list[Tensor]
    embeds: list[Tensor]
    """[1, 1, hidden] per step."""
    mods: list[Modulations]


@dataclass
class _Call:
    """One call's estimator inputs in its shape (rows R, frames F, cached keys W)."""

    x2: Tensor
    """[2R, 80, F]: the Euler state, conditional rows then unconditional rows."""
    mu: Tensor
    """[2R, 80, F]: the encoder's output (zeros on unconditional and padding rows)."""
    spk: Tensor
    """[2R, 80]."""
    convs: Tensor
    """[depth, 2R, channels, kernel - 1]: one step's convolution caches."""
    keys: Tensor
    """[depth, 2R, heads, F + W, 2 x head dim]: room for the chunk's own keys/values (each
    block writes its own there), then one step's key/value caches: the keys a block's
    attention reads in place (no copy of the cache per block)."""
    ends: Tensor
    """[2R]: each row's chunk length (where its convolution caches are taken)."""
    mask: Tensor | None
    """[2R, 1, 1, F + W]: the keys each row sees; None: all (nothing padded)."""
    embed: Tensor | None = None
    """[1, 1, hidden]: the step's timestep embedding (a graph's input)."""


@dataclass
class _Shape:
    """A bucket's tensors, and its graph once captured."""

    call: _Call
    bucket: tuple[int, int, int]
    """Rows, chunk frames, cached key frames."""
    graph: Any = None
    outputs: tuple[Tensor, Tensor, Tensor] | None = None


class FlowSolver(GraphSet):
    """The flow matching for many sessions' chunks over one CausalConditionalCFM (its
    replays: estimator steps)."""

    def __init__(self, cfm: Any, static: bool = False, graphs: bool = False) -> None:
        super().__init__("the vocoder's flow", next(cfm.parameters()).device, static, graphs)
        self.cfm = cfm
        self._times: dict[tuple[Any, ...], _Times] = {}
        self._shapes: dict[tuple[Any, ...], _Shape] = {}
        self._arena: Tensor | None = None
        self._full = False
        self.buckets: set[tuple[int, int, int]] = set()
        """Every bucket a static call has run in."""

    @property
    def captured(self) -> int:
        """Graphs captured so far."""
        return sum(shape.graph is not None for shape in self._shapes.values())

    def solve(
        self,
        mus: list[Tensor],
        spk: Tensor,
        convs: list[Tensor],
        keys: list[Tensor],
        keep: list[int] | None = None,
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """Row i: mu [1, 80, T_i], speaker row spk[i], caches [steps, depth, 2, ...] (keys
        L_i frames). Returns per row its mel [1, 80, T_i], conv caches and key/value caches
        of T_i + L_i frames (new tensors; the inputs are not changed), cut as the package's
        `_trim_estimator_cache` cuts them where `keep` gives row i's prompt frames."""
        cfm = self.cfm
        b = len(mus)
        lens, past = [m.shape[2] for m in mus], [k.shape[4] for k in keys]
        steps, device, dtype = keys[0].shape[0], mus[0].device, mus[0].dtype
        times = self._timing(steps, dtype, device)
        shape = self._shape(bucket(b, max(lens), max(past)), mus, convs, keys)
        if shape is not None:
            call = shape.call
            _fill(call, mus, spk, lens, past)
        else:
            call = _ragged(mus, spk, convs, keys, lens, past)
        rows, frames = call.x2.shape[0] // 2, call.x2.shape[2]
        noise = cfm.rand_noise[0]
        x = mus[0].new_zeros((rows, mus[0].shape[1], frames))
        # every row's noise from its cache length on, in one call (one op, not one a row)
        torch._foreach_copy_(
            [x[i, :, :n] for i, n in enumerate(lens)],
            [noise[:, p : p + n] for p, n in zip(past, lens, strict=True)],
        )
        # All rows' convolution caches of every step at once (small); keys a step at a time.
        conv_in = torch.stack([c[:steps] for c in convs], dim=3)  # [steps, depth, 2, B, C, k]
        conv_out = torch.empty_like(conv_in)
        depth, _, heads, _, pair = keys[0].shape[1:]
        kv_out = keys[0].new_empty((steps, depth, 2, b, heads, frames, pair))
        rate = cfm.inference_cfg_rate
        for step in range(steps):
            _stage(call, x, conv_in[step], [k[step] for k in keys], past)
            out, conv, kv = self._estimate(shape, call, times, step)
            cond, uncond = out.chunk(2, dim=0)
            x = x + times.dts[step] * ((1.0 + rate) * cond - rate * uncond)
            conv_out[step].copy_(conv.unflatten(1, (2, rows))[:, :, :b])
            kv_out[step].copy_(kv.unflatten(1, (2, rows))[:, :, :b])
        # A row's caches own their memory (one copy each): a view would keep the call's
        # tensors alive for as long as the row's session keeps its caches.
        out_convs = [conv_out[:, :, :, i].clone() for i in range(b)]
        out_keys = [
            _joined(kv_out[:, :, :, i, :, :n], old, None if keep is None else keep[i])
            for i, (n, old) in enumerate(zip(lens, keys, strict=True))
        ]
        mels = [x[i : i + 1, :, :n] for i, n in enumerate(lens)]
        return mels, out_convs, out_keys

    def _timing(self, steps: int, dtype: torch.dtype, device: torch.device) -> _Times:
        """The steps' times and modulations, computed once per step count, dtype, device and
        autocast state (they depend on nothing else)."""
        autocast = torch.is_autocast_enabled(device.type)
        key = (steps, dtype, device, autocast)
        times = self._times.get(key)
        if times is None:
            dit = self.cfm.estimator
            t_span = torch.linspace(0, 1, steps + 1, device=device, dtype=dtype)
            t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
            t, dt = t_span[0].unsqueeze(dim=0), t_span[1] - t_span[0]
            times = _Times([], [], [])
            for step in range(1, steps + 1):
                embed = dit.t_embedder(t).unsqueeze(1)
                times.dts.append(dt)
                times.embeds.append(embed)
                times.mods.append(_modulations(dit, embed))
                t = t + dt
                if step < steps:
                    dt = t_span[step + 1] - t
            self._times[key] = times
        return times

    def _estimate(
        self, shape: _Shape | None, call: _Call, times: _Times, step: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One Euler step's estimator over the call's rows: a graph replay where one is
        captured (or capturable), else eagerly with the kept modulations."""
        dit = self.cfm.estimator
        if shape is None or not self.graphs:
            return _estimate(dit, call, times.mods[step])
        if call.embed is None:
            call.embed = times.embeds[step].clone()
        call.embed.copy_(times.embeds[step])
        if shape.graph is None:
            self._capture(shape)
            if shape.graph is None:  # the capture failed: graphs are off, this step eager
                return _estimate(dit, call, times.mods[step])
        shape.graph.replay()
        self.replays += 1
        assert shape.outputs is not None
        return shape.outputs

    def _capture(self, shape: _Shape) -> None:
        """Captures the bucket's estimator step; on failure graphs are off (the caller runs
        the step eagerly)."""
        dit, call = self.cfm.estimator, shape.call
        embed = call.embed
        assert embed is not None
        t0 = time.perf_counter()
        captured = self.capture(lambda: _estimate(dit, call, _modulations(dit, embed)))
        if captured is None:
            return
        shape.graph, shape.outputs = captured
        rows, frames, keys = shape.bucket
        log.info(
            "vocoder flow: %d rows, %d frames, %d cached keys captured as a CUDA graph in %.2f s",
            rows,
            frames,
            keys,
            time.perf_counter() - t0,
        )

    def _shape(
        self,
        key: tuple[int, int, int],
        mus: list[Tensor],
        convs: list[Tensor],
        keys: list[Tensor],
    ) -> _Shape | None:
        """The bucket's tensors, made on its first call (its keys a view of the arena); None
        where the call runs ragged (static shapes off, or MAX_SHAPES buckets kept)."""
        if not self.static:
            return None
        rows, frames, width = key
        mu, conv, kv = mus[0], convs[0], keys[0]
        full = (*key, mu.dtype, kv.dtype, tuple(conv.shape[1:]), tuple(kv.shape[1:4]), kv.shape[5])
        shape = self._shapes.get(full)
        if shape is not None:
            self.buckets.add(key)
            return shape
        if len(self._shapes) >= MAX_SHAPES:
            if not self._full:
                self._full = True
                log.info("vocoder flow: %d buckets kept; calls in others run ragged", MAX_SHAPES)
            return None
        self.buckets.add(key)
        depth, _, heads = kv.shape[1:4]
        layout = (depth, 2 * rows, heads, frames + width, kv.shape[5])
        count = depth * 2 * rows * heads * (frames + width) * kv.shape[5]
        arena = self._arena
        if arena is None or arena.numel() < count or arena.dtype != kv.dtype:
            # Captured graphs read the old arena: they go with it.
            self._shapes.clear()
            self._arena = None
            arena = self._arena = kv.new_zeros(count)
        channels = mu.shape[1]
        call = _Call(
            x2=mu.new_zeros((2 * rows, channels, frames)),
            mu=mu.new_zeros((2 * rows, channels, frames)),
            spk=mu.new_zeros((2 * rows, channels)),
            convs=conv.new_zeros((conv.shape[1], 2 * rows, *conv.shape[3:])),
            keys=arena[:count].view(layout),
            ends=torch.zeros(2 * rows, dtype=torch.long, device=mu.device),
            mask=torch.zeros((2 * rows, 1, 1, frames + width), dtype=torch.bool, device=mu.device),
        )
        shape = self._shapes[full] = _Shape(call, key)
        return shape


def _modulations(dit: Any, embed: Tensor) -> Modulations:
    """What the timestep embedding gives each block (adaLN) and the final layer."""
    out = [tuple(block.adaLN_modulation(embed).chunk(9, dim=-1)) for block in dit.blocks]
    out.append(tuple(dit.final_layer.adaLN_modulation(embed).chunk(2, dim=-1)))
    return out


def _ragged(
    mus: list[Tensor],
    spk: Tensor,
    convs: list[Tensor],
    keys: list[Tensor],
    lens: list[int],
    past: list[int],
) -> _Call:
    """A call's inputs in its own shape (B rows, the longest chunk, the longest cache)."""
    rows, frames, width = len(mus), max(lens), max(past)
    mu = _right_pad([m[0] for m in mus])
    kv, conv = keys[0], convs[0]
    padded = len(set(lens)) > 1 or len(set(past)) > 1
    mask = None
    if padded:
        new = torch.arange(frames)[None] < torch.tensor(lens)[:, None]
        old = torch.arange(width)[None] < torch.tensor(past)[:, None]
        mask = to_device(torch.cat([new, old], dim=1).repeat(2, 1)[:, None, None], mu.device)
    return _Call(
        x2=mu.new_empty((2 * rows, mu.shape[1], frames)),
        mu=torch.cat([mu, torch.zeros_like(mu)]),
        spk=torch.cat([spk, torch.zeros_like(spk)]),
        convs=conv.new_empty((conv.shape[1], 2 * rows, *conv.shape[3:])),
        keys=kv.new_zeros((kv.shape[1], 2 * rows, kv.shape[3], frames + width, kv.shape[5])),
        ends=to_device(torch.tensor(lens + lens), mu.device),
        mask=mask,
    )


def _fill(call: _Call, mus: list[Tensor], spk: Tensor, lens: list[int], past: list[int]) -> None:
    """A static call's per-call inputs: each row's mu, speaker, end and mask; padding rows
    see only their own chunk (a row that sees no key at all would be NaN)."""
    rows, frames = call.x2.shape[0] // 2, call.x2.shape[2]
    b, width = len(mus), call.keys.shape[3] - frames
    call.mu.zero_()
    mu = call.mu.unflatten(0, (2, rows))
    torch._foreach_copy_([mu[0, i, :, :n] for i, n in enumerate(lens)], [m[0] for m in mus])
    call.spk.zero_()
    call.spk[:b] = spk
    ends = lens + [frames] * (rows - b)
    seen = past + [0] * (rows - b)
    new = torch.arange(frames)[None] < torch.tensor(ends)[:, None]
    old = torch.arange(width)[None] < torch.tensor(seen)[:, None]
    assert call.mask is not None
    device = call.ends.device
    call.mask.copy_(to_device(torch.cat([new, old], dim=1).repeat(2, 1)[:, None, None], device))
    call.ends.copy_(to_device(torch.tensor(ends + ends), device))


def _joined(new: Tensor, old: Tensor, keep: int | None) -> Tensor:
    """A row's key/value cache after its chunk, [new, old] on the frame axis (4), in one copy:
    where `keep` is given and the two hold more than keep + KEPT_TAIL frames, only the
    first `keep` frames and the last KEPT_TAIL of them (the package's estimator trim)."""
    n = new.shape[4]
    total = n + old.shape[4]
    if keep is None or total <= keep + KEPT_TAIL:
        return torch.cat([new, old], dim=4)
    pieces = []
    for start, end in ((0, keep), (total - KEPT_TAIL, total)):
        if start < min(end, n):
            pieces.append(new[:, :, :, :, start : min(end, n)])
        if end > max(start, n):
            pieces.append(old[:, :, :, :, max(start, n) - n : end - n])
    return torch.cat(pieces, dim=4)


def _stage(call: _Call, x: Tensor, convs: Tensor, keys: list[Tensor], past: list[int]) -> None:
    """One Euler step's inputs into the call: the state for both halves, every row's
    convolution caches ([depth, 2, B, C, k]) and key/value caches ([depth, 2, heads, L_i, 2d]
    each)."""
    rows, b = call.x2.shape[0] // 2, len(keys)
    call.x2.unflatten(0, (2, rows)).copy_(x.expand(2, *x.shape))
    call.convs.unflatten(1, (2, rows))[:, :, :b].copy_(convs)
    target = call.keys.unflatten(1, (2, rows))[:, :, :, :, call.x2.shape[2] :]
    torch._foreach_copy_([target[:, :, i, :, :p] for i, p in enumerate(past)], keys)


def _right_pad(rows: list[Tensor]) -> Tensor:
    """[C, T_i] rows stacked into [B, C, max T], zeros after each row's end."""
    width = max(r.shape[-1] for r in rows)
    return torch.stack([F.pad(r, (0, width - r.shape[-1])) for r in rows])


def _estimate(dit: Any, call: _Call, mods: Modulations) -> tuple[Tensor, Tensor, Tensor]:
    """DiT.forward_chunk over the call's 2R padded rows (one timestep for all, its
    modulations given). Returns the velocity [2R, 80, F], the new conv caches
    [depth, 2R, C, k] and the chunk's keys/values [depth, 2R, heads, F, 2d]."""
    x, mu = call.x2, call.mu
    frames = x.shape[2]
    spk = call.spk[:, :, None].expand(-1, -1, frames)
    h = dit.in_proj(torch.cat([x, mu, spk, torch.zeros_like(mu)], dim=1).transpose(1, 2))
    new_convs, new_keys = [], []
    for depth, block in enumerate(dit.blocks):
        h, conv, kv = _block(
            block, h, mods[depth], call.convs[depth], call.keys[depth], call.ends, call.mask
        )
        new_convs.append(conv)
        new_keys.append(kv)
    shift, scale = mods[-1]
    final = dit.final_layer
    h = final.linear(_modulate(final.norm_final(h), shift, scale)).transpose(1, 2)
    return h, torch.stack(new_convs), torch.stack(new_keys)


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN modulation (the DiT's `modulate`)."""
    return x * (1 + scale) + shift


def _block(
    block: Any,
    h: Tensor,
    mods: tuple[Tensor, ...],
    conv: Tensor,
    keys: Tensor,
    ends: Tensor,
    mask: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """DiTBlock.forward_chunk over padded rows; (h, new conv cache, chunk keys/values)."""
    # The package's order: attention, MLP, convolution; each (shift, scale, gate).
    attn, mlp, convolution = mods[0:3], mods[3:6], mods[6:9]
    attended, kv = _attend(block.attn, _modulate(block.norm1(h), *attn[:2]), keys, mask)
    h = h + attn[2] * attended
    y, conv = _convolve(block.conv, _modulate(block.norm3(h), *convolution[:2]), conv, ends)
    h = h + convolution[2] * y
    h = h + mlp[2] * block.mlp(_modulate(block.norm2(h), *mlp[:2]))
    return h, conv, kv


def _attend(attn: Any, h: Tensor, keys: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Attention.forward_chunk: the chunk's queries over [chunk keys, cached keys], `keys`
    [rows, heads, T + W, 2d] holding the cached ones after room for the chunk's, which are
    written there; returns the output and the chunk's own keys/values [rows, heads, T, 2d]
    (a view of `keys`)."""
    rows, frames, _ = h.shape
    q = attn.q_norm(attn.to_heads(attn.to_q(h)))
    k = attn.k_norm(attn.to_heads(attn.to_k(h)))
    v = attn.to_heads(attn.to_v(h))
    head = k.shape[-1]
    own = keys[:, :, :frames]
    own[..., :head].copy_(k)
    own[..., head:].copy_(v)
    out = F.scaled_dot_product_attention(q, keys[..., :head], keys[..., head:], attn_mask=mask)
    out = attn.proj(out.transpose(1, 2).reshape(rows, frames, -1))
    return out, own


def _convolve(block: Any, h: Tensor, cache: Tensor, ends: Tensor) -> tuple[Tensor, Tensor]:
    """CausalConvBlock.forward_chunk over padded rows [rows, T, C]; (output, new cache)."""
    first, second = cache.split((block.in_channels, block.out_channels), dim=1)
    y, new_first = _causal(block.block[1], h.transpose(1, 2), first, ends)
    y = block.block[2:6](y)
    y, new_second = _causal(block.block[6], y, second, ends)
    return y.transpose(1, 2), torch.cat([new_first, new_second], dim=1)


def _causal(conv: Any, y: Tensor, cache: Tensor, ends: Tensor) -> tuple[Tensor, Tensor]:
    """CausalConv1d.forward_chunk over padded rows [rows, C, T]: the cache is each row's last
    k - 1 input frames before its own end (ends[r]), not the padded tensor's."""
    width = conv.causal_padding[0]
    y = torch.cat([cache, y], dim=2)
    at = ends[:, None, None] + torch.arange(width, device=y.device)
    new_cache = y.gather(2, at.expand(-1, y.shape[1], -1))
    return nn.Conv1d.forward(conv, y), new_cache
