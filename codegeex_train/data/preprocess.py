"""Tokenize a corpus into Megatron indexed datasets (the library behind tools/preprocess_data.py).

Documents are read in order in this process, tokenized in batches by a pool of workers
(``imap`` keeps the order, so any worker count writes the same bytes), and appended to
``{output_prefix}_{json_key}_document.bin/.idx``, Megatron's naming.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import time
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from codegeex_train.data.corpus import CorpusError, iter_documents
from codegeex_train.data.default_corpus import default_corpus_files
from codegeex_train.data.indexed_dataset import IndexedDatasetBuilder, best_dtype
from codegeex_train.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer, build_tokenizer

__all__ = ["DEFAULT_INPUT", "PreprocessSummary", "TokenizerSpec", "output_prefix_for", "preprocess"]

DEFAULT_INPUT = "default"
"""``--input default``: the running Python's stdlib .py files (the embedded demo corpus)."""


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

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def documents_per_second(self) -> float:
        return self.documents / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        return (
            f"{self.documents} documents, {self.tokens} tokens in {self.seconds:.1f} s "
            f"({self.documents_per_second:,.0f} docs/s, {self.tokens_per_second:,.0f} tokens/s) "
            f"-> {', '.join(p + '.bin/.idx' for p in self.output_prefixes)}"
        )


# Per-process tokenizer of a pool worker. Pool initializers can only hand state to later tasks
# through the worker's module namespace; it is set once per worker and never read elsewhere.
_worker: dict[str, Any] = {}


def _init_worker(spec: TokenizerSpec, append_eod: bool) -> None:
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


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(texts)
    while batch := list(itertools.islice(it, size)):
        yield batch


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
) -> PreprocessSummary:
    """Tokenize ``inputs`` once per JSON key into ``output_prefix_for(output_prefix, key)``."""
    if workers < 1 or docs_per_batch < 1 or log_interval < 1:
        raise ValueError("--workers, --log-interval and the batch size must be >= 1")
    files = resolve_inputs(inputs)
    tok = tokenizer.build()
    dtype = best_dtype(tok.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    start = time.perf_counter()
    pool = (
        multiprocessing.Pool(workers, _init_worker, (tokenizer, append_eod)) if workers > 1 else None
    )
    documents = tokens = 0
    prefixes = []
    try:
        for key in json_keys:
            texts = iter_documents(
                files, (key,), tuple(extensions), language_tag, skip_bad_lines
            )
            batches = _batches(texts, docs_per_batch)
            encoded = (
                pool.imap(_encode_in_worker, batches)
                if pool
                else (_encode(tok, b, append_eod) for b in batches)
            )
            prefix = output_prefix_for(output_prefix, key)
            bar = tqdm(desc=f"tokenizing {key}", unit="doc", disable=not progress)
            with IndexedDatasetBuilder(prefix, dtype) as builder, bar:
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
    finally:
        if pool:  # every task has finished on success; on error, stop the workers now
            pool.terminate()
    return PreprocessSummary(documents, tokens, time.perf_counter() - start, prefixes)
