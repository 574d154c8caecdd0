"""(d) Generation: our KV-cached greedy decoding against Hugging Face ``generate`` on the same device, the same weights
(a model without the top query layer converted to GPT2LMHeadModel, as benchmarks/generation.py does), the same
left-padded prompts; runs interleaved, tokens/s of each and whether the greedy tokens agree."""

from __future__ import annotations

import statistics
import time

from benchmarks.gpu_check.child import Deadline, State, sync
from benchmarks.gpu_check.report import Row, cut_short, failed_rows


def unit_d(a, state: State, topology, device, deadline: Deadline) -> None:
    import torch
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from codegeex_train.formats.huggingface.gpt2 import full_to_hf_gpt2, hf_gpt2_config
    from codegeex_train.config.model_config import ModelConfig
    from codegeex_train.generation import Generator, SamplingParams
    from codegeex_train.model.codegeex import CodeGeeXModel

    hf_logging.set_verbosity_error()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.d_dtype]
    lo, hi = a.d_prompt_lengths
    config = ModelConfig(num_layers=a.d_num_layers, hidden_size=a.d_hidden_size,
                         num_attention_heads=a.d_num_attention_heads, vocab_size=1000 if a.smoke else 50400,
                         max_position_embeddings=max(2048, hi + a.d_new_tokens) if not a.smoke else hi + a.d_new_tokens,
                         hidden_dropout=0.0, attention_dropout=0.0, activation="gelu_tanh", top_query_layer=False)
    start = time.perf_counter()
    ours = CodeGeeXModel(config, None, None, dtype=dtype, device=device).eval()
    hf_config = hf_gpt2_config(config)
    hf_config.bos_token_id = hf_config.eos_token_id = None  # every row generates exactly --d-new-tokens tokens
    with torch.device(device):
        hf_model = GPT2LMHeadModel(hf_config)
    hf_model = hf_model.to(dtype).eval()
    missing, unexpected = hf_model.load_state_dict(full_to_hf_gpt2(ours.state_dict(), config), strict=False)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"GPT-2 conversion: missing {missing}, unexpected {unexpected}")
    state.set(build_seconds=time.perf_counter() - start, dtype=a.d_dtype,
              hf_attention=getattr(hf_model.config, "_attn_implementation", None),
              shape=f"{config.num_layers} layers x {config.hidden_size}, {config.num_attention_heads} heads, vocab "
                    f"{config.vocab_size}, no top query layer")

    g = torch.Generator().manual_seed(a.seed)
    lengths = torch.linspace(lo, hi, a.d_batch_size).round().long().tolist()
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    gen = Generator(ours, None, device=device)
    new = a.d_new_tokens

    from benchmarks.generation import hf_fixed_length

    def hf_generate(n_new: int) -> list[list[int]]:
        return hf_fixed_length(hf_model, prompts, n_new)

    def ours_generate(n_new: int) -> list[list[int]]:
        return gen.generate_ids(prompts, SamplingParams(max_new_tokens=n_new))

    def timed(fn):
        t0 = sync(device)
        result = fn(new)
        return sync(device) - t0, result

    ours_generate(4)  # warm-up: allocator, kernels' first calls
    hf_generate(4)
    times = {"ours": [], "hf": []}
    tokens = {}
    for rep in range(a.d_reps):  # ours, HF, HF, ours, ...: drift hits both alike
        for who in (("ours", "hf") if rep % 2 == 0 else ("hf", "ours")):
            if deadline.passed():
                state.note(f"stopped after {rep} of {a.d_reps} repetitions by the section's budget")
                break
            t, tokens[who] = timed(ours_generate if who == "ours" else hf_generate)
            times[who].append(t)
            state.set(seconds=times)
    n_tokens = len(prompts) * new
    result = {"batch": len(prompts), "new_tokens": new, "prompt_lengths": lengths}
    for who in ("ours", "hf"):
        if times[who]:
            result[f"{who}_tokens_per_s"] = n_tokens / statistics.median(times[who])
    if "ours" in tokens and "hf" in tokens:
        a_rows, b_rows = tokens["ours"], tokens["hf"]
        prefixes = []
        for x, y in zip(a_rows, b_rows):
            k = 0
            while k < min(len(x), len(y)) and x[k] == y[k]:
                k += 1
            prefixes.append(k)
        result.update(rows_identical=sum(x == y for x, y in zip(a_rows, b_rows)),
                      common_prefix=prefixes, lengths_ok=all(len(x) == new for x in a_rows + b_rows))
    state.set(**result)


def rows_d(state: dict, a) -> list[Row]:
    d = state.get("data", {})
    specs = [("d.ours", "(d) generation tokens/s, ours (KV cache)", "-"),
             ("d.hf", "(d) generation tokens/s, HF generate", "-"),
             ("d.ratio", "(d) ours / HF generate", ">= 1.0"),
             ("d.greedy", "(d) greedy tokens, ours vs HF", "equal in fp32; reported in bf16/fp16")]
    if "ours_tokens_per_s" not in d and "hf_tokens_per_s" not in d:
        return failed_rows(state, specs)
    ended = cut_short(state)
    what = (f"batch {d.get('batch')}, {d.get('new_tokens')} new tokens, prompts {min(d.get('prompt_lengths', [0]))}-"
            f"{max(d.get('prompt_lengths', [0]))} tokens left-padded, greedy, {d.get('dtype')}; median of "
            f"{len(d.get('seconds', {}).get('ours', []))} runs")
    rows = []
    for key, check, bar in specs[:2]:
        field = "ours_tokens_per_s" if key == "d.ours" else "hf_tokens_per_s"
        if field in d:
            extra = f"; HF attention {d.get('hf_attention')}" if key == "d.hf" else f"; {d.get('shape', '')}"
            rows.append(Row(key, check, f"{d[field]:,.1f}", bar, ended or "info", what + extra))
        else:
            rows.extend(failed_rows(state, [(key, check, bar)]))
    if "ours_tokens_per_s" in d and "hf_tokens_per_s" in d:
        ratio = d["ours_tokens_per_s"] / d["hf_tokens_per_s"]
        rows.append(Row("d.ratio", specs[2][1], f"{ratio:.2f}x", specs[2][2],
                        ended or ("pass" if ratio >= 1.0 else "below bar"),
                        "same weights, prompts and device, runs interleaved"))
    else:
        rows.extend(failed_rows(state, [specs[2]]))
    if "rows_identical" in d:
        exact = d["dtype"] == "fp32"
        same = d["rows_identical"] == d["batch"] and d.get("lengths_ok", True)
        status = ended or (("pass" if same else "FAIL") if exact else "info")
        rows.append(Row("d.greedy", specs[3][1], f"{d['rows_identical']} of {d['batch']} rows identical", specs[3][2],
                        status, f"common prefix per row {d['common_prefix']} of {d['new_tokens']}"
                        + ("" if exact else f"; {d['dtype']}: different kernels may flip near-ties")))
    else:
        rows.extend(failed_rows(state, [specs[3]]))
    return rows
