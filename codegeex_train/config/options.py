"""Command lines generated from typed config dataclasses.

A field declared with ``option(default, "help text", flags=("--lr", "--learning-rate"))`` becomes an
argparse flag; the first spelling defaults to Megatron's ``--field-name``. ``bool`` fields become
``store_true`` flags (``--x/--no-x`` when they default to True), ``list`` fields take several values, ``X | None`` fields are optional.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any


def option(default: Any = dataclasses.MISSING, help: str = "", *, flags: tuple[str, ...] = (),
           choices: tuple[Any, ...] | None = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that carries its command-line help and flag spellings."""
    meta = {"help": help, "flags": flags, "choices": choices}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _flags(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) of an annotation such as ``int | None``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    group = parser.add_argument_group(title or cls.__name__, (cls.__doc__ or "").strip().splitlines()[0])
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or "help" not in f.metadata:
            continue
        tp, _ = _base_type(hints[f.name])
        default = None if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING else (
            f.default if f.default is not dataclasses.MISSING else f.default_factory())
        kw: dict[str, Any] = {"dest": f"{cls.__name__}.{f.name}", "help": f.metadata["help"]}
        if tp is bool:
            # False by default: a Megatron-style switch; True by default: --x / --no-x.
            kw.update(action="store_true" if not default else argparse.BooleanOptionalAction, default=default)
        elif typing.get_origin(tp) in (list, tuple):
            kw.update(nargs="+", type=typing.get_args(tp)[0], default=default, metavar=f.name.upper())
        else:
            kw.update(type=tp, default=default, choices=f.metadata.get("choices"), metavar=f.name.upper())
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                kw["required"] = True
        if kw.get("default") not in (None, False) and kw["help"]:
            kw["help"] += " (default: %(default)s)"
        group.add_argument(*_flags(f), **kw)


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    prefix = cls.__name__ + "."
    values = {k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix)}
    return cls(**values)


def build_parser(sections: dict[str, type], description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for title, cls in sections.items():
        add_dataclass_arguments(parser, cls, title)
    return parser
