"""How deep JSON may nest where the standard library reads or writes it: its parser and
writer recurse once a level, and at the interpreter's recursion limit (1000 frames, the
server's own included) they fail, and so does any finalizer a garbage collection runs
there. Every reader of JSON text that orjson does not read (edge.fields' strict path, tool
schemas and arguments on the wire, the calls a model writes) and every check of a nested
value a client sends whole (a tool's parameters schema) asks here first.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

#: The deepest JSON text the standard library is given to read (objects and arrays), well
#: under the interpreter's limit whatever the caller's own stack. orjson refuses past 1024.
MAX_PARSE_DEPTH = 512
#: What the count sees: brackets, and strings (skipped whole; an unterminated one runs to
#: the end of the text).
_STRUCTURE = re.compile(r'[\[\]{}]|"[^"\\]*(?:\\[\s\S][^"\\]*)*"?')


class TooDeep(ValueError):
    """JSON nested past the limit the reader was given."""


def text_deeper_than(text: str, limit: int) -> bool:
    """Whether brackets outside strings nest more than `limit` deep in `text` (a scan,
    no recursion; free for text with fewer brackets than that)."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for token in _STRUCTURE.finditer(text):
        char = text[token.start()]
        if char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char != '"':
            depth -= 1
    return False


def value_deeper_than(value: Any, limit: int) -> bool:
    """Whether dicts and lists nest more than `limit` deep in `value` (no recursion)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > limit:
            return True
        pending.extend((child, depth + 1) for child in children)
    return False


def loads(text: str, limit: int = MAX_PARSE_DEPTH, **options: Any) -> Any:
    """The standard library's json.loads (`options` its keywords) of text nested at most
    `limit` deep; TooDeep (a ValueError) past it, before any parsing."""
    if text_deeper_than(text, limit):
        raise TooDeep(f"JSON nested deeper than {limit} levels")
    return json.loads(text, **options)


def raw_decode(text: str, start: int = 0, limit: int = MAX_PARSE_DEPTH) -> tuple[Any, int]:
    """json.JSONDecoder().raw_decode: the JSON value at `start` in text that may go on
    past it, and where it ends; TooDeep when the rest of the text nests past `limit`
    anywhere (checked first: what follows the value is counted too)."""
    if text_deeper_than(text[start:], limit):
        raise TooDeep(f"JSON nested deeper than {limit} levels")
    return _DECODER.raw_decode(text, start)


_DECODER = json.JSONDecoder()
