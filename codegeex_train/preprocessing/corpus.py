"""Corpus readers: JSON lines (optionally gzipped), parquet, plain text and source trees.

`iter_documents` streams documents one by one and reports bad records precisely (file and
line). `load_corpus` is the Hugging Face `datasets` route to the same inputs, for callers that
want a `datasets.Dataset` (map, shuffle, shard). Neither ever touches the network.

Formats, by file name: `.json`/`.jsonl` (+ `.gz`) are JSON lines, one object per line, text in
a field; `.parquet` has a text column; `.txt` is one document per file; a file or directory of
source files (matched by extension, directories searched recursively in sorted order) gives one
document per file, optionally prefixed with a CodeGeeX language tag (`# language: Python`).
Directories yield the files whose extension is in `extensions`, so `extensions=(".jsonl",)`
reads a directory of JSON lines files; only regular files inside the directory, never through a
symbolic link unless `follow_symlinks` (input_tree.py; what is skipped is counted in `CorpusStats`).

JSON lines are read as bytes, one line at a time, so a bad line (invalid UTF-8 or JSON, nested too
deeply, not an object, no string field, a lone surrogate the tokenizer cannot take) is reported at
its true line number and can be skipped like any other. `max_chars` drops documents longer than
that before they reach a tokenizer, and before a huge line or file is read whole.

`iter_records` is the reader underneath: each document with where it came from (file, line or row,
the --input entry that named it) and the JSON object or parquet row that held it, for callers that
need the other fields (source_files.py: repository, path, language).
"""

import dataclasses
import gzip
import json
import logging
import os
import re
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from codegeex_train.preprocessing.code_languages import language_header
from codegeex_train.preprocessing.input_tree import TreeSkips, tree_files

logger = logging.getLogger(__name__)

JSON_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")

class CorpusError(ValueError):
    """Bad corpus input; the message names the file (and line) and the fix."""


@dataclasses.dataclass
class CorpusStats:
    """Counts that `iter_documents` adds to while it runs."""

    files: int = 0
    documents: int = 0
    skipped: int = 0
    """Bad records skipped: JSON lines that are not UTF-8, not JSON, nested too deeply, not an
    object, without a string field or with a lone surrogate; text/source files that are not UTF-8."""
    empty: int = 0
    """Empty documents, always dropped."""
    oversized: int = 0
    """Documents longer than `max_chars`, dropped."""
    tree: TreeSkips = dataclasses.field(default_factory=TreeSkips)
    """Entries of input directories not read: symbolic links and special files (input_tree.py)."""
    bytes_total: int = 0
    """Size on disk of every input file (known once the inputs are listed): a progress bar's total."""
    bytes_read: int = 0
    """How far reading has got, in bytes on disk (compressed bytes for .gz; parquet counts whole files)."""


@dataclasses.dataclass(slots=True)
class Record:
    """One document as read, with where it came from."""

    text: str
    source: Path
    """The file."""
    input: str
    """The input entry (file or directory) that named the file."""
    number: int
    """Line (JSON lines) or row (parquet), from 1; 0 for a whole file (.txt, source)."""
    fields: dict | None
    """The JSON object or parquet row holding the text; None for a whole file."""

    @property
    def origin(self) -> str:
        """`file:line` (or `file:row`), or the file's path: what reports name."""
        return f"{self.source}:{self.number}" if self.number else str(self.source)


def _kind(path: Path, extensions: tuple[str, ...]) -> str:
    """How to read a file: "json", "parquet", "txt" (whole) or "source" (whole, may be tagged)."""
    name = path.name.lower()
    if name.endswith(JSON_SUFFIXES):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".txt"):
        return "txt"
    if path.suffix in extensions:
        return "source"
    raise CorpusError(
        f"corpus input {path}: unsupported file type; expected {', '.join(JSON_SUFFIXES)}, "
        f".parquet, .txt or a source extension in {extensions}"
    )


def _open_binary(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def expand_inputs(inputs: list[str], extensions: tuple[str, ...] = (".py",), follow_symlinks: bool = False,
                  skips: TreeSkips | None = None) -> list[Path]:
    """Files named by `inputs`; directories become their regular files with `extensions`, sorted (input_tree.py:
    links inside are followed only with `follow_symlinks`, and only to files inside; what is left out is counted
    in `skips`)."""
    skips = skips if skips is not None else TreeSkips()
    return [path for _, path in _expand_named(inputs, extensions, follow_symlinks, skips)]


def _expand_named(inputs: list[str], extensions: tuple[str, ...], follow_symlinks: bool,
                  skips: TreeSkips) -> list[tuple[str, Path]]:
    """(input entry, file) for every file `expand_inputs` lists."""
    files: list[tuple[str, Path]] = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            try:
                files.extend((name, p) for p in tree_files(path, extensions, follow_symlinks, skips))
            except OSError as e:
                raise CorpusError(f"corpus input {name}: cannot list {e.filename}: {e.strerror}") from None
        elif path.is_file():
            files.append((name, path))
        elif path.exists():
            raise CorpusError(f"corpus input {name}: not a regular file or a directory (a FIFO, socket or device); "
                              f"give a file or a directory")
        else:
            raise CorpusError(f"corpus input {name}: no such file or directory")
    return files


def bad_record(message: str, skip_bad_lines: bool, stats: CorpusStats) -> None:
    """Raise CorpusError for a bad record, or count it in `stats.skipped` with `skip_bad_lines`."""
    if not skip_bad_lines:
        raise CorpusError(f"{message} (to skip such records: skip_bad_lines / --skip-bad-lines)")
    stats.skipped += 1


class _BadRecord(Exception):
    """What is wrong with one record (the caller adds file and line)."""


# JSON spends at most 12 bytes on one character (an escaped surrogate pair, "\ud83d\ude00") and
# UTF-8 at most 4: a longer line or file cannot hold a document within `max_chars` (the 1 MiB is
# room for a JSON line's other fields), so it is skipped unread instead of being held in memory.
_JSON_BYTES_PER_CHAR = 12
_JSON_OTHER_FIELDS_BYTES = 1 << 20
_UTF8_BYTES_PER_CHAR = 4
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins valid pairs; these remain
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def _json_document(line: bytes, first_line: bool, key: str) -> tuple[str, dict] | None:
    """(the string in field `key`, the object) of one JSON line (None for a blank line); _BadRecord if none."""
    try:  # a byte-order mark is tolerated at the start of the file only
        decoded = line.decode("utf-8-sig" if first_line else "utf-8")
    except UnicodeDecodeError as e:
        raise _BadRecord(f"not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        record = json.loads(decoded)
    except RecursionError:
        raise _BadRecord("JSON nested too deeply") from None
    except json.JSONDecodeError as e:
        if not decoded.strip():  # checked here, not on every line: a blank line is rare
            return None
        raise _BadRecord(f"not valid JSON ({e.msg})") from None
    except ValueError:  # Python refuses integers of more than sys.get_int_max_str_digits() digits
        raise _BadRecord(f"an integer of more than {sys.get_int_max_str_digits()} digits") from None
    if not isinstance(record, dict):
        raise _BadRecord(f"not a JSON object (a JSON {_JSON_TYPES.get(type(record), 'value')})")
    text = record.get(key)
    if not isinstance(text, str):
        hint = " (The Stack's and StarCoderData's is 'content': --json-keys content)" if (
            key == "text" and isinstance(record.get("content"), str)) else ""
        raise _BadRecord(f"no string field {key!r}{hint}")
    if not text.isascii() and _LONE_SURROGATE.search(text):  # isascii() is O(1), and most code is ASCII
        raise _BadRecord(f"field {key!r} holds a lone surrogate (a \\ud800-\\udfff escape): not text")
    return text, record


def _skip_rest_of_line(f: IO[bytes]) -> None:
    while (chunk := f.readline(1 << 16)) and not chunk.endswith(b"\n"):
        pass


def _iter_json_lines(
    path: Path, key: str, skip: bool, stats: CorpusStats, max_chars: int = 0
) -> Iterator[tuple[int, str, dict]]:
    """(line number, text, object) of every good line."""
    cap = max_chars * _JSON_BYTES_PER_CHAR + _JSON_OTHER_FIELDS_BYTES if max_chars else -1
    lineno = 0
    start = stats.bytes_read
    try:
        with _open_binary(path) as f:
            position = getattr(f, "fileobj", f).tell  # on disk: a .gz's compressed bytes
            while line := f.readline(cap):
                lineno += 1
                stats.bytes_read = start + position()
                if len(line) == cap and not line.endswith(b"\n"):
                    line = b""  # hold no part of it while skipping the rest
                    _skip_rest_of_line(f)
                    stats.oversized += 1
                    continue
                try:
                    found = _json_document(line, lineno == 1, key)
                except _BadRecord as e:
                    bad_record(f"{path}:{lineno}: {e}", skip, stats)
                    continue
                if found is not None:
                    yield lineno, *found
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # truncated or corrupt .gz
        raise CorpusError(f"{path}: cannot read past line {lineno}: {e}") from e


def _field(record: Any, key: str) -> str | None:
    value = record.get(key) if isinstance(record, dict) else None
    return value if isinstance(value, str) else None


def _iter_parquet(path: Path, key: str, skip: bool, stats: CorpusStats) -> Iterator[tuple[int, str, dict]]:
    """(row number, text, row) of every good row."""
    import pyarrow  # a dependency of datasets

    datasets = offline_datasets()
    row_number = 0
    try:
        rows = datasets.load_dataset("parquet", data_files=str(path), split="train", streaming=True)
        if rows.column_names is not None and key not in rows.column_names:
            raise CorpusError(f"{path}: no column {key!r} (columns: {', '.join(rows.column_names)})")
        for row_number, row in enumerate(rows, start=1):
            text = _field(row, key)
            if text is None:
                bad_record(f"{path}: row {row_number}: column {key!r} is not a string", skip, stats)
                continue
            yield row_number, text, row
    except pyarrow.ArrowException as e:  # not parquet, truncated, corrupt
        raise CorpusError(f"{path}: cannot read past row {row_number} as parquet: {e}") from e


def _read_whole(path: Path, skip: bool, stats: CorpusStats, max_chars: int = 0) -> str | None:
    if max_chars and path.stat().st_size > max_chars * _UTF8_BYTES_PER_CHAR:
        stats.oversized += 1
        return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        bad_record(f"{path}: not UTF-8 ({e.reason} at byte {e.start})", skip, stats)
        return None


def iter_records(
    inputs: list[str],
    key: str = "text",
    extensions: tuple[str, ...] = (".py",),
    skip_bad_lines: bool = False,
    stats: CorpusStats | None = None,
    max_chars: int = 0,
    follow_symlinks: bool = False,
) -> Iterator[Record]:
    """Every document of `inputs` with where it came from, in input order (see `iter_documents`, which
    keeps its rules: empty and oversized documents dropped and counted, bad records raise or are skipped;
    `follow_symlinks`: `expand_inputs`')."""
    stats = stats if stats is not None else CorpusStats()
    named = [(name, path, path.stat().st_size)
             for name, path in _expand_named(inputs, extensions, follow_symlinks, stats.tree)]
    _warn_skipped(stats.tree, follow_symlinks)
    stats.bytes_total = sum(size for _, _, size in named)
    for name, path, size in named:
        stats.files += 1
        start = stats.bytes_read
        kind = _kind(path, extensions)
        if kind == "json":
            rows: Iterator[tuple[int, str, dict | None]] = _iter_json_lines(path, key, skip_bad_lines, stats,
                                                                              max_chars)
        elif kind == "parquet":
            rows = _iter_parquet(path, key, skip_bad_lines, stats)
        else:
            text = _read_whole(path, skip_bad_lines, stats, max_chars)
            rows = iter([] if text is None else [(0, text, None)])
        for number, doc, fields in rows:
            if not doc:
                stats.empty += 1
                continue
            if max_chars and len(doc) > max_chars:
                stats.oversized += 1
                continue
            stats.documents += 1
            yield Record(doc, path, name, number, fields)
        stats.bytes_read = start + size
    if stats.skipped:
        logger.warning("skipped %d bad records in %s", stats.skipped, inputs)
    if stats.documents == 0:
        oversized = f"; {stats.oversized} longer than {max_chars} characters" if stats.oversized else ""
        skipped = (f"; skipped {stats.tree.links} symbolic links and {stats.tree.special} special files in "
                   f"directories: a file named on the command line is read through its link"
                   if stats.tree.links or stats.tree.special else "")
        raise CorpusError(
            f"no documents found in {inputs} (json field {key!r}, source extensions {extensions}"
            f"{oversized}{skipped})"
        )


def _warn_skipped(skips: TreeSkips, follow_symlinks: bool) -> None:
    why = ("leading out of their directory, to a directory or nowhere" if follow_symlinks else
           "not followed; --follow-symlinks follows those to files inside their directory")
    parts = ([f"{skips.links} symbolic links ({why})"] if skips.links else []) + (
        [f"{skips.special} FIFOs, sockets or devices"] if skips.special else [])
    if parts:
        logger.warning("input directories: skipped %s: %s", " and ".join(parts), ", ".join(skips.examples))


def iter_documents(
    inputs: list[str],
    json_keys: tuple[str, ...] = ("text",),
    extensions: tuple[str, ...] = (".py",),
    language_tag: bool = False,
    skip_bad_lines: bool = False,
    stats: CorpusStats | None = None,
    max_chars: int = 0,
) -> Iterator[str]:
    """Yield document texts from files and directories, in input order (see the module doc).

    JSON and parquet documents come from field `json_keys[0]`; to read another field, call again
    with it first. Empty documents are dropped, and so are documents of more than `max_chars`
    characters (0: no limit), counted in `stats.oversized`. Bad records raise CorpusError naming
    the file and line, or are skipped and counted in `stats` (and a warning) with `skip_bad_lines`.
    Source files get CodeGeeX's language tag with `language_tag`.
    """
    for record in iter_records(inputs, json_keys[0], extensions, skip_bad_lines, stats, max_chars):
        if language_tag and record.fields is None and record.source.suffix in extensions:
            yield language_header(record.source) + record.text
        else:
            yield record.text


def offline_datasets() -> Any:
    """The `datasets` module, with hub access off unless the user already chose otherwise."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Imported late: datasets reads the variables above at import time. Local files with the
    # packaged json/parquet/text builders need no hub anyway; this guards against a stray lookup.
    import datasets

    return datasets


def load_corpus(
    inputs: list[str],
    json_keys: tuple[str, ...] = ("text",),
    extensions: tuple[str, ...] = (".py",),
    language_tag: bool = False,
    cache_dir: str | None = None,
) -> Any:
    """The same documents as `iter_documents`, as one `datasets.Dataset` with a "text" column.

    JSON lines, parquet and .txt files go through the `datasets` builders (cached under
    `cache_dir`); source files are read by `iter_documents` into memory. Documents keep the
    input order. Bad records raise CorpusError; for dirty data use
    `iter_documents(..., skip_bad_lines=True)`.
    """
    datasets = offline_datasets()
    key = json_keys[0]
    groups: list[tuple[str, list[Path]]] = []  # consecutive files of one kind, in input order
    for path in expand_inputs(inputs, extensions):
        kind = _kind(path, extensions)
        if groups and groups[-1][0] == kind:
            groups[-1][1].append(path)
        else:
            groups.append((kind, [path]))
    parts = []
    for kind, paths in groups:
        names = [str(p) for p in paths]
        if kind in ("json", "parquet"):
            parts.append(_load_with_builder(datasets, kind, paths, key, cache_dir))
        elif kind == "txt":
            kwargs = {"sample_by": "document", "cache_dir": cache_dir}
            parts.append(datasets.load_dataset("text", data_files=names, split="train", **kwargs))
        else:
            docs = list(iter_documents(names, extensions=extensions, language_tag=language_tag))
            parts.append(datasets.Dataset.from_dict({"text": docs}))
    corpus = parts and datasets.concatenate_datasets(parts).filter(lambda row: bool(row["text"]))
    if not corpus:
        raise CorpusError(
            f"no documents found in {inputs} (json field {key!r}, source extensions {extensions})"
        )
    return corpus


def _load_with_builder(
    datasets: Any, builder: str, files: list[Path], key: str, cache_dir: str | None
) -> Any:
    names = [str(p) for p in files]
    try:
        data = datasets.load_dataset(builder, data_files=names, split="train", cache_dir=cache_dir)
        error: Exception | None = None
    except Exception as e:  # datasets names no line; our own reader below does
        data, error = None, e
    if (
        data is not None
        and getattr(data.features.get(key), "dtype", None) in ("string", "large_string")
        and data.data.column(key).null_count == 0  # rows lacking the field come back as null
    ):
        data = data.select_columns([key])
        return data.rename_column(key, "text") if key != "text" else data
    read = _iter_json_lines if builder == "json" else _iter_parquet
    for path in files:
        for _ in read(path, key, False, CorpusStats()):
            pass
    columns = data.column_names if data is not None else "?"
    raise CorpusError(f"datasets could not read {key!r} from {names} (columns {columns}): {error}")
