"""The session's settings: what `session.update` may set, how each value is checked, what
is accepted and not used (logged once; the session object reported back shows the settings
in effect), and that object."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnifabric.common import tools
from omnifabric.common.tools import ToolChoice, ToolSpec
from omnifabric.edge import events as ev
from omnifabric.edge import fields
from omnifabric.edge.chat import MAX_NEW_TOKENS
from omnifabric.edge.dialects.openai.audio import format_json, parse_format
from omnifabric.edge.dialects.openai.wire import BadParam, Wire
from omnifabric.edge.errors import InvalidPayload

TURN_DETECTION = ("server_vad", "semantic_vad")
#: Turn detection settings the engine's own turn-taking has no use for.
TURN_DETECTION_EXTRAS = ("prefix_padding_ms", "create_response", "idle_timeout_ms", "eagerness")
#: Their values that ask for what the engine does anyway (nothing to log).
USUAL_EXTRAS = {"create_response": True, "eagerness": "auto"}
EAGERNESS = ("low", "medium", "high", "auto")


def _eagerness(body: dict[str, Any], key: str, where: str) -> None:
    if body[key] not in (None, *EAGERNESS):
        raise InvalidPayload(f"{where}.{key} must be one of {', '.join(EAGERNESS)}")


#: Every key turn_detection takes (the API's) and its check (`type` is checked first).
TURN_DETECTION_CHECKS: dict[str, Callable[[dict[str, Any], str, str], object]] = {
    "type": lambda body, key, where: None,
    "threshold": lambda body, key, where: fields.number_field(
        body, key, *fields.VAD_THRESHOLD, where
    ),
    "silence_duration_ms": lambda body, key, where: fields.integer_field(
        body, key, *fields.END_OF_TURN_SILENCE_MS, where
    ),
    "prefix_padding_ms": lambda body, key, where: fields.integer_field(
        body, key, 0, fields.MAX_UINT32, where
    ),
    "idle_timeout_ms": lambda body, key, where: fields.integer_field(
        body, key, 0, fields.MAX_UINT32, where
    ),
    "create_response": fields.flag,
    "interrupt_response": fields.flag,
    "eagerness": _eagerness,
}
#: Accepted and not used: logged once when set (session.updated shows what is in effect).
UNSUPPORTED = {
    "tracing": "traces are the server's own (OpenTelemetry), not per-session settings",
    "prompt": "stored prompts are not available: send instructions",
    "include": "log probabilities are not available",
    "truncation": "the engine keeps its own context (closes with context_full when full)",
    "audio.input.transcription": "the engine's own transcript is reported when it has one",
    "audio.input.noise_reduction": "no noise reduction is applied",
    "audio.output.speed": "the engine speaks at its own speed",
    "audio.input.turn_detection.prefix_padding_ms": "the engine keeps its own margins",
    "audio.input.turn_detection.create_response": "the duplex engine decides when to answer",
    "audio.input.turn_detection.idle_timeout_ms": "no idle timeout: the engine decides",
    "audio.input.turn_detection.eagerness": "the engine's own turn-taking decides",
}
SESSION_KEYS = {
    "type",
    "tools",
    "tool_choice",
    "model",
    "instructions",
    "output_modalities",
    "audio",
    "max_output_tokens",
    *(k for k in UNSUPPORTED if "." not in k),
}
#: Voice names that mean the server's default voice.
DEFAULT_VOICES = ("", "default")
#: Settings a running duplex session cannot take (it started with them): a change keeps
#: the running value, which session.updated reports.
LOCKED = ("instructions", "output_modalities", "voice", "turn_detection")
#: Why a locked setting is not applied.
LOCKED_WHY = "the conversation's duplex session runs with the value it started with"


@dataclass
class Settings:
    """The session's settings as the client last set them."""

    instructions: str = ""
    output_modalities: tuple[str, ...] = ("audio",)
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"
    turn_detection: dict[str, Any] | None = field(default_factory=lambda: {"type": "server_vad"})
    voice: str = ""
    max_output_tokens: int | None = None
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)

    @property
    def speaks(self) -> bool:
        return "audio" in self.output_modalities


def modalities(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) != 1 or value[0] not in ("audio", "text"):
        raise BadParam(
            f"{where}.output_modalities", 'output_modalities must be ["audio"] or ["text"]'
        )
    return (value[0],)


def max_tokens(value: Any, where: str) -> int | None:
    if value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise BadParam(f"{where}.max_output_tokens", 'max_output_tokens must be 1 to 4096 or "inf"')
    return min(value, MAX_NEW_TOKENS)


#: A response's metadata, as the API bounds it: pairs, key and value lengths (strings).
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def metadata(value: Any, where: str) -> dict[str, str] | None:
    """A `metadata` map (echoed on the response), or BadParam naming what is wrong."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        raise BadParam(where, f"metadata must be an object of at most {MAX_METADATA_PAIRS} pairs")
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise BadParam(where, f"metadata keys are at most {MAX_METADATA_KEY} characters")
        if not isinstance(text, str) or len(text) > MAX_METADATA_VALUE:
            raise BadParam(
                f"{where}.{key}", f"metadata values are strings of {MAX_METADATA_VALUE} or fewer"
            )
    return value


def parse_tools(value: Any, where: str) -> tuple[ToolSpec, ...]:
    """A `tools` list of function tools -> ToolSpecs (BadParam naming what is wrong)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise BadParam(where, f"{where} must be a list of function tools")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise BadParam(f"{at}.type", f"{at}: only function tools are served")
        description = tool.get("description") or ""
        if not isinstance(description, str):
            raise BadParam(f"{at}.description", f"{at}.description must be a string")
        try:
            name = tools.check_name(tool.get("name"), f"{at}.name")
        except ValueError as exc:
            raise BadParam(f"{at}.name", str(exc)) from None
        try:
            schema = tools.check_schema(tool.get("parameters"), f"{at}.parameters")
        except ValueError as exc:
            raise BadParam(f"{at}.parameters", str(exc)) from None
        if any(s.name == name for s in specs):
            raise BadParam(f"{at}.name", f"{at}.name: a second function {name!r}")
        specs.append(ToolSpec(name, description, schema))
    return tuple(specs)


def parse_tool_choice(value: Any, specs: tuple[ToolSpec, ...], where: str) -> ToolChoice:
    """auto, none, required, or {type: function, name} of one of `specs`."""
    if value is None:
        return ToolChoice()
    if value in (tools.AUTO, tools.NONE, tools.REQUIRED):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str):
            raise BadParam(f"{where}.name", f"{where}.name must be a function's name")
        if not any(s.name == name for s in specs):
            raise BadParam(f"{where}.name", f"{where}.name: no function {name!r} in the tools")
        return ToolChoice(tools.FUNCTION, name)
    raise BadParam(where, f'{where} must be "auto", "none", "required" or a function')


def tools_json(specs: tuple[ToolSpec, ...]) -> list[dict[str, Any]]:
    return [{"type": "function", **s.json()} for s in specs]


def tool_choice_json(choice: ToolChoice) -> str | dict[str, str]:
    if choice.kind == tools.FUNCTION:
        return {"type": "function", "name": choice.name}
    return choice.kind


def tokens_json(cap: int | None) -> int | str:
    return "inf" if cap is None else cap


class Voices:
    """The registered voices as this dialect names them."""

    def __init__(self, lookup: Callable[[str], bytes | None] | None) -> None:
        self._lookup = lookup

    def audio(self, voice: str) -> bytes:
        """A registered voice's reference audio; b"" for the default voice or an unknown
        one (said when it was set)."""
        if voice in DEFAULT_VOICES or self._lookup is None:
            return b""
        return self._lookup(voice) or b""

    def name(self, voice: str) -> str:
        """The voice that speaks, as the session reports it."""
        return voice if self.audio(voice) else "default"


class SettingsUpdate:
    """One `session.update`: the new settings (what is ignored is logged)."""

    def __init__(self, wire: Wire, voices: Voices, current: Settings) -> None:
        self.wire = wire
        self.voices = voices
        self.current = current
        self.new = dataclasses.replace(current)

    def apply(self, body: Any, started: bool) -> Settings:
        """Check and apply the update's `session` body; `started`: the duplex session
        runs with the settings it started with."""
        if not isinstance(body, dict):
            raise BadParam("session", "'session' must be an object")
        unknown = sorted(set(body) - SESSION_KEYS)
        if unknown:
            raise BadParam(f"session.{unknown[0]}", f"unknown parameter 'session.{unknown[0]}'")
        if body.get("type", "realtime") != "realtime":
            raise BadParam("session.type", "only realtime sessions are served (no transcription)")
        self._top(body)
        audio = body.get("audio")
        if audio is not None:
            if not isinstance(audio, dict):
                raise BadParam("session.audio", "audio must be an object")
            self._audio(audio)
        for key in UNSUPPORTED:
            if "." not in key and body.get(key) not in (None, [], "auto", "none"):
                self.wire.ignored(f"session.{key}", UNSUPPORTED[key])
        if started:
            self._locked()
        return self.new

    def _top(self, body: dict[str, Any]) -> None:
        new = self.new
        if "instructions" in body:
            if not isinstance(body["instructions"], str):
                raise BadParam("session.instructions", "instructions must be a string")
            new.instructions = body["instructions"]
        if "output_modalities" in body:
            new.output_modalities = modalities(body["output_modalities"], "session")
        if "max_output_tokens" in body:
            new.max_output_tokens = max_tokens(body["max_output_tokens"], "session")
        if "tools" in body:
            new.tools = parse_tools(body["tools"], "session.tools")
        if "tool_choice" in body or "tools" in body:
            choice = body.get("tool_choice", tool_choice_json(new.tool_choice))
            new.tool_choice = parse_tool_choice(choice, new.tools, "session.tool_choice")

    def _locked(self) -> None:
        before, new = self.current, self.new
        for name in LOCKED:
            if getattr(new, name) != getattr(before, name):
                self.wire.ignored(f"session.{name}", LOCKED_WHY)
                setattr(new, name, getattr(before, name))

    def _audio(self, audio: dict[str, Any]) -> None:
        new = self.new
        inp = fields.obj(audio, "input")
        out = fields.obj(audio, "output")
        if inp.get("format") is not None:
            new.input_format = parse_format(inp["format"], "session.audio.input.format")
        if out.get("format") is not None:
            new.output_format = parse_format(out["format"], "session.audio.output.format")
        for key in ("transcription", "noise_reduction"):
            if inp.get(key) is not None:
                name = f"audio.input.{key}"
                self.wire.ignored(name, UNSUPPORTED[name])
        if out.get("speed") not in (None, 1, 1.0):
            self.wire.ignored("audio.output.speed", UNSUPPORTED["audio.output.speed"])
        if "voice" in out:
            self._voice(out["voice"])
        if "turn_detection" in inp:
            self._turn_detection(inp["turn_detection"])

    def _voice(self, voice: Any) -> None:
        if not isinstance(voice, str):
            raise BadParam("session.audio.output.voice", "voice must be a string")
        self.new.voice = voice
        if voice not in DEFAULT_VOICES and not self.voices.audio(voice):
            self.wire.ignored(
                f"audio.output.voice={voice}",
                f"no registered voice {fields.shown(voice)} (POST /api/assets/ref_audio registers "
                "one): the server's default voice speaks",
            )

    def _turn_detection(self, value: Any) -> None:
        where = "session.audio.input.turn_detection"
        if value is None:
            self.new.turn_detection = None
            return
        if not isinstance(value, dict) or value.get("type") not in TURN_DETECTION:
            raise BadParam(
                f"{where}.type", "turn_detection.type must be server_vad or semantic_vad"
            )
        # Checked here (threshold and silence applied to the duplex session at its start;
        # the rest echoed in session.updated), and nothing else taken, as the API does.
        for key in value:
            check = TURN_DETECTION_CHECKS.get(key)
            if check is None:
                raise BadParam(f"{where}.{key}", f"unknown parameter '{where}.{key}'")
            try:
                check(value, key, where)
            except InvalidPayload as err:
                raise BadParam(f"{where}.{key}", err.message) from None
        # What the engine does anyway needs no notice: answering, yielding, its own pace.
        for key in TURN_DETECTION_EXTRAS:
            if value.get(key) is not None and value.get(key) != USUAL_EXTRAS.get(key):
                name = f"audio.input.turn_detection.{key}"
                self.wire.ignored(name, UNSUPPORTED[name])
        self.new.turn_detection = dict(value)


def session_json(s: Settings, session_id: str | None, model: str, voice: str) -> dict[str, Any]:
    """The session object of session.created / session.updated (`voice`: the one that
    speaks)."""
    turn = None if s.turn_detection is None else dict(s.turn_detection)
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": model,
        "output_modalities": list(s.output_modalities),
        "instructions": s.instructions,
        "max_output_tokens": tokens_json(s.max_output_tokens),
        "audio": {
            "input": {
                "format": format_json(s.input_format),
                "turn_detection": turn,
                "transcription": None,
                "noise_reduction": None,
            },
            "output": {"format": format_json(s.output_format), "voice": voice, "speed": 1.0},
        },
        "tools": tools_json(s.tools),
        "tool_choice": tool_choice_json(s.tool_choice),
    }


def init_command(s: Settings, ref_audio: bytes) -> ev.InitCommand:
    """The duplex session's start, with the settings it runs with."""
    turn = s.turn_detection or {}
    threshold = turn.get("threshold")
    config = ev.DuplexSettings(
        tts_enabled=s.speaks,
        vad_threshold=None if threshold is None else float(threshold),
        end_of_turn_silence_ms=turn.get("silence_duration_ms"),
    )
    return ev.InitCommand(
        dialect=ev.Dialect.CURRENT,
        system_prompt=s.instructions,
        config=config,
        ref_audio=ref_audio,
        tools=s.tools,
        tool_choice=s.tool_choice,
    )
