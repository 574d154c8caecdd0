"""Source files with their repository, path and language: what repository documents, deduplication and
decontamination work on.

Where each comes from:

=====================  ==========================================================================================
JSON lines / parquet   the fields ``SourceFields`` names; their defaults are The Stack's (``max_stars_repo_name``,
                       ``max_stars_repo_path``, ``lang``), which StarCoderData shares (it has no ``lang``: the
                       language then comes from the path's extension); the text is the --json-keys field
                       (``content`` in both)
a directory            one repository, named after the directory; each file's path is relative to it (so
                       ``--input repos/*`` reads a folder of clones, one repository each)
a file named directly  the repository is its parent directory (by name), the path its file name
=====================  ==========================================================================================
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator
from pathlib import Path

from codegeex_train.preprocessing.code_languages import language_header, language_of
from codegeex_train.preprocessing.corpus import CorpusStats, Record, bad_record, iter_records


@dataclasses.dataclass(frozen=True)
class SourceFields:
    """Column names of repository, path and language in JSON lines and parquet rows (--repo-key, --path-key,
    --language-key)."""

    repo_key: str = "max_stars_repo_name"
    path_key: str = "max_stars_repo_path"
    language_key: str = "lang"


@dataclasses.dataclass(slots=True)
class SourceFile:
    """One file of a corpus."""

    content: str
    repo: str | None
    path: str | None
    language: str | None
    """Our name for it (``Python``, ``C++``) when known, else the dataset's own value, or None."""
    origin: str
    """Where it was read: ``file:line`` (``file:row``) or the file's path; what reports name."""

    @property
    def language_header(self) -> str:
        """CodeGeeX's language tag line (``# language: Python\\n``), or '' for an unknown language."""
        return language_header(self.path, self.language)


def _text_field(fields: dict, key: str) -> str | None:
    value = fields.get(key)
    return value if isinstance(value, str) and value else None


@functools.lru_cache(maxsize=1024)
def _tree_name(name: str) -> str | None:
    """The repository name of an --input directory (None for a file)."""
    root = Path(name)
    return (root.name or root.resolve().name) if root.is_dir() else None


def source_file(record: Record, fields: SourceFields) -> SourceFile:
    """The SourceFile of one record read by ``iter_records``."""
    if record.fields is None:  # a whole file
        repo = _tree_name(record.input)
        if repo is not None:
            path = record.source.relative_to(record.input).as_posix()
        else:  # abspath, not resolve(): no system call per path component
            repo, path = os.path.basename(os.path.dirname(os.path.abspath(record.source))), record.source.name
        language = None
    else:
        repo, path = _text_field(record.fields, fields.repo_key), _text_field(record.fields, fields.path_key)
        language = _text_field(record.fields, fields.language_key)
    known = language_of(path, language)
    return SourceFile(record.text, repo, path, known[0] if known else language, record.origin)


def _missing(file: SourceFile, fields: SourceFields) -> str | None:
    """Why ``file`` cannot go into a repository document, or None."""
    for value, key, flag in ((file.repo, fields.repo_key, "--repo-key"), (file.path, fields.path_key, "--path-key")):
        if value is None:
            return (f"no string field {key!r} ({flag}): a repository document needs every file's repository and "
                    f"path")
        if "\n" in value:
            return f"field {key!r} holds a line break: it cannot be a header line of a repository document"
    if file.language and "\n" in file.language:
        return f"field {fields.language_key!r} holds a line break: it cannot be a header line"
    return None


def iter_source_files(
    inputs: list[str],
    content_key: str = "text",
    fields: SourceFields = SourceFields(),
    extensions: tuple[str, ...] = (".py",),
    skip_bad_lines: bool = False,
    stats: CorpusStats | None = None,
    max_chars: int = 0,
    need_location: bool = False,
    follow_symlinks: bool = False,
) -> Iterator[SourceFile]:
    """Every file of ``inputs`` in input order (``iter_records``' rules for bad, empty and oversized records, and
    for links and special files in directories).

    ``need_location`` (repository documents): a row without a repository or a path, or with a line break in
    one, is a bad record (CorpusError naming it, or skipped and counted with ``skip_bad_lines``)."""
    stats = stats if stats is not None else CorpusStats()
    for record in iter_records(inputs, content_key, extensions, skip_bad_lines, stats, max_chars, follow_symlinks):
        file = source_file(record, fields)
        if need_location and (why := _missing(file, fields)):
            bad_record(f"{record.origin}: {why}", skip_bad_lines, stats)
            stats.documents -= 1
            continue
        yield file
