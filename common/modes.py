"""The session modes: one enum, its names, and the one map to and from common.proto's Mode.

The scheduler keeps modes as Mode; the edge and the worker name them ("audio", "video",
"chat"); the wire carries common.proto's values. Every conversion goes through here.
"""

from __future__ import annotations

import enum

from omnifabric.omni.realtime.v1 import common_pb2


class Mode(enum.Enum):
    """Session mode a request asks for and a worker serves."""

    AUDIO = "audio"
    VIDEO = "video"
    CHAT = "chat"


#: Every mode's name.
NAMES = tuple(m.value for m in Mode)
#: The modes of a duplex session ("chat" is a turn's).
DUPLEX = (Mode.AUDIO.value, Mode.VIDEO.value)

_TO_PB = {
    Mode.AUDIO: common_pb2.MODE_AUDIO,
    Mode.VIDEO: common_pb2.MODE_VIDEO,
    Mode.CHAT: common_pb2.MODE_CHAT,
}
_FROM_PB = {value: mode for mode, value in _TO_PB.items()}


def to_pb(mode: Mode | str) -> common_pb2.Mode:
    """The wire value of a mode or a mode's name (ValueError for an unknown name)."""
    return _TO_PB[mode if isinstance(mode, Mode) else Mode(mode)]


def from_pb(value: int) -> Mode | None:
    """The mode a wire value carries; None for MODE_UNSPECIFIED or an unknown value."""
    return _FROM_PB.get(value)  # type: ignore[call-overload]


def name(value: int) -> str | None:
    """The name of the mode a wire value carries; None where from_pb gives None."""
    mode = from_pb(value)
    return None if mode is None else mode.value


def label(value: int) -> str:
    """What status pages call a wire value: its mode's name, else the enum's own name
    lowercased ("unspecified", or the number of a value this build does not know)."""
    found = name(value)
    if found is not None:
        return found
    try:
        return common_pb2.Mode.Name(value).removeprefix("MODE_").lower()
    except ValueError:
        return str(value)
