"""One configuration scheme for every service: a frozen dataclass whose fields are declared
with `setting(...)` (the OMNI_* variable, the command-line flag, the range or choices), read
by the same code from the environment and from flags.

    port: int = setting(50051, env="OMNI_SCHEDULER_PORT", flag="--port", range=(0, 65535))

- `load(Config, environ, flags)`: defaults, then the variables that are set, then the flags
  given (flags win). A malformed or out-of-range value raises ConfigError naming where it came
  from: the variable (`OMNI_SCHEDULER_PORT must be in 0..65535, got 70000`) or the flag.
- `check(config)`, called by each dataclass's __post_init__, holds the ranges and choices
  whatever built the config (tests and tools construct configs directly too).
- `add_flags(parser, Config)`: one argparse option per setting that has a flag, whose help
  names the variable and the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

_KEY = "omnifabric.setting"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one field is set: its variable, its flags, and what values it takes."""

    env: str
    flags: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] | None = None
    help: str = ""
    repeat: bool = False
    """A tuple field whose flag may be given several times (the variable: comma-separated)."""


class ConfigError(ValueError):
    """A setting is malformed or out of range; the message names the variable or flag."""

    def __init__(self, subject: str, detail: str) -> None:
        super().__init__(f"{subject} {detail}")
        self.subject = subject
        self.detail = detail


def setting(
    default: Any = dataclasses.MISSING,
    *,
    env: str,
    flag: str | tuple[str, ...] = (),
    range: tuple[float, float] | None = None,  # noqa: A002 - reads best at the call site
    choices: tuple[str, ...] | None = None,
    help: str = "",  # noqa: A002
    repeat: bool = False,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field read from `env` (and `flag`, when given)."""
    spec = Setting(
        env=env,
        flags=(flag,) if isinstance(flag, str) else tuple(flag),
        low=None if range is None else range[0],
        high=None if range is None else range[1],
        choices=choices,
        help=help,
        repeat=repeat,
    )
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={_KEY: spec})
    return dataclasses.field(default=default, metadata={_KEY: spec})


def settings(cls: type) -> dict[str, Setting]:
    """Field name -> Setting, for the fields of `cls` declared with setting()."""
    return {f.name: f.metadata[_KEY] for f in dataclasses.fields(cls) if _KEY in f.metadata}


def _types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base(kind: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return kind, False


def parse(kind: Any, raw: str, subject: str) -> Any:
    """`raw` as a value of type `kind`; ConfigError naming `subject` when it is not one."""
    base, optional = _base(kind)
    text = raw.strip()
    if optional and text.lower() in ("", "none", "auto"):
        return None
    if base is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(subject, f"must be one of {'/'.join(_TRUE + _FALSE)}, got {raw!r}")
    if base is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(subject, f"must be an integer, got {raw!r}") from None
    if base is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(subject, f"must be a number, got {raw!r}") from None
    if typing.get_origin(base) is tuple:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if not text:
        raise ConfigError(subject, "must not be empty")
    return raw


def check_value(spec: Setting, value: Any, subject: str) -> None:
    """Raise ConfigError naming `subject` unless `value` is within the setting's range and
    choices (None passes: it means "the default of whoever uses it")."""
    if value is None:
        return
    if spec.low is not None and spec.high is not None:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and spec.low <= value <= spec.high):
            low, high = _plain(spec.low), _plain(spec.high)
            raise ConfigError(subject, f"must be in {low}..{high}, got {value!r}")
    if spec.choices is not None and value not in spec.choices:
        raise ConfigError(subject, f"must be one of {', '.join(spec.choices)}, got {value!r}")


def _plain(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def check(config: Any) -> None:
    """Every setting of `config` within its range and choices; ConfigError naming the field's
    variable otherwise (load() names the flag instead when a flag set it)."""
    for name, spec in settings(type(config)).items():
        check_value(spec, getattr(config, name), spec.env)


def load(
    cls: type[T],
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    **values: Any,
) -> T:
    """`cls` from its defaults, the variables set in `environ` (os.environ by default), then
    `values` (fields computed by the caller), then `flags` (field -> value; None = not given).
    Raises ConfigError naming the variable or flag at fault."""
    env = os.environ if environ is None else environ
    kinds = _types(cls)
    sources: dict[str, str] = {}
    for name, spec in settings(cls).items():
        raw = env.get(spec.env)
        if raw is not None and raw.strip() != "":
            values[name] = parse(kinds[name], raw, spec.env)
            sources[spec.env] = spec.env
    for name, value in (flags or {}).items():
        if value is None:
            continue
        spec = settings(cls)[name]
        values[name] = tuple(value) if spec.repeat else value
        if spec.flags:
            sources[spec.env] = spec.flags[0]
    try:
        return cls(**values)
    except ConfigError as exc:
        raise ConfigError(sources.get(exc.subject, exc.subject), exc.detail) from None


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One option per setting of `cls` that has a flag. Values are parsed and checked as they
    are read (argparse names the flag); an option not given stays None."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    kinds = _types(cls)
    for name, spec in settings(cls).items():
        if not spec.flags:
            continue
        default = defaults[name]
        shown = "" if default is dataclasses.MISSING or default in (None, ()) else default
        text = f"{spec.help} (env {spec.env}" + (f", default {shown})" if shown != "" else ")")
        base, _ = _base(kinds[name])
        if base is bool:
            parser.add_argument(
                *spec.flags, dest=name, action="store_true", default=None, help=text.strip()
            )
            continue
        converter = _converter(spec, base if spec.repeat else kinds[name])
        if spec.repeat:
            parser.add_argument(
                *spec.flags, dest=name, type=converter, action="append", help=text.strip()
            )
        else:
            parser.add_argument(*spec.flags, dest=name, type=converter, help=text.strip())


def _converter(spec: Setting, kind: Any) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        try:
            value = raw if spec.repeat else parse(kind, raw, spec.flags[0])
            check_value(spec, value, spec.flags[0])
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    return convert


def flag_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The settings of `cls` given as flags in `args` (field -> value, None = not given)."""
    return {name: getattr(args, name) for name in settings(cls) if hasattr(args, name)}
