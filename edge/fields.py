"""The one validator of client fields, for every dialect: JSON text, objects, numbers,
integers, flags, strings and the duplex settings. No I/O here; audio, image and base64
payloads are checked in edge.pcm.

Every check raises a ClientError naming the field (`where.key`), so a client sees which
field is wrong and the connection goes on.
"""

from __future__ import annotations

import json
import math
from typing import Any

from omnifabric.common import nesting
from omnifabric.common.session_types import WINDOW_MODES
from omnifabric.edge import codec
from omnifabric.edge.errors import InvalidPayload, MissingField
from omnifabric.edge.events import DuplexSettings

#: At most this many video frames in one unit (the model takes ~1 frame per second).
MAX_FRAMES_PER_UNIT = 4
#: The largest value a uint32 protobuf field carries.
MAX_UINT32 = (1 << 32) - 1
#: The model's fixed context, tokens.
MAX_CONTEXT_TOKENS = 8192


class InvalidJson(Exception):
    """The frame is not JSON text at all: a WebSocket connection closes with 1003."""


class _NonFinite(Exception):
    pass


def _reject_constant(name: str) -> float:
    raise _NonFinite(name)


def parse_object(text: str, what: str = "an event") -> dict[str, Any]:
    """Decode a JSON object (`what`: how errors name it). Raises InvalidJson for text that
    is not JSON, InvalidPayload for JSON that is too deep, uses NaN/Infinity, has an
    integer past Python's digit limit, or is not an object."""
    try:
        value = codec.loads_fast(text)
    except codec.JSONDecodeError:
        value = _parse_strictly(text)
    if not isinstance(value, dict):
        raise InvalidPayload(f"{what} must be a JSON object")
    return value


def _parse_strictly(text: str) -> Any:
    """The standard library's reading of what orjson refused: the exact error (or the
    value: a lone surrogate escape is JSON), never nested past common.nesting's limit."""
    try:
        return nesting.loads(text, parse_constant=_reject_constant)
    except (nesting.TooDeep, RecursionError):  # RecursionError: a deep caller's own stack
        raise InvalidPayload("JSON nesting too deep") from None
    except _NonFinite as exc:
        raise InvalidPayload(f"{exc} is not a JSON number") from None
    except json.JSONDecodeError as exc:
        raise InvalidJson(str(exc)) from None
    except ValueError:
        # Valid JSON all the same: an integer past Python's digit limit (4300 digits).
        raise InvalidPayload("a number in the JSON text is too long") from None


def parse_frame(text: str) -> dict[str, Any]:
    """Decode one text frame into an event object with a string `type` (errors as
    parse_object, and MissingField without `type`)."""
    event = parse_object(text)
    if "type" not in event:
        raise MissingField("event has no 'type'")
    if not isinstance(event["type"], str):
        raise InvalidPayload("'type' must be a string")
    return event


def shown(value: Any, limit: int = 64) -> str:
    """A client's value as an error message quotes it: at most `limit` characters of a
    string or number, a container by its kind (never the repr of a nested one, which
    recurses once a level)."""
    if isinstance(value, dict | list):
        return "an object" if isinstance(value, dict) else "a list"
    return repr(value[:limit] if isinstance(value, str) else value)[: limit + 2]


def obj(body: dict[str, Any], key: str, required: bool = False) -> dict[str, Any]:
    """``body[key]`` as an object ({} when absent and not required)."""
    value = body.get(key)
    if value is None:
        if required:
            raise MissingField(f"'{key}' is required")
        return {}
    if not isinstance(value, dict):
        raise InvalidPayload(f"'{key}' must be an object")
    return value


def _name(where: str, key: str) -> str:
    """How a message names the field: `where.key`, or `'key'` at the top level."""
    return f"{where}.{key}" if where else f"'{key}'"


def number_field(
    cfg: dict[str, Any], key: str, lo: float, hi: float, where: str = "config"
) -> float | None:
    """``cfg[key]`` as a float in [lo, hi], None when absent; InvalidPayload naming
    ``where.key`` otherwise."""
    value = cfg.get(key)
    if value is None:
        return None
    # An int is compared as it is: math.isfinite() overflows on one beyond float range.
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise InvalidPayload(f"{_name(where, key)} must be a number")
    if not lo <= value <= hi:
        raise InvalidPayload(f"{_name(where, key)} must be in [{lo}, {hi}]")
    return float(value)


def integer_field(
    cfg: dict[str, Any], key: str, lo: int, hi: int, where: str = "config"
) -> int | None:
    """``cfg[key]`` as an int in [lo, hi], None when absent; InvalidPayload otherwise."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidPayload(f"{_name(where, key)} must be an integer")
    if not lo <= value <= hi:
        raise InvalidPayload(f"{_name(where, key)} must be in [{lo}, {hi}]")
    return value


def flag(cfg: dict[str, Any], key: str, where: str = "config") -> bool | None:
    """``cfg[key]`` as true/false, None when absent."""
    value = cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise InvalidPayload(f"{_name(where, key)} must be true or false")
    return value


def string(body: dict[str, Any], key: str, what: str | None = None) -> str | None:
    """``body[key]`` as a string, None when absent or null."""
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidPayload(f"{what or repr(key)} must be a string")
    return value


def voice_id(bodies: tuple[dict[str, Any], ...], key: str, audio_key: str) -> str:
    """A registered voice's id under `key` in the first of `bodies` that has one ("" for
    none); InvalidPayload when the audio itself (`audio_key`) is sent too."""
    for body in bodies:
        value = string(body, key)
        if value:
            if any(b.get(audio_key) for b in bodies):
                raise InvalidPayload(f"send {audio_key} or {key}, not both")
            return value
    return ""


def slice_count(value: Any, where: str = "max_slice_nums") -> int:
    """A max_slice_nums as sent (0 when absent): a positive integer that fits the wire
    (uint32). Only its form is checked here; the range a model takes comes from the
    leased worker (edge.worker_client.check_slices, against the lease's limits)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidPayload(f"{where} must be a positive integer")
    if value > MAX_UINT32:
        raise InvalidPayload(f"{where} is far too large")
    return value


#: The largest sampling seed a session may give (the wire's uint64 holds it; torch takes
#: seeds below 2**63 on every device).
MAX_SEED = (1 << 63) - 1

#: Voice-activity turn-taking (engines that detect the user's turn by VAD): a window's speech
#: probability threshold, the speech a turn needs (ms) and the silence that ends it (ms).
VAD_THRESHOLD = (0.05, 0.99)
MIN_SPEECH_MS = (0, 5000)
END_OF_TURN_SILENCE_MS = (100, 5000)


def duplex_settings(cfg: dict[str, Any], where: str = "config") -> DuplexSettings:
    """Validate a duplex `config` object, mapping the SDK's own keys; others ignored."""
    return DuplexSettings(
        length_penalty=number_field(cfg, "length_penalty", 0.0, 10.0, where),
        temperature=number_field(cfg, "temperature", 0.0, 5.0, where),
        top_k=integer_field(cfg, "top_k", 1, 1000, where),
        top_p=number_field(cfg, "top_p", 0.0, 1.0, where),
        listen_prob_scale=number_field(cfg, "listen_prob_scale", 0.0, 100.0, where),
        force_listen_count=integer_field(cfg, "force_listen_count", 0, 100, where),
        max_new_speak_tokens_per_chunk=integer_field(
            cfg, "max_new_speak_tokens_per_chunk", 1, 200, where
        ),
        max_kv_tokens=integer_field(cfg, "max_kv_tokens", 64, MAX_CONTEXT_TOKENS, where),
        tts_enabled=flag(cfg, "tts_enabled", where),
        max_tokens=integer_field(cfg, "max_tokens", 1, 1 << 20, where),
        vad_threshold=number_field(cfg, "vad_threshold", *VAD_THRESHOLD, where),
        min_speech_ms=integer_field(cfg, "min_speech_ms", *MIN_SPEECH_MS, where),
        end_of_turn_silence_ms=integer_field(
            cfg, "end_of_turn_silence_ms", *END_OF_TURN_SILENCE_MS, where
        ),
        seed=integer_field(cfg, "seed", 0, MAX_SEED, where),
        context_window=window_mode(cfg, where),
        window_high_tokens=integer_field(cfg, "window_high_tokens", 2, MAX_CONTEXT_TOKENS, where),
        window_low_tokens=integer_field(cfg, "window_low_tokens", 1, MAX_CONTEXT_TOKENS, where),
        window_units=integer_field(cfg, "window_units", 1, MAX_CONTEXT_TOKENS, where),
        window_previous_tokens=integer_field(
            cfg, "window_previous_tokens", 0, MAX_CONTEXT_TOKENS, where
        ),
    )


def window_mode(cfg: dict[str, Any], where: str = "config") -> str | None:
    """``cfg["context_window"]``: off, basic or context (None when absent). Whether the
    watermarks fit the worker's context cap is the worker's to say (it knows the cap)."""
    value = string(cfg, "context_window", _name(where, "context_window"))
    if value is not None and value not in WINDOW_MODES:
        raise InvalidPayload(
            f"{_name(where, 'context_window')} must be one of {', '.join(WINDOW_MODES)}"
        )
    return value


def frame_list(value: Any, key: str) -> list[Any]:
    """A list of base64 JPEG frames for one unit (at most MAX_FRAMES_PER_UNIT)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidPayload(f"'{key}' must be a list of base64 JPEG strings")
    if len(value) > MAX_FRAMES_PER_UNIT:
        raise InvalidPayload(f"at most {MAX_FRAMES_PER_UNIT} video frames per unit")
    return value
