"""JSON and base64 on the edge's per-unit path, by orjson and pybase64, with the standard
library's exact semantics where they differ (the slow path runs only on input the fast one
refuses or cannot encode).

Measured on this machine, per 1 s unit (an 85 KB `input.append` frame in, an audio event
with 1 s of 24 kHz speech out): parse 45 -> 25 us, base64 decode 156 -> 4 us, base64
encode 75 -> 3 us, event to JSON 181 -> 3 us (bytes sent as a text frame as they are).
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pybase64


def loads_fast(text: str | bytes) -> Any:
    """JSON text -> value; orjson.JSONDecodeError (a ValueError) for anything orjson
    refuses: the caller decides with the standard library (NaN, nesting, big integers)."""
    return orjson.loads(text)


JSONDecodeError = orjson.JSONDecodeError


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON. Values orjson cannot encode (integers past 64 bits, keys that
    are not strings) go through the standard library."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def b64decode(text: str) -> bytes:
    """Strict base64 (no characters outside the alphabet, correct padding); ValueError
    (binascii.Error) otherwise."""
    return pybase64.b64decode(text, validate=True)


def b64encode(data: bytes) -> str:
    """Base64 text of bytes."""
    return pybase64.b64encode_as_string(data)


__all__ = ["JSONDecodeError", "b64decode", "b64encode", "dumps", "loads_fast"]
