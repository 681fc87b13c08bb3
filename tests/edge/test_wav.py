"""WAV input (edge.pcm.wav_to_pcm16k, the one decoder of reference voices, chat audio
parts, stored voices and `omnifabric probe`): every encoding users have, any rate, mono or
stereo, to 16 kHz mono float32; and a named InvalidPayload for what it cannot take."""

from __future__ import annotations

import base64
import io
import struct
import wave

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnifabric.edge import pcm
from omnifabric.edge.chat import parse_chat
from omnifabric.edge.chat_input import AudioPart
from omnifabric.edge.errors import InvalidPayload

PCM, FLOAT, ALAW, MULAW, EXTENSIBLE = 1, 3, 6, 7, 0xFFFE
#: The sub-format GUID of WAVE_FORMAT_EXTENSIBLE after its 2-byte format tag.
GUID_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"


def riff(tag: int, channels: int, rate: int, bits: int, data: bytes, sub: int = 0) -> bytes:
    """A WAV file by hand: the fmt chunk (extensible when `tag` is EXTENSIBLE, `sub` its
    sub-format) and the data chunk."""
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    if tag == EXTENSIBLE:
        mask = (1 << channels) - 1
        fmt += struct.pack("<HHI", 22, bits, mask) + struct.pack("<H", sub) + GUID_TAIL
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def tone(rate: int, seconds: float = 1.0, freq: float = 440.0, level: float = 0.5) -> np.ndarray:
    return level * np.sin(2 * np.pi * freq * np.arange(int(rate * seconds)) / rate)


def encode(x: np.ndarray, bits: int, is_float: bool) -> bytes:
    """Samples in [-1, 1] as WAV stores them: float, unsigned 8-bit, signed 16/24/32-bit."""
    if is_float:
        return x.astype("<f4" if bits == 32 else "<f8").tobytes()
    if bits == 8:
        return np.round(x * 127 + 128).astype("u1").tobytes()
    if bits == 24:
        ints = np.round(x * (2**23 - 1)).astype("<i4").tobytes()
        return b"".join(ints[i : i + 3] for i in range(0, len(ints), 4))
    return np.round(x * (2 ** (bits - 1) - 1)).astype(f"<i{bits // 8}").tobytes()


def decoded(data: bytes) -> np.ndarray:
    return np.frombuffer(pcm.wav_to_pcm16k(data, "ref_audio"), "<f4")


def assert_tone(got: np.ndarray, seconds: float = 1.0, level: float = 0.5, tol: float = 2e-3):
    """`got` is the 440 Hz tone at 16 kHz (away from the ends, which see the file's edges)."""
    expected = tone(16000, seconds, level=level)
    assert got.size == expected.size
    np.testing.assert_allclose(got[160:-160], expected[160:-160], atol=tol)


@pytest.mark.parametrize(
    "bits, is_float, tol",
    [(8, False, 2e-2), (16, False, 2e-4), (24, False, 2e-4), (32, False, 2e-4)]
    + [(32, True, 2e-4), (64, True, 2e-4)],
)
@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
def test_pcm_and_float_wavs_at_any_rate(bits, is_float, tol, rate):
    """Integer PCM of 8/16/24/32 bits and 32/64-bit float (the edge's own recorder writes
    float WAVs; 24-bit, float and the extensible header were refused before)."""
    data = encode(tone(rate), bits, is_float)
    assert_tone(decoded(riff(FLOAT if is_float else PCM, 1, rate, bits, data)), tol=tol)


@pytest.mark.parametrize("bits, is_float", [(16, False), (24, False), (32, True)])
def test_extensible_headers(bits, is_float):
    data = encode(tone(48000), bits, is_float)
    got = decoded(riff(EXTENSIBLE, 1, 48000, bits, data, sub=FLOAT if is_float else PCM))
    assert_tone(got, tol=2e-4)


def test_stereo_is_mixed_down():
    """Left carries the tone, right its opposite at half the level: their mean is the tone
    at a quarter of left's level."""
    left, right = tone(24000), -0.5 * tone(24000)
    data = encode(np.stack([left, right], axis=1).reshape(-1), 16, False)
    assert_tone(decoded(riff(PCM, 2, 24000, 16, data)), level=0.125, tol=2e-4)


def test_stdlib_written_wav_and_g711():
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(encode(tone(8000), 16, False))
    assert_tone(decoded(buf.getvalue()), tol=2e-4)
    silence = decoded(riff(MULAW, 1, 8000, 8, b"\xff" * 8000))  # mu-law 0xFF is zero
    assert silence.size == 16000 and np.abs(silence).max() < 1e-3


def test_a_file_cut_short_keeps_its_whole_frames():
    data = encode(tone(16000), 16, False)
    cut = riff(PCM, 1, 16000, 16, data)[:-1]  # inside the last sample
    assert decoded(cut).size == 15999
    assert decoded(riff(PCM, 1, 16000, 16, b"")).size == 0


@pytest.mark.parametrize(
    "data, message",
    [
        (b"not a wav at all", "ref_audio: unreadable WAV"),
        (b"RIFF\x00\x00\x00\x00WAVE", "ref_audio: unreadable WAV"),
        (riff(2, 1, 16000, 4, b"\x00" * 256), "ref_audio: WAV encoding adpcm_ms not supported"),
        (riff(PCM, 1, 2000, 16, b"\x00" * 64), "ref_audio: WAV sample rate 2000 Hz"),
        (riff(PCM, 1, 768000, 16, b"\x00" * 64), "ref_audio: WAV sample rate 768000 Hz"),
        (riff(PCM, 9, 16000, 16, b"\x00" * 72), "ref_audio: WAV with 9 channels"),
        (riff(PCM, 1, 0, 16, b"\x00" * 64), "ref_audio: WAV sample rate 0 Hz"),
        (riff(PCM, 0, 16000, 16, b"\x00" * 64), "ref_audio: WAV with 0 channels"),
    ],
)
def test_what_cannot_be_taken_is_named(data, message):
    with pytest.raises(InvalidPayload, match=message):
        decoded(data)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_voice_or_a_float_wav_of_non_finite_samples_is_refused_as_units_are(bad):
    # Reference voices of NaN were taken (session.created) where a unit of them is refused.
    samples = tone(16000)
    samples[100] = bad
    raw = samples.astype("<f4").tobytes()
    wav = riff(FLOAT, 1, 16000, 32, raw)
    for data in (raw, wav):
        with pytest.raises(InvalidPayload, match="^r: samples must be finite numbers$"):
            pcm.reference_audio(base64.b64encode(data).decode(), "r")
    body = {"messages": [{"role": "user", "content": [{"type": "audio", "data": ""}]}]}
    for data in (raw, wav):
        body["messages"][0]["content"][0]["data"] = base64.b64encode(data).decode()
        with pytest.raises(InvalidPayload, match="samples must be finite numbers"):
            parse_chat(body)


def test_a_voice_of_no_audio_or_longer_than_the_limit_is_refused_on_every_path():
    # gRPC voices had no bound (a 200 s voice was taken); the voice registry's 60 s is the
    # same rule now (pcm.check_voice_length), for raw PCM and WAVs alike.
    at_limit = np.zeros(int(pcm.MAX_VOICE_S * 16000), "<f4")
    assert len(pcm.reference_pcm(at_limit.tobytes(), "r")) == at_limit.nbytes
    over = np.zeros(at_limit.size + 16, "<f4")
    for data in (over.tobytes(), riff(FLOAT, 1, 16000, 32, over.tobytes())):
        with pytest.raises(InvalidPayload, match=r"^r: the voice is 60.0 s: at most 60 s$"):
            pcm.reference_audio(base64.b64encode(data).decode(), "r")
    with pytest.raises(InvalidPayload, match="^r: the voice holds no audio$"):
        pcm.reference_pcm(riff(FLOAT, 1, 16000, 32, b""), "r")


def test_reference_audio_and_chat_audio_parts_take_wavs_and_raw_pcm():
    wav = riff(FLOAT, 1, 24000, 32, encode(tone(24000), 32, True))
    assert_tone(np.frombuffer(pcm.reference_audio(base64.b64encode(wav).decode(), "r"), "<f4"))
    raw = tone(16000).astype("<f4").tobytes()
    assert pcm.reference_audio(base64.b64encode(raw).decode(), "r") == raw

    def chat(part: dict) -> np.ndarray:
        body = {"messages": [{"role": "user", "content": [part]}]}
        (audio,) = parse_chat(body).messages[0].parts
        assert isinstance(audio, AudioPart)
        return np.frombuffer(audio.pcm, "<f4")

    assert_tone(chat({"type": "audio", "data": base64.b64encode(wav).decode()}))
    raw48 = tone(48000).astype("<f4").tobytes()
    part = {"type": "audio", "data": base64.b64encode(raw48).decode(), "sample_rate": 48000}
    assert_tone(chat(part), tol=2e-4)
    long = riff(PCM, 1, 8000, 8, b"\x80" * 8000 * 121)
    with pytest.raises(InvalidPayload, match=r"content\[0\]: at most 120 s"):
        chat({"type": "audio", "data": base64.b64encode(long).decode()})


@settings(max_examples=300, deadline=None)
@given(
    base=st.sampled_from(
        [
            riff(PCM, 1, 16000, 16, encode(tone(16000, 0.01), 16, False)),
            riff(PCM, 2, 44100, 24, encode(tone(44100, 0.01).repeat(2), 24, False)),
            riff(EXTENSIBLE, 1, 48000, 32, encode(tone(48000, 0.01), 32, True), sub=FLOAT),
        ]
    ),
    edits=st.lists(st.tuples(st.integers(0, 80), st.integers(0, 255)), max_size=4),
    cut=st.integers(0, 2000),
)
def test_damaged_files_give_invalid_payload_or_audio(base, edits, cut):
    """Header bytes changed and the file cut anywhere: a decoded array or InvalidPayload
    naming the field, never another exception."""
    data = bytearray(base[: len(base) - cut])
    for at, value in edits:
        if at < len(data):
            data[at] = value
    try:
        out = pcm.wav_to_pcm16k(bytes(data), "ref_audio")
    except InvalidPayload as exc:
        assert str(exc).startswith("ref_audio: ")
    else:
        assert len(out) % 4 == 0
