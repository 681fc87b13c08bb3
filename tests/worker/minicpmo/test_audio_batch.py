"""The batched streaming audio encoder gives each session what the public per-session call
gives it alone.

Sessions (noise of different seeds and amplitudes, silence) get their mel chunks from their
own streaming mel processor, as the duplex path makes them; they join at different units, so
rows at their first unit (102 frames, no prefix) sit beside rows at later units (104). Every
unit runs twice: all active rows through audio_batch.encode_streaming on the batched caches,
and each session alone through the public `get_audio_embedding_streaming` with its cache
swapped onto the model. Compared per row and unit: the embeddings (within 1e-5, fp32), the
cache lengths, the reset flag, that a grown cache is the session's own object (as the public
call grows it); at the end the caches' keys and values. One plan runs far enough for the
1500-position reset; one has shorter chunks beside full ones; in one, sessions switch between
both paths unit by unit; one runs the encoder's eager attention. Two controls must make the
comparison fail: one row's positions shifted by one, the padded keys left unmasked. Opt-in
(OMNI_MINICPMO_CODE_DIR, see conftest), for every layout the public code offers, on the tiny
random-weight checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omnifabric.worker.engines.minicpmo import audio_batch
from omnifabric.worker.engines.minicpmo.audio_batch import AudioRow, encode_streaming
from tests.worker.minicpmo.conftest import LAYOUTS, ON, needs_code

pytestmark = needs_code
TOLERANCE = 1e-5
#: (seed, amplitude); amplitude 0 is silence.
SOUNDS = [(1, 0.5), (2, 0.05), (3, 0.0), (4, 1.0), (5, 0.2), (6, 0.0), (7, 0.8), (8, 0.01)]


@pytest.fixture(scope="module", params=[layout for layout, _ in LAYOUTS] or ["none"])
def model(request: pytest.FixtureRequest, tiny_dirs: dict[Path, Path]) -> Iterator[Any]:
    """The tiny checkpoint's model, loaded as the engine loads it, once per layout; on a GPU
    with cuDNN's TF32 off (PyTorch's default for convolutions: the batched and the lone
    call would pick kernels that round apart by more than TOLERANCE)."""
    from omnifabric.worker.engines.minicpmo import MiniCPMOEngine

    layout = request.param
    engine = MiniCPMOEngine(str(tiny_dirs[dict(LAYOUTS)[layout]]), slots=4, api=layout, **ON)
    engine.load()
    assert engine.layout == layout
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield engine.model
    torch.backends.cudnn.allow_tf32 = before


def mels(model: Any, seed: int, amplitude: float, units: int) -> list[torch.Tensor]:
    """A session's mel chunks of `units` units: its own streaming mel processor fed the
    samples it asks for (1035 ms, then 1000 ms)."""
    model.init_streaming_processor()
    processor = model.processor
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(units):
        need = processor.get_streaming_chunk_size()
        chunk = (amplitude * rng.standard_normal(need)).astype(np.float32)
        feature = processor.process_audio_streaming(chunk, reset=False, return_batch_feature=True)
        out.append(feature["audio_features"].to(model.device))
    processor._streaming_mel_processor = None
    # The first unit's chunk has no prefix context: 102 frames, then 2 + 100 + 2.
    assert [m.shape[-1] for m in out[:2]] == [102, 104][:units]
    return out


@dataclass
class Session:
    join: int
    chunks: list[torch.Tensor]
    ours: Any = None
    public: Any = None
    unit: int = 0
    resets: list[int] = field(default_factory=list)

    def active(self, step: int) -> bool:
        return self.join <= step < self.join + len(self.chunks)


def public_unit(model: Any, session: Session, cache: Any) -> tuple[torch.Tensor, Any]:
    """One unit of one session through the public call, its cache swapped onto the model."""
    mel = session.chunks[session.unit]
    model.audio_past_key_values = cache
    try:
        nested = model.get_audio_embedding_streaming(
            {"audio_features": mel, "audio_feature_lens": [torch.tensor([mel.shape[-1]])]},
            use_extra_context=True,
            prefix_extra_frames=0 if session.unit == 0 else 2,
            suffix_extra_frames=2,
        )
        return torch.cat([t for group in nested for t in group]), model.audio_past_key_values
    finally:
        model.audio_past_key_values = None


def row(session: Session) -> AudioRow:
    return AudioRow(
        features=session.chunks[session.unit],
        cache=session.ours,
        prefix_extra_frames=0 if session.unit == 0 else 2,
    )


def length(cache: Any) -> int:
    return 0 if cache is None else int(cache.get_seq_length(0))


def run(
    model: Any, sessions: list[Session], public_steps: Callable[[int, int], bool] | None = None
) -> float:
    """Every step through both paths; returns the largest difference seen. `public_steps(i,
    unit)`: session i's unit goes through the public call on OUR cache instead of the batch
    (the switch between paths)."""
    worst = scale = 0.0
    with torch.no_grad():
        for step in range(max(s.join + len(s.chunks) for s in sessions)):
            active = [i for i, s in enumerate(sessions) if s.active(step)]
            if step % 2:
                active.reverse()
            switched = [i for i in active if public_steps and public_steps(i, sessions[i].unit)]
            batched = [i for i in active if i not in switched]
            given = [sessions[i].ours for i in batched]
            outs = encode_streaming(model, [row(sessions[i]) for i in batched])
            mine: dict[int, tuple[torch.Tensor, Any, bool | None]] = {
                i: (o.embeds, o.cache, o.reset) for i, o in zip(batched, outs, strict=True)
            }
            for cache, out in zip(given, outs, strict=True):
                # Grown in place, as the public call grows the model's, unless reset or new.
                assert (out.cache is cache) == (cache is not None and not out.reset)
            for i in switched:
                embeds, cache = public_unit(model, sessions[i], sessions[i].ours)
                mine[i] = (embeds, cache, None)
            for i in active:
                s = sessions[i]
                before = length(s.public)
                given_public = s.public
                want, s.public = public_unit(model, s, s.public)
                assert (s.public is given_public) == (before > 0 and length(s.public) > before)
                scale = max(scale, float(want.abs().max()))
                got, s.ours, reset = mine[i]
                assert got.shape == want.shape
                worst = max(worst, float((got - want).abs().max()))
                assert length(s.ours) == length(s.public), (i, s.unit)
                public_reset = length(s.public) <= before
                if reset is not None:
                    assert reset == (public_reset and before > 0), (i, s.unit)
                if public_reset and before > 0:
                    s.resets.append(s.unit)
                s.unit += 1
    for s in sessions:
        for layer in range(len(s.public.key_cache)):
            worst = max(
                worst,
                float((s.ours.key_cache[layer] - s.public.key_cache[layer]).abs().max()),
                float((s.ours.value_cache[layer] - s.public.value_cache[layer]).abs().max()),
            )
    print(f"largest |embedding| {scale:.3g}", end="; ")
    return worst


def plan(model: Any, joins: list[int], units: int) -> list[Session]:
    return [
        Session(join, mels(model, *SOUNDS[i % len(SOUNDS)], units)) for i, join in enumerate(joins)
    ]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_rows_match_the_public_call(model: Any, n: int) -> None:
    joins = [0, 5, 2, 0, 7, 1, 5, 3][:n]
    sessions = plan(model, joins, 7)
    worst = run(model, sessions)
    scale = max(float(c.abs().max()) for s in sessions for c in s.chunks)
    print(f"n={n}: max |diff| {worst:.3g} (mel up to {scale:.3g})")
    assert worst <= TOLERANCE


def test_chunks_of_other_lengths(model: Any) -> None:
    """A shorter chunk (as a stream's last one can be) beside full ones: its own conv group,
    fewer new keys (padded queries), fewer embeddings."""
    sessions = plan(model, [0, 1, 1], 5)
    sessions[1].chunks[2] = sessions[1].chunks[2][..., :60]
    sessions[2].chunks[3] = sessions[2].chunks[3][..., :77]
    worst = run(model, sessions)
    assert worst <= TOLERANCE


def test_cache_reset_at_1500_positions(model: Any) -> None:
    sessions = plan(model, [0, 3], 32)
    worst = run(model, sessions)
    print(f"reset: max |diff| {worst:.3g}; reset at units {[s.resets for s in sessions]}")
    assert worst <= TOLERANCE
    assert sessions[0].resets and sessions[1].resets
    # Both reset at their own 30th unit (1450 + 52 >= 1500), at different steps.
    assert sessions[0].resets[0] == sessions[1].resets[0] == 29


def test_a_session_goes_on_through_either_path(model: Any) -> None:
    sessions = plan(model, [0, 1, 2], 8)
    worst = run(model, sessions, public_steps=lambda i, unit: (unit + i) % 3 == 1)
    assert worst <= TOLERANCE


def test_a_unit_costs_the_host_the_same_ops_whatever_the_rows(model: Any, monkeypatch) -> None:
    """The ops a unit issues do not grow with its rows (101 a row and unit with the released
    encoder's 24 layers before: a concatenation and two copies a row and layer, and the
    positions a row), but for a buffer that grows (one copy a row every few units); and
    every copy of keys and values goes between dense blocks of one layout (what lets
    torch._foreach_copy_ run them as a few kernels on CUDA)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if not func.is_view:
                self.ops += 1
            return func(*args, **(kwargs or {}))

    copy = torch._foreach_copy_
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def watched(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        pairs.extend(zip(dst, src, strict=True))
        copy(dst, src)

    monkeypatch.setattr(torch, "_foreach_copy_", watched)
    counts: dict[int, list[int]] = {}
    for rows in (2, 6):
        sessions = plan(model, [0] * rows, 5)
        counts[rows] = []
        with torch.no_grad():
            for unit in range(5):
                for s in sessions:
                    s.unit = unit
                counter = Count()
                with counter:
                    outs = encode_streaming(model, [row(s) for s in sessions])
                counts[rows].append(counter.ops)
                for s, out in zip(sessions, outs, strict=True):
                    s.ours = out.cache
    growth = [b - a for a, b in zip(counts[2], counts[6], strict=True)]
    print(f"ops a unit, 2 rows {counts[2]}, 6 rows {counts[6]}")
    assert max(growth) <= 4  # at most one copy more for each of the 4 more rows
    assert pairs and all(
        d.shape == s.shape and d.stride() == s.stride() and d.is_contiguous() for d, s in pairs
    )


def test_control_a_shifted_position_fails(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    positions = audio_batch._positions

    def shifted(plan: Any, longest: int, table: int, device: torch.device) -> torch.Tensor:
        out = positions(plan, longest, table, device).clone()
        later = [r for r, past in enumerate(plan.pasts) if past]
        if later:  # one row with a past: its positions one further on
            out[later[0]] += 1
        return out

    monkeypatch.setattr(audio_batch, "_positions", shifted)
    sessions = plan(model, [0, 2], 4)
    worst = run(model, sessions)
    print(f"control: max |diff| {worst:.3g}")
    assert worst > 100 * TOLERANCE


def test_control_unmasked_padding_fails(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of different past lengths: seeing the padded keys must change the result."""

    def unmasked(plan: Any, longest: int, width: int, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(plan.pasts), 1, longest, width, dtype=like.dtype, device=like.device)

    monkeypatch.setattr(audio_batch, "_mask", unmasked)
    sessions = plan(model, [0, 2], 4)
    worst = run(model, sessions)
    print(f"control: max |diff| {worst:.3g}")
    assert worst > 100 * TOLERANCE


def test_eager_attention(tiny_dirs: dict[Path, Path]) -> None:
    """The encoder's eager attention (a model loaded with attn="eager") takes the same mask."""
    from omnifabric.worker.engines.minicpmo import MiniCPMOEngine

    layout, code = LAYOUTS[0]
    engine = MiniCPMOEngine(str(tiny_dirs[code]), slots=4, api=layout, attn="eager", **ON)
    engine.load()
    attention = engine.model.apm.layers[0].self_attn
    assert type(attention).__name__ == "WhisperAttention"
    sessions = plan(engine.model, [0, 5, 2, 0, 7, 1, 5, 3], 7)
    worst = run(engine.model, sessions)
    print(f"eager: max |diff| {worst:.3g}")
    assert worst <= TOLERANCE
