"""Function calling on the wire: the one map between common.tools' types and common.proto's
ToolSpec and ToolCall, used by the worker's servicer, the edge's worker client and the
gRPC RealtimeService dialect."""

from __future__ import annotations

import json
from collections.abc import Iterable

from omnifabric.common import nesting, tools
from omnifabric.common.tools import ToolCall, ToolChoice, ToolSpec
from omnifabric.omni.realtime.v1 import common_pb2


def specs_to_pb(specs: Iterable[ToolSpec]) -> list[common_pb2.ToolSpec]:
    return [
        common_pb2.ToolSpec(
            name=s.name, description=s.description, parameters_json=json.dumps(s.parameters)
        )
        for s in specs
    ]


def specs_from_pb(
    msgs: Iterable[common_pb2.ToolSpec], where: str = "tools"
) -> tuple[ToolSpec, ...]:
    """Checked: ValueError naming the function that is wrong (a bad name, a schema that is
    not JSON or not an object schema, a name given twice)."""
    specs: list[ToolSpec] = []
    for i, msg in enumerate(msgs):
        name = tools.check_name(msg.name, f"{where}[{i}].name")
        text = msg.parameters_json or "{}"
        try:
            schema = nesting.loads(text, tools.MAX_SCHEMA_DEPTH)
        except nesting.TooDeep as exc:
            raise ValueError(f"{where}[{i}].parameters_json: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{where}[{i}].parameters_json is not JSON ({exc})") from None
        schema = tools.check_schema(schema, f"{where}[{i}].parameters")
        if any(s.name == name for s in specs):
            raise ValueError(f"{where}[{i}].name: a second function {name!r}")
        specs.append(ToolSpec(name, msg.description, schema))
    return tuple(specs)


def choice_from(kind: str, name: str, specs: tuple[ToolSpec, ...]) -> ToolChoice:
    """A tool choice as the wire gives it ("" = auto). ValueError when it is not one, or
    names no function of `specs`."""
    kind = kind or tools.AUTO
    if kind not in tools.CHOICES:
        raise ValueError(f"tool_choice must be one of {', '.join(tools.CHOICES)}")
    if kind == tools.FUNCTION and name not in {s.name for s in specs}:
        raise ValueError(f"tool_choice names no function of the request: {name!r}")
    return ToolChoice(kind, name if kind == tools.FUNCTION else "")


def call_to_pb(call: ToolCall) -> common_pb2.ToolCall:
    return common_pb2.ToolCall(call_id=call.call_id, name=call.name, arguments_json=call.arguments)


def call_from_pb(msg: common_pb2.ToolCall) -> ToolCall:
    return ToolCall(msg.call_id, msg.name, msg.arguments_json)
