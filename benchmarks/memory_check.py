"""The memory check's estimate beside each rank's measured peak, on CPU (accounting/fit.py; docs/_issue29_memory.md).

Each shape trains on fresh processes launched as `make pretrain` launches them (torchrun here; one python per
rank, DS_ACCELERATOR=cpu, gloo, one thread, glibc's malloc thresholds at 4 MiB as scripts/pretrain_codegen.sh sets
them), on a slice of the Python stdlib with the shipped tokenizer. Per rank:

  estimate  what the check in pretrain.prepare computes for this rank (fit.rank_need(...).host): the tensors
            resident at the peak (theory's weights, gradients, optimizer, activations, recompute), the framework's
            constant and the heap fragmentation term;
  measured  the rank's peak resident memory over the run (VmHWM read after its last training step) minus its
            resident memory when the check ran (VmRSS inside prepare): what the rank takes after the check, the
            figure the check compares with what the host has free.

    python benchmarks/memory_check.py                         # default, wide, pp shapes, 20 iterations: ~6 min
    python benchmarks/memory_check.py --shapes tiny --iters 4 # FRAMEWORK_BYTES: a model of negligible tensors
    python benchmarks/memory_check.py --shapes tiny --iters 2 --ranks 1 --num-workers 0 --json out.json  # the test's
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20

# Each shape's pretrain flags (micro-batch and global batch per DP rank: --global-batch-size is micro x ranks).
SHAPES = {
    # what `make pretrain` trains (scripts/pretrain_codegen.sh CONFIG=default): 4 layers, h 256, seq 256, micro 8
    "default": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
                "--max-position-embeddings", "256", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
                "--activation", "fast_gelu", "--seq-length", "256", "--micro-batch-size", "8"],
    # wider and longer: every activation tensor at or above the 4 MiB mmap threshold (no heap fragmentation term)
    "wide": ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
             "--max-position-embeddings", "512", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
             "--seq-length", "512", "--micro-batch-size", "4"],
    # two pipeline stages, 4 micro-batches, dropout 0.1 (CPU attention's math path: s x s probabilities kept)
    "pp": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--max-position-embeddings",
           "256", "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--seq-length", "256",
           "--micro-batch-size", "4", "--pipeline-model-parallel-size", "2", "--num-microbatches", "4"],
    # negligible tensors: what remains is the framework's constant
    "tiny": ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--max-position-embeddings",
             "64", "--seq-length", "32", "--micro-batch-size", "2"],
    # the test's: small enough for ~10 s on one rank, tensors (~0.2 GiB) as large as the constant
    "small": ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8",
              "--max-position-embeddings", "256", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
              "--seq-length", "256", "--micro-batch-size", "8"],
}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def rank_worker(out: str, argv: list[str]) -> None:
    """One rank (under torchrun): pretrain.main(argv), recording the check's estimate and the measurements."""
    from codegeex_train import pretrain
    from codegeex_train.accounting import fit
    from codegeex_train.training import trainer

    record: dict = {"rank": int(os.environ.get("RANK", "0"))}
    real_check, real_step = fit.check_run_memory, trainer.train_step

    def check_run_memory(model, plan, train, data, ds_config, num_samples, host):
        real_check(model, plan, train, data, ds_config, num_samples, host)
        w = fit.Workload.from_run(model, plan, ds_config, host.device)
        need = fit.rank_need(w, plan.dims.coords(host.rank)[2])
        record.update(rss_at_check=_status("VmRSS"), estimate=need.host, parts=need.parts)

    def train_step(*args, **kwargs):
        loss = real_step(*args, **kwargs)
        record["peak_rss"] = _status("VmHWM")
        return loss

    pretrain.check_run_memory, trainer.train_step = check_run_memory, train_step
    pretrain.main(argv)
    record["measured"] = record["peak_rss"] - record["rss_at_check"]
    Path(f"{out}.rank{record['rank']}.json").write_text(json.dumps(record))


def default_data(directory: str) -> str:
    """A slice of the Python stdlib, preprocessed with the shipped tokenizer (as the suite's tiny_data)."""
    from codegeex_train.preprocessing.default_corpus import default_corpus_files
    from codegeex_train.preprocessing.preprocess import TokenizerSpec, preprocess

    summary = preprocess(default_corpus_files()[:60], os.path.join(directory, "stdlib"),
                         TokenizerSpec(whitespace_encoding=True), append_eod=True, workers=1, progress=False)
    return summary.output_prefixes[0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(shape: str, data: str, iters: int, ranks: int, workdir: str, timeout: float = 900,
            num_workers: int = 1) -> list[dict]:
    """Train ``shape`` for ``iters`` iterations on ``ranks`` fresh CPU processes; each rank's record."""
    out = os.path.join(workdir, shape)
    flags = SHAPES[shape]
    micro = int(flags[flags.index("--micro-batch-size") + 1])
    pp = int(flags[flags.index("--pipeline-model-parallel-size") + 1]) if "--pipeline-model-parallel-size" in flags \
        else 1
    batch = [] if "--num-microbatches" in flags else ["--global-batch-size", str(micro * ranks // pp)]
    argv = [*flags, *batch, "--train-iters", str(iters), "--lr", "1e-3", "--data-path", data, "--split", "969,30,1",
            "--deepspeed-config", str(ROOT / "ds_configs" / "cpu_fp32_zero2.json"), "--distributed-backend", "gloo",
            "--eval-interval", str(iters + 1), "--eval-iters", "1", "--log-interval", str(iters),
            "--num-workers", str(num_workers), "--no-progress-bar"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "MALLOC_MMAP_THRESHOLD_": "4194304", "MALLOC_TRIM_THRESHOLD_": "4194304", "WANDB_MODE": "offline",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))}
    if ranks == 1:  # a world of one needs no launcher (pretrain.main defaults the rest): a second quicker
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        cmd = [sys.executable, __file__, "--rank-worker", out, "--", *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(_free_port()), __file__, "--rank-worker", out, "--", *argv]
    done = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{shape}: the run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(ranks)]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-worker"]:
        return rank_worker(argv[1], argv[3:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="default,wide,pp", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--iters", type=int, default=20, help="training iterations per shape (the peak settles by ~12)")
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks (data parallel, or the pipeline's stages)")
    p.add_argument("--data-path", help="an indexed dataset prefix (default: a stdlib slice, preprocessed here)")
    p.add_argument("--num-workers", type=int, default=1, help="DataLoader workers per rank (the script's 1)")
    p.add_argument("--json", help="write every rank's record here")
    a = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="memory-check-") as workdir:
        data = a.data_path or default_data(workdir)
        print(f"{'shape':8} {'rank':>4} {'estimate MiB':>12} {'measured MiB':>12} {'error':>7}   "
              f"estimate's parts (MiB)")
        for shape in a.shapes.split(","):
            results[shape] = measure(shape, data, a.iters, a.ranks, workdir, num_workers=a.num_workers)
            for r in results[shape]:
                parts = ", ".join(f"{k} {v / MIB:.0f}" for k, v in r["parts"].items() if v)
                error = r["estimate"] / r["measured"] - 1
                print(f"{shape:8} {r['rank']:>4} {r['estimate'] / MIB:12.0f} {r['measured'] / MIB:12.0f} "
                      f"{error:+7.1%}   {parts}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
