"""Strict YAML for config files: one reading of a document, the same for every reader, or one line saying why not.

``yaml.safe_load`` reads YAML 1.1: ``0100`` is the octal 64, ``1:00`` the sexagesimal 60, ``yes`` and ``off`` are
booleans, a key given twice keeps its last value, and a deep enough nesting ends in a RecursionError. ``parse``
reads a plain scalar as the command line reads the same word (YAML 1.2's core schema agrees) and refuses what YAML
1.1 would read otherwise, so no reader of a file sees another value than the run uses:

- structure: nesting at most ``MAX_DEPTH`` levels and at most ``MAX_NODES`` values with aliases expanded (a
  recursive anchor or an alias bomb stops there); a key given twice in one mapping is refused; a tag other than
  ``!!str`` (``!!python/object``, ``!!binary``, ``!!int``, ...) is refused;
- plain scalars: ``null``/``~``/empty, ``true``/``false`` (and ``True``, ``TRUE``, ...), decimal ints and floats
  (``2e-3`` too), ``.inf``/``.nan``, anything else text (``0o17`` and ``0x1F`` too: the command line reads no such
  number). A scalar that YAML 1.1 reads as a boolean or number its text does not mean (``0100``, ``0x1F``,
  ``0b11``, ``1_000``, ``1:00``, ``yes``, ``off``) is refused naming both readings: write it in decimal (or
  true/false), or quote it for text.

``words=True`` keeps a number's text (``1.0e-05`` and ``.inf`` stay those words) so the command line receives
exactly the word the file holds; ``False`` gives ints and floats (the planner's reading). Every error is a
``StrictYamlError`` whose message names the key (``model.num_layers``, ``data.data_path[1]``) or the line. The file
itself is read by config_file.load (regular, bounded, UTF-8: bounded_read.py).
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

MAX_DEPTH = 8  # sections > keys > a list's items is 3; nothing a flag takes goes deeper
MAX_NODES = 10_000  # a resolved config has about 150

_PLAIN = "tag:codegeex_train,2024:plain"  # an untagged plain scalar: resolved here, not by YAML 1.1's regexes
_STR, _SEQ, _MAP = "tag:yaml.org,2002:str", "tag:yaml.org,2002:seq", "tag:yaml.org,2002:map"
_NULLS = ("", "~", "null", "Null", "NULL")
_BOOLS = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
_DECIMAL = re.compile(r"[-+]?[0-9]+")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_INF, _NAN = (".inf", ".Inf", ".INF"), (".nan", ".NaN", ".NAN")
# PyYAML's own YAML 1.1 reading (resolver and constructors), to find the scalars it reads otherwise
_YAML11, _YAML11_VALUES = yaml.resolver.Resolver(), yaml.constructor.SafeConstructor()
_YAML11_TYPES = {"tag:yaml.org,2002:bool": _YAML11_VALUES.construct_yaml_bool,
                 "tag:yaml.org,2002:int": _YAML11_VALUES.construct_yaml_int,
                 "tag:yaml.org,2002:float": _YAML11_VALUES.construct_yaml_float}


class StrictYamlError(ValueError):
    """A file that has no single reading; the message names the key or the line."""


class _Composer(yaml.SafeLoader):
    """PyYAML's parser and composer (nodes, not values), plain scalars left unresolved, nesting bounded (the
    composer recurses once per level: 3,000 levels are a RecursionError)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.depth = 0

    def resolve(self, kind, value, implicit):
        if kind is yaml.ScalarNode and implicit[0]:
            return _PLAIN
        return super().resolve(kind, value, implicit)

    def compose_node(self, parent, index):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            line = self.peek_event().start_mark.line + 1
            raise StrictYamlError(f"nested deeper than {MAX_DEPTH} levels at line {line} (a config is sections of "
                                  f"keys, a key's value one value or a list)")
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _show(value: Any) -> str:
    return {True: "true", False: "false"}[value] if isinstance(value, bool) else repr(value)


def _core(text: str) -> Any:
    """The YAML 1.2 core schema's reading of a plain scalar."""
    if text in _NULLS:
        return None
    if text in _BOOLS:
        return _BOOLS[text]
    if _DECIMAL.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    if text in _NAN:
        return math.nan
    if text[1:] in _INF and text[0] in "+-" or text in _INF:
        return -math.inf if text[0] == "-" else math.inf
    return text


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _plain(node: yaml.ScalarNode, where: str, words: bool) -> Any:
    """A plain scalar's value: YAML 1.2's, refused where YAML 1.1 reads a boolean or number the text does not mean."""
    text, where = node.value, where or "the document"
    try:
        value = _core(text)
        tag = _YAML11.resolve(yaml.ScalarNode, text, (True, False))
        old = _YAML11_TYPES[tag](node) if tag in _YAML11_TYPES else value
    except ValueError:  # an int past Python's 4,300 digits
        raise StrictYamlError(f"{where}: {text[:20]}... has too many digits") from None
    if not _same(old, value):
        fix = "true or false" if isinstance(old, bool) else "the number in decimal"
        raise StrictYamlError(f"{where}: {text} is ambiguous: YAML 1.1 reads {_show(old)}, the command line "
                              f"{_show(value)}; write {fix}, or quote it for text")
    if words and isinstance(value, (int, float)) and not isinstance(value, bool):
        return text
    return value


class _Builder:
    """Values from composed nodes, each node visited once per path (aliases expanded, so bounded)."""

    def __init__(self, words: bool) -> None:
        self.words, self.nodes = words, 0

    def value(self, node: yaml.Node, where: str, depth: int) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            section = where.split(".")[0].split("[")[0] or "the file"
            raise StrictYamlError(f"{section}: more than {MAX_NODES} values (aliases expanded)")
        if depth > MAX_DEPTH:
            raise StrictYamlError(f"{where}: nested deeper than {MAX_DEPTH} levels (aliases expanded)")
        if node.tag not in (_PLAIN, _STR, _SEQ, _MAP):
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise StrictYamlError(f"{where or 'the file'}: the tag {tag} at line {node.start_mark.line + 1} is not "
                                  f"allowed (a config holds plain values, lists and mappings)")
        if isinstance(node, yaml.ScalarNode):
            return _plain(node, where, self.words) if node.tag == _PLAIN else node.value
        if isinstance(node, yaml.SequenceNode):
            return [self.value(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(node.value)]
        out: dict[str, Any] = {}
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag not in (_PLAIN, _STR):
                raise StrictYamlError(f"line {line}: a key must be a name, not a {key_node.id} or tagged value")
            key = key_node.value
            full = f"{where}.{key}" if where else key
            if key in out:
                raise StrictYamlError(f"{full} is given twice (lines {lines[key]} and {line}): keep one")
            lines[key] = line
            out[key] = self.value(value_node, full, depth + 1)
        return out


def parse(text: str, words: bool = False) -> Any:
    """The value of the YAML document ``text`` (None when empty); StrictYamlError otherwise."""
    try:
        loader = _Composer(text)  # (its reader checks the characters here)
        try:
            node = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        at = f" at line {e.problem_mark.line + 1}" if e.problem_mark is not None else ""
        raise StrictYamlError(f"not valid YAML{at} ({e.problem or e.context or e})") from None
    except yaml.reader.ReaderError as e:
        raise StrictYamlError(f"not valid YAML: character #x{e.character:04x} at line "
                              f"{text[:e.position].count(chr(10)) + 1} is not allowed") from None
    return None if node is None else _Builder(words).value(node, "", 1)
