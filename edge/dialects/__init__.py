"""Every dialect the edge speaks, by where clients reach it.

A dialect is one translator module (client messages <-> domain commands and events, no
I/O: see base.py); adding one is that module plus one line in a table below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from omnifabric.edge.dialects.base import ChatDialect, DuplexDialect
from omnifabric.edge.dialects.grpc_realtime import GrpcRealtime
from omnifabric.edge.dialects.half_duplex import HalfDuplex
from omnifabric.edge.dialects.http_chat import HttpChat
from omnifabric.edge.dialects.legacy_chat import LegacyChat
from omnifabric.edge.dialects.legacy_duplex import LegacyDuplex
from omnifabric.edge.dialects.openai import OpenAIRealtime
from omnifabric.edge.dialects.realtime import RealtimeDuplex
from omnifabric.edge.dialects.realtime_chat import RealtimeChat

Dialect = DuplexDialect | ChatDialect
#: The kind of dialect a route opens (a table of routes may mix kinds: Route[Dialect]).
D = TypeVar("D", bound=Dialect, covariant=True)


@dataclass(frozen=True)
class Route(Generic[D]):
    """Where a dialect is reached. `open(rest, query, default_mode)` makes the dialect of
    one connection: `rest` is the path after a prefix route, `query` the URL's query."""

    path: str
    open: Callable[[str, Mapping[str, list[str]], str], D]
    prefix: bool = False

    def matches(self, path: str) -> bool:
        if self.prefix:
            return path.startswith(self.path) and len(path) > len(self.path)
        return path == self.path


def _realtime(_: str, query: Mapping[str, list[str]], default_mode: str) -> Dialect:
    if "mode" not in query and "model" in query:
        # OpenAI's clients name a model and never a mode; MiniCPM-o's always name a mode.
        return OpenAIRealtime(query["model"][0][:128])
    mode = (query.get("mode") or [default_mode])[0]
    if mode == "chat":
        return RealtimeChat()
    token = (query.get("resume_token") or [""])[0]
    return RealtimeDuplex(mode, token, (query.get("last_seq") or [""])[0])


WEBSOCKET: tuple[Route[Dialect], ...] = (
    Route("/v1/realtime", _realtime),
    Route("/ws/duplex/", lambda rest, _q, _m: LegacyDuplex(rest), prefix=True),
    Route("/ws/chat", lambda _r, _q, _m: LegacyChat()),
    Route("/ws/half_duplex/", lambda rest, _q, _m: HalfDuplex(rest), prefix=True),
)
HTTP: tuple[Route[ChatDialect], ...] = (Route("/api/chat", lambda _r, _q, _m: HttpChat()),)
GRPC_CONNECT = Route("/omni.realtime.v1.RealtimeService/Connect", lambda _r, _q, _m: GrpcRealtime())


def find(routes: tuple[Route[D], ...], path: str) -> tuple[Route[D], str] | None:
    """The route for `path` and the rest of the path after it, or None."""
    for route in routes:
        if route.matches(path):
            return route, path[len(route.path) :] if route.prefix else ""
    return None
