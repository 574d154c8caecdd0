"""What checking every token id and the whole index costs, beside the data it guards (issue 29).

    python benchmarks/token_id_scan.py                       # synthetic 1-billion-token uint16 dataset (2 GB, temp dir)
    python benchmarks/token_id_scan.py --tokens 100000000    # a smaller one
    python benchmarks/token_id_scan.py --prefix .cache/data/stdlib_text_document   # an existing dataset (`make
        # pretrain` preprocesses the default corpus there), beside one epoch of its samples read as training does

Times, best of --repeats, with the page cache warm (the synthetic data was just written; read an existing dataset
once before, as the benchmark does):
  open      MMapIndexedDataset(prefix): reads the header and validates every pointer, length and document index
  scan      the uncached min/max pass over every token (token_range.scan_token_range)
  cached    check_token_ids when the range is already cached beside the index (a relaunch)
With --prefix also:
  index     building the sample index of one epoch of --seq-length samples (GPTDataset, uncached)
  epoch     reading every sample of that epoch through the training DataLoader (micro-batch --micro-batch-size,
            0 workers: the reading itself, which workers would only spread over processes), with the per-sample id
            check and without it (interleaved); "data time" = index + epoch
  sample    dataset[i] over the epoch, per sample, with and without the check: the check's own cost
"""

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from codegeex_train.data.gpt_dataset import GPTDataset
from codegeex_train.data.indexed_dataset import MMapIndexedDataset, bin_path, idx_path, write_index
from codegeex_train.data.sampler import build_pretraining_data_loader
from codegeex_train.data.token_range import check_token_ids, scan_token_range

VOCAB = 50400  # CodeGeeX's padded vocabulary; the synthetic ids stay below it


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def write_synthetic(prefix: str, tokens: int, seed: int = 0) -> None:
    """``tokens`` uint16 ids in documents of 1-4096 tokens, written in 64M-token chunks."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 4097, size=tokens // 2048 + 16)
    ends = np.cumsum(lengths)
    lengths = lengths[: int(np.searchsorted(ends, tokens)) + 1]
    lengths[-1] -= int(lengths.sum()) - tokens
    with open(bin_path(prefix), "wb") as f:
        chunk = 1 << 26
        for start in range(0, tokens, chunk):
            (np.arange(start, min(start + chunk, tokens), dtype=np.int64) % (VOCAB - 1)).astype(np.uint16).tofile(f)
    write_index(idx_path(prefix), np.uint16, lengths, np.arange(len(lengths) + 1))


def measure(prefix: str, repeats: int) -> dict[str, float]:
    ds = MMapIndexedDataset(prefix)
    scan_token_range(ds.tokens)  # warm the page cache
    check_token_ids(ds, VOCAB)  # and the range cache
    return {
        "documents": len(ds),
        "tokens": ds.num_tokens,
        "open": best(lambda: MMapIndexedDataset(prefix), repeats),
        "scan": best(lambda: scan_token_range(ds.tokens), repeats),
        "cached": best(lambda: check_token_ids(MMapIndexedDataset(prefix), VOCAB), repeats),
    }


def epoch(prefix: str, seq_length: int, micro_batch: int, repeats: int) -> dict[str, float]:
    ds = MMapIndexedDataset(prefix)
    samples = (ds.num_tokens - 1) // seq_length
    with tempfile.TemporaryDirectory() as cache_dir:
        def build_index():
            shutil.rmtree(cache_dir)
            os.mkdir(cache_dir)
            GPTDataset(ds, "train", (0, len(ds)), seq_length, samples, seed=1234, cache_dir=cache_dir)

        index = best(build_index, repeats)
        checked, unchecked = (GPTDataset(ds, "train", (0, len(ds)), seq_length, samples, seed=1234,
                                         cache_dir=cache_dir, vocab_size=vocab) for vocab in (VOCAB, None))
        times: dict[str, list[float]] = {"epoch": [], "epoch_unchecked": [], "sample": [], "sample_unchecked": []}
        for _ in range(repeats):  # interleaved, so load on the machine hits both alike
            for suffix, dataset in (("", checked), ("_unchecked", unchecked)):
                loader = build_pretraining_data_loader(dataset, 0, micro_batch, 0, 1, total_samples=samples)
                start = time.perf_counter()
                for _ in loader:
                    pass
                times["epoch" + suffix].append(time.perf_counter() - start)
                start = time.perf_counter()
                for i in range(samples):
                    dataset[i]
                times["sample" + suffix].append((time.perf_counter() - start) / samples)
    return {"samples": samples, "index": index, **{k: min(v) for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=10**9, help="size of the synthetic dataset")
    parser.add_argument("--prefix", help="measure this existing dataset instead of a synthetic one")
    parser.add_argument("--seq-length", type=int, default=256, help="with --prefix: the epoch's sample length")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", help="where the synthetic dataset goes (default: the temp dir)")
    args = parser.parse_args()
    if args.prefix:
        result = measure(args.prefix, args.repeats)
        result.update(epoch(args.prefix, args.seq_length, args.micro_batch_size, args.repeats))
    else:
        need = args.tokens * 2 + args.tokens // 100
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="token-id-scan-") as out:
            free = shutil.disk_usage(out).free
            if free < 2 * need:
                raise SystemExit(f"token_id_scan.py: error: {out} has {free / 1e9:.1f} GB free; the synthetic "
                                 f"dataset needs {need / 1e9:.1f} GB (and as much again spare): pass --dir or --tokens")
            prefix = os.path.join(out, "synthetic")
            start = time.perf_counter()
            write_synthetic(prefix, args.tokens)
            print(f"wrote {args.tokens:,} tokens in {time.perf_counter() - start:.1f} s")
            result = measure(prefix, args.repeats)
    print(f"{'documents':>16} {result['documents']:,}\n{'tokens':>16} {result['tokens']:,}")
    for name in ("open", "scan", "cached", "index", "epoch", "epoch_unchecked"):
        if name in result:
            print(f"{name:>16} {result[name]:8.3f} s")
    print(f"{'scan rate':>16} {result['tokens'] / result['scan'] / 1e9:8.2f} G tokens/s")
    if "epoch" in result:
        data_time = result["index"] + result["epoch"]
        print(f"{'data time':>16} {data_time:8.3f} s (index + epoch)\n{'scan / data time':>16} "
              f"{result['scan'] / data_time:8.3%}")
        print(f"{'per sample':>16} {result['sample'] * 1e6:8.1f} us checked, {result['sample_unchecked'] * 1e6:.1f} "
              f"us unchecked (dataset[i]); the check: {(result['sample'] - result['sample_unchecked']) * 1e6:.1f} us, "
              f"{result['epoch'] / result['epoch_unchecked'] - 1:+.1%} on the epoch through the loader")


if __name__ == "__main__":
    main()
