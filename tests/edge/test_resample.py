"""The rate converter (common.resample, as edge.pcm names it): what it leaves out of the
band it converts to (aliases, images), what it keeps, and that a stream cut in pieces comes
out as the whole buffer does, with its length."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnifabric.edge import pcm

#: What the issue asks of every conversion: aliases and images at least 60 dB down.
FLOOR_DB = -60.0


def tone(freq: float, rate: int, seconds: float = 1.0) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * freq * np.arange(int(rate * seconds)) / rate)).astype(
        np.float32
    )


def power_db(y: np.ndarray, x: np.ndarray) -> float:
    return float(10 * np.log10(max(np.mean(y.astype(np.float64) ** 2), 1e-30) / np.mean(x**2)))


def streamed(src: int, dst: int, x: np.ndarray, piece_s: float = 0.1) -> np.ndarray:
    """`x` through a Resampler in pieces of `piece_s`, then its flush."""
    converter = pcm.Resampler(src, dst)
    n = max(1, int(src * piece_s))
    out = [converter.process(x[i : i + n]) for i in range(0, x.size, n)]
    return np.concatenate([*out, converter.flush()])


@pytest.mark.parametrize("src, dst", [(24000, 16000), (24000, 8000), (48000, 16000)])
@pytest.mark.parametrize("way", ["one-shot", "streamed"])
def test_tones_above_the_target_nyquist_are_attenuated(src, dst, way):
    """Linear interpolation let 8.5-11.5 kHz through 24 -> 16 kHz at -2 to -3 dB and
    24 -> 8 kHz at 0 dB; each tone from the target's Nyquist to the source's now comes
    out at least 60 dB down (measured: -105 dB or lower)."""
    for freq in np.linspace(dst / 2, 0.95 * src / 2, 10):
        x = tone(freq, src)
        y = pcm.resample(x, src, dst) if way == "one-shot" else streamed(src, dst, x)
        assert power_db(y[dst // 20 : -dst // 20], x) <= FLOOR_DB, f"{freq:.0f} Hz"


@pytest.mark.parametrize("src, dst", [(8000, 16000), (16000, 24000)])
@pytest.mark.parametrize("way", ["one-shot", "streamed"])
def test_upsampling_leaves_no_images(src, dst, way):
    """A tone below the source's Nyquist comes out alone: nothing above that Nyquist (its
    image at src - f was at -10 dB with linear interpolation) is within 60 dB of it."""
    for freq in np.linspace(0.05 * src, 0.45 * src, 8):
        x = tone(freq, src, 2.0)
        y = pcm.resample(x, src, dst) if way == "one-shot" else streamed(src, dst, x)
        y = y[dst // 4 : -dst // 4]
        spectrum = np.abs(np.fft.rfft(y * np.hanning(y.size))) ** 2
        freqs = np.fft.rfftfreq(y.size, 1 / dst)
        image = spectrum[freqs > src / 2].sum() / spectrum[np.abs(freqs - freq) < 30].sum()
        assert 10 * np.log10(image) <= FLOOR_DB, f"{freq:.0f} Hz"


@pytest.mark.parametrize(
    "src, dst", [(24000, 16000), (16000, 24000), (24000, 8000), (8000, 16000), (48000, 16000)]
)
def test_the_band_is_kept_flat(src, dst):
    """Tones up to 90% of the lower Nyquist keep their level within 0.1 dB (8 -> 16 kHz
    linear interpolation took 3 kHz down by 3.2 dB)."""
    for freq in (300, 1000, 0.9 * min(src, dst) / 2):
        x = tone(freq, src)
        y = pcm.resample(x, src, dst)[dst // 20 : -dst // 20]
        assert abs(power_db(y, x)) < 0.1, f"{freq:.0f} Hz"


@pytest.mark.parametrize(
    "src, dst", [(24000, 16000), (16000, 24000), (24000, 8000), (8000, 16000), (48000, 16000)]
)
def test_a_tone_streamed_in_100_ms_pieces_has_no_seam(src, dst):
    """The stream's output equals the whole buffer's, sample for sample, once the filter
    has history (its first and last few ms see the stream's edges), so nothing happens at
    a piece's boundary; and no step between neighbours is larger than the tone's own."""
    x = tone(440, src, 2.0)
    whole = pcm.resample(x, src, dst)
    pieces = streamed(src, dst, x)
    assert pieces.size == whole.size
    edge = dst // 50  # 20 ms
    np.testing.assert_allclose(pieces[edge:-edge], whole[edge:-edge], atol=1e-5)
    steepest = np.abs(np.diff(whole[edge:-edge])).max()
    assert np.abs(np.diff(pieces[edge:-edge])).max() <= steepest * 1.001


@settings(max_examples=40, deadline=None)
@given(
    rates=st.sampled_from([(24000, 16000), (16000, 24000), (24000, 8000), (8000, 16000)]),
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=12),
)
def test_lengths_add_up_over_a_stream(rates, sizes):
    """However the input is cut (empty pieces too), the stream's output after the flush is
    n_in * dst / src samples within one; once 30 ms have come in, at most 10 ms of output
    are held back (the filter's delay: 4 to 8.5 ms)."""
    src, dst = rates
    converter = pcm.Resampler(src, dst)
    rng = np.random.default_rng(sum(sizes))
    total = taken = 0
    for size in sizes:
        total += converter.process(rng.standard_normal(size).astype(np.float32) * 0.1).size
        taken += size
        assert converter.held == int(taken * dst / src) - total
        assert taken < 0.03 * src or converter.held <= dst // 100
    total += converter.flush().size
    assert abs(total - sum(sizes) * dst / src) <= 1


def test_flush_ends_the_stream_and_the_next_starts_fresh():
    converter = pcm.Resampler(24000, 16000)
    x = tone(440, 24000)
    first = np.concatenate([converter.process(x), converter.flush()])
    assert converter.held == 0
    second = np.concatenate([converter.process(x), converter.flush()])
    np.testing.assert_array_equal(first, second)


def test_equal_rates_and_empty_input_pass_through():
    x = tone(440, 16000, 0.1)
    assert np.array_equal(pcm.Resampler(16000, 16000).process(x), x)
    assert np.array_equal(pcm.resample(x, 16000, 16000), x)
    assert pcm.resample(np.zeros(0, np.float32), 24000, 16000).size == 0
    assert pcm.Resampler(24000, 16000).process(np.zeros(0, np.float32)).size == 0
    with pytest.raises(ValueError, match="positive"):
        pcm.Resampler(0, 16000)
