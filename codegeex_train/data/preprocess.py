"""Tokenize a corpus into Megatron indexed datasets (the library behind tools/preprocess_data.py).

Documents are read in order in this process, tokenized in batches by a pool of workers (results
are taken in submission order, so any worker count writes the same bytes), and appended to
``{output_prefix}_{json_key}_document.bin/.idx``, Megatron's naming.

A run is all or nothing: the outputs of every JSON key appear together when the last key is done;
on any failure (a bad record, a dead worker, a full disk, Ctrl-C) no .bin/.idx or .tmp is left.
Documents longer than ``max_document_chars`` never reach a tokenizer: Hugging Face's byte-level
BPE needs about 190 bytes of memory per character of one document (measured), so a stray 100 MB
line would need ~19 GB in one worker.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import os
import signal
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from codegeex_train.data.corpus import CorpusError, CorpusStats, iter_documents
from codegeex_train.data.default_corpus import default_corpus_files
from codegeex_train.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from codegeex_train.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer, build_tokenizer

__all__ = [
    "DEFAULT_INPUT",
    "DEFAULT_MAX_DOCUMENT_CHARS",
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

_INTERRUPTS = {signal.SIGINT, signal.SIGTERM}

_BATCH_CHARS = 1 << 20
"""A batch closes at ``docs_per_batch`` documents or this many characters, whichever comes first:
together with the document limit it bounds what one worker holds (about 400 MB at the defaults)."""


class WorkerDiedError(RuntimeError):
    """A tokenizer worker process died (killed by a signal, e.g. the out-of-memory killer)."""


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


@dataclasses.dataclass
class PreprocessSummary:
    documents: int
    tokens: int
    seconds: float
    output_prefixes: list[str]
    skipped_bad: int = 0
    """Bad records skipped with ``skip_bad_lines`` (summed over JSON keys)."""
    skipped_oversized: int = 0
    """Documents longer than ``max_document_chars``, skipped (summed over JSON keys)."""
    max_document_chars: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def documents_per_second(self) -> float:
        return self.documents / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        skipped = ""
        if self.skipped_bad:
            skipped += f"; skipped {self.skipped_bad} bad records (--skip-bad-lines)"
        if self.skipped_oversized:
            skipped += (f"; skipped {self.skipped_oversized} documents over --max-document-chars "
                        f"{self.max_document_chars}")
        return (
            f"{self.documents} documents, {self.tokens} tokens in {self.seconds:.1f} s "
            f"({self.documents_per_second:,.0f} docs/s, {self.tokens_per_second:,.0f} tokens/s) "
            f"-> {', '.join(p + '.bin/.idx' for p in self.output_prefixes)}{skipped}"
        )


# Per-process tokenizer of a pool worker. Pool initializers can only hand state to later tasks
# through the worker's module namespace; it is set once per worker and never read elsewhere.
_worker: dict[str, Any] = {}


def _init_worker(spec: TokenizerSpec, append_eod: bool) -> None:
    # Ctrl-C reaches the whole process group: the main process alone handles it (and stops the
    # workers); SIGTERM kills a worker outright, whatever handler the main process installed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _INTERRUPTS)  # held back while the pool forked us
    # The processes are the parallelism: Hugging Face's thread pool in every worker on top
    # oversubscribes the cores (on 2 cores, 2 workers were then no faster than 1).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker["tokenizer"], _worker["append_eod"] = spec.build(), append_eod


def _encode(tokenizer: Tokenizer, texts: list[str], append_eod: bool) -> list[np.ndarray]:
    dtype = best_dtype(tokenizer.vocab_size)
    eod = [tokenizer.eod] if append_eod else []
    # Arrays, not lists of ints: far cheaper to pickle back from a worker to the writer.
    return [np.array(ids + eod, dtype=dtype) for ids in tokenizer.encode_batch(texts)]


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    return _encode(_worker["tokenizer"], texts, _worker["append_eod"])


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait for the end of the block: for steps that must not be cut in two."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _INTERRUPTS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _batches(texts: Iterable[str], size: int, max_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if len(batch) == size or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _death_cause(exit_codes: list[int | None]) -> str:
    """How a pool's worker died, from its workers' exit codes (-N: killed by signal N)."""
    # The pool terminates (SIGTERM) the survivors itself, so any other code is the first death.
    died = [c for c in exit_codes if c not in (None, 0, -signal.SIGTERM)]
    code = died[0] if died else (-signal.SIGTERM if -signal.SIGTERM in exit_codes else None)
    if code is None:
        return "it exited unexpectedly"
    if code > 0:
        return f"exit code {code}"
    try:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"killed by signal {-code}"


class _TokenizerPool:
    """Worker processes that tokenize batches; results come back in submission order.

    concurrent.futures rather than multiprocessing.Pool: when a worker dies (the OOM killer's
    SIGKILL) the pool breaks and every pending result raises at once; Pool silently replaces the
    worker and waits forever for the lost batch. At most ``2 * workers`` batches are in flight,
    so a huge corpus is not read ahead into memory.
    """

    def __init__(self, workers: int, spec: TokenizerSpec, append_eod: bool, max_chars: int):
        self._executor = ProcessPoolExecutor(workers, initializer=_init_worker,
                                             initargs=(spec, append_eod))
        # The first task starts every worker. Ctrl-C or SIGTERM during a fork() would be raised in
        # an at-fork hook, where Python prints and drops it (the run went on): hold them back.
        with _interrupts_held():
            self._executor.submit(int)
        self._window = 2 * workers
        self._max_chars = max_chars

    def imap(self, batches: Iterable[list[str]]) -> Iterator[list[np.ndarray]]:
        pending: collections.deque[Future] = collections.deque()
        try:
            for batch in batches:
                pending.append(self._executor.submit(_encode_in_worker, batch))
                if len(pending) > self._window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool:
            processes = self._processes()
            self._executor.shutdown(wait=True, cancel_futures=True)  # it has stopped the others
            cause = _death_cause([process.exitcode for process in processes])
            limit = f" (now {self._max_chars})" if self._max_chars else " (now 0: no limit)"
            raise WorkerDiedError(
                f"a tokenizer worker died ({cause}: out of memory? lower --max-document-chars"
                f"{limit} or --workers); nothing was written"
            ) from None

    def close(self, ok: bool) -> None:
        """Let idle workers exit after a complete run; otherwise stop them at once."""
        if ok:
            self._executor.shutdown(wait=True)
        else:
            self._stop()

    def _stop(self) -> None:
        """Kill the workers (a batch may take seconds) and wait for them."""
        for process in self._processes():
            process.kill()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _processes(self) -> list[Any]:
        # The executor's {pid: Process}; no public accessor before Python 3.14 (terminate_workers).
        return list((getattr(self._executor, "_processes", None) or {}).values())


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
) -> PreprocessSummary:
    """Tokenize ``inputs`` once per JSON key into ``output_prefix_for(output_prefix, key)``.

    Documents longer than ``max_document_chars`` (0: no limit) are skipped and counted.
    """
    if workers < 1 or docs_per_batch < 1 or log_interval < 1:
        raise ValueError("--workers, --log-interval and the batch size must be >= 1")
    if max_document_chars < 0:
        raise ValueError(f"--max-document-chars {max_document_chars}: must be >= 0 (0: no limit)")
    files = resolve_inputs(inputs)
    tok = tokenizer.build()
    dtype = best_dtype(tok.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    start = time.perf_counter()
    pool = (
        _TokenizerPool(workers, tokenizer, append_eod, max_document_chars) if workers > 1 else None
    )
    skipped_bad = skipped_oversized = documents = tokens = 0
    prefixes = []
    ok = False
    try:
        # Each builder writes .tmp files; leaving the stack finalizes them all (success) or
        # deletes them all (any exception), so the outputs appear together or not at all.
        with contextlib.ExitStack() as outputs:
            for key in json_keys:
                stats = CorpusStats()
                texts = iter_documents(files, (key,), tuple(extensions), language_tag,
                                       skip_bad_lines, stats, max_document_chars)
                batches = _batches(texts, docs_per_batch, _BATCH_CHARS)
                encoded = (
                    pool.imap(batches)
                    if pool
                    else (_encode(tok, b, append_eod) for b in batches)
                )
                prefix = output_prefix_for(output_prefix, key)
                with _interrupts_held():  # its .tmp file is created and registered for removal
                    builder = outputs.enter_context(IndexedDatasetBuilder(prefix, dtype))
                bar = tqdm(desc=f"tokenizing {key}", unit="doc", disable=not progress)
                with bar:
                    last_log = documents
                    for batch in encoded:
                        for ids in batch:
                            builder.add_document(ids)
                            tokens += len(ids)
                        documents += len(batch)
                        bar.update(len(batch))
                        if documents - last_log >= log_interval:
                            last_log = documents
                            elapsed = time.perf_counter() - start
                            bar.set_postfix_str(
                                f"{documents / elapsed:,.0f} docs/s, {tokens / elapsed:,.0f} tokens/s"
                            )
                prefixes.append(prefix)
                skipped_bad += stats.skipped
                skipped_oversized += stats.oversized
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
    return PreprocessSummary(documents, tokens, time.perf_counter() - start, prefixes,
                             skipped_bad, skipped_oversized, max_document_chars)
