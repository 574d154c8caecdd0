"""Long context on CPU: a tiny RoPE model trains at sequence 16,384 with context parallelism 4, beside CP 1 at 4,096.

    python benchmarks/long_context.py                     # ~10 min on 2 idle cores
    python benchmarks/long_context.py --iters 2 --seq-lengths 2048 --cp-sizes 2   # a quick look

Each run is ``pretrain.main`` on spawned gloo ranks (distributed/spawn.py), the tiny model (2 layers + the top query
layer, hidden 64, 4 heads, RoPE), micro-batch 1, fp32, on the stdlib's .py files (the embedded corpus, preprocessed
into --work-dir on first use). Reported per run, from its metrics records after the first (warm-up) iteration:
tokens/s (the whole job's: tokens per step / step time) and the largest resident memory of any rank (the ranks'
VmHWM, read from /proc at the end: everything the process held, weights, activations, the ring's buffers and
Python). Beside them, the accounting's activation estimate per rank (accounting/theory.py) at the run's CP and at
CP 1: what one rank would hold without context parallelism.
The figures go into docs/context-parallelism.md (a JSON copy in --work-dir).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from codegeex_train.bounded_read import read_jsonl  # noqa: E402
from codegeex_train.distributed.spawn import run_distributed  # noqa: E402
from codegeex_train.layout.dims import ParallelDims  # noqa: E402

MODEL = ["--position-embedding-type", "rope", "--hidden-dropout", "0", "--attention-dropout", "0"]
MAX_METRICS_BYTES = 1 << 30


def model_args(seq: int) -> list[str]:
    """The tiny model at sequence length ``seq``: 2 layers (+ the top query layer), hidden 64, 4 heads, RoPE."""
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(seq),
            "--max-position-embeddings", str(seq), *MODEL]


def train_records(save: Path) -> dict[int, dict]:
    """The training records of ``save``/metrics.jsonl by iteration."""
    return {r["iteration"]: r for _, r in read_jsonl(save / "metrics.jsonl", MAX_METRICS_BYTES)
            if r.get("split", "train") == "train"}


def data(work: Path) -> str:
    from codegeex_train.preprocessing.default_corpus import default_corpus_files
    from codegeex_train.preprocessing.preprocess import TokenizerSpec, preprocess

    prefix = work / "stdlib_text_document"
    if not Path(f"{prefix}.idx").exists():
        summary = preprocess(default_corpus_files(), str(work / "stdlib"), TokenizerSpec(whitespace_encoding=True),
                             append_eod=True, workers=2, progress=False)
        return summary.output_prefixes[0]
    return str(prefix)


def train_and_measure(topology, argv):
    from codegeex_train import pretrain

    pretrain.main(argv)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes (Linux reports KiB)


def run(work: Path, prefix: str, seq: int, cp: int, iters: int) -> dict:
    save = work / f"seq{seq}_cp{cp}"
    argv = [*model_args(seq), "--context-parallel-size", str(cp), "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", str(iters), "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "100000",
            "--eval-iters", "1", "--data-path", prefix, "--split", "98,1,1", "--save", str(save),
            "--save-interval", "100000", "--no-progress-bar", "--num-workers", "0", "--skip-memory-check"]
    peaks = run_distributed(train_and_measure, ParallelDims(cp, cp_size=cp), deadline_s=3600, argv=argv)
    records = train_records(save)
    timed = [records[i] for i in sorted(records) if i > 1] or [records[max(records)]]
    return {"seq_length": seq, "cp": cp, "iterations": len(records),
            "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed),
            "loss_first": records[min(records)]["loss"], "loss_last": records[max(records)]["loss"],
            "peak_rss_gib_per_rank": max(peaks) / 2**30,
            "activations_gib_per_rank": activations(seq, cp), "activations_gib_at_cp1": activations(seq, 1)}


def activations(seq: int, cp: int) -> float:
    """The accounting's estimate of one micro-batch's saved activations on one rank (GiB)."""
    from codegeex_train.accounting.theory import Workload, activation_bytes_per_microbatch
    from codegeex_train.config.arguments import parse_args, validate

    argv = [*model_args(seq), "--context-parallel-size", str(cp), "--micro-batch-size", "1", "--data-path", "x"]
    args = parse_args(argv)
    model = args.model.with_vocab(50_000)
    return activation_bytes_per_microbatch(Workload.from_run(model, validate(args, cp, model))) / 2**30


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", default=str(ROOT / ".cache/long_context"))
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 4], help="one per --seq-lengths entry")
    p.add_argument("--iters", type=int, default=10)
    return p


def main() -> None:
    args = parser().parse_args()
    if len(args.cp_sizes) != len(args.seq_lengths):
        parser().error("--cp-sizes: give one CP size per --seq-lengths entry")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    prefix = data(work)
    results = [run(work, prefix, seq, cp, args.iters) for seq, cp in zip(args.seq_lengths, args.cp_sizes)]
    (work / "long_context.json").write_text(json.dumps(results, indent=1))
    print(f"{'seq':>7} {'CP':>3} {'tokens/s':>9} {'peak RSS GiB/rank':>18} {'act. GiB/rank':>14} "
          f"{'act. GiB at CP 1':>17} loss first -> last")
    for r in results:
        print(f"{r['seq_length']:>7} {r['cp']:>3} {r['tokens_per_s']:>9.0f} {r['peak_rss_gib_per_rank']:>18.2f} "
              f"{r['activations_gib_per_rank']:>14.3f} {r['activations_gib_at_cp1']:>17.3f} "
              f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}")


if __name__ == "__main__":
    main()
