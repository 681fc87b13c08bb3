"""The edge's finiteness check of unit audio agrees with numpy on every float32."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnifabric.edge import pcm
from omnifabric.edge.errors import InvalidPayload


def f32(*values: float) -> bytes:
    return np.array(values, dtype="<f4").tobytes()


@given(st.lists(st.binary(min_size=4, max_size=4), max_size=64))
def test_all_finite_agrees_with_numpy_on_any_bits(samples):
    raw = b"".join(samples)
    assert pcm.all_finite(raw) == bool(np.isfinite(np.frombuffer(raw, dtype="<f4")).all())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -np.nan])
@pytest.mark.parametrize("at", [0, 7999, 15999])
def test_one_non_finite_sample_anywhere_is_refused(bad, at):
    audio = (np.random.default_rng(at).standard_normal(16000) * 0.3).astype("<f4")
    audio[at] = bad
    with pytest.raises(InvalidPayload, match="samples must be finite numbers"):
        pcm.check_unit_pcm(audio.tobytes())


def test_huge_tiny_and_ordinary_finite_samples_pass():
    largest = float(np.finfo(np.float32).max)
    smallest = float(np.finfo(np.float32).smallest_subnormal)
    raw = f32(largest, -largest, 2.0**127, -(2.0**127), smallest, -0.0, 0.0, 0.5, -1.0)
    assert pcm.check_unit_pcm(raw) is raw
    speech = (np.random.default_rng(1).standard_normal(16000) * 0.3).astype("<f4").tobytes()
    assert pcm.check_unit_pcm(speech) is speech


@pytest.mark.parametrize(
    "rate, target", [(24000, 16000), (8000, 16000), (24000, 8000), (16000, 24000), (48000, 16000)]
)
def test_resampling_keeps_the_length_and_a_band_limited_signal(rate, target):
    """round(n * target / rate) float32 samples for any n, and a tone well inside both
    bands comes through unchanged away from the buffer's ends, where what came before and
    after is unknown (it was linear interpolation, which bent it: 3 dB down at 6 kHz; the
    low-pass converter's own tests are tests/edge/test_resample.py)."""
    rng = np.random.default_rng(7)
    for size in (1, 2, 5, 4799, 4800, 24001):
        x = rng.standard_normal(size).astype(np.float32)
        n = int(round(size * target / rate))
        got = pcm.resample(x, rate, target)
        assert got.shape == (n,) and got.dtype == np.float32
    t = np.arange(rate) / rate
    got = pcm.resample(np.sin(2 * np.pi * 1000 * t).astype(np.float32), rate, target)
    expected = np.sin(2 * np.pi * 1000 * np.arange(target) / target)
    edge = target // 100  # 10 ms
    np.testing.assert_allclose(got[edge:-edge], expected[edge:-edge], atol=1e-4)
