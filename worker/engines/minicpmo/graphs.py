"""The decode loop's LLM forwards in static shapes, replayed as CUDA graphs (issue 51).

A ragged decode forward (slots.feed) has a shape of its own every call: as many rows as are
still speaking, keys up to the longest of their contexts. Here each forward is padded to a
bucket: rows up to the next of ROW_BUCKETS (the padding rows sit on the slot cache's scratch
row), keys up to the next power of two from MIN_WIDTH up to WIDTH_STEP, then to the next
multiple of WIDTH_STEP (capped at the slot length), and
every index, position and mask lives in tensors allocated once per bucket and filled in
place (SlotCache.begin_decode). With graphs on, the first forward of a bucket is run eagerly
twice on a side stream (its cache writes are the step's own, so running it again changes
nothing), then captured; later forwards of that bucket copy their embeddings in and replay
the graph: one launch instead of a kernel launch per op. A capture that fails turns graphs
off for the worker with a warning, and the eager static forward goes on.

On a CPU (or with graphs off) the same static-shape forward runs eagerly: what the CPU tests
compare with the ragged path, row for row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnifabric.worker.engines.minicpmo.slots import FeedResult, SlotCache, SlotStep

log = logging.getLogger(__name__)

#: Rows of a decode forward (LLM and TTS) are padded up to the next of these: steps of 8 to
#: 64, then of 16, 32 and 64 (vLLM's habit). A padding row reads the scratch row's keys up
#: to the forward's width like any row: with powers of two, 33 rows ran as 64 and 31 of them
#: read keys for nothing (at 4,096 keys and the released sizes 17 GiB a forward).
ROW_BUCKETS = (
    *(1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64),
    *(80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512),
)
#: The vocoder's calls (flow, HiFT) pad their rows to powers of two: each of its buckets is
#: made per chunk shape too (frames, cached keys), and its warm-up speaks a turn in each.
POWER_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
#: The narrowest key width of a decode forward; wider ones double up to WIDTH_STEP, then
#: grow by WIDTH_STEP, up to the slot length.
MIN_WIDTH = 256
#: A forward's attention reads every row's keys up to its width (the mask hides the rest,
#: the memory is read): doubling past this would read up to twice the keys a long context
#: needs (a 4,097-token context read as 8,192: at the released sizes 64 rows x 4,095
#: padding keys x 144 KiB is 36 GiB more a forward); steps of it pad by at most 1,023.
WIDTH_STEP = 1024


def bucket(rows: int, width: int, slots: int, max_len: int) -> tuple[int, int]:
    """The static shape (rows, keys) a decode of `rows` rows needing `width` keys runs in."""
    top = max(slots, 1)
    rows_b = next((b for b in ROW_BUCKETS if b >= rows), rows)
    rows_b = max(rows, min(rows_b, top))  # no more padding rows than the cache has slots
    width_b = MIN_WIDTH
    while width_b < width and width_b < WIDTH_STEP:
        width_b *= 2
    if width_b < width:
        width_b = -(-width // WIDTH_STEP) * WIDTH_STEP
    return rows_b, min(width_b, max_len)


def buckets(slots: int, max_len: int) -> list[tuple[int, int]]:
    """Every static shape `bucket` gives a decode over a cache of `slots` slots of `max_len`
    tokens: each row bucket up to the slots, each key width up to the slot length."""
    rows = sorted({bucket(n, 1, slots, max_len)[0] for n in range(1, max(slots, 1) + 1)})
    widths = []
    width = 1
    while True:
        width_b = bucket(1, width, slots, max_len)[1]
        widths.append(width_b)
        if width_b >= max_len:
            break
        width = width_b + 1
    return [(r, w) for r in rows for w in widths]


@dataclass
class _Shape:
    """A bucket's static tensors, and its graph once captured."""

    step: SlotStep
    embeds: torch.Tensor
    """[rows, 1, hidden]: the rows' new embeddings (zeros on padding rows)."""
    hidden: torch.Tensor
    """[rows, 1, hidden]: the final hidden states."""
    logits: torch.Tensor
    """[rows, vocab]."""
    graph: Any = None


class GraphSet:
    """The CUDA graphs of one part of the step (the decode, the vocoder's flow, its HiFT):
    whether it runs static shapes and captures them, one memory pool, the replays, and the
    failure that turned its graphs off."""

    def __init__(self, what: str, device: Any, static: bool, graphs: bool) -> None:
        self.what = what
        self.static = static or graphs
        self.graphs = graphs and torch.device(device).type == "cuda"
        self.failure: str | None = None
        """Why graphs were turned off, when a capture failed."""
        self.replays = 0
        """Runs that were a graph replay (no module forward seen by hooks)."""
        self._pool: Any = None

    @property
    def captured(self) -> int:
        """Graphs captured so far."""
        return 0

    def figures(self) -> dict[str, Any]:
        """What a report says of this set."""
        return {
            "static": self.static,
            "graphs": self.graphs,
            "captured": self.captured,
            "replays": self.replays,
            "failure": self.failure,
        }

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any] | None:
        """`fn` captured in this set's pool (graphs.capture): (graph, outputs); None where the
        capture failed, graphs then off for good with a warning (a slower worker, never a
        dead one; the caller runs eagerly)."""
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            return capture(fn, self._pool)
        except Exception as exc:
            self.turn_off(exc)
            return None

    def turn_off(self, exc: Exception) -> None:
        """Graphs off for good after `exc` (a failed capture), with a warning."""
        self.graphs = False
        self.failure = f"{type(exc).__name__}: {exc}"
        log.warning("CUDA graph capture failed, %s runs eagerly: %s", self.what, self.failure)
        if torch.cuda.is_available():
            torch.cuda.synchronize()


class StaticDecode(GraphSet):
    """Decode forwards of one LLM over one slot cache (made with scratch=True) in bucketed
    static shapes; `graphs` captures and replays them on CUDA. `llm` has the backbone as
    `.model` and its `.config`; its `.lm_head`, where it is not None, makes the logits (the
    TTS's backbone has none here: its heads run after, outside the graph)."""

    def __init__(self, llm: Any, cache: SlotCache, graphs: bool, what: str = "decode") -> None:
        super().__init__(what, cache.device, static=True, graphs=graphs)
        self.llm = llm
        self.cache = cache
        self.calls = 0
        """Forwards run in static shapes (replayed or eager)."""
        self._shapes: dict[tuple[int, int], _Shape] = {}
        self._io: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        """Per row bucket, the embeddings, hidden states and logits every key width of it
        shares (one bucket runs at a time; its outputs are copied out after each run): at
        64 slots of a 151,748-token vocabulary, 39 MB of logits where one set per bucket
        took 190."""

    @property
    def captured(self) -> int:
        """Graphs captured so far."""
        return sum(shape.graph is not None for shape in self._shapes.values())

    def feed(self, rows: Sequence[tuple[int, torch.Tensor]]) -> FeedResult:
        """Like slots.feed for rows of one new token each ([1, hidden] embeddings): the
        logits [rows, vocab] and per row its hidden state [1, hidden], both copies."""
        if not rows:
            raise ValueError("a decode forward needs at least one row")
        for slot, embeds in rows:
            if tuple(embeds.shape[:1]) != (1,) or embeds.dim() != 2:
                raise ValueError(
                    f"slot {slot}: a decode row is one token, [1, hidden], got "
                    f"{tuple(embeds.shape)}"
                )
        hidden, logits = self.feed_stacked(
            [slot for slot, _ in rows], torch.cat([embeds for _, embeds in rows])
        )
        return FeedResult(logits=logits, hidden=list(hidden))

    def feed_stacked(self, slots: Sequence[int], embeds: torch.Tensor) -> tuple[Any, Any]:
        """`feed` for rows given as one tensor, embeds [rows, hidden] (row k: slot slots[k]),
        without a tensor a row: the hidden states [rows, 1, hidden] and the logits [rows,
        vocab] (a copy each; the logits empty where the model has no head)."""
        n = len(slots)
        if n == 0 or embeds.dim() != 2 or embeds.shape[0] != n:
            raise ValueError(f"{n} decode rows need embeddings [{n}, hidden], got {embeds.shape}")
        cache = self.cache
        need = max(cache.length(slot) for slot in slots) + 1
        shape = self._shape(*bucket(n, need, cache.slots, cache.max_len))
        step = cache.begin_decode(list(slots), shape.step)
        self.calls += 1
        try:
            with torch.no_grad():
                shape.embeds[n:].zero_()
                shape.embeds[:n, 0].copy_(embeds)
                self._run(shape, step)
        except BaseException:
            cache.abort()
            raise
        cache.commit()
        logits = shape.logits[:n]
        return shape.hidden[:n].clone(), logits.clone() if logits.shape[1] else logits

    def capture_all(self) -> int:
        """Captures the graph of every bucket (graphs.buckets) not captured yet, over padding
        rows only (the scratch row at position 0: no slot's tokens are read or written), so
        no step of a session pays for a capture (two eager forwards and the capture, where
        it first meets a bucket). Nothing without graphs; whatever fails here (a capture, a
        bucket's buffers, its eager forward) turns graphs off with the capture's warning and
        ends it: the worker serves eagerly, never dies of it. Returns how many it captured."""
        if not self.graphs:
            return 0
        cache = self.cache
        done = 0
        for rows, width in buckets(cache.slots, cache.max_len):
            try:
                shape = self._shape(rows, width)
                if shape.graph is not None:
                    continue
                step = cache.begin_decode([], shape.step)
                try:
                    with torch.no_grad():
                        shape.embeds.zero_()
                        self._capture(shape, step)
                finally:
                    cache.abort()
            except Exception as exc:
                self.turn_off(exc)
                break
            if shape.graph is None:  # the capture failed (graphs are off)
                break
            done += 1
        return done

    def _shape(self, rows: int, width: int) -> _Shape:
        key = (rows, width)
        shape = self._shapes.get(key)
        if shape is None:
            io = self._io.get(rows)
            if io is None:
                head = self.llm.lm_head
                vocab = 0 if head is None else head.weight.shape[0]
                hidden = self.llm.config.hidden_size
                dev, dtype = self.cache.device, self.cache.dtype
                io = self._io[rows] = (
                    torch.zeros((rows, 1, hidden), device=dev, dtype=dtype),
                    torch.zeros((rows, 1, hidden), device=dev, dtype=dtype),
                    torch.zeros(
                        (rows, vocab),
                        device=dev,
                        dtype=dtype if head is None else head.weight.dtype,
                    ),
                )
            shape = _Shape(
                step=self.cache.decode_shape(rows, width), embeds=io[0], hidden=io[1], logits=io[2]
            )
            self._shapes[key] = shape
        return shape

    def _run(self, shape: _Shape, step: SlotStep) -> None:
        if shape.graph is not None:
            shape.graph.replay()
            self.replays += 1
            return
        if not self.graphs:
            self._forward(shape, step)
            return
        self._capture(shape, step)

    def _forward(self, shape: _Shape, step: SlotStep) -> None:
        """The static-shape forward: the decoder over the padded rows, the head over them."""
        out = self.llm.model(
            inputs_embeds=shape.embeds,
            position_ids=step.positions,
            attention_mask=step.mask,
            past_key_values=self.cache,
            use_cache=True,
            return_dict=True,
        )
        shape.hidden.copy_(out.last_hidden_state)
        if self.llm.lm_head is not None:
            shape.logits.copy_(self.llm.lm_head(out.last_hidden_state[:, 0]))

    def _capture(self, shape: _Shape, step: SlotStep) -> None:
        """Captures the step's forward (its eager runs are the step's own: its cache writes
        are the step's, so running it again changes nothing); on failure the eager run
        stands."""
        captured = self.capture(lambda: self._forward(shape, step))
        if captured is None:
            self._forward(shape, step)  # the outputs the capture may have left half-written
            return
        shape.graph = captured[0]
        shape.graph.replay()  # the outputs of this step (the capture itself ran nothing)


def capture(fn: Callable[[], Any], pool: Any) -> tuple[Any, Any]:
    """`fn` (a function of static tensors) captured as a CUDA graph in the memory pool `pool`:
    run eagerly twice on a side stream first (as capture needs: kernels picked, workspaces
    made), then captured with autocast's cast cache off (what it caches would be freed
    outside the graph) and the capture's checks on this thread only (a CUDA call another
    thread of the worker makes meanwhile is not an error of the capture). Returns the graph
    and what `fn` returned during the capture: the tensors each replay writes. Raises where
    the capture fails."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    autocast = torch.is_autocast_enabled("cuda")
    dtype = torch.get_autocast_dtype("cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.autocast("cuda", dtype=dtype, enabled=autocast, cache_enabled=False):
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = fn()
    return graph, outputs
