"""Function calling's plain types, shared by the edge, the worker and its engines: a function
a reply may call (ToolSpec), a call (ToolCall), how a request lets the reply call
(ToolChoice), and the one check of a call's arguments against its function's schema.

The schema is the JSON schema subset function definitions use: an object with
`properties` (each with a `type`: string, integer, number, boolean, array, object, null,
or a list of them; `enum`; `items` of an array), `required`, and
`additionalProperties: false`. Anything else in a schema is kept and not checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnifabric.common import nesting

#: How a request lets its reply call functions.
AUTO, NONE, REQUIRED, FUNCTION = "auto", "none", "required", "function"
CHOICES = (AUTO, NONE, REQUIRED, FUNCTION)
#: Why a reply ended when it ended in calls (ChatDone.reason).
TOOL_CALLS = "tool_calls"
#: A function name: what the OpenAI API and the chat templates take.
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_NAME = 64
#: A parameters schema nests at most this deep (objects and lists): past any real
#: function's, and shallow enough for every JSON writer and check that walks it.
MAX_SCHEMA_DEPTH = 32

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class ToolSpec:
    """A function a reply may call."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    """Its arguments' JSON schema (an object schema; {} takes any object)."""

    def json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


@dataclass(frozen=True)
class ToolCall:
    """A call a reply made: `arguments` is a JSON object as text."""

    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolChoice:
    """AUTO (the model decides), NONE, REQUIRED (at least one call), or FUNCTION (`name`)."""

    kind: str = AUTO
    name: str = ""

    def allows_calls(self) -> bool:
        return self.kind != NONE


def check_name(name: Any, where: str) -> str:
    """A function name, or ValueError naming `where`."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise ValueError(f"{where} must be a name of 1 to {MAX_NAME} characters")
    if not set(name) <= NAME_CHARS:
        raise ValueError(f"{where} may hold letters, digits, '_' and '-' only")
    return name


def check_schema(schema: Any, where: str) -> dict[str, Any]:
    """A function's parameters schema, or ValueError naming what is wrong."""
    if schema is None:
        return {}
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object")
    if nesting.value_deeper_than(schema, MAX_SCHEMA_DEPTH):
        raise ValueError(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where}.type must be object")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(
        isinstance(p, dict) for p in properties.values()
    ):
        raise ValueError(f"{where}.properties must map names to schemas")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{where}.required must be a list of names")
    return schema


def argument_errors(spec: ToolSpec, arguments: str) -> list[str]:
    """What is wrong with a call's arguments (JSON text) for `spec`: [] when they fit."""
    try:
        value = nesting.loads(arguments)
    except ValueError as exc:
        return [f"the arguments are not JSON ({exc})"]
    return _errors(value, spec.parameters or {"type": "object"}, "arguments")


def _errors(value: Any, schema: dict[str, Any], at: str) -> list[str]:
    problems = _type_errors(value, schema.get("type"), at)
    if problems:
        return problems
    if "enum" in schema and value not in schema["enum"]:
        return [f"{at} must be one of {schema['enum']}"]
    if isinstance(value, dict):
        return _object_errors(value, schema, at)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [e for i, v in enumerate(value) for e in _errors(v, schema["items"], f"{at}[{i}]")]
    return []


def _type_errors(value: Any, kind: Any, at: str) -> list[str]:
    if kind is None:
        return []
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        types = _TYPES.get(k)
        if types is None:
            return []  # a type this check does not know: not checked
        if isinstance(value, types) and not (
            isinstance(value, bool) and k in ("integer", "number")
        ):
            return []
        if k == "number" and isinstance(value, float) and value.is_integer():
            return []
        if k == "integer" and isinstance(value, float) and value.is_integer():
            return []
    return [f"{at} must be {' or '.join(str(k) for k in kinds)}"]


def _object_errors(value: dict[str, Any], schema: dict[str, Any], at: str) -> list[str]:
    properties = schema.get("properties") or {}
    problems = [
        f"{at}.{name} is required" for name in schema.get("required", []) if name not in value
    ]
    if schema.get("additionalProperties") is False:
        problems += [f"{at}.{k} is not a parameter" for k in value if k not in properties]
    for key, item in value.items():
        if isinstance(properties.get(key), dict):
            problems += _errors(item, properties[key], f"{at}.{key}")
    return problems
