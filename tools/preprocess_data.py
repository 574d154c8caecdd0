"""Tokenize a corpus into Megatron indexed datasets: PREFIX_{key}_document.bin/.idx.

Flags are Megatron-LM's (tools/preprocess_data.py), so existing scripts keep working: --tokenizer-type
HuggingFaceTokenizer is our HFTokenizer, --partitions, --keep-newlines and --keep-sequential-samples are accepted
(documents are read in order and tokenized whole, newlines included), --split-sentences is refused (it needs nltk;
code has no sentences). docs/megatron-flags.md has the whole table.

The embedded demo corpus (this Python's stdlib .py files) with the shipped tokenizer:

    python tools/preprocess_data.py --input default --output-prefix data/stdlib \\
        --whitespace-encoding --append-eod --workers 2

JSON lines (field "content") with a GPT-2 BPE vocabulary:

    python tools/preprocess_data.py --input code.jsonl.gz --json-keys content \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --output-prefix data/code --append-eod --workers 8

Train with --data-path data/stdlib_text_document.

Bad input (a missing file, a malformed JSON line, an unreadable tokenizer, a bad flag value, an unknown flag) ends
with one `preprocess_data.py: error: ...` line and a non-zero exit; so do a dead tokenizer worker (the OOM killer), a
full disk, Ctrl-C and SIGTERM. The outputs appear only when the whole run succeeds: a failed run leaves no .bin/.idx
and no .tmp. Documents longer than --max-document-chars (default 1 Mi characters, BigCode's 1 MB file cut) are skipped
and counted in the summary line; --max-document-chars 0 keeps them all.
"""

import argparse
import signal
import sys

from codegeex_train.config.megatron_flags import ORIGIN, PREPROCESS_DATA, SEE
from codegeex_train.config.options import FlagParser, add_foreign_flags
from codegeex_train.data.corpus import CorpusError
from codegeex_train.data.indexed_dataset import IndexedDatasetError
from codegeex_train.data.preprocess import (
    DEFAULT_INPUT,
    DEFAULT_MAX_DOCUMENT_CHARS,
    TokenizerSpec,
    WorkerDiedError,
    preprocess,
)
from codegeex_train.data.tokenizer import DEFAULT_TOKENIZER_PATH, TOKENIZER_TYPES, TokenizerError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = FlagParser(description=__doc__, error_prefix="preprocess_data.py: ",
                        usage="python tools/preprocess_data.py --input FILE|DIR|default --output-prefix PREFIX "
                        "[FLAGS]")
    data = parser.add_argument_group("input data")
    data.add_argument("--input", nargs="+", default=[DEFAULT_INPUT],
                      help="files (.jsonl[.gz], .parquet, .txt, source) or directories; "
                      f"'{DEFAULT_INPUT}' = the stdlib's .py files (the default)")
    data.add_argument("--json-keys", nargs="+", default=["text"],
                      help="JSON fields to extract; one output dataset per key")
    data.add_argument("--extensions", nargs="+", default=[".py"],
                      help="source file extensions searched for in directories")
    data.add_argument("--language-tag", action="store_true",
                      help="prefix source files with CodeGeeX's '# language: X' line")
    data.add_argument("--skip-bad-lines", action="store_true",
                      help="skip (and count) bad records instead of failing: JSON lines that are not UTF-8, not "
                      "JSON, nested too deeply, not an object, without a string --json-keys field or with a lone "
                      "surrogate; text/source files that are not UTF-8")
    data.add_argument("--max-document-chars", type=int, default=DEFAULT_MAX_DOCUMENT_CHARS, metavar="N",
                      help="skip (and count) documents longer than N characters before they reach the tokenizer, "
                      "which needs ~190 bytes of memory per character (0 = no limit; default: %(default)s, "
                      "as BigCode and Codex drop files over 1 MB)")
    tok = parser.add_argument_group("tokenizer")
    tok.add_argument("--tokenizer-type", default="HFTokenizer", choices=TOKENIZER_TYPES)
    tok.add_argument("--tokenizer-model", default=DEFAULT_TOKENIZER_PATH,
                     help="tokenizer.json (HFTokenizer) or .model (SentencePieceTokenizer); "
                     "default: the shipped 8192-token BPE")
    tok.add_argument("--vocab-file", help="GPT2BPETokenizer vocab (encoder.json / vocab.json)")
    tok.add_argument("--merge-file", help="GPT2BPETokenizer merges (vocab.bpe / merges.txt)")
    tok.add_argument("--whitespace-encoding", action="store_true",
                     help="CodeGeeX's whitespace tokens for runs of spaces (use with the default "
                     "tokenizer, and the same setting in training)")
    tok.add_argument("--append-eod", action="store_true",
                     help="append the end-of-document token to every document")
    out = parser.add_argument_group("output")
    out.add_argument("--output-prefix", required=True,
                     help="writes OUTPUT_PREFIX_{key}_document.bin/.idx")
    run = parser.add_argument_group("runtime")
    run.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    run.add_argument("--log-interval", type=int, default=100,
                     help="documents between throughput updates of the progress bar")
    add_foreign_flags(parser, PREPROCESS_DATA, ORIGIN, SEE)
    args = parser.parse_args(argv)
    for flag in ("--workers", "--log-interval"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value < 1:
            parser.error(f"{flag} {value}: must be >= 1")
    if args.max_document_chars < 0:
        parser.error(f"--max-document-chars {args.max_document_chars}: must be >= 0 (0 = no limit)")
    partitions = getattr(args, "ignored --partitions", None)
    if partitions not in (None, "1"):
        print(f"preprocess_data.py: note: --partitions {partitions} ({ORIGIN}) has no effect: one reader feeds "
              f"--workers {args.workers} tokenizer processes (raise --workers for speed); the output is the same",
              file=sys.stderr)
    return args


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's cancel), raised like Ctrl-C so that the unfinished outputs are removed."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    spec = TokenizerSpec(args.tokenizer_type, args.tokenizer_model, args.vocab_file,
                         args.merge_file, args.whitespace_encoding)
    try:
        summary = preprocess(
            args.input,
            args.output_prefix,
            spec,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            extensions=args.extensions,
            language_tag=args.language_tag,
            skip_bad_lines=args.skip_bad_lines,
            log_interval=args.log_interval,
            max_document_chars=args.max_document_chars,
        )
    except (CorpusError, TokenizerError, IndexedDatasetError, WorkerDiedError, OSError) as e:
        print(f"preprocess_data.py: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None  # bad input or unwritable output: one line, exit 2 as argparse
    except KeyboardInterrupt as e:
        name, code = ("SIGTERM", 128 + signal.SIGTERM) if isinstance(e, Terminated) else ("SIGINT", 128 + signal.SIGINT)
        print(f"\npreprocess_data.py: error: interrupted ({name}); no partial output is left", file=sys.stderr)  # own line: a progress bar may be mid-line
        sys.exit(code)
    print(summary)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _raise_terminated)
    main()
