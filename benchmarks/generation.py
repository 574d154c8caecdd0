"""Generation throughput: our KV-cached decoding vs Hugging Face ``generate`` vs our own no-cache decoding.

One process, one model shape, the same weights and the same batch of prompts (different lengths, left-padded)
for all three, greedy, every row generating exactly --new-tokens tokens (no end-of-text id):

  ours      codegeex_train.generation.Generator (KV cache for every layer, one (b, 1) step per token);
  HF        transformers.GPT2LMHeadModel(hf_gpt2_config(config)).generate(do_sample=False), its own KV cache;
  no cache  the same Generator with use_cache=False: the whole sequence recomputed at every step.

The model is GPT-2 shaped (top query layer off, gelu_tanh), so our weights load into HF's class. Runs of ours
and HF's alternate (ours, HF, HF, ours, ...) so that drift on a shared machine hits both alike; each figure is
the median run, tokens/s = batch x new tokens / the run's wall time (prefill included). The ratios printed
are measured in the same run, under the same torch.set_num_threads. The greedy tokens of the three are
compared too (they should be equal).

    python benchmarks/generation.py                       # 6 layers x 512, GPT-2's vocabulary, batch 4 (~2 min)
    python benchmarks/generation.py --num-layers 12 --hidden-size 768 --num-attention-heads 12   # GPT-2 small
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

from codegeex_train.checkpoint import hf_gpt2_config, hf_gpt2_to_full
from codegeex_train.generation import Generator, SamplingParams
from codegeex_train.model import CodeGeeXModel, ModelConfig


def build(args) -> tuple[CodeGeeXModel, torch.nn.Module, ModelConfig]:
    from transformers import GPT2LMHeadModel

    config = ModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                         max_position_embeddings=args.max_position_embeddings, hidden_dropout=0.0,
                         attention_dropout=0.0, activation="gelu_tanh", top_query_layer=False)
    hf_config = hf_gpt2_config(config)
    hf_config.bos_token_id = hf_config.eos_token_id = None  # every row generates exactly --new-tokens tokens
    torch.manual_seed(args.seed)
    hf_model = GPT2LMHeadModel(hf_config).eval()
    ours = CodeGeeXModel(config, None, None).eval()
    ours.load_state_dict(hf_gpt2_to_full(hf_model.state_dict(), config))
    return ours, hf_model, config


def prompts(args) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    lo, hi = args.prompt_lengths
    lengths = torch.linspace(lo, hi, args.batch_size).round().long().tolist()
    return [torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in lengths]


def hf_generate(hf_model, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, p in enumerate(batch):  # left padding, as HF documents for decoder-only batches
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids.to(hf_model.device), attention_mask=mask.to(hf_model.device),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=50257, help="GPT-2's by default")
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4, help="prompts per generate call")
    p.add_argument("--prompt-lengths", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"),
                   help="prompt lengths spread evenly over [MIN, MAX] (default 16 64)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="timed runs of ours and of HF each (median)")
    p.add_argument("--no-cache-reps", type=int, default=1, help="timed runs of the no-cache decoding")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads for all three")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", module="transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # GPT2Config's default bos/eos ids lie outside a smaller vocabulary
    torch.set_num_threads(args.threads)
    ours_model, hf_model, config = build(args)
    gen = Generator(ours_model, None)
    batch = prompts(args)
    greedy = SamplingParams(max_new_tokens=args.new_tokens)
    n_tokens = len(batch) * args.new_tokens

    # Warm-up (allocator, kernels' first calls), short.
    gen.generate_ids(batch, SamplingParams(max_new_tokens=4))
    hf_generate(hf_model, batch, 4)

    ours_t, hf_t = [], []
    ours_tokens = hf_tokens = None
    for rep in range(args.reps):  # ours, HF, HF, ours, ...
        order = ("ours", "hf") if rep % 2 == 0 else ("hf", "ours")
        for who in order:
            if who == "ours":
                t, ours_tokens = timed(lambda: gen.generate_ids(batch, greedy))
                ours_t.append(t)
            else:
                t, hf_tokens = timed(lambda: hf_generate(hf_model, batch, args.new_tokens))
                hf_t.append(t)
    nocache_t = []
    nocache_tokens = None
    for _ in range(args.no_cache_reps):
        t, nocache_tokens = timed(lambda: gen.generate_ids(batch, greedy, use_cache=False))
        nocache_t.append(t)

    ours_tps = n_tokens / statistics.median(ours_t)
    hf_tps = n_tokens / statistics.median(hf_t)
    nocache_tps = n_tokens / statistics.median(nocache_t)
    print(f"model: {config.num_layers} layers x {config.hidden_size} hidden, {config.num_attention_heads} heads, vocab "
          f"{config.vocab_size} (GPT-2 shaped, fp32); batch {len(batch)} prompts of {[len(b) for b in batch]} tokens, "
          f"{args.new_tokens} new tokens each, greedy; torch threads {torch.get_num_threads()}")
    print(f"{'':10} {'tokens/s':>10} {'median s':>9}  runs (s)")
    for name, tps, times in (("ours", ours_tps, ours_t), ("HF", hf_tps, hf_t), ("no cache", nocache_tps, nocache_t)):
        print(f"{name:10} {tps:10.1f} {statistics.median(times):9.2f}  {' '.join(f'{t:.2f}' for t in times)}")
    print(f"ours / HF generate:      {ours_tps / hf_tps:.2f}x")
    print(f"ours / ours without cache: {ours_tps / nocache_tps:.2f}x")
    print(f"greedy tokens equal: ours == HF {ours_tokens == hf_tokens}, ours == no cache {ours_tokens == nocache_tokens}")


if __name__ == "__main__":
    main()
