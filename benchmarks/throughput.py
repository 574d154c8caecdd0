"""Training throughput: our stack vs Hugging Face GPT-2, both under the same DeepSpeed ZeRO-2 config.

For each (TP, DP) layout, the same spawned ranks build the engines on random tokens and time them side by
side (iterations interleaved ours/HF/HF/ours..., so drift on a shared machine hits both alike):

  ours  CodeGeeXModel (top query layer off, gelu_tanh, dropout 0) + our AdamW + ZeRO-2 with our mpu,
        wired as codegeex_train/pretrain.py does;
  HF    transformers.GPT2LMHeadModel(hf_gpt2_config(config)), the same shape, AdamW and DeepSpeed config
        (batch, sequence, clipping, precision), no mpu. HF has no tensor parallelism: at TP > 1 it runs on
        the same processes as pure DP with the same global batch (micro batch x DP / world per rank).
  plain the same HF model trained by a plain PyTorch loop (AdamW, clip_grad_norm_), no DeepSpeed; only in
        one-process layouts (1x1).
  mcore megatron-core's GPTModel (local layer spec, no fusions), the same shape, with megatron's tensor
        parallelism at the layout's TP, trained by the same plain loop (clipping over the sharded model); only
        in TP x 1 layouts with TP > 1, and only when megatron-core is installed (benchmarks/megatron_core_baseline.py).

tokens/s = global tokens per iteration / median iteration time after warm-up (an iteration: forward, backward,
optimizer step; its time is the slowest rank's). Threads are split so all ranks together use --threads.

    # CPU (default): TP x DP = 1x1, 1x2, 2x1 on this 2-core machine, ENVIRONMENT.md's GPT-2 shape (~3 min)
    python benchmarks/throughput.py
    # smaller and quicker
    python benchmarks/throughput.py --num-layers 2 --hidden-size 256 --seq-length 256 --iters 3
    # one layout on launched ranks (what a GPU needs: NCCL; --device cuda is untested, no GPU here)
    torchrun --nproc_per_node 2 benchmarks/throughput.py --device cuda --bf16 --configs 2x1 --iters 20

Without a launcher the script spawns the ranks itself (gloo, codegeex_train.distributed.spawn.run_distributed);
under torchrun/deepspeed it runs the --configs whose TP x DP equals the launched world size.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from codegeex_train.formats.huggingface.gpt2 import hf_gpt2_config
from codegeex_train.config.arguments import Args, DataConfig, LoggingConfig, OptimConfig, ParallelConfig, TrainConfig
from codegeex_train.config.deepspeed import build_deepspeed_config
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.distributed.topology import Topology
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.model import CodeGeeXModel, ModelGroups
from codegeex_train.model.flops import model_flops_per_iteration
from codegeex_train.tensor_parallel import model_parallel_seed
from codegeex_train.training.engine import build_engine
from codegeex_train.training.optim import build_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # this checkout's codegeex_train, whatever else is installed
    sys.path.insert(0, ROOT)

PHASES = ("forward", "backward", "step", "total")


@dataclass(frozen=True)
class BenchLayout:
    tp_size: int
    dp_size: int

    @classmethod
    def parse(cls, text: str) -> "BenchLayout":
        tp, dp = (int(x) for x in text.lower().split("x"))
        return cls(tp, dp)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size

    def __str__(self) -> str:
        return f"TP={self.tp_size} DP={self.dp_size}"


@dataclass(frozen=True)
class BenchSpec:
    """What every rank needs (pickled into the spawned processes)."""

    model: ModelConfig
    micro_batch_size: int
    seq_length: int
    iters: int
    warmup_iters: int
    threads_per_rank: int
    device: str = "cpu"
    bf16: bool = False
    seed: int = 1234
    megatron: bool = False  # megatron-core imports: run the mcore baseline where the layout allows
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-4, lr_decay_style="constant"))


def ds_args(spec: BenchSpec, micro_batch_size: int) -> Args:
    """The Args that build_deepspeed_config reads (batch, clipping, precision, ZeRO-2)."""
    train = TrainConfig(micro_batch_size=micro_batch_size, seq_length=spec.seq_length, bf16=spec.bf16, zero_stage=2,
                        train_iters=spec.iters + spec.warmup_iters, seed=spec.seed)
    return Args(spec.model, ParallelConfig(), train, spec.optim, DataConfig(), LoggingConfig())


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # queued kernels belong to the phase that launched them
    return time.perf_counter()


class Stack:
    """One engine, its data stream and per-iteration phase times."""

    def __init__(self, name: str, engine, mpu, data_rank: int, micro_batch_size: int, spec: BenchSpec,
                 device: torch.device):
        self.name, self.engine, self.mpu, self.device, self.spec = name, engine, mpu, device, spec
        self.micro_batch_size = micro_batch_size
        self.generator = torch.Generator().manual_seed(spec.seed + 1000 * data_rank)  # same on a TP group's ranks
        self.times: list[list[float]] = []
        self.losses: list[torch.Tensor] = []

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec.seq_length
        tokens = torch.randint(self.spec.model.vocab_size, (self.micro_batch_size, s + 1), generator=self.generator)
        return tokens[:, :-1].to(self.device), tokens[:, 1:].to(self.device)  # 2 x (b, s)

    def loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def iteration(self, record: bool) -> None:
        from deepspeed.utils import groups

        # DeepSpeed keeps the last engine's mpu in a module global and some runtime paths read it:
        # give each engine its own (None = the whole world is data parallel).
        groups.mpu = self.mpu
        ids, labels = self.batch()
        dist.barrier()  # every rank starts the iteration together
        t0 = sync(self.device)
        loss = self.loss(ids, labels)
        t1 = sync(self.device)
        self.engine.backward(loss)
        t2 = sync(self.device)
        self.engine.step()
        t3 = sync(self.device)
        if record:
            self.times.append([t1 - t0, t2 - t1, t3 - t2, t3 - t0])
        self.losses.append(loss.detach())

    def slowest_rank_times(self) -> torch.Tensor:
        """(iters, phases): each entry the max over all ranks."""
        times = torch.tensor(self.times, dtype=torch.float64, device=self.device)  # NCCL wants device tensors
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        return times.cpu()


class OurStack(Stack):
    def loss(self, ids, labels):
        position_ids = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # (b, s)
        return self.engine(ids, position_ids, labels=labels).mean()  # (b, s) per-token loss -> scalar


class HFStack(Stack):
    def loss(self, ids, labels):
        # GPT-2's own causal-LM loss (it shifts the labels itself): HF's standard training path.
        return self.engine(input_ids=ids, labels=ids).loss


class LoopStack(Stack):
    """A model trained by a plain PyTorch loop, no DeepSpeed: forward, backward, clip, optimizer step."""

    def __init__(self, name: str, model, optimizer, data_rank: int, micro_batch_size: int, spec: BenchSpec,
                 device: torch.device):
        super().__init__(name, model, None, data_rank, micro_batch_size, spec, device)
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]

    def clip(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, self.spec.optim.clip_grad)

    def iteration(self, record: bool) -> None:
        ids, labels = self.batch()
        dist.barrier()  # every rank starts the iteration together
        t0 = sync(self.device)
        loss = self.loss(ids, labels)
        t1 = sync(self.device)
        loss.backward()
        t2 = sync(self.device)
        if self.spec.optim.clip_grad > 0:  # 0 disables clipping, as in the DeepSpeed config
            self.clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = sync(self.device)
        if record:
            self.times.append([t1 - t0, t2 - t1, t3 - t2, t3 - t0])
        self.losses.append(loss.detach())


class PlainHFStack(LoopStack):
    """HF GPT-2 trained by a plain PyTorch loop, no DeepSpeed: the baseline a single-process user starts from
    (the same AdamW groups, fused kernel, clipping by ``clip_grad_norm_``)."""

    def __init__(self, model, optimizer, micro_batch_size: int, spec: BenchSpec, device: torch.device):
        super().__init__("plain", model, optimizer, 0, micro_batch_size, spec, device)

    def loss(self, ids, labels):
        return self.model(input_ids=ids, labels=ids).loss

    def slowest_rank_times(self) -> torch.Tensor:
        return torch.tensor(self.times, dtype=torch.float64)  # one process


class MegatronStack(LoopStack):
    """megatron-core's GPTModel, tensor parallel over every rank (TP x 1), by the same plain loop."""

    def __init__(self, spec: BenchSpec, device: torch.device, layout: BenchLayout):
        import megatron_core_baseline as mcore  # benchmarks/, on sys.path as the script's folder

        self.mcore = mcore
        model, optimizer, self.tp_group = mcore.build(spec.model, spec.seq_length, layout.tp_size, spec.seed,
                                                      spec.optim, device)
        super().__init__("mcore", model, optimizer, 0, spec.micro_batch_size, spec, device)  # one data stream

    def loss(self, ids, labels):
        return self.mcore.loss(self.model, ids, labels)

    def clip(self) -> None:
        self.mcore.clip_grad_norm_(self.params, self.spec.optim.clip_grad, self.tp_group)


def build_plain_hf(spec: BenchSpec, device: torch.device) -> PlainHFStack:
    from transformers import GPT2LMHeadModel

    hf_config = hf_gpt2_config(spec.model)
    hf_config.use_cache = False
    torch.manual_seed(spec.seed)
    model = GPT2LMHeadModel(hf_config).to(device)
    return PlainHFStack(model, build_optimizer(model, spec.optim), spec.micro_batch_size, spec, device)


def build_ours(topology: Topology, spec: BenchSpec, device: torch.device, layout: BenchLayout) -> OurStack:
    tracker = model_parallel_seed(spec.seed, topology.tp_rank, device)
    model = CodeGeeXModel(spec.model, ModelGroups.from_topology(topology), rng_tracker=tracker, seed=spec.seed,
                          device=device)
    batch_layout = ParallelPlan.derive(ParallelDims(layout.world_size, layout.tp_size),
                                       micro_batch_size=spec.micro_batch_size, dtype="bf16" if spec.bf16 else "fp32")
    config = build_deepspeed_config(ds_args(spec, spec.micro_batch_size), batch_layout)
    engine = build_engine(model, spec.optim, spec.iters + spec.warmup_iters, config, topology)
    return OurStack("ours", engine, engine.mpu, topology.dp_rank, spec.micro_batch_size, spec, device)


def hf_micro_batch_size(spec: BenchSpec, layout: BenchLayout) -> int:
    """HF runs DP over every rank with our global batch: micro x DP_ours / world."""
    global_batch = spec.micro_batch_size * layout.dp_size
    if global_batch % layout.world_size:
        raise SystemExit(f"error: global batch {global_batch} (--micro-batch-size x DP) does not split over "
                         f"{layout.world_size} HF data-parallel ranks: use a --micro-batch-size divisible by TP")
    return global_batch // layout.world_size


def build_hf(topology: Topology, spec: BenchSpec, device: torch.device, layout: BenchLayout) -> HFStack:
    from deepspeed.utils import groups
    from transformers import GPT2LMHeadModel
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()  # GPT2Config's default token ids lie outside a small vocabulary: harmless
    hf_config = hf_gpt2_config(spec.model)
    hf_config.use_cache = False  # training: no key/value cache
    torch.manual_seed(spec.seed)  # same replica on every rank (DeepSpeed also broadcasts it)
    model = GPT2LMHeadModel(hf_config).to(device)
    micro = hf_micro_batch_size(spec, layout)
    batch_layout = ParallelPlan.derive(ParallelDims(layout.world_size, 1), micro_batch_size=micro,
                                       dtype="bf16" if spec.bf16 else "fp32")
    config = build_deepspeed_config(ds_args(spec, micro), batch_layout)
    groups.mpu = None  # else this engine would inherit our engine's mpu (see Stack.iteration)
    engine = build_engine(model, spec.optim, spec.iters + spec.warmup_iters, config)
    return HFStack("HF", engine, None, topology.rank, micro, spec, device)


def bench_rank(topology: Topology, *, spec: BenchSpec, layout: BenchLayout) -> dict | None:
    """Build both engines on this rank, run them interleaved, return rank 0's summary."""
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)  # ZeRO's all_gather_into_tensor, every step
    torch.set_num_threads(spec.threads_per_rank)
    device = torch.device(spec.device, int(os.environ.get("LOCAL_RANK", "0"))) if spec.device == "cuda" \
        else torch.device("cpu")
    stacks = [build_ours(topology, spec, device, layout), build_hf(topology, spec, device, layout)]
    if layout.world_size == 1:  # the plain-PyTorch baseline has no parallelism: one process only
        stacks.append(build_plain_hf(spec, device))
    if spec.megatron and layout.tp_size > 1 and layout.dp_size == 1:  # megatron's own DP is not wired up
        stacks.append(MegatronStack(spec, device, layout))
    torch.set_num_threads(spec.threads_per_rank)  # in case initialisation changed it
    for i in range(spec.warmup_iters + spec.iters):
        for stack in (stacks if i % 2 == 0 else stacks[::-1]):  # ours, HF, plain/mcore, plain/mcore, HF, ours, ...
            stack.iteration(record=i >= spec.warmup_iters)
    times = {s.name: s.slowest_rank_times() for s in stacks}
    if topology.rank != 0:
        return None
    summary = {"threads_per_rank": torch.get_num_threads(),
               "hf_attention": stacks[1].engine.module.config._attn_implementation}
    for s in stacks:
        global_batch = s.micro_batch_size * (layout.dp_size if s.name in ("ours", "mcore") else
                                             1 if s.name == "plain" else layout.world_size)
        medians = dict(zip(PHASES, times[s.name].median(dim=0).values.tolist()))
        summary[s.name] = {
            "global_batch": global_batch,
            "tokens_per_s": global_batch * spec.seq_length / medians["total"],
            "median_s": medians,
            "iteration_s": times[s.name][:, -1].tolist(),
            "loss_first_last": (s.losses[0].item(), s.losses[-1].item()),
        }
    return summary


def model_config(a: argparse.Namespace) -> ModelConfig:
    return ModelConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
                       max_position_embeddings=a.seq_length, hidden_dropout=0.0, attention_dropout=0.0,
                       activation="gelu_tanh", top_query_layer=False, vocab_size=a.vocab_size)


def report(layout: BenchLayout, spec: BenchSpec, r: dict) -> str:
    ours, hf = r["ours"], r["HF"]
    gflop = model_flops_per_iteration(spec.model, ours["global_batch"], spec.seq_length) / 1e9
    head = (f"{layout}: {layout.world_size} rank(s) x {r['threads_per_rank']} thread(s); HF attention "
            f"{r['hf_attention']}")
    if layout.tp_size > 1:
        head += (f"; HF has no TP: it runs as DP={layout.world_size} on the same {layout.world_size} processes, "
                 f"micro batch {hf['global_batch'] // layout.world_size}, same global batch {hf['global_batch']}")
    lines = [head]
    lines.append(f"  {'stack':5} {'tokens/s':>9} {'GFLOP/s':>8} {'iter ms':>8} {'fwd ms':>8} {'bwd ms':>8} "
                 f"{'step ms':>8}  {'loss first->last':>17}  iteration ms")
    for name, s in [("ours", ours), ("HF", hf)] + [(n, r[n]) for n in ("plain", "mcore") if n in r]:
        m = s["median_s"]
        lines.append(f"  {name:5} {s['tokens_per_s']:9.0f} {gflop / m['total']:8.1f} {1e3 * m['total']:8.0f} "
                     f"{1e3 * m['forward']:8.0f} {1e3 * m['backward']:8.0f} {1e3 * m['step']:8.0f}  "
                     f"{s['loss_first_last'][0]:7.3f} -> {s['loss_first_last'][1]:6.3f}  "
                     + " ".join(f"{1e3 * t:.0f}" for t in s["iteration_s"]))
    ratio = ours["tokens_per_s"] / hf["tokens_per_s"]
    lines.append(f"  => {layout}: ours {ours['tokens_per_s']:.0f} tokens/s, HF {hf['tokens_per_s']:.0f} tokens/s, "
                 f"ours/HF = {ratio:.2f} (global batch {ours['global_batch']} x {spec.seq_length} tokens)")
    if "plain" in r:
        lines.append(f"  => {layout}: plain PyTorch HF {r['plain']['tokens_per_s']:.0f} tokens/s, ours/plain = "
                     f"{ours['tokens_per_s'] / r['plain']['tokens_per_s']:.2f}")
    if "mcore" in r:
        lines.append(f"  => {layout}: megatron-core TP={layout.tp_size} {r['mcore']['tokens_per_s']:.0f} tokens/s, "
                     f"ours/megatron-core = {ours['tokens_per_s'] / r['mcore']['tokens_per_s']:.2f}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8192, help="random tokens in [0, V); a multiple of 128")
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch per DP rank (ours)")
    p.add_argument("--iters", type=int, default=8, help="timed iterations per stack (the median is reported)")
    p.add_argument("--warmup-iters", type=int, default=1, help="untimed iterations per stack first")
    p.add_argument("--configs", nargs="+", type=BenchLayout.parse, default=[BenchLayout(1, 1), BenchLayout(1, 2), BenchLayout(2, 1)],
                   metavar="TPxDP", help="layouts to compare (default: 1x1 1x2 2x1)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads for all ranks together")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda needs a launcher (torchrun)")
    p.add_argument("--bf16", action="store_true", help="DeepSpeed bf16 for both stacks (slow on this CPU)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    # Before anything imports DeepSpeed (spawned ranks inherit these): its CPU accelerator, and this
    # checkout's JIT op cache (ENVIRONMENT.md) so the comm op is not rebuilt.
    os.environ.setdefault("DS_ACCELERATOR", a.device)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), ".cache", "torch_extensions"))
    cfg = model_config(a)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    leader = not launched or os.environ["RANK"] == "0"
    base = BenchSpec(cfg, a.micro_batch_size, a.seq_length, a.iters, a.warmup_iters, 1, a.device, a.bf16)
    if leader:
        print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, vocab "
              f"{cfg.vocab_size}, seq {a.seq_length}, micro batch {a.micro_batch_size}, fp32 master weights"
              f"{' + bf16' if a.bf16 else ''}, ZeRO-2, clip {base.optim.clip_grad}; {a.warmup_iters} warm-up + "
              f"{a.iters} timed iterations per stack, device {a.device}", flush=True)
    if any(layout.tp_size > 1 and layout.dp_size == 1 for layout in a.configs):
        import megatron_core_baseline as mcore  # benchmarks/, on sys.path as the script's folder

        why = mcore.available()
        base = replace(base, megatron=why is None)
        if why is not None and leader:
            print(f"megatron-core baseline skipped: megatron.core does not import ({why}); install it with "
                  f"`{mcore.INSTALL}`", flush=True)
    results = []
    for layout in a.configs:
        spec = replace(base, threads_per_rank=max(1, a.threads // layout.world_size))
        if launched:
            if layout.world_size != int(os.environ["WORLD_SIZE"]):
                continue
            r = run_launched(spec, layout)
        else:
            if a.device == "cuda":
                raise SystemExit("error: --device cuda needs a launcher: torchrun --nproc_per_node N ...")
            from codegeex_train.distributed.spawn import run_distributed

            r = run_distributed(bench_rank, ParallelDims(layout.world_size, layout.tp_size), deadline_s=900.0,
                                collective_timeout_s=300.0, spec=spec, layout=layout)[0]
        if r is not None:
            print(report(layout, spec, r), flush=True)
            results.append((layout, r))
    if results:
        print("\nsummary (tokens/s; same global batch and hardware per row):")
        print(f"  {'layout':12} {'ours':>8} {'HF':>8} {'ours/HF':>8} {'plain':>8} {'ours/plain':>10} {'mcore':>8} "
              f"{'ours/mcore':>10}")
        for layout, r in results:
            o, h = r["ours"]["tokens_per_s"], r["HF"]["tokens_per_s"]
            other = " ".join(f"{r[n]['tokens_per_s']:8.0f} {o / r[n]['tokens_per_s']:10.2f}" if n in r else
                             f"{'-':>8} {'-':>10}" for n in ("plain", "mcore"))
            print(f"  {str(layout):12} {o:8.0f} {h:8.0f} {o / h:8.2f} {other}")


def run_launched(spec: BenchSpec, layout: BenchLayout) -> dict | None:
    """Under torchrun / the deepspeed launcher: join its process group and bench on it."""
    if spec.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if spec.device == "cuda" else "gloo")
    topology = Topology(ParallelDims(layout.world_size, layout.tp_size))
    return bench_rank(topology, spec=spec, layout=layout)


if __name__ == "__main__":
    main()
