"""G.711 telephony audio (ITU-T G.711): mu-law (`audio/pcmu`) and A-law (`audio/pcma`),
8 kHz, one byte a sample, as phone bridges (Twilio, SIP trunks) carry it.

Both directions are table lookups (256 entries to decode, 65536 to encode, built once at
import from the standard's segment rules), so a second of audio costs tens of microseconds."""

from __future__ import annotations

import numpy as np

#: mu-law: the bias added before the segment search (on 16-bit samples, and on the 14-bit
#: values the encoder works with), and the largest 14-bit magnitude encoded.
_MU_BIAS = 0x84
_MU_BIAS_14 = 0x21
_MU_CLIP_14 = 8159


def _mulaw_expand(codes: np.ndarray) -> np.ndarray:
    u = (~codes.astype(np.int32)) & 0xFF
    exponent = (u >> 4) & 0x07
    magnitude = ((((u & 0x0F) << 3) + _MU_BIAS) << exponent) - _MU_BIAS
    return np.where(u & 0x80, -magnitude, magnitude).astype(np.int16)


def _alaw_expand(codes: np.ndarray) -> np.ndarray:
    a = codes.astype(np.int32) ^ 0x55
    segment = (a & 0x70) >> 4
    mantissa = (a & 0x0F) << 4
    magnitude = np.where(
        segment == 0,
        mantissa + 8,
        (mantissa + 0x108) << np.maximum(segment - 1, 0),
    )
    return np.where(a & 0x80, magnitude, -magnitude).astype(np.int16)


_ALL_CODES = np.arange(256, dtype=np.uint8)
_MULAW_TABLE = _mulaw_expand(_ALL_CODES)
_ALAW_TABLE = _alaw_expand(_ALL_CODES)


def mulaw_decode(data: bytes) -> np.ndarray:
    """mu-law bytes -> int16 samples."""
    return _MULAW_TABLE[np.frombuffer(data, dtype=np.uint8)]


def alaw_decode(data: bytes) -> np.ndarray:
    """A-law bytes -> int16 samples."""
    return _ALAW_TABLE[np.frombuffer(data, dtype=np.uint8)]


def _segment(magnitude: np.ndarray, first_bit: int) -> np.ndarray:
    """The G.711 segment (0-7) of each magnitude: where its highest set bit lies above
    `first_bit` (mu-law: bit 5 of its 14-bit value, A-law: bit 4 of its 13-bit one)."""
    highest = np.floor(np.log2(np.maximum(magnitude, 1))).astype(np.int32)
    return np.clip(highest - first_bit, 0, 7)


def _mulaw_compress(samples: np.ndarray) -> np.ndarray:
    x = samples.astype(np.int32) >> 2  # 14-bit
    mask = np.where(x < 0, 0x7F, 0xFF)
    magnitude = np.minimum(np.abs(x), _MU_CLIP_14) + _MU_BIAS_14
    segment = _segment(magnitude, 5)
    code = (segment << 4) | ((magnitude >> (segment + 1)) & 0x0F)
    code = np.where(magnitude > 0x1FFF, 0x7F, code)  # past the last segment: its top code
    return ((code ^ mask) & 0xFF).astype(np.uint8)


def _alaw_compress(samples: np.ndarray) -> np.ndarray:
    x = samples.astype(np.int32) >> 3  # 13-bit
    negative = x < 0
    mask = np.where(negative, 0x55, 0xD5)
    magnitude = np.where(negative, -x - 1, x)
    segment = _segment(magnitude, 4)
    low = np.where(segment < 2, magnitude >> 1, magnitude >> np.maximum(segment, 1)) & 0x0F
    code = np.where(magnitude > 0xFFF, 0x7F, (segment << 4) | low)
    return ((code ^ mask) & 0xFF).astype(np.uint8)


#: Every int16 sample's code, indexed by sample + 32768 (64 KiB each): encoding is a lookup.
_ALL_SAMPLES = np.arange(-32768, 32768, dtype=np.int32)
_MULAW_CODES = _mulaw_compress(_ALL_SAMPLES)
_ALAW_CODES = _alaw_compress(_ALL_SAMPLES)


def mulaw_encode(samples: np.ndarray) -> bytes:
    """int16 samples -> mu-law bytes."""
    return _MULAW_CODES[samples.astype(np.int32) + 32768].tobytes()


def alaw_encode(samples: np.ndarray) -> bytes:
    """int16 samples -> A-law bytes."""
    return _ALAW_CODES[samples.astype(np.int32) + 32768].tobytes()
