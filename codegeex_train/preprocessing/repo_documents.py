"""Repository-level documents: the files of one repository in one document, each after a header naming its path,
each header opened by the file-separator token.

The format is one table, ``REPO_FORMATS`` (--repo-format), with three presets (``[EOD]`` with --append-eod)::

    starcoder2     <repo_name>NAME<file_sep>PATH\\nCONTENT<file_sep>PATH\\nCONTENT...[EOD]
    qwen2.5-coder  <repo_name>NAME\\n<file_sep>PATH\\nCONTENT<file_sep>PATH\\nCONTENT...[EOD]
    codegeex4      <file_sep>###PATH: PATH\\n###LANGUAGE:Language\\nCONTENT<file_sep>...[EOD]

``<repo_name>`` and ``<file_sep>`` are the tokenizer's own (code_tokens.py): a Qwen2.5-Coder tokenizer's are
``<|repo_name|>`` and ``<|file_sep|>``, StarCoder2's ``<repo_name>`` and ``<file_sep>``; [EOD] is its eos.

starcoder2 is StarCoder2's repository-context layout with metadata (StarCoder 2 and The Stack v2, 2024: the
repository name after ``<repo_name>``, then each file as ``<file_sep>``, its path, a newline and its text).
qwen2.5-coder is Qwen2.5-Coder's repository-level layout (its model card: a newline after the repository name, each
file as its path, a newline and its text). codegeex4 uses CodeGeeX4's own headers: its repository prompts give each
file as ``###PATH: path`` then the text, its completion prompts name the language as ``###LANGUAGE:Python``
(guides/Repository_tasks_guideline.md and Infilling_guideline.md of THUDM/CodeGeeX4); CodeGeeX4 writes no repository
name and no token between files, we put ``<file_sep>`` before each header so that a file whose text holds
``###PATH:`` cannot split the document. An unknown language leaves the value empty, as CodeGeeX4 does.

Sentinels (code_tokens.py) are inserted as ids, never tokenized from text: a file whose text spells
``<file_sep>`` keeps it as ordinary tokens, so ``decode_repository`` finds exactly the files that went in.
Within a repository the files are in path order or in a seeded random order (``random.Random(f"{seed}/{name}")``
over the path-sorted files: the same whatever order the corpus lists them, different per repository).
"""

from __future__ import annotations

import dataclasses
import random
import re
import string
from collections.abc import Iterable, Sequence

from codegeex_train.tokenization.code_tokens import CodeTokens
from codegeex_train.preprocessing.source_files import SourceFields, SourceFile
from codegeex_train.tokenization.tokenizer import Tokenizer

FILE_ORDERS = ("path", "random")
DOCUMENT_LEVELS = ("file", "repo")


@dataclasses.dataclass(frozen=True)
class RepoFormat:
    """How a repository document lays out its repository and files around the sentinels."""

    name: str
    repo_name: bool
    """Open the document with ``<repo_name>`` and the repository's name."""
    file_header: str
    """Text after each ``<file_sep>``, before the file's own text; fields ``{path}`` and ``{language}``."""
    name_suffix: str = ""
    """Text after the repository's name, before the first ``<file_sep>``."""

    def header(self, file: SourceFile) -> str:
        return self.file_header.format(path=file.path, language=file.language or "")

    @property
    def header_pattern(self) -> re.Pattern[str]:
        """The header as a regular expression with groups ``path`` (and ``language``): one line each."""
        parts = []
        for literal, field, _, _ in string.Formatter().parse(self.file_header):
            parts.append(re.escape(literal))
            if field:
                parts.append(f"(?P<{field}>[^\\n]*)")
        return re.compile("".join(parts))


REPO_FORMATS = {f.name: f for f in (
    RepoFormat("starcoder2", repo_name=True, file_header="{path}\n"),
    RepoFormat("qwen2.5-coder", repo_name=True, file_header="{path}\n", name_suffix="\n"),
    RepoFormat("codegeex4", repo_name=False, file_header="###PATH: {path}\n###LANGUAGE:{language}\n"),
)}


@dataclasses.dataclass(frozen=True)
class DocumentSpec:
    """What one document is: a file, or a repository (repo_documents.py)."""

    level: str = "file"
    """--document-level: "file" or "repo"."""
    repo_format: str = "starcoder2"
    """--repo-format: a key of REPO_FORMATS."""
    file_order: str = "path"
    """--file-order: a repository's files by "path" or in a seeded "random" order."""
    seed: int = 1234
    """--seed of the random file order."""
    fields: SourceFields = SourceFields()
    """--repo-key, --path-key, --language-key: where JSON lines and parquet rows keep them."""

    def validate(self) -> None:
        for flag, value, choices in (("--document-level", self.level, DOCUMENT_LEVELS),
                                     ("--repo-format", self.repo_format, tuple(REPO_FORMATS)),
                                     ("--file-order", self.file_order, FILE_ORDERS)):
            if value not in choices:
                raise ValueError(f"{flag} {value!r}: expected one of {', '.join(choices)}")
        for flag, key in (("--repo-key", self.fields.repo_key), ("--path-key", self.fields.path_key),
                          ("--language-key", self.fields.language_key)):
            if not key:
                raise ValueError(f"{flag}: a column name, not empty")


@dataclasses.dataclass(frozen=True)
class Repository:
    name: str
    files: tuple[SourceFile, ...]

    @property
    def chars(self) -> int:
        return sum(len(f.content) for f in self.files)


def order_files(files: Sequence[SourceFile], file_order: str, seed: int, repo: str) -> tuple[SourceFile, ...]:
    """``files`` by path (``path``), or shuffled by ``random.Random(f"{seed}/{repo}")`` (``random``)."""
    ordered = sorted(files, key=lambda f: f.path or "")
    if file_order == "random":
        random.Random(f"{seed}/{repo}").shuffle(ordered)
    elif file_order != "path":
        raise ValueError(f"--file-order {file_order!r}: expected one of {', '.join(FILE_ORDERS)}")
    return tuple(ordered)


def group_repositories(files: Iterable[SourceFile], file_order: str = "path", seed: int = 1234) -> list[Repository]:
    """The repositories of ``files`` in order of first appearance, each with its files in ``file_order``.

    Holds every file in memory: a corpus whose rows of one repository are not contiguous (The Stack is ordered
    by language) can only be grouped whole; shard a larger corpus by repository first."""
    by_repo: dict[str, list[SourceFile]] = {}
    for file in files:
        by_repo.setdefault(file.repo or "", []).append(file)
    return [Repository(name, order_files(group, file_order, seed, name)) for name, group in by_repo.items()]


def encode_repository(tokenizer: Tokenizer, tokens: CodeTokens, fmt: RepoFormat, repo: Repository) -> list[int]:
    """The document's ids (without EOD): sentinels as ids, the name and each header + text tokenized."""
    texts = [fmt.header(f) + f.content for f in repo.files]
    encoded = tokenizer.encode_batch([repo.name + fmt.name_suffix, *texts] if fmt.repo_name else texts)
    ids = [tokens.repo_name, *encoded.pop(0)] if fmt.repo_name else []
    for piece in encoded:
        ids.append(tokens.file_sep)
        ids.extend(piece)
    return ids


def decode_repository(tokenizer: Tokenizer, tokens: CodeTokens, fmt: RepoFormat,
                      ids: Sequence[int]) -> tuple[str | None, list[tuple[str, str]]]:
    """(repository name or None, [(path, text)] in document order) of a document ``encode_repository`` made
    (a trailing EOD is dropped); ValueError when ``ids`` is not laid out as ``fmt`` says."""
    ids = list(ids)
    if ids and ids[-1] == tokenizer.eod:
        ids.pop()
    cuts = [i for i, token in enumerate(ids) if token == tokens.file_sep]
    head = ids[:cuts[0]] if cuts else ids
    name = None
    if fmt.repo_name:
        if not head or head[0] != tokens.repo_name:
            raise ValueError(f"a {fmt.name} repository document starts with <repo_name> (id {tokens.repo_name})")
        name = tokenizer.decode(head[1:]).removesuffix(fmt.name_suffix)
    elif head:
        raise ValueError(f"a {fmt.name} repository document starts with <file_sep> (id {tokens.file_sep})")
    pattern = fmt.header_pattern
    files = []
    for start, end in zip(cuts, cuts[1:] + [len(ids)]):
        text = tokenizer.decode(ids[start + 1:end])
        header = pattern.match(text)
        if header is None:
            raise ValueError(f"file {len(files)} of the document has no {fmt.name} header: {text[:80]!r}")
        files.append((header["path"], text[header.end():]))
    return name, files
