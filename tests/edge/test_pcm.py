"""The edge's finiteness check of unit audio agrees with numpy on every float32."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnifabric.edge import pcm
from omnifabric.edge.errors import InvalidPayload
from tests.conftest import claimed_png


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


def _jpeg(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(out, "JPEG")
    return out.getvalue()


@pytest.mark.parametrize(
    "width, height",
    [
        (8193, 8192),  # just over the limit, under PIL's own warning (89.5 MP)
        (9000, 9000),  # PIL only warns (81 MP) and a worker would decode it
        (20000, 20000),  # PIL raises its DecompressionBombError
        (65535, 65535),
    ],
)
def test_an_image_over_the_pixel_limit_is_refused_before_any_decoding(width, height):
    png = claimed_png(width, height)
    with pytest.raises(InvalidPayload, match="over the limit of 67,108,864 pixels"):
        pcm.check_image(png, "content[0].data")


def test_images_within_the_limit_pass_and_broken_or_foreign_ones_are_named():
    assert pcm.check_image(claimed_png(8192, 8192), "x") == claimed_png(8192, 8192)
    jpeg = _jpeg(32, 24)
    assert pcm.check_image(jpeg, "x") == jpeg and pcm.check_jpeg(jpeg, "f") == jpeg
    with pytest.raises(InvalidPayload, match="^f is not a JPEG image$"):
        pcm.check_jpeg(claimed_png(8, 8), "f")
    with pytest.raises(InvalidPayload, match="^x is not a readable image$"):
        pcm.check_image(b"hi", "x")
    with pytest.raises(InvalidPayload, match="^f is a broken JPEG image$"):
        pcm.check_jpeg(jpeg[:40], "f")
