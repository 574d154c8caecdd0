"""Config files: ``--config FILE.yaml`` for the pretraining command line, and the resolved config of a run.

A file holds the sections of ``Args`` (``model:``, ``parallel:``, ``train:``, ``optim:``, ``data:``, ``logging:``),
each a mapping of field names (``num_layers``; dashes and a flag's other spelling too: ``learning-rate``) to
values::

    model:
      num_layers: 39
      top_query_layer: false      # a switch: true gives --x; false --no-x where the flag has one, else nothing
    train:
      seq_length: 2048
    data:
      data_path: [1.0, data/a, 2.0, data/b]   # a list flag takes a list; null: the flag's default

The file becomes flags in front of the command line's (``expand``), so every value goes through the flag's own
type, choices and range, and a flag given on the command line wins (a ``store_true`` switch set in the file stays on:
such flags have no ``--no-`` form). The file is read strictly (config/strict_yaml.py): a plain scalar means what the
same word means on the command line, and a form YAML 1.1 reads otherwise (``0100``, ``1:00``, ``yes``), a key given
twice (in any of its spellings), a deep nesting, a file that is not UTF-8 or larger than 1 MiB are refused; a list
is only for a list flag, and its items are values, never flags. Every mistake is one line naming the file and the
key: an unknown key with the closest known one, a wrong type, a value out of range. Two sections serve the other
readers of configs/*.yaml and are skipped here: ``launch:`` (scripts/pretrain_codegen.sh's memory defaults, which
depend on the layout) and ``planner:`` (the planner's cluster and vocabulary; accounting/planner.py checks it).

``dump_resolved(args)`` writes a run's ``Args`` as such a file: ``pretrain --config`` of it rebuilds the same
``Args`` (a value whose credential was redacted must be given again on the command line: ``refuse_redacted``).
``write_resolved`` puts it in the run's output directory (<save>/config.yaml). docs/config-files.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from codegeex_train.config import strict_yaml
from codegeex_train.config.options import flag_name
from codegeex_train.config.redaction import REDACTED, redact_secrets
from codegeex_train.bounded_read import FileReadError, read_text

LAUNCH_SECTION, PLANNER_SECTION = "launch", "planner"
LAUNCH_KEYS = ("recompute", "sequence_parallel_with_tp")
NOT_DUMPED = ("dry_run", "dry_run_skip_data")  # a resolved config runs the run: never a dry run again
RESOLVED_NAME = "config.yaml"
MAX_CONFIG_BYTES = 1 << 20  # a resolved config is about 5 kB
CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"  # the presets, beside scripts/ in the checkout


class ConfigFileError(ValueError):
    """A config file that cannot be used; the message names the file and the key."""


def _flag_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init and "help" in f.metadata]


def known_keys(sections: dict[str, type]) -> dict[str, dict[str, dataclasses.Field]]:
    """{section: {key: field}} of ``sections`` ({name: dataclass}, arguments.SECTIONS): every field name and every
    spelling of its flags (dashes as underscores)."""
    keys: dict[str, dict[str, dataclasses.Field]] = {}
    for section, cls in sections.items():
        keys[section] = {}
        for f in _flag_fields(cls):
            keys[section][f.name] = f
            for flag in f.metadata.get("flags") or ():
                keys[section][flag.lstrip("-").replace("-", "_")] = f
    return keys


def load(path: str, words: bool = False) -> dict[str, Any]:
    """The file's top-level mapping (a regular file, at most ``MAX_CONFIG_BYTES``, UTF-8, read by
    ``strict_yaml.parse``: ``words`` keeps numbers as the words written), or ConfigFileError."""
    try:
        data = strict_yaml.parse(read_text(path, MAX_CONFIG_BYTES, "--config"), words)
    except FileReadError as e:
        raise ConfigFileError(str(e)) from None
    except strict_yaml.StrictYamlError as e:
        raise ConfigFileError(f"--config {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: expected sections (model:, train:, ...) at the top, got a "
                              f"{type(data).__name__}")
    return data


def _closest(name: str, keys: dict[str, dict[str, dataclasses.Field]]) -> str:
    """' (did you mean section.key?)' for the known key nearest to ``name`` (a key's bare name), or ''."""
    bare = {k: f"{s}.{k}" for s, ks in keys.items() for k in ks}
    close = difflib.get_close_matches(name, list(bare), n=1)
    return f" (did you mean {bare[close[0]]}?)" if close else ""


def _entries(path: str, data: dict[str, Any], sections: dict[str, type]) -> list[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, value) of every setting, in file order; an unknown key or section, or a flag set twice
    (``num_layers`` and ``num-layers``, ``lr`` and ``learning_rate``), is an error."""
    keys = known_keys(sections)
    entries, seen = [], {}
    for section, values in data.items():
        section = str(section)
        if section == PLANNER_SECTION:
            continue
        if section == LAUNCH_SECTION:
            launch_values(path, data)
            continue
        if section not in keys:
            # a key written at the top level, or a misspelt section
            hint = _closest(section, keys) if not isinstance(values, dict) else (
                f" (did you mean {m[0]}?)" if (m := difflib.get_close_matches(section, list(keys), n=1)) else "")
            raise ConfigFileError(f"--config {path}: unknown key {section!r}{hint}; the top level holds the "
                                  f"sections {', '.join(keys)} (and {LAUNCH_SECTION}, {PLANNER_SECTION})")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigFileError(f"--config {path}: {section} must be a mapping of keys to values")
        for key, value in values.items():
            name = str(key).replace("-", "_")
            if name not in keys[section]:
                raise ConfigFileError(f"--config {path}: unknown key {section}.{key}{_closest(name, keys)}")
            field = keys[section][name]
            if field.name in seen:
                raise ConfigFileError(f"--config {path}: {seen[field.name]} and {section}.{key} both set "
                                      f"{flag_name(field)}: keep one")
            seen[field.name] = f"{section}.{key}"
            entries.append((f"{section}.{key}", field, value))
    return entries


def _tokens(path: str, key: str, action: argparse.Action, value: Any) -> list[str]:
    """The command-line words of one setting."""
    flag = action.option_strings[0]
    if value is None:
        return []  # unset: the flag's default (None for every optional flag)
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ConfigFileError(f"--config {path}: {key} must be true or false, not {_shown(value)}")
        if value:
            return [flag]
        # --x/--no-x: the negative form; a store_true switch (--fp16, --no-load-optim itself) is off by default
        return [f"--no-{flag[2:]}"] if isinstance(action, argparse.BooleanOptionalAction) else []
    if isinstance(value, bool) or isinstance(value, (dict, list)) and action.nargs != "+":
        raise ConfigFileError(f"--config {path}: {key} {_shown(value)}: expected one "
                              f"{getattr(action.type, '__name__', 'str')} value")
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, (dict, list, bool)) or v is None for v in values):
        raise ConfigFileError(f"--config {path}: {key} must be a list of values, not {_shown(value)}")
    return [flag, *(str(v) for v in values)]


def _shown(value: Any) -> str:
    """A value as the file wrote it (words unquoted: the file is read with ``words=True``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "[" + ", ".join(map(_shown, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


class _Refusal(Exception):
    pass


def _check(parser: argparse.ArgumentParser, path: str, key: str, field: dataclasses.Field, tokens: list[str]) -> Any:
    """Parse one setting alone (its type and choices) and check its range: a bad value is one line naming the key.
    Returns the parsed value."""
    for word in tokens[1:]:
        if parser._parse_optional(word) is not None:  # argparse's own test: this word would be read as a flag
            raise ConfigFileError(f"--config {path}: {key}: {word} would be read as a flag, not a value (as on the "
                                  f"command line: a value cannot start with -)")

    def refuse(message: str):
        raise _Refusal(message)

    saved, parser.error = parser.error, refuse  # (an instance attribute shadows FlagParser.error for this call)
    try:
        namespace = parser.parse_args(tokens)
    except _Refusal as e:
        message = str(e).replace(f"argument {flag_name(field)}: ", "").replace(f"argument {tokens[0]}: ", "")
        raise ConfigFileError(f"--config {path}: {key}: {message}") from None
    finally:
        parser.error = saved
    value = next(v for dest, v in vars(namespace).items() if dest.endswith("." + field.name))
    bounds = field.metadata.get("bounds")
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if bounds is not None and isinstance(v, (int, float)) and not isinstance(v, bool) and v not in bounds:
            raise ConfigFileError(f"--config {path}: {key} {v} must be {bounds}")
    return value


def _is_default(field: dataclasses.Field, value: Any) -> bool:
    """Whether a parsed value is the field's default (a list equal to a tuple default counts)."""
    default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
    if isinstance(value, list) and isinstance(default, (list, tuple)):
        return value == list(default)
    return value == default and type(value) is type(default)


def file_argv(parser: argparse.ArgumentParser, path: str, sections: dict[str, type]) -> list[str]:
    """The flags a config file stands for (``parser``: the command line generated from ``sections``), each checked
    (type, choices, range); ConfigFileError otherwise."""
    argv = []
    for key, field, value in _entries(path, load(path, words=True), sections):
        action = parser._option_string_actions[flag_name(field)]
        tokens = _tokens(path, key, action, value)
        # a value equal to the default is left to it: the same Args as a command line without the flag
        if tokens and not _is_default(field, _check(parser, path, key, field, tokens)):
            argv += tokens
    return argv


def split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the --config path or None, argv without it); ConfigFileError when given twice or without a file."""
    path, rest, i = None, [], 0
    while i < len(argv):
        word = argv[i]
        if word == "--config" or word.startswith("--config="):
            if path is not None:
                raise ConfigFileError("--config is given twice: pass one file (flags on the command line override it)")
            if "=" in word:
                path = word.split("=", 1)[1]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                path, i = argv[i + 1], i + 1
            else:
                raise ConfigFileError("--config needs a file: --config FILE.yaml")
            if not path:
                raise ConfigFileError("--config needs a file: --config FILE.yaml")
        else:
            rest.append(word)
        i += 1
    return path, rest


def expand(parser: argparse.ArgumentParser, argv: list[str] | None, sections: dict[str, type]) -> list[str]:
    """``argv`` (None: the process's) with ``--config FILE`` replaced by the file's flags in front of the others
    (which win)."""
    path, rest = split_config(sys.argv[1:] if argv is None else list(argv))
    if path is None:
        return rest
    from_file = file_argv(parser, path, sections)
    refuse_redacted(parser, path, from_file, rest)
    if from_file and rest and parser._parse_optional(rest[0]) is None:
        # a stray first word would be one more value of the file's last flag: refused, as on the command line alone
        raise ConfigFileError(parser.unrecognized(rest[:1]))
    return from_file + rest


def refuse_redacted(parser: argparse.ArgumentParser, path: str, from_file: list[str], rest: list[str]) -> None:
    """A value ``dump_resolved`` redacted (``<redacted>`` where a credential was) is not the run's value: as a path it
    would silently be another place. ConfigFileError naming its flag, unless the command line (``rest``) gives that
    flag, whose value then wins."""
    actions = parser._option_string_actions
    given = {actions[word.split("=", 1)[0]].dest for word in rest if word.split("=", 1)[0] in actions}
    flag = None
    for word in from_file:  # [flag, value..., flag, value...]
        if word in actions:
            flag = actions[word]
        elif REDACTED in word and flag is not None and flag.dest not in given:
            name = flag.option_strings[0]
            raise ConfigFileError(f"--config {path}: {name} {word}: a credential was redacted from this value when "
                                  f"the file was written; give {name} on the command line (it overrides the file)")


def resolved(args: Any) -> dict[str, dict[str, Any]]:
    """{section: {field: value}} of every flag of ``args`` (an ``Args``: one dataclass per section), tuples as
    lists."""
    out: dict[str, dict[str, Any]] = {}
    for section in dataclasses.fields(args):
        values = getattr(args, section.name)
        out[section.name] = {}
        for f in _flag_fields(type(values)):
            if f.name in NOT_DUMPED:
                continue
            value = getattr(values, f.name)
            out[section.name][f.name] = list(value) if isinstance(value, tuple) else value
    return out


def dump_resolved(args: Any) -> str:
    """The fully resolved config of ``args`` as YAML: ``pretrain --config`` of it rebuilds the same ``Args``.
    Credentials are redacted (``redaction.py``: the file and every checkpoint holding it are shared more widely than
    the job); ``--config`` refuses a redacted value unless the command line gives its flag (``refuse_redacted``)."""
    values = resolved(args)
    redacted = redact_secrets(values)
    header = ("# The resolved configuration of a codegeex_train run: every flag's value (defaults included).\n"
              "# Rerun it with: python -m codegeex_train.pretrain --config THIS_FILE (flags given override it).\n")
    if redacted != values:
        header += f"# Values holding {REDACTED} held a credential: give those flags on the command line too.\n"
    return header + yaml.safe_dump(redacted, sort_keys=False, default_flow_style=False, width=120)


def write_resolved(args: Any, directory: str) -> str:
    """Write ``dump_resolved(args)`` to ``directory``/config.yaml atomically (a temporary file renamed into place);
    returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RESOLVED_NAME)
    fd, tmp = tempfile.mkstemp(prefix=f".{RESOLVED_NAME}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(dump_resolved(args))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def launch_values(path: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``launch:`` section (scripts/pretrain_codegen.sh's own defaults), its keys checked."""
    values = (load(path) if data is None else data).get(LAUNCH_SECTION) or {}
    if not isinstance(values, dict):
        raise ConfigFileError(f"--config {path}: {LAUNCH_SECTION} must be a mapping of keys to values")
    for key in values:
        if key not in LAUNCH_KEYS:
            raise ConfigFileError(f"--config {path}: unknown key {LAUNCH_SECTION}.{key} (it holds "
                                  f"{', '.join(LAUNCH_KEYS)})")
    return values


def preset_path(name: str) -> str:
    """A preset's file: ``configs/NAME.yaml``, or ``name`` itself when it is a path (ends in .yaml/.yml or has a /);
    ConfigFileError naming the presets when there is no such file."""
    path = Path(name) if name.endswith((".yaml", ".yml")) or "/" in name else CONFIGS_DIR / f"{name}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml")))
        raise ConfigFileError(f"--config {name}: no such preset or file ({path}); the presets: {names}")
    return str(path)


def section(path: str, name: str) -> dict[str, Any]:
    """One section of a config file as a mapping ({} when absent), keys as written."""
    values = load(path).get(name) or {}
    if not isinstance(values, dict):
        raise ConfigFileError(f"--config {path}: {name} must be a mapping of keys to values")
    return values
