"""Settings objects whose command line is generated from them: each field is declared once, with its flag, help,
parse and check (`option`), and `Settings` turns the dataclass into argparse flags, back into an object, and
into the argv that reproduces it (what a launcher hands its workers)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from stackproof import environment
from stackproof.errors import ConfigError

_S = TypeVar("_S", bound="Settings")

_SIZE = re.compile(r"^(\d+)\s*([KMG]i?B?|B)?$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_bytes(text: str) -> int:
    """'4G', '256MiB', '65536' -> bytes (binary units, as nccl-tests' -b/-e take them)."""
    match = _SIZE.match(str(text).strip())
    if not match:
        raise ValueError(f"expected a size such as 65536, 64K, 256M or 4G, found {text!r}")
    return int(match.group(1)) * _UNITS[(match.group(2) or "").lower()[:1]]


def at_least(low: float) -> Callable[[Any], str | None]:
    return lambda v: None if v is None or v >= low else f"expected >= {low:g}, found {v}"


def between(low: float, high: float) -> Callable[[Any], str | None]:
    return lambda v: None if v is None or low <= v <= high else f"expected {low:g} to {high:g}, found {v}"


def positive(v: Any) -> str | None:
    return None if v is None or v > 0 else f"expected > 0, found {v}"


# The longest wait a seconds flag may ask for: 30 days. Longer is a typo, and past it the waits underneath
# overflow (timedelta, thread waits: OverflowError in every rank instead of exit 2 here).
MAX_SECONDS = 30 * 24 * 3600


def seconds(v: Any) -> str | None:
    """A duration: positive, finite, at most MAX_SECONDS."""
    return None if v is None or 0 < v <= MAX_SECONDS else f"expected seconds in (0, {MAX_SECONDS}] (30 days), found {v}"


def fraction(v: Any) -> str | None:
    return None if v is None or 0 < v <= 1 else f"expected a fraction in (0, 1], found {v}"


def not_blank(v: Any) -> str | None:
    return None if v is None or str(v).strip() else f"expected a non-empty value, found {v!r}"


# A node's name as schedulers take it: letters, digits, '.', '_' and '-'. Anything else reaches scontrol (where
# ',' and '[1-3]' name other nodes), kubectl, and the breaker's '|'-separated parse of sinfo.
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


def node_name(v: Any) -> str | None:
    if v is None or _NODE_NAME.match(str(v)):
        return None
    return (f"expected a node name (letters, digits, '.', '_', '-'; as the scheduler knows the node), found "
            f"{v!r}")


def parse_seconds(text: str) -> float:
    """A duration given on a command line: a number of seconds, checked like a seconds setting."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number of seconds, found {text!r}") from None
    problem = seconds(value)
    if problem:
        raise ValueError(problem)
    return value


def parse_signal(text: str) -> str:
    """'SIGTERM', 'term' or '15' -> 'SIGTERM' (how the launchers name the signal that stopped a run)."""
    import signal

    name = str(text).strip().upper()
    try:
        return signal.Signals(int(name)).name if name.isdigit() else signal.Signals[
            name if name.startswith("SIG") else "SIG" + name].name
    except (KeyError, ValueError):
        raise ValueError(f"expected a signal such as SIGTERM, SIGINT or SIGKILL (or its number), found "
                         f"{text!r}") from None


def argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A parse function as an argparse type: its ValueError's own words become argparse's message."""
    def typed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    typed.__name__ = parse.__name__
    return typed


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def parse_switch(text: str) -> bool:
    """An environment variable's on/off: 1/true/yes/on or 0/false/no/off (or empty)."""
    value = str(text).strip().lower()
    if value in _TRUE + _FALSE:
        return value in _TRUE
    raise ValueError(f"expected one of {', '.join(_TRUE)} (on) or {', '.join(repr(v) for v in _FALSE)} (off), "
                     f"found {text!r}")


def option(default: Any = None, help: str = "", *, flag: str | None = None, metavar: str | None = None,
           parse: Callable[[str], Any] | None = None, check: Callable[[Any], str | None] | None = None,
           choices: Sequence[str] | None = None, factory: Callable[[], Any] | None = None,
           positional: bool = False, env: str | None = None) -> Any:
    """A settings field and its command-line flag, declared together; `env`: the variable that sets it when the
    flag is not given (read and checked by `from_args`, at start-up)."""
    meta = {"help": help, "flag": flag, "metavar": metavar, "parse": parse, "check": check, "choices": choices,
            "positional": positional, "env": env}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class Settings:
    """Base of the frozen settings dataclasses (ValidateConfig, ...): fields declared with `option`."""

    def to_json(self) -> dict[str, Any]:
        """The settings as the record keeps them (report.json's `settings`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def field_problems(self) -> list[str]:
        """Each field's own check and choices, as '<flag>: expected ..., found ...'."""
        problems = [f"{flag_of(f)}: {message}" for f in dataclasses.fields(self)
                    if f.metadata.get("check") and (message := f.metadata["check"](getattr(self, f.name)))]
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) is not None and getattr(self, f.name) not in choices:
                problems.append(f"{flag_of(f)}: expected one of {', '.join(choices)}, found {getattr(self, f.name)!r}")
        return problems

    @staticmethod
    def refuse(problems: list[str], help_command: str) -> None:
        if problems:
            raise ConfigError("; ".join(problems) + f" (see: {help_command})")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None,
                      hidden: tuple[str, ...] = ()) -> None:
        """The flags; `defaults` replaces a field's default for this command (its help says the one in force);
        `hidden`: fields this command refuses, parsed (to say so in one line) but not listed in its --help."""
        defaults = defaults or {}
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if f.name in hidden:
                parser.add_argument(flag_of(f), dest=f.name, default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                                    **({"action": "store_true"} if str(f.type) == "bool" else {}))
                continue
            default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING else None)
            env = f" (env {meta['env']})" if meta.get("env") else ""
            text = meta["help"] + (f" (default {default})" if default not in (None, (), "", False) else "") + env
            text = text.replace("%", "%%")  # argparse formats help with %: a literal one (10%) is written %%
            if meta["positional"]:
                parser.add_argument(f.name, nargs="*", metavar=meta["metavar"], help=text)
                continue
            if str(f.type) == "bool":
                parser.add_argument(flag_of(f), dest=f.name, action="store_true", default=argparse.SUPPRESS,
                                    help=meta["help"] + env)
                continue
            parser.add_argument(flag_of(f), dest=f.name, metavar=meta["metavar"], choices=meta["choices"],
                                type=_arg_type(f), default=argparse.SUPPRESS, help=text)

    @classmethod
    def from_args(cls: type[_S], args: argparse.Namespace, environ: Any = None) -> _S:
        """The settings of these flags; a field whose flag was not given takes its environment variable, if set
        (exit 2 naming the variable when its value does not parse or pass the field's check)."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        environ = environment.current() if environ is None else environ
        problems = []
        for f in dataclasses.fields(cls):
            if f.metadata["positional"]:
                values[f.name] = tuple(values.get(f.name, ()))
            elif f.name not in values and f.metadata.get("env") and f.metadata["env"] in environ:
                try:
                    values[f.name] = from_env(f, environ[f.metadata["env"]])
                except ValueError as err:
                    problems.append(str(err))
        cls.refuse(problems, "stackproof --help")
        return cls(**values)

    @classmethod
    def environment(cls) -> dict[str, str]:
        """{variable: its flag}: every environment variable these settings read."""
        return {f.metadata["env"]: flag_of(f) for f in dataclasses.fields(cls) if f.metadata.get("env")}

    def to_argv(self) -> list[str]:
        """The flags that reproduce these settings (what the launcher hands every rank)."""
        argv: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata["positional"] or value is None or value is False or value == ():
                continue
            if value is True:
                argv.append(flag_of(f))
            elif isinstance(value, tuple):
                argv += [flag_of(f), ",".join(map(str, value))]
            else:
                argv += [flag_of(f), str(value)]
        rest = [v for f in dataclasses.fields(self) if f.metadata["positional"] for v in getattr(self, f.name)]
        return [*argv, "--", *rest] if rest else argv


def parse_counts(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4)."""
    try:
        counts = tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise ValueError(f"expected whole numbers separated by commas, such as 1,2,4, found {text!r}") from None
    return counts


def from_env(field: dataclasses.Field, raw: str) -> Any:
    """A field's value from its environment variable: parsed like the flag, then the field's own check; a
    ValueError says the variable, what was expected, what was found and the fix."""
    name = field.metadata["env"]
    fix = f"fix: correct {name}, unset it, or pass {flag_of(field)}"
    try:
        value = parse_switch(raw) if str(field.type) == "bool" else _arg_type(field).__wrapped__(raw)
    except (ValueError, argparse.ArgumentTypeError) as err:
        raise ValueError(f"{name}={raw!r}: {err}; {fix}") from None
    problem = (field.metadata.get("check") or (lambda _v: None))(value)
    choices = field.metadata.get("choices")
    if problem is None and choices and value not in choices:
        problem = f"expected one of {', '.join(choices)}, found {value!r}"
    if problem:
        raise ValueError(f"{name}={raw!r}: {problem}; {fix}")
    return value


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _arg_type(field: dataclasses.Field) -> Callable[[str], Any]:
    parse = field.metadata.get("parse")
    kind = {"int | None": int, "int": int, "float | None": float, "float": float}.get(str(field.type), str)
    convert = parse or kind
    name = {int: "a whole number", float: "a number"}.get(convert, "a value")

    def typed(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err) if parse else f"expected {name}, found {text!r}") from None

    def strict(text: str) -> Any:  # an environment variable's value: the conversion's own error
        try:
            return convert(text)
        except ValueError as err:
            raise ValueError(str(err) if parse else f"expected {name}, found {text!r}") from None

    typed.__name__ = name  # argparse names the type in its message
    typed.__wrapped__ = strict  # type: ignore[attr-defined]
    return typed
