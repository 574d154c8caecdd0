"""Generation throughput against Hugging Face ``generate``, on the same weights in one process.

**The evaluation workload** (default): P HumanEval prompts (spread over the 164 problems, so their lengths
differ), n samples each at temperature 0.8 / top-p 0.95, up to 256 new tokens, HumanEval's stop strings -- the
samples end at different lengths, as in a pass@k evaluation:

  ours  Generator.from_checkpoint(CKPT).generate_ids(prompts, num_samples=n, batch_size=B): one prefill per
        prompt, its keys and values shared by its samples, continuous batching over B rows (default the
        Generator's: min(P n, max(P, 64)), 64 here), stop strings incrementally;
  HF    the checkpoint exported by our converter (formats/huggingface/adapter.to_hf, what tools/convert_checkpoint.py
        --to-hf runs: a GPT-2-shaped model is transformers' GPT2LMHeadModel) and its exported tokenizer:
        generate(do_sample=True, num_return_sequences=n, stop_strings=HUMANEVAL_STOP, tokenizer=...), its own
        KV cache; either one call per prompt or all P prompts in one left-padded call, whichever is faster (one
        timed run of each picks it; --hf-mode forces one).

Runs alternate (ours, HF, HF, ours, ...) under one torch.set_num_threads; each side's figure is its median run.
**Useful tokens** of a row are counted by one function (``useful``) for both sides: its tokens before the first
end-of-text id, cut after the token that completes its first stop string (our Generator's completion_text and the
stop strings decide). Useful tokens/s = all rows' useful tokens / the run's wall time; per sample = wall / (P n).
The greedy case is the correctness check: ours and HF greedy on the same P prompts (one sample each, the same
stop strings) must give the same useful tokens ("greedy tokens equal: True").

The model: random weights never write "\\ndef", so by default scripts/pretrain_codegen.sh trains configs/default.yaml's
shape (4 layers x 256) GPT-2 shaped (--no-top-query-layer --activation gelu_tanh, learned positions, 1024 of them
so that HumanEval prompts + 256 new tokens fit) on the embedded stdlib corpus for 500 iterations (at 200 it
indents every line, and 1 sample in 8 reaches a stop string; at 500, 1 in 4 -- the rest run to 256 tokens), once:
it is cached under .cache/benchmarks/ keyed by its settings (~12 min on 2 idle CPU cores). --load CKPT measures a
given checkpoint (TP 1, PP 1) instead.

**--workload greedy** keeps the fixed-length case on random weights: ours KV-cached, HF generate and our no-cache
decoding, greedy, every row generating exactly --new-tokens tokens, a batch of prompts of random ids.

    python benchmarks/generation.py                             # P 8 x n 20 (~13 min, + the training once)
    python benchmarks/generation.py --load outputs/codegen-x --prompts 4 --samples 10
    python benchmarks/generation.py --workload greedy           # random weights, 6 layers x 512, batch 4 (~2 min)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from codegeex_train.formats.huggingface.gpt2 import hf_gpt2_config, hf_gpt2_to_full  # noqa: E402
from codegeex_train.checkpoint.files import CheckpointError, checkpoint_tokenizer, read_checkpoint_meta  # noqa: E402
from codegeex_train.config.arguments import DataConfig  # noqa: E402
from codegeex_train.config.options import add_config_flags  # noqa: E402
from codegeex_train.tokenization.tokenizer import load_tokenizer  # noqa: E402
from codegeex_train.generation import HUMANEVAL_STOP, Generator, SamplingParams  # noqa: E402
from codegeex_train.model import CodeGeeXModel, ModelConfig  # noqa: E402

# The default model: configs/default.yaml through scripts/pretrain_codegen.sh, made GPT-2 shaped with room for
# HumanEval prompts (up to ~700 tokens here) + 256 new tokens.
GPT2_FLAGS = ("--no-top-query-layer", "--activation", "gelu_tanh", "--max-position-embeddings", "1024")


def fail(message: str) -> None:
    """Bad input or a failed step: one line (or a line and the failing output) on stderr, exit 2."""
    print(f"generation.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


# --- the model ----------------------------------------------------------------------------------------------

def default_checkpoint(cache_dir: Path, train_iters: int) -> Path:
    """The default model's checkpoint directory, trained on the first call for these settings."""
    config = ROOT / "configs" / "default.yaml"
    key = hashlib.sha256(json.dumps({"config": config.read_text(), "flags": GPT2_FLAGS, "iters": train_iters})
                         .encode()).hexdigest()[:12]
    out = cache_dir / f"generation-model-{key}"
    if (out / "latest").exists() and read_checkpoint_meta(out)[1]["iteration"] == train_iters:
        return out
    print(f"training the default model once (cached in {out}; ~12 min on 2 CPU cores) ...", flush=True)
    env = {**os.environ, "OUTPUT_DIR": str(out), "TRAIN_ITERS": str(train_iters), "DEVICE": "cpu",
           "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "pretrain_codegen.sh"), *GPT2_FLAGS], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:  # a rerun resumes from its last checkpoint
        fail(f"training the default model failed (exit {proc.returncode}; run again to resume); its output "
             f"ends:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return out


def load_pair(ckpt: Path, hf_dir: Path):
    """(our Generator with the checkpoint's tokenizer, the HF export of the same checkpoint, its tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from codegeex_train.formats.huggingface.adapter import to_hf

    settings, _ = checkpoint_tokenizer(ckpt, read_checkpoint_meta(ckpt)[1], {})
    tokenizer = load_tokenizer(DataConfig(**{k: v for k, v in settings.items() if v is not None}))
    gen = Generator.from_checkpoint(ckpt, tokenizer)
    with contextlib.redirect_stderr(io.StringIO()):  # its progress bar
        to_hf(str(ckpt), str(hf_dir))  # tools/convert_checkpoint.py --to-hf
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True, local_files_only=True,
                                                    dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True)
    return gen, hf_model, hf_tok


def humaneval_prompts(count: int) -> list[tuple[str, str]]:
    """(task id, prompt) of ``count`` HumanEval problems spread evenly over the file (varied lengths)."""
    from codegeex_train.evaluation import read_problems

    problems = list(read_problems().values())
    return [(p["task_id"], p["prompt"]) for p in (problems[k * len(problems) // count] for k in range(count))]


# --- counting -----------------------------------------------------------------------------------------------

def useful(gen: Generator, prompt_ids: list[int], ids: list[int], stop) -> tuple[int, str]:
    """(useful tokens, why the row ends: "stop", "eod" or "max") of a row of new token ids, ours or HF's: the tokens
    before its first end-of-text id, cut after the one that completes the first stop string of its completion
    text (``gen.completion_text``, as our Generator reads it). Containing a stop string is monotone in the
    number of tokens, so the cut is found by bisection."""
    ids = list(ids)
    end = "max"
    if gen.eod in ids:
        ids, end = ids[:ids.index(gen.eod)], "eod"

    def stops(k: int) -> bool:
        text = gen.completion_text(prompt_ids, ids[:k])
        return any(s in text for s in stop)

    if not stops(len(ids)):
        return len(ids), end
    lo, hi = 1, len(ids)  # the fewest tokens whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if stops(mid) else (mid + 1, hi)
    return lo, "stop"


def count(gen: Generator, prompt_ids: list[list[int]], rows: list[list[int]], n: int, stop) -> list[tuple[int, str]]:
    """``useful`` of every row (row i * n + j: sample j of prompt i)."""
    return [useful(gen, prompt_ids[r // n], row, stop) for r, row in enumerate(rows)]


def describe(counted: list[tuple[int, str]]) -> str:
    lengths = sorted(k for k, _ in counted)
    ends = {why: sum(w == why for _, w in counted) for why in ("stop", "eod", "max")}
    return (f"min {lengths[0]} / median {statistics.median(lengths):g} / max {lengths[-1]}; ends: "
            + ", ".join(f"{why} {k}" for why, k in ends.items()))


# --- HF generate --------------------------------------------------------------------------------------------

def left_padded(batch: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of a batch left-padded with ``pad``, as HF documents for decoder-only batches."""
    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    return ids, mask


def hf_generate(hf_model, hf_tok, prompt_ids: list[list[int]], n: int, params: SamplingParams, eod: int,
                batched: bool) -> list[list[int]]:
    """n samples of each prompt by HF generate: new token ids per row (prompt-major), padded with ``eod`` after
    a row ends. ``batched``: all prompts in one left-padded call, else one call per prompt."""
    sampling = dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0) \
        if not params.greedy else dict(do_sample=False)
    kwargs = dict(num_return_sequences=n, max_new_tokens=params.max_new_tokens, stop_strings=list(params.stop),
                  tokenizer=hf_tok, pad_token_id=eod, eos_token_id=eod, **sampling)
    torch.manual_seed(params.seed)
    out: list[list[int]] = []
    for batch in ([prompt_ids] if batched else [[p] for p in prompt_ids]):
        ids, mask = left_padded(batch, eod)
        with torch.no_grad():
            new = hf_model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, ids.shape[1]:]  # (len(batch) n, .)
        out.extend(new.tolist())
    return out


def evaluation_workload(args) -> dict:
    """Run the evaluation workload, print its table; returns the figures."""
    start = time.perf_counter()
    ckpt = Path(args.load) if args.load else default_checkpoint(Path(args.cache_dir), args.train_iters)
    try:
        with tempfile.TemporaryDirectory(prefix="generation-benchmark-") as tmp:
            gen, hf_model, hf_tok = load_pair(ckpt, Path(tmp) / "hf")
    except (CheckpointError, ValueError) as e:
        fail(f"checkpoint {ckpt}: {' '.join(str(e).split())}")
    tasks = humaneval_prompts(args.prompts)
    prompt_ids = gen.tokenizer.encode_batch([p for _, p in tasks])
    n, stop = args.samples, HUMANEVAL_STOP
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, stop=stop)
    greedy = SamplingParams(max_new_tokens=args.new_tokens, stop=stop)
    rows = args.batch_size or min(len(prompt_ids) * n, max(len(prompt_ids), 64))  # Generator's default

    def ours(p, samples):
        return gen.generate_ids(prompt_ids, p, num_samples=samples, batch_size=rows if samples == n else None)

    def hf(p, samples, batched):
        return hf_generate(hf_model, hf_tok, prompt_ids, samples, p, gen.eod, batched)

    def progress(what: str, seconds: float) -> None:
        print(f"  {what}: {seconds:.2f} s", flush=True)

    # The correctness check (also the warm-up): greedy, one sample per prompt, the same stop strings.
    useful_ids = []
    for who, run in (("ours", lambda: ours(greedy, 1)), ("HF", lambda: hf(greedy, 1, False))):
        t, out = timed(run)
        progress(f"greedy {who}", t)
        useful_ids.append([row[:k] for row, (k, _) in zip(out, count(gen, prompt_ids, out, 1, stop))])
    greedy_equal = useful_ids[0] == useful_ids[1]

    modes = {"per-prompt": False, "batched": True}
    chosen = args.hf_mode
    trial: dict[str, float] = {}
    if chosen == "auto":  # one timed run of each; the faster is the baseline
        for mode, batched in modes.items():
            trial[mode] = timed(lambda: hf(params, n, batched))[0]
            progress(f"HF {mode} (trial)", trial[mode])
        chosen = min(trial, key=trial.get)

    times: dict[str, list[float]] = {"ours": [], "HF": []}
    outputs: dict[str, list[list[int]]] = {}
    for rep in range(args.reps):  # ours, HF, HF, ours, ...
        for who in (("ours", "HF") if rep % 2 == 0 else ("HF", "ours")):
            t, outputs[who] = timed(lambda: ours(params, n) if who == "ours" else hf(params, n, modes[chosen]))
            times[who].append(t)
            progress(f"run {rep + 1} {who}", t)

    counted = {who: count(gen, prompt_ids, out, n, stop) for who, out in outputs.items()}
    figures = {}
    for who in times:
        tokens, wall = sum(k for k, _ in counted[who]), statistics.median(times[who])
        figures[who] = {"useful_tokens": tokens, "tokens_per_s": tokens / wall, "s_per_sample": wall / len(counted[who]),
                        "median_s": wall, "runs_s": times[who], "lengths": sorted(k for k, _ in counted[who])}
    ratio = figures["ours"]["tokens_per_s"] / figures["HF"]["tokens_per_s"]

    lengths = sorted(map(len, prompt_ids))
    print(f"model: {ckpt} ({gen.config.num_layers} layers x {gen.config.hidden_size}, vocab {gen.config.vocab_size}, "
          f"fp32; HF: {type(hf_model).__name__}); torch threads {torch.get_num_threads()}")
    print(f"workload: {len(tasks)} HumanEval prompts ({tasks[0][0]} .. {tasks[-1][0]}, {lengths[0]}..{lengths[-1]} "
          f"tokens) x {n} samples, temperature {params.temperature}, top-p {params.top_p}, up to {params.max_new_tokens}"
          f" new tokens, stop {list(stop)}; ours decodes {rows} rows at once")
    how = {"per-prompt": "one generate call per prompt", "batched": "all prompts in one left-padded call"}[chosen]
    tried = f" (one run each: {', '.join(f'{m} {t:.2f} s' for m, t in trial.items())})" if trial else " (--hf-mode)"
    print(f"HF baseline: {chosen}, {how}{tried}")
    print(f"{'':6} {'useful tokens':>13} {'tokens/s':>9} {'s/sample':>9} {'median s':>9}  runs (s)")
    for who, f in figures.items():
        print(f"{who:6} {f['useful_tokens']:13d} {f['tokens_per_s']:9.1f} {f['s_per_sample']:9.4f} "
              f"{f['median_s']:9.2f}  {' '.join(f'{t:.2f}' for t in f['runs_s'])}")
    print(f"ours / HF useful tokens/s: {ratio:.2f}x")
    for who in figures:
        print(f"useful lengths {who}: {describe(counted[who])}")
    print(f"greedy tokens equal: {greedy_equal}")
    print(f"runtime: {time.perf_counter() - start:.0f} s")
    return {"checkpoint": str(ckpt), "hf_mode": chosen, "hf_trial_s": trial, "ratio": ratio,
            "greedy_equal": greedy_equal, **figures}


# --- the fixed-length greedy case on random weights ---------------------------------------------------------

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


def random_prompts(args) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    lo, hi = args.prompt_lengths
    lengths = torch.linspace(lo, hi, args.batch_size).round().long().tolist()
    return [torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in lengths]


def hf_fixed_length(hf_model, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    ids, mask = left_padded(batch, 0)
    width = ids.shape[1]
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids.to(hf_model.device), attention_mask=mask.to(hf_model.device),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


def greedy_workload(args) -> dict:
    ours_model, hf_model, config = build(args)
    gen = Generator(ours_model, None)
    batch = random_prompts(args)
    greedy = SamplingParams(max_new_tokens=args.new_tokens)
    n_tokens = len(batch) * args.new_tokens
    gen.generate_ids(batch, SamplingParams(max_new_tokens=4))  # warm-up (allocator, kernels' first calls)
    hf_fixed_length(hf_model, batch, 4)
    times: dict[str, list[float]] = {"ours": [], "HF": [], "no cache": []}
    tokens: dict[str, list[list[int]]] = {}
    runs = {"ours": lambda: gen.generate_ids(batch, greedy), "HF": lambda: hf_fixed_length(hf_model, batch,
                                                                                          args.new_tokens),
            "no cache": lambda: gen.generate_ids(batch, greedy, use_cache=False)}
    for rep in range(args.reps):  # ours, HF, HF, ours, ...
        for who in (("ours", "HF") if rep % 2 == 0 else ("HF", "ours")):
            t, tokens[who] = timed(runs[who])
            times[who].append(t)
    for _ in range(args.no_cache_reps):
        t, tokens["no cache"] = timed(runs["no cache"])
        times["no cache"].append(t)
    tps = {who: n_tokens / statistics.median(t) for who, t in times.items()}
    print(f"model: {config.num_layers} layers x {config.hidden_size} hidden, {config.num_attention_heads} heads, vocab "
          f"{config.vocab_size} (GPT-2 shaped, fp32, random weights); batch {len(batch)} prompts of "
          f"{[len(b) for b in batch]} tokens, {args.new_tokens} new tokens each, greedy; torch threads "
          f"{torch.get_num_threads()}")
    print(f"{'':10} {'tokens/s':>10} {'median s':>9}  runs (s)")
    for who, t in times.items():
        print(f"{who:10} {tps[who]:10.1f} {statistics.median(t):9.2f}  {' '.join(f'{x:.2f}' for x in t)}")
    print(f"ours / HF generate:      {tps['ours'] / tps['HF']:.2f}x")
    print(f"ours / ours without cache: {tps['ours'] / tps['no cache']:.2f}x")
    print(f"greedy tokens equal: ours == HF {tokens['ours'] == tokens['HF']}, "
          f"ours == no cache {tokens['ours'] == tokens['no cache']}")
    return {"tokens_per_s": tps, "greedy_equal": tokens["ours"] == tokens["HF"] == tokens["no cache"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("evaluation", "greedy"), default="evaluation")
    p.add_argument("--new-tokens", type=int, default=None, help="max new tokens (default 256; greedy: exactly 64)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="rows decoded together: ours' continuous batch (default the Generator's: min(P n, max(P, 64))); "
                        "greedy: prompts per call (default 4)")
    p.add_argument("--reps", type=int, default=3, help="timed runs of ours and of HF each (median)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads for all")
    p.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("the evaluation workload")
    e.add_argument("--load", default=None, help="checkpoint to measure (TP 1, PP 1; default: the trained default "
                                                "model, trained once and cached)")
    e.add_argument("--train-iters", type=int, default=500,
                   help="the default model's training iterations")
    e.add_argument("--cache-dir", default=str(ROOT / ".cache" / "benchmarks"), help="where the default model lives")
    e.add_argument("--prompts", type=int, default=8, help="P: HumanEval prompts, spread over the 164")
    e.add_argument("--samples", type=int, default=20, help="n: samples per prompt")
    add_config_flags(e, SamplingParams, ("temperature", "top_p"), defaults={"temperature": 0.8, "top_p": 0.95})
    e.add_argument("--hf-mode", choices=("auto", "per-prompt", "batched"), default="auto",
                   help="HF's baseline: one call per prompt, all prompts in one call, or the faster (auto)")
    g = p.add_argument_group("--workload greedy (random weights)")
    g.add_argument("--num-layers", type=int, default=6)
    g.add_argument("--hidden-size", type=int, default=512)
    g.add_argument("--num-attention-heads", type=int, default=8)
    g.add_argument("--vocab-size", type=int, default=50257, help="GPT-2's by default")
    g.add_argument("--max-position-embeddings", type=int, default=1024)
    g.add_argument("--prompt-lengths", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"),
                   help="prompt lengths spread evenly over [MIN, MAX] (default 16 64)")
    g.add_argument("--no-cache-reps", type=int, default=1, help="timed runs of the no-cache decoding")
    args = p.parse_args(argv)
    evaluation = args.workload == "evaluation"
    args.new_tokens = args.new_tokens if args.new_tokens is not None else (256 if evaluation else 64)
    for flag in ("new_tokens", "batch_size", "reps", "threads", "prompts", "samples", "train_iters"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if args.batch_size is None and not evaluation:
        args.batch_size = 4
    if args.load and not Path(args.load).is_dir():
        p.error(f"--load {args.load}: no such checkpoint directory")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module="transformers")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # GPT2Config's default bos/eos ids lie outside a smaller vocabulary
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    return evaluation_workload(args) if args.workload == "evaluation" else greedy_workload(args)


if __name__ == "__main__":
    main()
