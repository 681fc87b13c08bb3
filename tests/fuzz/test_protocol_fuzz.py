"""Fuzzing the public JSON parser (RELIABILITY.md, Fuzzing): `parse_frame` then `command`,
the two calls the WebSocket handler makes on every text frame, over arbitrary text,
arbitrary JSON and near-valid events (wrong values, huge numbers, NaN/Infinity literals,
deep nesting, bad base64, broken WAV and JPEG payloads).

Only the documented errors may come out: InvalidJson (close 1003) and the client
EdgeErrors (an `error` event, session usable). Valid JSON is never "not JSON".
OMNI_FUZZ_EXAMPLES examples per property (tests.fuzz.EXAMPLES: 2000 in the default suite,
10,000 in `omnifabric soak --rows FUZZ`), derandomized and without a database, so CI is
stable.
"""

from __future__ import annotations

import base64
import io
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnifabric.edge import fields
from omnifabric.edge.dialects import realtime
from omnifabric.edge.errors import EdgeError
from tests.fuzz import EXAMPLES

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: What a client mistake may be reported as (edge/errors.py, RELIABILITY.md E4/E5).
CLIENT_CODES = {"unknown_event", "missing_field", "invalid_payload"}


def feed(text: str) -> str:
    """Run one frame through the parser as the handler does: "ok", "invalid_json" or the
    error code. Anything else raised fails the property."""
    try:
        realtime.command(fields.parse_frame(text))
    except fields.InvalidJson:
        return "invalid_json"
    except EdgeError as err:
        assert err.code in CLIENT_CODES, err.code
        assert err.close_code is None and err.message
        return err.code
    return "ok"


@dataclass(frozen=True)
class Raw:
    """JSON text placed verbatim: literals json.dumps would never write."""

    text: str


def encode(value: Any) -> str:
    """JSON text of `value`, with Raw pieces verbatim (NaN, 1e999, 5000 digits...)."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{encode(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(encode(v) for v in value) + "]"
    return json.dumps(value)


def _nested(depth: int, kind: str) -> Raw:
    if kind == "list":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"a":' * depth + "1" + "}" * depth)


#: Values that trip naive validation; sampled in one draw, so cheap to generate.
ODD_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    9,
    10,
    64,
    8193,
    2**31,
    2**63,
    -(2**63),
    10**400,
    0.5,
    -0.0,
    1e308,
    "",
    "x",
    "1",
    [],
    {},
    [1],
    {"a": 1},
    Raw("NaN"),
    Raw("Infinity"),
    Raw("-Infinity"),
    Raw("1e999"),
    Raw("-1e999"),
    Raw("1E-400"),
    Raw("-0"),
    Raw("1" * 5000),  # past Python's 4300-digit limit for int conversion
    Raw("-" + "9" * 400),
    _nested(64, "obj"),
    _nested(1000, "list"),
    _nested(100_000, "list"),
    _nested(100_000, "obj"),
]
SCALARS = st.one_of(st.sampled_from(ODD_VALUES), st.integers(), st.floats(), st.text(max_size=12))
KEYS = st.sampled_from(["type", "audio", "input", "payload", "session", "a", ""])
#: Any JSON value two levels deep (deeper nesting comes from the Raw literals); cheaper
#: to draw than st.recursive, which matters at 10k examples.
WILD = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.dictionaries(KEYS, SCALARS, max_size=3),
    st.dictionaries(KEYS, st.lists(SCALARS, max_size=2) | st.dictionaries(KEYS, SCALARS)),
)


def mostly(draw, good: st.SearchStrategy, odd: st.SearchStrategy = SCALARS) -> Any:
    """Three draws in four from `good` (so later checks get their turn), else from `odd`."""
    return draw(odd) if draw(st.integers(0, 3)) == 3 else draw(good)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _pcm(samples: int, poison: float | None) -> str:
    """Base64 float32 PCM of `samples` zeros, the middle one replaced by `poison`."""
    pcm = np.zeros(samples, "<f4")
    if poison is not None and samples:
        pcm[samples // 2] = poison
    return _b64(pcm.tobytes())


BAD_BASE64 = st.sampled_from(
    [
        "",
        "=",
        "AAAA=",
        "AAA",
        "AA==AA==",
        "A A=",
        "AAAA\n",
        "-_-_",
        "!!!!",
        "data:audio/wav;base64," + _pcm(16000, None),
        _pcm(16001, None).rstrip("="),
        "\u00e9AAA",
    ]
) | st.text(alphabet="ABCDabcd0189+/=-_ \n!", max_size=24)
AUDIO = st.one_of(
    st.builds(
        _pcm,
        st.sampled_from([0, 1, 3999, 4000, 16000, 64000, 64001]),
        st.sampled_from([None, float("nan"), float("inf"), -float("inf"), 1e30]),
    ),
    st.binary(max_size=20_000).map(_b64),  # ragged byte counts, random floats (NaN too)
    BAD_BASE64,
    WILD,
)


@st.composite
def wav_files(draw) -> bytes:
    """RIFF/WAVE files, mostly well formed with one or two odd header values, lying
    lengths or truncation."""
    channels = draw(st.sampled_from([1, 1, 2, 0, 3, 65535]))
    width = draw(st.sampled_from([2, 2, 4, 1, 3, 0]))
    rate = draw(st.sampled_from([16000, 16000, 24000, 0, 1, 2**32 - 1]))
    fmt = draw(st.sampled_from([1, 1, 1, 3, 0xFFFE]))
    data = draw(st.binary(max_size=96))
    fmt_chunk = struct.pack(
        "<HHIIHH",
        fmt,
        channels,
        rate,
        (rate * channels * width) & 0xFFFFFFFF,
        (channels * width) & 0xFFFF,
        (8 * width) & 0xFFFF,
    )
    data_len = draw(st.sampled_from([len(data), len(data), 0, 1, 2**31, 2**32 - 1]))
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt_chunk)) + fmt_chunk
    body += b"data" + struct.pack("<I", data_len) + data
    blob = b"RIFF" + struct.pack("<I", len(body)) + body
    cut = draw(st.sampled_from([None, None, None, 4, 12, 20, 36, 44, 45]))
    return blob if cut is None else blob[:cut]


def _small_jpeg() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(out, "JPEG")
    return out.getvalue()


JPEG = _small_jpeg()


@st.composite
def jpeg_files(draw) -> bytes:
    """A real JPEG with flipped bytes, truncated, or claiming other dimensions."""
    data = bytearray(JPEG)
    how = draw(st.sampled_from(["flip", "cut", "size", "header_only"]))
    if how == "flip":
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    elif how == "cut":
        data = data[: draw(st.integers(0, len(data)))]
    elif how == "size":
        sof = data.find(b"\xff\xc0")
        size = draw(st.sampled_from([0, 1, 16, 4096, 20000, 65535]))
        data[sof + 5 : sof + 9] = struct.pack(">HH", size, draw(st.sampled_from([0, 1, 65535])))
    else:
        data = bytearray(b"\xff\xd8\xff" + draw(st.binary(max_size=32)))
    return bytes(data)


ODD_REF_AUDIO = st.one_of(st.binary(max_size=64).map(_b64), BAD_BASE64, SCALARS)
ODD_FRAME = st.one_of(BAD_BASE64, SCALARS)
NUMBER = st.sampled_from([0, 1, 0.5, -1, 5.5, 10, 100.5, 1000, 1001, 8192, 10**400, 1e308])
CONFIG_KEYS = ["temperature", "top_p", "length_penalty", "listen_prob_scale", "top_k"]
CONFIG_KEYS += ["force_listen_count", "max_kv_tokens", "max_tokens", "tts_enabled", "vision_hd"]
CONFIG_KEYS += ["seed"]
#: A config object: a few known keys with numbers, flags or odd values.
CONFIG = st.lists(
    st.tuples(st.sampled_from(CONFIG_KEYS), NUMBER | st.booleans() | SCALARS), max_size=3
).map(dict)
PROMPT = st.sampled_from(["", "be brief", "\u0000\ud800"])
#: A unit that passes the audio checks, so the frame and flag checks get their turn.
GOOD_AUDIO = _pcm(16000, None)


def _corrupt(text: str, cut: int, junk: bytes) -> str:
    cut %= len(text) + 1
    return text[:cut] + junk.decode("latin-1") + text[cut:]


@st.composite
def init_events(draw) -> dict[str, Any]:
    """Both dialects' init, fields near-valid; the voice often a broken WAV."""
    current = draw(st.booleans())
    body: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(["system_prompt", "instructions"]), max_size=1)):
        body[key] = mostly(draw, PROMPT)
    if draw(st.booleans()):
        body["config"] = mostly(draw, CONFIG)
    if draw(st.booleans()):
        body["max_slice_nums"] = mostly(draw, NUMBER)
    if draw(st.integers(0, 3)) < 3:
        key = "tts_ref_audio" if draw(st.booleans()) else "ref_audio"
        key += "_base64" if current else ""
        ref = mostly(draw, wav_files().map(_b64), ODD_REF_AUDIO)
        if current and draw(st.booleans()):
            body["voice"] = {key: ref}
        else:
            body[key] = ref
    if current:
        return {"type": "session.init", "payload": mostly(draw, st.just(body))}
    return {"type": "session.update", "session": mostly(draw, st.just(body))}


@st.composite
def unit_events(draw) -> dict[str, Any]:
    """input.append / input_audio_buffer.append: audio, video frames, flags."""
    body: dict[str, Any] = {"audio": mostly(draw, st.just(GOOD_AUDIO), AUDIO)}
    if draw(st.booleans()):
        frames = mostly(draw, st.just(1), st.integers(0, 5))
        body["video_frames"] = [mostly(draw, jpeg_files().map(_b64), ODD_FRAME)] * frames
    if draw(st.booleans()):
        body["force_listen"] = mostly(draw, st.booleans())
    if draw(st.booleans()):
        body["max_slice_nums"] = mostly(draw, NUMBER)
    if draw(st.booleans()):
        return {"type": "input.append", "input": mostly(draw, st.just(body))}
    return {"type": "input_audio_buffer.append", **body}


OTHER_EVENTS = st.builds(
    lambda kind, reason: {"type": kind, "reason": reason},
    st.sampled_from(["session.close", "session.close", "response.create", "", "x" * 100]),
    SCALARS,
)
EVENTS = st.one_of(init_events(), unit_events(), OTHER_EVENTS)


@st.composite
def frames(draw) -> tuple[str, bool]:
    """(a text frame, whether it is JSON): any text, any JSON value, or a near-valid event
    (half of the draws: its checks run deepest), whole or with a few bytes spliced in."""
    kind = draw(st.sampled_from(["event", "event", "json", "text"]))
    if kind == "text":
        return draw(st.text(max_size=256)), False
    if kind == "json":
        return encode(draw(WILD)), True
    text = encode(draw(EVENTS))
    if draw(st.booleans()):
        return text, True
    cut, junk = draw(st.integers(0, 1 << 16)), draw(st.binary(min_size=1, max_size=3))
    return _corrupt(text, cut, junk), False


@pytest.mark.ci_long  # hundreds of generated frames: ~10 s (tests/conftest.py)
@FUZZ
@given(frames())
def test_only_documented_errors_escape(frame):
    """10k frames of every kind: the parser answers each with a command or a documented
    error, and a JSON frame is never "not JSON"."""
    text, is_json = frame
    outcome = feed(text)
    assert not (is_json and outcome == "invalid_json"), text[:200]


def _wav(channels: int, width: int, rate: int, data: bytes, data_len: int | None = None) -> bytes:
    fmt = struct.pack(
        "<HHIIHH", 1, channels, rate, rate * channels * width, channels * width, 8 * width
    )
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data) if data_len is None else data_len) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _huge_jpeg() -> bytes:
    data = bytearray(JPEG)
    sof = data.find(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", 65535, 65535)
    return bytes(data)


def _voice(wav: bytes) -> str:
    return encode({"type": "session.init", "payload": {"voice": {"ref_audio_base64": _b64(wav)}}})


@pytest.mark.parametrize(
    "text, outcome",
    [
        # OverflowError: math.isfinite() of an int beyond float range.
        (
            encode({"type": "session.init", "payload": {"config": {"temperature": 10**400}}}),
            "invalid_payload",
        ),
        # ValueError past Python's 4300-digit limit: valid JSON, was "not JSON" (1003).
        (encode({"type": "session.close", "reason": Raw("1" * 5000)}), "invalid_payload"),
        # ZeroDivisionError: a WAV header with a 0 Hz sample rate.
        (_voice(_wav(1, 2, 0, b"\0\0\0\0")), "invalid_payload"),
        # ValueError: a WAV cut short inside a sample, or inside a stereo frame (the
        # whole samples and frames are kept).
        (_voice(_wav(1, 2, 16000, b"\0\0\0", data_len=4)), "ok"),
        (_voice(_wav(2, 2, 16000, b"\0" * 6, data_len=8)), "ok"),
        # RuntimeError from the wave module: a chunk size past the end of the file.
        (_voice(_wav(1, 2, 16000, b"\0\0")[:36] + b"LIST\x10\0\0\0/"), "invalid_payload"),
        # DecompressionBombError from PIL: a JPEG frame claiming 65535 x 65535 pixels.
        (
            encode(
                {
                    "type": "input.append",
                    "input": {"audio": GOOD_AUDIO, "video_frames": [_b64(_huge_jpeg())]},
                }
            ),
            "invalid_payload",
        ),
    ],
)
def test_inputs_the_fuzzer_found(text, outcome):
    """Each of these once escaped the parser as a crash of the connection handler (or,
    the long number, closed the connection as "not JSON")."""
    assert feed(text) == outcome
