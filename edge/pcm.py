"""Base64 audio and image payloads: decoded once at the edge, validated, carried as bytes;
WAV files decoded to 16 kHz mono, and the rate converter (common.resample) re-exported."""

from __future__ import annotations

import binascii
import io
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

# The rate converter is common's (the worker's engines use it too); the edge's code names
# it here, with the decoders of what clients send.
from omnifabric.common.resample import Resampler as Resampler
from omnifabric.common.resample import resample as resample
from omnifabric.edge import codec
from omnifabric.edge.errors import InvalidPayload

if TYPE_CHECKING:
    import av
    import av.audio.stream

#: Audio louder than this (RMS, full scale 1.0) counts as speech: a unit's for the dialects'
#: speech events (`holds_speech`), a 20 ms frame's for the paced cadence's end of speech.
SPEECH_RMS = 0.01
#: WAV sample rates accepted (reference voices, probe input), Hz.
MIN_WAV_RATE, MAX_WAV_RATE = 4000, 384000
#: Channels a WAV may have (7.1 at most); they are mixed down to mono.
MAX_WAV_CHANNELS = 8
#: The longest reference voice a session or the voice registry takes (seconds of audio):
#: a voice prompt is a few seconds of speech; the models hear at most 30 s of it.
MAX_VOICE_S = 60.0
#: The most pixels an image a client sends may have (64 MP, e.g. 8192 x 8192; a 48 MP phone
#: photo fits). A picture at the limit decodes to 192 MB of RGB in a worker.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
#: FFmpeg's decoders of the WAV encodings taken: unsigned 8-bit, signed 16/24/32-bit and
#: float PCM (little-endian, as WAV stores them), and G.711 A-law and mu-law.
WAV_CODECS = frozenset(
    {"pcm_u8", "pcm_s16le", "pcm_s24le", "pcm_s32le", "pcm_f32le", "pcm_f64le"}
    | {"pcm_alaw", "pcm_mulaw"}
)


def rms(samples: np.ndarray) -> float:
    """Root mean square of float samples (0.0 for none)."""
    return float(np.sqrt(np.mean(np.square(samples, dtype=np.float64)))) if samples.size else 0.0


def holds_speech(samples: np.ndarray) -> bool:
    """Whether float samples are loud enough, as a whole, to count as speech."""
    return rms(samples) > SPEECH_RMS


def b64decode(value: object, what: str) -> bytes:
    """Strict base64 decode; InvalidPayload names the field on any defect."""
    if not isinstance(value, str):
        raise InvalidPayload(f"{what} must be a base64 string")
    if not value:
        raise InvalidPayload(f"{what} is empty")
    try:
        return codec.b64decode(value)
    except (binascii.Error, ValueError):
        raise InvalidPayload(f"{what} base64 decode failed") from None


def unit_pcm(value: object, what: str = "audio") -> bytes:
    """Float32 16 kHz PCM bytes of one unit, checked for size and finite samples."""
    raw = b64decode(value, what)
    return check_unit_pcm(raw, what)


def check_unit_pcm(raw: bytes, what: str = "audio") -> bytes:
    """Validate raw float32 PCM bytes of one unit; returns them unchanged. How many samples
    a unit may carry is the worker's rule (its engine limits, checked with the lease:
    edge.session.SessionCore.append); the frame size limit bounds it before."""
    if len(raw) % 4:
        raise InvalidPayload(f"{what}: {len(raw)} bytes is not a whole number of float32 samples")
    return check_finite(raw, what)


def check_finite(raw: bytes, what: str) -> bytes:
    """Float32 PCM bytes, returned unchanged when every sample is a finite number (units,
    reference voices, chat audio, float WAV files); InvalidPayload otherwise."""
    if not all_finite(raw):
        raise InvalidPayload(f"{what}: samples must be finite numbers")
    return raw


def all_finite(raw: bytes) -> bool:
    """Whether every little-endian float32 in `raw` is finite.

    NaN and the infinities have all eight exponent bits set, so a sample's high byte is
    0x7F or 0xFF; when no sample's is, all are finite, which holds for any real audio. That
    takes ~30 us on a unit's cold path (the first call after a second idle) where numpy's
    check takes ~100 us (and 4.6 against 2.6 us back to back). A high byte of 0x7F or 0xFF
    is also |x| >= 2**127 (finite): numpy decides those."""
    high = raw[3::4]
    if b"\x7f" not in high and b"\xff" not in high:
        return True
    return bool(np.isfinite(np.frombuffer(raw, dtype="<f4")).all())


def reference_audio(value: object, what: str) -> bytes:
    """Reference voice (base64) as float32 16 kHz PCM bytes (``reference_pcm``)."""
    return reference_pcm(b64decode(value, what), what)


def reference_pcm(raw: bytes, what: str) -> bytes:
    """Reference voice bytes, raw float32 PCM or a WAV file, as float32 16 kHz PCM bytes;
    InvalidPayload naming ``what`` for anything else, a sample that is not finite, no
    audio at all or more than MAX_VOICE_S of it."""
    if raw[:4] == b"RIFF":
        found = wav_to_pcm16k(raw, what)
    elif len(raw) % 4:
        raise InvalidPayload(f"{what}: not a WAV file and not float32 PCM")
    else:
        found = check_finite(raw, what)
    return check_voice_length(found, what)


def check_voice_length(raw: bytes, what: str) -> bytes:
    """Float32 16 kHz reference voice bytes as they are, or InvalidPayload naming ``what``
    where they hold no audio or more than MAX_VOICE_S of it."""
    if not raw:
        raise InvalidPayload(f"{what}: the voice holds no audio")
    seconds = len(raw) / 4 / 16000
    if seconds > MAX_VOICE_S:
        raise InvalidPayload(f"{what}: the voice is {seconds:.1f} s: at most {MAX_VOICE_S:g} s")
    return raw


def wav_to_pcm16k(data: bytes, what: str) -> bytes:
    """A WAV file as mono float32 at 16 kHz: PCM of 8, 16, 24 or 32 bits, 32- or 64-bit
    float or G.711, plain or WAVE_FORMAT_EXTENSIBLE headers, any rate from MIN_WAV_RATE to
    MAX_WAV_RATE, up to MAX_WAV_CHANNELS channels mixed down, decoded by FFmpeg's WAV reader
    (PyAV) and resampled with the low-pass converter. A file cut short keeps its whole
    frames. InvalidPayload, its message starting with `what`, names what cannot be taken."""
    import av

    _check_fmt_chunk(data, what)
    try:
        with av.open(io.BytesIO(data), "r", format="wav") as container:
            if not container.streams.audio:
                raise InvalidPayload(f"{what}: the WAV file holds no audio stream")
            stream = container.streams.audio[0]
            _check_wav_stream(stream, what)
            audio = _mono_float(container.decode(stream))
            rate = stream.rate
    except InvalidPayload:
        raise
    except (av.error.FFmpegError, ValueError, OSError, EOFError) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise InvalidPayload(f"{what}: unreadable WAV ({why})") from None
    return check_finite(resample(audio, rate, 16000).astype("<f4").tobytes(), what)


def _check_wav_stream(stream: av.audio.stream.AudioStream, what: str) -> None:
    """The decoder, rate and channel count of a WAV's audio, or InvalidPayload naming the
    one that cannot be taken."""
    context = stream.codec_context  # None: FFmpeg has no decoder for the header's format
    codec = context.name if context is not None else "(unknown)"
    if codec not in WAV_CODECS:
        raise InvalidPayload(
            f"{what}: WAV encoding {codec} not supported "
            "(use PCM of 8, 16, 24 or 32 bits, 32- or 64-bit float, or G.711)"
        )
    _check_rate_and_channels(stream.rate, stream.channels, what)


def _check_fmt_chunk(data: bytes, what: str) -> None:
    """The rate and channel count of a RIFF/WAVE file's fmt chunk, checked before FFmpeg
    reads it, which refuses a 0 Hz or channel-less header as mere "invalid data": this
    names the value. Files without a readable fmt chunk are left to FFmpeg."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return
    at = 12
    while at + 16 <= len(data):
        size = int.from_bytes(data[at + 4 : at + 8], "little")
        if data[at : at + 4] == b"fmt ":
            channels = int.from_bytes(data[at + 10 : at + 12], "little")
            _check_rate_and_channels(
                int.from_bytes(data[at + 12 : at + 16], "little"), channels, what
            )
            return
        at += 8 + size + (size & 1)  # chunks are padded to an even size


def _check_rate_and_channels(rate: int, channels: int, what: str) -> None:
    """Bounded rates (resampling a 1 Hz file to 16 kHz would multiply its size by 16000)
    and channel counts, or InvalidPayload naming the value."""
    if not MIN_WAV_RATE <= rate <= MAX_WAV_RATE:
        raise InvalidPayload(
            f"{what}: WAV sample rate {rate} Hz (use {MIN_WAV_RATE} to {MAX_WAV_RATE})"
        )
    if not 1 <= channels <= MAX_WAV_CHANNELS:
        raise InvalidPayload(f"{what}: WAV with {channels} channels (use 1 to {MAX_WAV_CHANNELS})")


#: FFmpeg sample formats the WAV decoders give -> the scale that maps them to [-1, 1) and
#: the offset of unsigned 8-bit samples.
_SAMPLE_SCALES = {"u8": (128.0, 128.0), "s16": (32768.0, 0.0), "s32": (2147483648.0, 0.0)}
_SAMPLE_SCALES.update(flt=(1.0, 0.0), dbl=(1.0, 0.0))


def _mono_float(frames: Iterable[av.AudioFrame]) -> np.ndarray:
    """Decoded frames of any sample format as one float32 mono array (integers scaled to
    [-1, 1), the channels averaged), converted here with numpy: FFmpeg's converter crashed
    the process on frames of a damaged header (tests/edge/test_wav.py's fuzzing)."""
    parts = []
    for frame in frames:
        name = frame.format.name
        planar = name.endswith("p")
        scale, offset = _SAMPLE_SCALES.get(name.rstrip("p"), (0.0, 0.0))
        channels = len(frame.layout.channels)
        if not scale or channels < 1:
            raise ValueError(f"decoded as {name} with {channels} channels")
        samples = frame.to_ndarray().astype(np.float64)
        if planar:
            mono = samples.mean(axis=0)
        else:
            mono = samples.reshape(-1)[: samples.size - samples.size % channels]
            mono = mono.reshape(-1, channels).mean(axis=1)
        parts.append((mono - offset) / scale)
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


def jpeg_frame(value: object, what: str) -> bytes:
    """A base64 JPEG frame, checked by the JPEG parser (header and structure)."""
    return check_jpeg(b64decode(value, what), what)


def check_jpeg(raw: bytes, what: str) -> bytes:
    """Raw JPEG bytes, verified (``check_image``); InvalidPayload when broken or not a JPEG."""
    if raw[:3] != b"\xff\xd8\xff":
        raise InvalidPayload(f"{what} is not a JPEG image")
    return check_image(raw, what, "JPEG")


def check_image(raw: bytes, what: str, only: str | None = None) -> bytes:
    """Raw image file bytes (JPEG, PNG, ...; only the format ``only`` where given), verified
    by the image parser without decoding the pixels, and at most ``MAX_IMAGE_PIXELS``
    pixels; InvalidPayload saying which otherwise. The one check of every image a client
    sends: chat parts, OpenAI input_image items, video frames (``check_jpeg``)."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    kind = f"{only} image" if only else "image"
    try:
        with warnings.catch_warnings():
            # The size is checked here, against our limit, instead of PIL's warning.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw)) as image:
                if only is not None and image.format != only:
                    raise InvalidPayload(f"{what} is not a {kind}")
                width, height = image.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise InvalidPayload(
                        f"{what}: a {width} x {height} {kind} is over the limit of "
                        f"{MAX_IMAGE_PIXELS:,} pixels"
                    )
                image.verify()
    except Image.DecompressionBombError:
        raise InvalidPayload(
            f"{what}: the {kind}'s dimensions are over the limit of {MAX_IMAGE_PIXELS:,} pixels"
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        broken = f"a broken {kind}" if only else "not a readable image"
        raise InvalidPayload(f"{what} is {broken}") from None
    return raw


def encode_pcm(pcm: bytes) -> str:
    """Base64 text of raw PCM bytes, for the JSON protocol."""
    return codec.b64encode(pcm)
