"""Tokenize a corpus into Megatron indexed datasets (the library behind tools/preprocess_data.py).

Documents are read in order in this process, tokenized in batches by a pool of workers (results
are taken in submission order, so any worker count writes the same bytes), and appended to
``{output_prefix}_{json_key}_document.bin/.idx``, Megatron's naming.

Between reading and tokenizing, on source files (``DocumentSpec``, ``FilterSpec``)::

    read -> decontaminate -> deduplicate -> file documents (optionally language-tagged)
                                         -> or repository documents (grouped, ordered; repo_documents.py)

Decontamination and deduplication work on files, before any grouping; their per-file work (benchmark search,
MinHash signature) runs in the workers, their decisions here in corpus order, so any worker count drops the same
files. Their reports land beside the outputs: ``{output_prefix}_dedup.json``,
``{output_prefix}_decontamination.json``; a tokenizer that got the sentinels appended (repository documents with a
Hugging Face tokenizer that lacked them) is saved as ``{output_prefix}_tokenizer.json``, for training's
--tokenizer-model. Beside each dataset ``PREFIX.meta.json`` records the tokenizer that wrote it (its flags and
fingerprint, ``tokenizer_record.py``), which training's data check compares with its own.

A run is all or nothing: the outputs of every JSON key (and the reports) appear together when the last key is done;
on any failure (a bad record, a dead worker, a full disk, Ctrl-C) no .bin/.idx, report or .tmp is left.
Documents longer than ``max_document_chars`` never reach a tokenizer: Hugging Face's byte-level
BPE needs about 190 bytes of memory per character of one document (measured), so a stray 100 MB
line would need ~19 GB in one worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import os
import signal
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from codegeex_train.tokenization.code_tokens import CodeTokens, code_tokens
from codegeex_train.preprocessing.corpus import CorpusError, CorpusStats
from codegeex_train.preprocessing.default_corpus import default_corpus_files
from codegeex_train.preprocessing.file_filters import FileFilter, FilterSpec
from codegeex_train.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from codegeex_train.preprocessing.outputs import PreprocessSummary, Reports, tokenizer_json
from codegeex_train.preprocessing.repo_documents import (
    REPO_FORMATS,
    DocumentSpec,
    Repository,
    encode_repository,
    group_repositories,
)
from codegeex_train.preprocessing.source_files import SourceFile, iter_source_files
from codegeex_train.tokenization.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    EOD_TOKEN,
    TOKENIZER_CONFIG,
    Tokenizer,
    build_tokenizer,
)
from codegeex_train.tokenization.record import dataset_meta_path, dataset_meta_text
from codegeex_train.preprocessing.worker_pool import BATCH_CHARS, INTERRUPTS, OrderedPool, WorkerDiedError, batches
from codegeex_train.preprocessing.worker_pool import interrupts_held as _interrupts_held

__all__ = [
    "DEFAULT_INPUT",
    "DEFAULT_MAX_DOCUMENT_CHARS",
    "DocumentSpec",
    "FilterSpec",
    "PreprocessSummary",
    "TokenizerSpec",
    "WorkerDiedError",
    "output_prefix_for",
    "preprocess",
]

DEFAULT_INPUT = "default"
"""``--input default``: the running Python's stdlib .py files (the embedded demo corpus)."""

DEFAULT_MAX_DOCUMENT_CHARS = 1 << 20
"""``--max-document-chars``: 1 Mi characters, so nothing of a corpus filtered at 1 MB per file
(BigCode's The Stack, Codex's training set) is dropped; about 200 MB and 2 s of tokenizing."""


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """The build_tokenizer() arguments; small and picklable, so each worker builds its own."""

    tokenizer_type: str = "HFTokenizer"
    tokenizer_model: str | None = DEFAULT_TOKENIZER_PATH
    vocab_file: str | None = None
    merge_file: str | None = None
    whitespace_encoding: bool = False

    def build(self) -> Tokenizer:
        return build_tokenizer(**dataclasses.asdict(self))


# Per-process state of a pool worker. Pool initializers can only hand state to later tasks
# through the worker's module namespace; it is set once per worker and never read elsewhere.
_worker: dict[str, Any] = {}


def _init_worker(spec: TokenizerSpec, append_eod: bool, repo_format: str | None = None,
                 tokens: CodeTokens | None = None, file_filter: FileFilter | None = None) -> None:
    # Ctrl-C reaches the whole process group: the main process alone handles it (and stops the
    # workers); SIGTERM kills a worker outright, whatever handler the main process installed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTS)  # held back while the pool forked us
    # The processes are the parallelism: Hugging Face's thread pool in every worker on top
    # oversubscribes the cores (on 2 cores, 2 workers were then no faster than 1).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = spec.build()
    if tokens is not None and code_tokens(tokenizer) != tokens:  # appended in a fixed order: the same ids
        raise RuntimeError(f"a worker's sentinels {code_tokens(tokenizer)} differ from {tokens}")
    _worker.update(tokenizer=tokenizer, append_eod=append_eod, repo_format=repo_format, tokens=tokens,
                   file_filter=file_filter)


def _encode(tokenizer: Tokenizer, texts: list[str], append_eod: bool) -> list[np.ndarray]:
    dtype = best_dtype(tokenizer.vocab_size)
    eod = [tokenizer.eod] if append_eod else []
    # Arrays, not lists of ints: far cheaper to pickle back from a worker to the writer.
    return [np.array(ids + eod, dtype=dtype) for ids in tokenizer.encode_batch(texts)]


def _encode_repositories(tokenizer: Tokenizer, tokens: CodeTokens, repo_format: str, repos: list[Repository],
                         append_eod: bool) -> list[np.ndarray]:
    dtype = best_dtype(tokenizer.vocab_size)
    eod = [tokenizer.eod] if append_eod else []
    fmt = REPO_FORMATS[repo_format]
    return [np.array(encode_repository(tokenizer, tokens, fmt, repo) + eod, dtype=dtype) for repo in repos]


def _encode_in_worker(items: list[str] | list[Repository]) -> list[np.ndarray]:
    w = _worker
    if w["repo_format"] is not None:
        return _encode_repositories(w["tokenizer"], w["tokens"], w["repo_format"], items, w["append_eod"])
    return _encode(w["tokenizer"], items, w["append_eod"])


def _inspect_in_worker(texts: list[str]) -> list[tuple]:
    return _worker["file_filter"].inspect(texts)


def output_prefix_for(output_prefix: str, json_key: str) -> str:
    """Megatron's ``{output_prefix}_{key}_{level}`` with level "document"."""
    return f"{output_prefix}_{json_key}_document"


def resolve_inputs(inputs: Sequence[str]) -> list[str]:
    """``default`` (or nothing) stands for the stdlib corpus; other inputs pass through."""
    if not inputs or list(inputs) == [DEFAULT_INPUT]:
        return [str(p) for p in default_corpus_files()]
    if DEFAULT_INPUT in inputs:
        raise CorpusError(f"--input {DEFAULT_INPUT} cannot be combined with other inputs")
    return list(inputs)


def _is_disk_full(e: OSError) -> bool:
    """A failed write to the outputs: such errors carry no file name of their own."""
    return e.filename is None and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def check_options(json_keys: Sequence[str], language_tag: bool, documents: DocumentSpec, filters: FilterSpec,
                  decontaminate: bool | None = None) -> None:
    """ValueError naming the flag for settings that do not go together (or a bad value). ``decontaminate``:
    whether benchmarks will be searched for (default: whether ``filters`` holds any yet)."""
    documents.validate()
    filters.validate()
    decontaminate = bool(filters.benchmarks) if decontaminate is None else decontaminate
    features = [flag for flag, on in (("--document-level repo", documents.level == "repo"),
                                      (f"--dedup {filters.dedup}", filters.dedup),
                                      ("--decontaminate", decontaminate)) if on]
    if features and len(json_keys) > 1:
        raise ValueError(f"--json-keys {' '.join(json_keys)}: {features[0]} works on one field (the files' "
                         f"content); give one key")
    if language_tag and documents.level == "repo":
        raise ValueError("--language-tag is for --document-level file (a repository document's headers name "
                         "each file's path; --repo-format codegeex4 also its language)")


def _progress(desc: str, unit: str, total: int | None, progress: bool) -> tqdm:
    return tqdm(desc=desc, unit=unit, unit_scale=unit == "B", total=total, disable=not progress)


def _started(items: Iterable[Any]) -> Iterator[Any]:
    """``items`` with the first one already read: the inputs are listed by then, so ``CorpusStats.bytes_total``
    (their size on disk) can be a bar's total from its first line."""
    items = iter(items)
    first = next(items, _NONE)
    return items if first is _NONE else itertools.chain((first,), items)


_NONE = object()


def _tracked(items: Iterable[Any], stats: CorpusStats, bar: tqdm) -> Iterator[Any]:
    """``items``, moving ``bar`` (bytes) to how far the reader has got, to the end once they are all read."""
    for item in items:
        bar.update(stats.bytes_read - bar.n)
        yield item
    bar.update(stats.bytes_read - bar.n)  # the last file counts once read to its end, after its last item


def _documents(sources: Iterator[SourceFile], stats: CorpusStats, key: str, documents: DocumentSpec,
               language_tag: bool, progress: bool, summary: PreprocessSummary) -> tuple[Iterator[Any], Any, tqdm]:
    """(the documents to tokenize, their length in characters, the progress bar of tokenizing them): texts of
    files, or repositories, which are all read (and grouped) first, with a bar of their own. File bars count bytes
    on disk out of the inputs' total size, the repository bar repositories out of their number."""
    sources = _started(sources)
    if documents.level == "file":
        bar = _progress(f"tokenizing {key}", "B", stats.bytes_total or None, progress)
        texts = (f.language_header + f.content if language_tag else f.content for f in _tracked(sources, stats, bar))
        return texts, len, bar
    with _progress(f"reading {key}", "B", stats.bytes_total or None, progress) as reading:
        repos = group_repositories(_tracked(sources, stats, reading), documents.file_order, documents.seed)
    summary.files += sum(len(r.files) for r in repos)
    return iter(repos), lambda r: r.chars, _progress(f"tokenizing {key}", "repo", len(repos), progress)


def _write(builder: IndexedDatasetBuilder, encoded: Iterable[list[np.ndarray]], bar: tqdm,
           summary: PreprocessSummary, log_interval: int, start: float, repositories: bool) -> None:
    """Append every encoded document to ``builder``, counting into ``summary`` and showing the speed on ``bar``
    (which counts repositories; a file-level bar moves with the bytes read)."""
    with bar:
        last_log = summary.documents
        for batch in encoded:
            for ids in batch:
                builder.add_document(ids)
                summary.tokens += len(ids)
            summary.documents += len(batch)
            if repositories:
                bar.update(len(batch))
            if summary.documents - last_log >= log_interval:
                last_log = summary.documents
                elapsed = time.perf_counter() - start
                bar.set_postfix_str(f"{summary.documents:,} docs, {summary.documents / elapsed:,.0f} docs/s, "
                                    f"{summary.tokens / elapsed:,.0f} tokens/s")


def _save_tokenizer(reports: Reports, output_prefix: str, tok: Tokenizer, text: str) -> str:
    """Write the tokenizer that grew (sentinels appended) beside the outputs; returns what --tokenizer-model names:
    ``PREFIX_tokenizer.json``, or, when its eod is a model family's eos (an HF directory's, e.g. DeepSeek-Coder's),
    the directory ``PREFIX_tokenizer`` with its tokenizer_config.json naming that eos (a bare file's is
    <|endoftext|>)."""
    eos = tok.decode([tok.eod])
    if eos == EOD_TOKEN:
        reports.add(f"{output_prefix}_tokenizer.json", text)
        return f"{output_prefix}_tokenizer.json"
    directory = f"{output_prefix}_tokenizer"
    os.makedirs(directory, exist_ok=True)
    reports.add(os.path.join(directory, "tokenizer.json"), text)
    reports.add(os.path.join(directory, TOKENIZER_CONFIG), json.dumps({"eos_token": eos}) + "\n")
    return directory


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer: TokenizerSpec = TokenizerSpec(),
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    extensions: Sequence[str] = (".py",),
    language_tag: bool = False,
    skip_bad_lines: bool = False,
    log_interval: int = 100,
    docs_per_batch: int = 16,
    progress: bool = True,
    max_document_chars: int = DEFAULT_MAX_DOCUMENT_CHARS,
    documents: DocumentSpec = DocumentSpec(),
    filters: FilterSpec = FilterSpec(),
    follow_symlinks: bool = False,
) -> PreprocessSummary:
    """Tokenize ``inputs`` once per JSON key into ``output_prefix_for(output_prefix, key)``.

    Documents longer than ``max_document_chars`` (0: no limit) are skipped and counted. ``documents`` says what
    a document is (a file, or a repository's files), ``filters`` which files are dropped first (module doc).
    In input directories only regular files are read, through a symbolic link only with ``follow_symlinks`` and
    to a file inside the directory (input_tree.py); the others are skipped and counted.
    """
    if workers < 1 or docs_per_batch < 1 or log_interval < 1:
        raise ValueError("--workers, --log-interval and the batch size must be >= 1")
    if max_document_chars < 0:
        raise ValueError(f"--max-document-chars {max_document_chars}: must be >= 0 (0: no limit)")
    check_options(json_keys, language_tag, documents, filters)
    files = resolve_inputs(inputs)
    tok = tokenizer.build()
    repo = documents.level == "repo"
    vocab_size = tok.vocab_size
    tokens = code_tokens(tok) if repo else None  # appended to a tokenizer that lacks them
    tokenizer_text = tokenizer_json(tok) if tok.vocab_size != vocab_size else None
    dtype = best_dtype(tok.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    start = time.perf_counter()
    file_filter = FileFilter(filters) if filters.active else None
    limit = f"(now {max_document_chars})" if max_document_chars else "(now 0: no limit)"
    pool = OrderedPool(workers, _init_worker, (tokenizer, append_eod, documents.repo_format if repo else None,
                                               tokens, file_filter),
                       died_hint=f"lower --max-document-chars {limit} or --workers") if workers > 1 else None
    summary = PreprocessSummary(0, 0, 0.0, [], max_document_chars=max_document_chars, follow_symlinks=follow_symlinks)
    ok = False
    try:
        # Each builder writes .tmp files; leaving the stack finalizes them all (success) or
        # deletes them all (any exception), so the outputs appear together or not at all.
        with contextlib.ExitStack() as outputs:
            reports = outputs.enter_context(Reports())  # renamed last, after every dataset
            for key in json_keys:
                stats = CorpusStats()
                sources = iter_source_files(files, key, documents.fields, tuple(extensions), skip_bad_lines,
                                            stats, max_document_chars, need_location=repo,
                                            follow_symlinks=follow_symlinks)
                if file_filter:
                    inspect = ((lambda texts: pool.imap(_inspect_in_worker, texts)) if pool
                               else (lambda texts: map(file_filter.inspect, texts)))
                    sources = file_filter.filtered(sources, inspect, docs_per_batch)
                items, chars, bar = _documents(sources, stats, key, documents, language_tag, progress, summary)
                encode = ((lambda b: _encode_repositories(tok, tokens, documents.repo_format, b, append_eod)) if repo
                          else (lambda b: _encode(tok, b, append_eod)))
                grouped = batches(items, docs_per_batch, BATCH_CHARS, chars)
                encoded = pool.imap(_encode_in_worker, grouped) if pool else map(encode, grouped)
                prefix = output_prefix_for(output_prefix, key)
                with _interrupts_held():  # its .tmp file is created and registered for removal
                    builder = outputs.enter_context(IndexedDatasetBuilder(prefix, dtype))
                written = summary.documents
                _write(builder, encoded, bar, summary, log_interval, start, repositories=repo)
                if summary.documents == written:
                    raise CorpusError(f"no documents left in {list(inputs)} (field {key!r}): all {stats.documents} "
                                      f"were removed by --dedup / --decontaminate")
                if not repo:
                    summary.files += summary.documents - written
                summary.output_prefixes.append(prefix)
                summary.skipped_bad += stats.skipped
                summary.skipped_oversized += stats.oversized
                summary.skipped_links, summary.skipped_special = stats.tree.links, stats.tree.special  # every key's
            if file_filter:
                summary.duplicates, summary.contaminated = file_filter.duplicates, file_filter.contaminated
                for name, report in file_filter.reports().items():
                    reports.add(f"{output_prefix}_{name}.json", json.dumps(report, indent=1) + "\n")
            if tokenizer_text is not None:
                summary.tokenizer_file = _save_tokenizer(reports, output_prefix, tok, tokenizer_text)
            summary.reports = [p for p in reports.paths if not p.startswith(f"{output_prefix}_tokenizer")]
            # Which tokenizer wrote each dataset, as training must name it (tokenizer_record.py)
            named = tokenizer if tokenizer_text is None else dataclasses.replace(
                tokenizer, tokenizer_type="HFTokenizer", tokenizer_model=summary.tokenizer_file, vocab_file=None,
                merge_file=None)
            for prefix in summary.output_prefixes:
                reports.add(dataset_meta_path(prefix), dataset_meta_text(tok, named))
            with _interrupts_held():  # every .tmp is renamed into place, or none is
                outputs.close()
        ok = True
    except OSError as e:
        if not _is_disk_full(e):
            raise
        raise OSError(f"cannot write {output_prefix}_*: {e.strerror}; nothing was written "
                      "(free some space, or choose another --output-prefix)") from e
    finally:
        if pool:
            pool.close(ok)
    summary.seconds = time.perf_counter() - start
    return summary
