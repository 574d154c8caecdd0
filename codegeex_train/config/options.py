"""Command lines generated from typed config dataclasses.

A field declared with ``option(default, "help text", flags=("--lr", "--learning-rate"))`` becomes an
argparse flag; the first spelling defaults to Megatron's ``--field-name``. ``bool`` fields become
``store_true`` flags (``--x/--no-x`` when they default to True), ``list`` fields take several values, ``X | None`` fields are optional.
Every flag's help shows its default (zeros and False included) and its choices. A numeric field declares its allowed
values with ``bounds=`` (a ``Range``: ``at_least(1)``, ``above(0)``, ``Range(0, 1, hi_open=True)``); ``out_of_range``
checks every field of a section against them (and refuses NaN and infinities), so the rules live beside the fields.
A tool that takes some of those flags generates them from the same fields (``add_config_flags``, with its own
default where its meaning differs), so a flag is declared once whatever the commands that take it.

``FlagParser`` is argparse with errors a person reads: one ``error:`` line (no usage dump) that names the flag and,
for a misspelt one, the closest known flag. ``add_foreign_flags`` teaches it another program's spellings
(Megatron-LM's: ``config/megatron_flags.py``): each is the same flag, an alias, accepted without effect, or refused
with a line naming ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import fnmatch
import math
import sys
import types
import typing
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric flag allows: ``lo``..``hi`` (None: unbounded), each end closed unless marked open."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False  # NaN compares false with everything; an infinite rate or size is never meant
        if self.lo is not None and (value < self.lo or self.lo_open and value == self.lo):
            return False
        return self.hi is None or value < self.hi or not self.hi_open and value == self.hi

    def __str__(self) -> str:
        """'>= 1', '> 0', 'in [0, 1)', 'in [0, 4294967295]': what an error line says the value must be."""
        lo, hi = _number(self.lo), _number(self.hi)
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {lo}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {hi}"
        return "a finite number"


def _number(x: float | None) -> str:
    return "" if x is None else str(int(x)) if float(x).is_integer() else f"{x:g}"


UNIT_OPEN = Range(0, 1, hi_open=True)  # a probability that must leave something: dropout, Adam's betas, momentum


def at_least(lo: float) -> Range:
    return Range(lo)


def above(lo: float) -> Range:
    return Range(lo, lo_open=True)


def option(default: Any = dataclasses.MISSING, help: str = "", *, flags: tuple[str, ...] = (),
           choices: tuple[Any, ...] | None = None, default_factory: Any = dataclasses.MISSING,
           bounds: Range | None = None) -> Any:
    """A dataclass field that carries its command-line help, flag spellings and, for a number, its allowed range
    (``out_of_range`` checks it; ``None``, an unset optional flag, is always allowed)."""
    meta = {"help": help, "flags": flags, "choices": choices, "bounds": bounds}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _flags(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)


def flag_name(f: dataclasses.Field) -> str:
    """The flag an error line names: the field's first spelling (``--lr``, ``--num-layers``)."""
    return _flags(f)[0]


def out_of_range(section: Any) -> list[str]:
    """One message per field of the dataclass instance ``section`` whose value lies outside its ``bounds`` or is a
    NaN or infinity (any float field), e.g. '--adam-beta1 2.0 must be in [0, 1) (default 0.9)'; [] when every
    value fits."""
    problems = []
    for f in dataclasses.fields(section):
        value, bounds = getattr(section, f.name), f.metadata.get("bounds")
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue  # unset, a switch, or not a number
            finite = not isinstance(v, float) or math.isfinite(v)
            if finite and (bounds is None or v in bounds):
                continue
            must = str(bounds) if finite else "a finite number" + (f" {bounds}" if bounds is not None else "")
            default = "" if f.default in (None, dataclasses.MISSING) else f" (default {f.default})"
            problems.append(f"{flag_name(f)} {v} must be {must}{default}")
    return problems


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) of an annotation such as ``int | None``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return None if f.default_factory is dataclasses.MISSING else f.default_factory()


def _add_field(group, f: dataclasses.Field, hint: Any, dest: str, default: Any, shown: str | None = None) -> None:
    """Field ``f`` as one flag of ``group``: its spellings, type, choices and help (with its default: ``shown``, else
    the value), into ``dest``."""
    tp, _ = _base_type(hint)
    kw: dict[str, Any] = {"dest": dest, "help": f.metadata["help"]}
    if tp is bool:
        # False by default: a Megatron-style switch; True by default: --x / --no-x.
        kw.update(action="store_true" if not _field_default(f) else argparse.BooleanOptionalAction, default=default)
    elif typing.get_origin(tp) in (list, tuple):
        kw.update(nargs="+", type=typing.get_args(tp)[0], default=default, metavar=f.name.upper())
    else:
        kw.update(type=tp, default=default, choices=f.metadata.get("choices"))
        if not kw["choices"]:  # with choices, argparse shows them ({a,b,c}) where the metavar would be
            kw["metavar"] = f.name.upper()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kw["required"] = True
    if kw["help"] and "(default" not in kw["help"]:  # every default, 0 / False / None included
        kw["help"] += f" (default: {'%(default)s' if shown is None else shown})"
    action = group.add_argument(*_flags(f), **kw)
    if action.help and action.help.count(" (default") > 1:  # an argparse that appends it itself (--x/--no-x)
        action.help = action.help[:action.help.rindex(" (default")]


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    group = parser.add_argument_group(title or cls.__name__, (cls.__doc__ or "").strip().splitlines()[0])
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.init and "help" in f.metadata:
            _add_field(group, f, hints[f.name], f"{cls.__name__}.{f.name}", _field_default(f))


class Default(typing.NamedTuple):
    """A tool's own default for a flag it shares (``add_config_flags``; ``value`` left out: the field's), and how
    --help says it when the value alone would not (None meaning "the checkpoint's", or "greedy for one sample, else
    0.8")."""

    value: Any = dataclasses.MISSING
    shown: str | None = None


def add_config_flags(group, cls: type, names: tuple[str, ...] | None = None,
                     defaults: dict[str, Any] | None = None) -> None:
    """The fields ``names`` (default: all) of ``cls`` (a dataclass whose fields are ``option``s) as flags of a tool's
    parser (or argument ``group``), declared once for every command that takes them: the spellings, type, choices
    and help, into ``args.<field>``. ``defaults`` gives a field the tool's own default where its meaning differs
    (None: "what the checkpoint records"; a ``Default`` when --help should say it in words)."""
    hints, defaults = typing.get_type_hints(cls), defaults or {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names or tuple(fields):
        f = fields[name]
        default = defaults.get(name, Default())
        if not isinstance(default, Default):
            default = Default(default)
        value = _field_default(f) if default.value is dataclasses.MISSING else default.value
        _add_field(group, f, hints[name], name, value, default.shown)


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    prefix = cls.__name__ + "."
    values = {k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix)}
    return cls(**values)


class FlagParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``{error_prefix}error: ...``, exit status 2: a bad value names its flag
    (argparse's own message), an unknown flag gets "did you mean --X?" when a known one is close, and a refused
    foreign flag (``refuse``) gets its note. ``--help`` opens with the description, then one usage line."""

    def __init__(self, *args, error_prefix: str = "", **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self.error_prefix = error_prefix
        self.refusal_suffix = ""  # said once after the refusals, e.g. where they are documented
        self._refused: dict[str, Callable[[str], str]] = {}  # flag or fnmatch pattern ("--fp8-*") -> message

    def refuse(self, flag: str, message: Callable[[str], str]) -> None:
        """Answer ``flag`` (or any flag matching the pattern) with ``message(the flag given)`` instead of parsing."""
        self._refused[flag] = message

    def _refusal(self, token: str) -> str | None:
        name = token.split("=", 1)[0]
        if not name.startswith("--") or name in self._option_string_actions:
            return None  # one of our flags (or a value) always wins over a refusal
        pattern = name if name in self._refused else next(
            (p for p in self._refused if fnmatch.fnmatchcase(name, p)), None)
        return self._refused[pattern](name) if pattern else None

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        refused = list(dict.fromkeys(m for token in args if (m := self._refusal(token))))
        if refused:  # all of them at once, so a script is fixed in one go
            self.error("; ".join(refused) + (f" ({self.refusal_suffix})" if self.refusal_suffix else ""))
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self.unrecognized(extras))
        return namespace

    def known_flags(self) -> list[str]:
        """The flags --help shows (hidden ones, e.g. the DeepSpeed launcher's --local_rank, left out)."""
        return [s for a in self._actions if a.help is not argparse.SUPPRESS for s in a.option_strings
                if s.startswith("--")]

    def unrecognized(self, extras: list[str]) -> str:
        flags = [x for x in extras if x.startswith("-") and not x.lstrip("-").replace(".", "", 1).isdigit()]
        if not flags:
            return f"unexpected value{'s' * (len(extras) > 1)} {' '.join(extras)} (every input is a --flag VALUE)"
        parts = []
        for flag in flags:
            close = difflib.get_close_matches(flag.split("=", 1)[0], self.known_flags(), n=1)
            parts.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
        what = "unrecognized argument" + ("s" if len(parts) > 1 else "")
        return f"{what} {', '.join(parts)}; --help lists every flag"

    def error(self, message: str):
        self.exit(2, f"{self.error_prefix}error: {' '.join(str(message).split())}\n")

    def format_help(self) -> str:
        formatter = self._get_formatter()
        formatter.add_text(self.description)  # what the command does and examples first, then the usage line
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        for group in self._action_groups:
            formatter.start_section(group.title)
            formatter.add_text(group.description)
            formatter.add_arguments(group._group_actions)
            formatter.end_section()
        formatter.add_text(self.epilog)
        return formatter.format_help()


SAME, ALIAS, IGNORED, REFUSED = "same", "alias", "ignored", "refused"


@dataclasses.dataclass(frozen=True)
class ForeignFlag:
    """What our command does with another program's flag (a table's key: ``--flag``, ``--flag VALUE`` for one
    value of a flag, or a pattern such as ``--fp8-*``). ``ours``: our flag (and value) of the same meaning, or
    for a refused one what to use instead. SAME: the same spelling and meaning; ALIAS: accepted as ``ours``;
    IGNORED: accepted, no effect (what it asks for is what happens anyway: ``note`` says why); REFUSED: an error
    line saying ``note`` and ``ours``."""

    kind: str
    ours: str
    note: str = ""

    def refusal(self, flag: str, origin: str) -> str:
        return f"{flag} ({origin}) is not supported here: {self.note}; ours: {self.ours}"


def _value_converter(base, flag: str, values: dict[str, tuple[ForeignFlag, str]]):
    """``base`` (an argparse type), first mapping the foreign values of ``flag`` to ours or refusing them."""
    def convert(text: str):
        if text in values:
            entry, message = values[text]
            if entry.kind == REFUSED:
                raise argparse.ArgumentTypeError(message)  # argparse puts "argument --flag: " in front
            if entry.kind == ALIAS:
                text = entry.ours.split(None, 1)[1]
        return base(text)

    convert.__name__ = getattr(base, "__name__", "value")  # argparse's "invalid <type> value" message
    return convert


def add_foreign_flags(parser: FlagParser, table: dict[str, ForeignFlag], origin: str, see: str) -> None:
    """Teach ``parser`` the spellings of ``table`` (see ``ForeignFlag``). An alias of a flag is listed next to ours
    in --help; ``--flag`` for ``--ours VALUE`` sets that value; the others are hidden (``see`` documents them)."""
    actions = parser._option_string_actions
    parser.refusal_suffix = see
    values: dict[str, dict[str, tuple[ForeignFlag, str]]] = {}
    for key, entry in table.items():
        flag, _, value = key.partition(" ")
        if entry.kind == SAME or flag in actions and not value:
            continue  # ours already (a flag added since the table was written wins)
        if value:  # one value of one of our flags
            values.setdefault(flag, {})[value] = (entry, f"{entry.refusal(value, origin)} ({see})")
        elif entry.kind == REFUSED:
            parser.refuse(flag, lambda given, entry=entry: entry.refusal(given, origin))
        elif entry.kind == IGNORED:
            parser.add_argument(flag, nargs="?", default=argparse.SUPPRESS, dest=f"ignored {flag}",
                                help=argparse.SUPPRESS)
        elif entry.kind == ALIAS:
            target, _, const = entry.ours.partition(" ")
            action = actions[target]
            if const:  # --openai-gelu = --activation gelu_tanh
                const = (action.type or str)(const)
                if action.choices is not None and const not in action.choices:
                    raise ValueError(f"{key}: {entry.ours} is not one of {target}'s choices")
                parser.add_argument(flag, action="store_const", const=const, dest=action.dest,
                                    default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            else:  # parsed as ours (errors name ours); --help names it after ours
                actions[flag] = action
                if action.help not in (None, argparse.SUPPRESS):
                    action.help += f" (also {flag})"
        else:
            raise ValueError(f"{key}: unknown kind {entry.kind!r}")
    for flag, by_value in values.items():
        action = actions[flag]
        action.type = _value_converter(action.type or str, flag, by_value)


def type_name(value: object) -> str:
    """For messages about a value read from a file: 'a str', 'an int', ... (what a field holds instead of what it should; never the value itself)."""
    name = "null" if value is None else type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


_FIELD_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def has_declared_type(value: object, declared: str) -> bool:
    """Whether ``value`` (read from a file) is of a dataclass field's ``declared`` type ('int', 'float | None', ...):
    a bool is no number, a float (2.0) no int; an int is a float."""
    kind, _, optional = declared.partition(" | ")
    if value is None:
        return optional == "None"
    return isinstance(value, _FIELD_TYPES[kind]) and (kind == "bool" or not isinstance(value, bool))


def build_parser(sections: dict[str, type], description: str, usage: str | None = None,
                 epilog: str | None = None) -> FlagParser:
    parser = FlagParser(description=description, usage=usage, epilog=epilog)
    for title, cls in sections.items():
        add_dataclass_arguments(parser, cls, title)
    return parser
