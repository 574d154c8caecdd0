"""Train a byte-level BPE tokenizer (Hugging Face `tokenizers`) and save its `tokenizer.json`.

The file holds `<|endoftext|>` and, unless --no-whitespace-tokens, CodeGeeX's whitespace tokens
(`<|extratoken_10|>`..`<|extratoken_18|>`, runs of 2..10 spaces); the merges are then learned on
whitespace-encoded text, so use the file with whitespace encoding on (`--tokenizer-type
HFTokenizer --tokenizer-model FILE` plus whitespace encoding). It still round-trips exactly without.
Special tokens count towards --vocab-size, so the ids are exactly 0..vocab_size-1.

Regenerate the shipped default tokenizer (stdlib of Python 3.11, about 10 s on 2 cores):

    python tools/train_tokenizer.py --default-corpus --vocab-size 8192 \\
        --output codegeex_train/tokenization/assets/default_tokenizer.json

Train on your own code (directories searched recursively by extension; JSON lines by field):

    python tools/train_tokenizer.py --input src/ data/code.jsonl.gz --extensions .py .c \\
        --json-key content --vocab-size 50304 --output my_tokenizer.json

Bad input (a missing file, a malformed JSON line, a bad flag value) ends with one
`train_tokenizer.py: error: ...` line and a non-zero exit.
"""

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from codegeex_train.preprocessing.corpus import CorpusError, CorpusStats, iter_documents
from codegeex_train.preprocessing.default_corpus import default_corpus_files
from codegeex_train.tokenization.tokenizer import EOD_TOKEN
from codegeex_train.tokenization.whitespace import (
    DEFAULT_MAX_WHITESPACE_RUN,
    split_whitespace_runs,
    whitespace_tokens,
)
from codegeex_train.distributed.log import get_logger, setup_logging


@dataclasses.dataclass
class TrainSummary:
    vocab_size: int
    documents: int
    corpus_bytes: int
    seconds: float
    file_bytes: int
    output_path: str


def train_bpe_tokenizer(
    files_or_dirs: list[str],
    vocab_size: int,
    output_path: str,
    json_keys: tuple[str, ...] = ("text",),
    extensions: tuple[str, ...] = (".py",),
    whitespace_tokens_max_run: int | None = DEFAULT_MAX_WHITESPACE_RUN,
    min_frequency: int = 2,
    skip_bad_lines: bool = False,
    show_progress: bool = True,
) -> TrainSummary:
    """Train a byte-level BPE on the documents of `files_or_dirs`; save it to `output_path`.

    With `whitespace_tokens_max_run` (the default), the file holds the whitespace tokens and the
    BPE is trained on whitespace-encoded text: use it with whitespace encoding on. `None` trains
    a plain byte-level BPE on the raw text.
    """
    start = time.perf_counter()
    special = [EOD_TOKEN]
    if whitespace_tokens_max_run is not None:
        special += whitespace_tokens(whitespace_tokens_max_run)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special,
        # All 256 bytes from the start, so any text encodes (and decodes back exactly).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    stats = CorpusStats()
    corpus_bytes = 0

    def documents() -> Iterator[str]:
        nonlocal corpus_bytes
        for text in iter_documents(
            files_or_dirs, json_keys, extensions, skip_bad_lines=skip_bad_lines, stats=stats
        ):
            corpus_bytes += len(text.encode("utf-8"))
            if whitespace_tokens_max_run is None:
                yield text
            else:
                # Learn merges on exactly the pieces whitespace encoding will hand the BPE; on raw
                # text it would spend merges on space runs and split words left after indents.
                parts = split_whitespace_runs(text, whitespace_tokens_max_run)
                yield from (p for p in parts if isinstance(p, str))

    tokenizer.train_from_iterator(documents(), trainer=trainer)
    Path(output_path).parent.mkdir(parents=True, exist_ok=True)
    try:
        tokenizer.save(output_path)
    except Exception as e:
        if type(e) is not Exception:  # `tokenizers` reports a failed write as a bare Exception
            raise
        raise OSError(f"cannot write {output_path}: {e}") from None
    return TrainSummary(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        documents=stats.documents,
        corpus_bytes=corpus_bytes,
        seconds=time.perf_counter() - start,
        file_bytes=os.path.getsize(output_path),
        output_path=output_path,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", help="files or directories")
    source.add_argument("--default-corpus", action="store_true", help="this Python's stdlib source")
    add("--output", required=True, help="path of the tokenizer.json to write")
    add("--vocab-size", type=int, required=True, help="total ids, special tokens included")
    add("--json-key", default="text", help="text field of JSON lines / parquet inputs")
    add("--extensions", nargs="+", default=[".py"], help="source file extensions in directories")
    add("--min-frequency", type=int, default=2, help="least count for a merge")
    add("--max-whitespace-run", type=int, default=DEFAULT_MAX_WHITESPACE_RUN,
        help="whitespace tokens for runs of 2..N spaces")
    add("--no-whitespace-tokens", action="store_true", help="plain BPE, no whitespace tokens")
    add("--skip-bad-lines", action="store_true", help="skip (and count) bad JSON lines")
    args = parser.parse_args(argv)
    if args.max_whitespace_run < 2:
        parser.error(f"--max-whitespace-run {args.max_whitespace_run}: runs start at 2 spaces, so at least 2")
    if args.min_frequency < 0:
        parser.error(f"--min-frequency {args.min_frequency}: must be >= 0")
    # Every byte is a token from the start, and the special tokens count too: fewer ids cannot be had.
    special = 1 + (0 if args.no_whitespace_tokens else len(whitespace_tokens(args.max_whitespace_run)))
    if args.vocab_size < 256 + special:
        parser.error(f"--vocab-size {args.vocab_size}: at least {256 + special} (256 byte tokens and "
                     f"{special} special tokens)")
    if os.path.isdir(args.output):
        parser.error(f"--output {args.output} is a directory; name the tokenizer.json file to write")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    inputs = [str(p) for p in default_corpus_files()] if args.default_corpus else args.input
    setup_logging(info_stream="stderr")  # stdout is the summary
    get_logger("tools.train_tokenizer").info(f"training a BPE (vocab {args.vocab_size}) on {len(inputs)} inputs")
    try:
        summary = train_bpe_tokenizer(
            inputs,
            args.vocab_size,
            args.output,
            json_keys=(args.json_key,),
            extensions=tuple(args.extensions),
            whitespace_tokens_max_run=None if args.no_whitespace_tokens else args.max_whitespace_run,
            min_frequency=args.min_frequency,
            skip_bad_lines=args.skip_bad_lines,
        )
    except (CorpusError, OSError) as e:  # bad or unreadable input, unwritable output
        print(f"train_tokenizer.py: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None  # bad input: one line, exit 2 as argparse
    print(
        f"wrote {summary.output_path}: vocab size {summary.vocab_size}, "
        f"{summary.file_bytes / 1e6:.2f} MB; trained on {summary.documents} documents "
        f"({summary.corpus_bytes / 1e6:.1f} MB) in {summary.seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
