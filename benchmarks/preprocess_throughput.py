"""Preprocessing throughput: the stdlib corpus tokenized with 1 and with 2 worker processes.

Both runs happen in one invocation, so the ratio is meaningful even on a noisy machine:

    python benchmarks/preprocess_throughput.py              # first 8 MB of the stdlib's .py files
    python benchmarks/preprocess_throughput.py --limit-mb 0 --workers 1 2 4   # all of it

With workers=1 the main process tokenizes; Hugging Face's batch encoder may still use several
threads (set TOKENIZERS_PARALLELISM=false for a strictly single-core baseline).
"""

import argparse
import os
import tempfile

from codegeex_train.preprocessing.default_corpus import default_corpus_files
from codegeex_train.preprocessing.preprocess import PreprocessSummary, TokenizerSpec, preprocess


def run(limit_mb: float, workers: list[int]) -> list[tuple[int, PreprocessSummary]]:
    """Preprocess the same files once per worker count (shipped tokenizer, whitespace encoding)."""
    files = [str(p) for p in default_corpus_files(int(limit_mb * 2**20) if limit_mb > 0 else None)]
    spec = TokenizerSpec(whitespace_encoding=True)
    results = []
    with tempfile.TemporaryDirectory() as out:
        for n in workers:
            prefix = os.path.join(out, f"w{n}")
            results.append((n, preprocess(files, prefix, spec, append_eod=True, workers=n,
                                          progress=False)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit-mb", type=float, default=8.0,
                        help="stdlib source to use, in MiB (0 = all)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    results = run(args.limit_mb, args.workers)
    base = results[0][1].tokens_per_second
    print(f"{'workers':>7} {'documents':>9} {'tokens':>10} {'seconds':>7} {'tokens/s':>10} {'ratio':>5}")
    for n, s in results:
        print(f"{n:>7} {s.documents:>9} {s.tokens:>10} {s.seconds:>7.2f} "
              f"{s.tokens_per_second:>10,.0f} {s.tokens_per_second / base:>5.2f}")


if __name__ == "__main__":
    main()
