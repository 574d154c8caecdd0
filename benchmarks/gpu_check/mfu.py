"""(c) Training throughput and MFU of a ~1.3B CodeGeeX (or the model of the preset --config names) in bf16 under
ZeRO-2 on one GPU, without and with activation recomputation: tokens/s over timed train steps (each between two
device synchronisations) and model FLOP/s (codegeex_train/model/flops.py, without the recomputed forward) over the
device's peak."""

from __future__ import annotations

import math
import statistics
import time

from benchmarks.gpu_check.child import Deadline, State, build_run, sync, weights_dtype
from benchmarks.gpu_check.report import Row, cut_short, failed_rows

MFU_REFERENCE = "Megatron-core reports 41-47% on H100 for 1.7-7B models"


def unit_name(recompute: bool) -> str:
    return "c-recompute" if recompute else "c"


def c_model(a):
    """(c)'s model: the --c-* shape with the rest of the preset's model: section (``a.c_model``: any field, e.g.
    codegeex-1.3b's fast GeLU and 52,224-row table beside the default top query layer, or a Qwen2's grouped-query
    attention, SwiGLU, RMSNorm and untied output layer) and its planner: vocabulary (CodeGeeX's 50,400 when it gives
    none); --smoke: a CodeGeeX with fast GeLU and a vocabulary of 1,000."""
    from codegeex_train.config.config_file import known_keys
    from codegeex_train.config.model_config import ModelConfig

    fields = known_keys({"model": ModelConfig})["model"]  # every spelling of a field, as --config reads it
    preset = {fields[k.replace("-", "_")].name: v for k, v in (a.c_model or {}).items()}
    preset.pop("max_position_embeddings", None)  # the sequence measured is --c-seq-length
    if a.smoke:
        preset = {"activation": "fast_gelu"}
    config = ModelConfig(**preset, num_layers=a.c_num_layers, hidden_size=a.c_hidden_size,
                         num_attention_heads=a.c_num_attention_heads, max_position_embeddings=a.c_seq_length,
                         vocab_size=1000 if a.smoke else (a.c_vocab_size or 50400))
    config.check_architecture()
    return config


def unit_c(a, state: State, topology, device, deadline: Deadline, recompute: bool) -> None:
    """Build the ~1.3B model in bf16 under ZeRO-2, then time ``a.c_iters`` train steps after the warm-up ones."""
    import torch

    from codegeex_train.accounting.planner import describe_model
    from codegeex_train.model.flops import model_flops_per_iteration
    from codegeex_train.training.trainer import train_step

    mb = a.c_recompute_micro_batch_size if recompute else a.c_micro_batch_size
    nmb, s = a.c_num_microbatches, a.c_seq_length
    config = c_model(a)
    iters = a.c_warmup_iters + a.c_iters
    state.set(micro_batch_size=mb, num_microbatches=nmb, seq_length=s, warmup=a.c_warmup_iters,
              iters_planned=a.c_iters, padded_vocab=config.padded_vocab_size,
              shape=f"{describe_model(config)}, seq {s}")
    if unit_name(recompute) in a.inject_oom and mb > 1:
        raise torch.OutOfMemoryError(f"injected out of memory at micro-batch {mb} (--inject-oom, tests only)")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    run = build_run(topology, device, config, precision="bf16", seq_length=s, micro_batch_size=mb,
                    num_microbatches=nmb, train_iters=iters, seed=a.seed, checkpoint_activations=recompute)
    params = sum(p.numel() for p in run.engine.module.parameters())
    state.set(build_seconds=time.perf_counter() - start, parameters=params, weights=weights_dtype(run))
    g = torch.Generator().manual_seed(a.seed)
    data = [torch.randint(config.vocab_size, (mb, s + 1), generator=g) for _ in range(iters * nmb)]
    batches = iter({"text": t} for t in data)
    times: list[float] = []
    losses: list[float] = []
    for i in range(iters):
        if deadline.passed():
            state.note(f"stopped after {i} of {iters} iterations by the section's budget")
            break
        t0 = sync(device)
        loss = train_step(run, batches)
        t1 = sync(device)
        losses.append(loss.item())
        if i >= a.c_warmup_iters:
            times.append(t1 - t0)
        state.set(iteration_seconds=times, losses=losses)
    if not times:
        raise RuntimeError(f"no timed iteration within the budget ({len(losses)} warm-up iterations done)")
    global_batch = run.plan.global_batch_size
    seconds = sum(times) / len(times)
    model_flops = model_flops_per_iteration(config, global_batch, s, False)
    counted_flops = model_flops_per_iteration(config, global_batch, s, recompute)  # what pretrain.py logs
    peak = a.peak_tflops * 1e12
    result = {"global_batch": global_batch, "tokens_per_s": global_batch * s / seconds,
              "seconds_per_iteration": seconds,
              "median_seconds": statistics.median(times), "model_tflops": model_flops / seconds / 1e12,
              "mfu": model_flops / seconds / peak, "mfu_with_recompute_flops": counted_flops / seconds / peak,
              "losses_finite": all(math.isfinite(x) for x in losses)}
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        result["total_memory_gb"] = torch.cuda.get_device_properties(device).total_memory / 1e9
    state.set(**result)


def rows_c(state: dict, a, unit: str) -> list[Row]:
    d = state.get("data", {})
    recompute = unit == "c-recompute"
    label = "with recomputation" if recompute else "no recomputation"
    bar = f">= {a.mfu_bar:.0%} ({MFU_REFERENCE})"
    specs = [(f"{unit}.tokens_per_s", f"(c) train tokens/s, {label}", "-"),
             (f"{unit}.mfu", f"(c) MFU, {label}", bar)]
    if "tokens_per_s" not in d:
        rows = failed_rows(state, specs)
        if d.get("iteration_seconds") is not None or state.get("attempts"):
            for r in rows:
                r.note += f"; micro-batch {d.get('micro_batch_size')}, attempts {state.get('attempts')}"
        return rows
    ended = cut_short(state)
    retried = f"; retried after OOM at micro-batch {state['attempts'][0]['micro_batch_size']}" \
        if state.get("attempts") else ""
    timed = len(d.get("iteration_seconds", []))
    memory = (f"; peak memory {d['peak_memory_gb']:.1f} of {d['total_memory_gb']:.0f} GB"
              if "peak_memory_gb" in d else "")
    note_tps = (f"{d.get('parameters', 0) / 1e9:.3f} B parameters, {d.get('weights')}; micro-batch "
                f"{d['micro_batch_size']} x "
                f"{d['num_microbatches']} micro-batches = {d['global_batch']} x {d['seq_length']} tokens per step; "
                f"{timed} timed after {d['warmup']} warm-up, mean {d['seconds_per_iteration']:.3f} s, median "
                f"{d['median_seconds']:.3f} s per step{memory}{retried}; {d.get('shape', '')}")
    on_gpu = a.device == "cuda"
    mfu = d["mfu"]
    status = ended or (("pass" if mfu >= a.mfu_bar else "below bar") if on_gpu else "info")
    note_mfu = f"{d['model_tflops']:.1f} TFLOP/s of {a.peak_tflops:g} peak (bf16 dense)"
    if recompute:
        note_mfu += (f"; counting the recomputed forward too (flops.py with checkpoint_activations, as pretrain.py "
                     f"logs it): {d['mfu_with_recompute_flops']:.1%}")
    if not on_gpu:
        note_mfu += "; CPU smoke run: MFU against a GPU peak means nothing here"
    if not d.get("losses_finite", True):
        status, note_mfu = "FAIL", note_mfu + "; a loss was NaN/Inf"
    return [Row(specs[0][0], specs[0][1], f"{d['tokens_per_s']:,.0f}", "-", ended or "info", note_tps),
            Row(specs[1][0], specs[1][1], f"{mfu:.1%}", bar, status, note_mfu)]
