"""(a) bf16 against fp32 and (b) fp16 dynamic loss scaling: a small CodeGeeX trained on real code tokens through the
trainer's train_step on a ZeRO-2 engine, in each precision from the same initial weights."""

from __future__ import annotations

import math
import time

from benchmarks.gpu_check.child import Deadline, State, build_run, free, weights_dtype
from benchmarks.gpu_check.report import Row, cut_short, failed_rows


def small_model(a, vocab_size: int):
    from codegeex_train.config.model_config import ModelConfig

    h = a.small_hidden_size
    heads = h // 64 if h >= 64 else 4  # head size 64 (768 -> 12 heads, as GPT-2 small)
    return ModelConfig(num_layers=a.small_num_layers, hidden_size=h, num_attention_heads=heads,
                       max_position_embeddings=a.small_seq_length, hidden_dropout=0.0, attention_dropout=0.0,
                       activation="fast_gelu", top_query_layer=True, vocab_size=vocab_size)


def code_batches(a, count: int):
    """``count`` micro-batches (b, s + 1) of consecutive tokens of this Python's stdlib source, tokenized with the
    shipped tokenizer: real code, so the loss falls over the iterations. Returns (batches, vocab size)."""
    import torch

    from codegeex_train.preprocessing.default_corpus import default_corpus_files
    from codegeex_train.tokenization.tokenizer import default_tokenizer

    tokenizer = default_tokenizer()
    b, s = a.small_micro_batch_size, a.small_seq_length
    need = count * b * (s + 1)
    ids: list[int] = []
    for path in default_corpus_files():
        ids += tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")) + [tokenizer.eod]
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise RuntimeError(f"the stdlib corpus gave {len(ids)} tokens, {need} needed")
    stream = torch.tensor(ids[:need], dtype=torch.long).view(count, b, s + 1)
    return list(stream), tokenizer.vocab_size


def train_losses(run, batches, deadline: Deadline, on_step) -> int:
    """One optimizer step per micro-batch (num_microbatches 1) through the trainer's train_step."""
    from codegeex_train.training.trainer import train_step

    for i, text in enumerate(batches):
        if deadline.passed():
            return i
        loss = train_step(run, iter([{"text": text}]))
        on_step(i, loss.item())
    return len(batches)


def unit_a(a, state: State, topology, device, deadline: Deadline) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: no TF32 in the reference
    torch.backends.cudnn.allow_tf32 = False
    batches, vocab = code_batches(a, a.a_iters)
    config = small_model(a, vocab)
    state.set(iters_planned=a.a_iters, shape=f"{config.num_layers} layers x {config.hidden_size}, "
              f"{config.num_attention_heads} heads, vocab {config.padded_vocab_size}, seq {a.small_seq_length}, "
              f"micro-batch {a.small_micro_batch_size}")
    for precision in ("fp32", "bf16"):
        run = build_run(topology, device, config, precision=precision, seq_length=a.small_seq_length,
                        micro_batch_size=a.small_micro_batch_size, num_microbatches=1, train_iters=a.a_iters,
                        seed=a.seed)
        state.set(**{f"{precision}_weights": weights_dtype(run)})
        losses: list[float] = []

        def record(i, loss, losses=losses, precision=precision):
            losses.append(loss)
            state.set(**{f"{precision}_losses": losses})

        start = time.perf_counter()
        done = train_losses(run, batches, deadline, record)
        state.set(**{f"{precision}_seconds": time.perf_counter() - start})
        run = None  # the engine goes before the next one is built
        free(device)
        if done < len(batches):
            state.note(f"{precision}: stopped after {done} of {len(batches)} iterations by the section's budget")
            return


def unit_b(a, state: State, topology, device, deadline: Deadline) -> None:
    if device.type == "cpu":
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        if accelerator.is_fp16_supported():  # this CPU has AVX-512 FP16 / AMX: DeepSpeed accepts fp16 as it is
            state.set(cpu_fp16="fp16 on CPU: DeepSpeed accepts it on this CPU (not forced)")
        elif not a.force_fp16_on_cpu:
            state.set(skipped="fp16 is a GPU path: DeepSpeed refuses it on this CPU (--no-force-fp16-on-cpu)")
            return
        else:
            accelerator.is_fp16_supported = lambda: True  # this process only: DeepSpeed's sanity check
            state.set(cpu_fp16="fp16 forced on CPU: DeepSpeed refuses it on this CPU (its accelerator's "
                               "is_fp16_supported patched in this process only)")
    batches, vocab = code_batches(a, a.b_iters)
    config = small_model(a, vocab)
    power = a.fp16_initial_scale_power
    user = {"fp16": {"initial_scale_power": power, "loss_scale_window": a.fp16_loss_scale_window, "hysteresis": 2,
                     "min_loss_scale": 1}}
    run = build_run(topology, device, config, precision="fp16", seq_length=a.small_seq_length,
                    micro_batch_size=a.small_micro_batch_size, num_microbatches=1, train_iters=a.b_iters,
                    seed=a.seed, ds_user=user)
    engine = run.engine
    state.set(weights=weights_dtype(run), iters_planned=a.b_iters, initial_scale_power=power,
              window=a.fp16_loss_scale_window)
    steps: list[dict] = []

    def scale() -> float:
        optimizer = engine.optimizer
        return float(getattr(optimizer, "cur_scale", getattr(optimizer, "loss_scale", 1.0)))

    skipped_before = [int(getattr(engine, "skipped_steps", 0))]
    scale_before = [scale()]

    def record(i, loss):
        skipped_now = int(getattr(engine, "skipped_steps", 0))
        steps.append({"step": i + 1, "scale": scale_before[0], "skipped": skipped_now > skipped_before[0],
                      "loss": loss})
        skipped_before[0], scale_before[0] = skipped_now, scale()
        state.set(steps=steps, final_scale=scale_before[0])

    done = train_losses(run, batches, deadline, record)
    if done < len(batches):
        state.note(f"stopped after {done} of {len(batches)} iterations by the section's budget")


def rows_a(state: dict, a) -> list[Row]:
    d = state.get("data", {})
    specs = [("a.max_rel_diff", "(a) bf16 vs fp32: max |dloss| / loss_fp32",
              f"<= {a.bf16_rtol:g}"),
             ("a.final_loss", "(a) final loss fp32 / bf16 (first -> last)", "both fall")]
    fp32, bf16 = d.get("fp32_losses") or [], d.get("bf16_losses") or []
    n = min(len(fp32), len(bf16))
    if n == 0:
        return failed_rows(state, specs)
    ended = cut_short(state)
    diffs = [abs(y - x) / abs(x) for x, y in zip(fp32, bf16)]
    worst = max(range(n), key=lambda i: diffs[i])
    partial = f"; only {n} of {d.get('iters_planned')} iterations" if n < d.get("iters_planned", n) else ""
    note = (f"{n} iterations each, same seed and code tokens; worst at iteration {worst + 1}; "
            f"{d.get('shape', '')}; module weights {d.get('fp32_weights')} / {d.get('bf16_weights')}, fp32 without "
            f"TF32{partial}")
    rel = diffs[worst]
    learns = fp32[n - 1] < fp32[0] and bf16[n - 1] < bf16[0]
    return [Row(specs[0][0], specs[0][1], f"{rel:.2e}", specs[0][2],
                ended or ("pass" if rel <= a.bf16_rtol else "FAIL"), note),
            Row(specs[1][0], specs[1][1], f"{fp32[n - 1]:.4f} / {bf16[n - 1]:.4f}", specs[1][2],
                ended or ("pass" if learns else "FAIL"),
                f"fp32 {fp32[0]:.3f} -> {fp32[n - 1]:.3f}, bf16 {bf16[0]:.3f} -> {bf16[n - 1]:.3f}; "
                f"{d.get('fp32_seconds', 0):.1f} s fp32, {d.get('bf16_seconds', 0):.1f} s bf16")]


def _fmt_pow2(x: float) -> str:
    if x > 0 and float(x).is_integer() and 2 ** round(math.log2(x)) == x:
        return f"2^{round(math.log2(x))}"
    return f"{x:g}"


def _trajectory(scales: list[float]) -> str:
    """2^32 x2 -> 2^31 -> ... : runs of equal scales, at most 12 runs shown."""
    runs: list[list] = []
    for x in scales:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    parts = [_fmt_pow2(x) + (f" x{k}" if k > 1 else "") for x, k in runs]
    if len(parts) > 12:
        parts = parts[:6] + ["..."] + parts[-5:]
    return " -> ".join(parts)


def rows_b(state: dict, a) -> list[Row]:
    d = state.get("data", {})
    power = d.get("initial_scale_power", a.fp16_initial_scale_power)
    specs = [("b.skipped", "(b) fp16: steps skipped by dynamic loss scaling", f">= 1, from step 1 (scale 2^{power})"),
             ("b.loss_scale", "(b) fp16: loss scale per step", f"falls from 2^{power} until steps apply"),
             ("b.applied", "(b) fp16: applied steps, loss first -> last", ">= 1 applied, finite, falling")]
    if d.get("skipped"):
        return [Row(k, c, "-", b, "skipped", d["skipped"]) for k, c, b in specs]
    steps = d.get("steps") or []
    if not steps:
        return failed_rows(state, specs)
    ended = cut_short(state)
    forced = d.get("cpu_fp16", "")
    skipped = [s["step"] for s in steps if s["skipped"]]
    applied = [s for s in steps if not s["skipped"]]
    scales = [s["scale"] for s in steps]
    first_applied = applied[0]["step"] if applied else None
    ok_skips = bool(skipped) and skipped[0] == 1
    ok_scale = bool(applied) and min(scales) < 2.0 ** power and first_applied is not None
    losses = [s["loss"] for s in applied]
    ok_applied = bool(applied) and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    partial = f"; only {len(steps)} of {d.get('iters_planned')} steps" if len(steps) < d.get("iters_planned", 0) else ""
    return [
        Row(specs[0][0], specs[0][1], f"{len(skipped)} of {len(steps)}", specs[0][2],
            ended or ("pass" if ok_skips else "FAIL"),
            f"skipped steps {skipped}; module weights {d.get('weights')}; hysteresis 2, loss_scale_window "
            f"{d.get('window')}{partial}"
            + (f"; {forced}" if forced else "")),
        Row(specs[1][0], specs[1][1], _trajectory(scales) + f" (final {_fmt_pow2(d.get('final_scale', 0))})",
            specs[1][2], ended or ("pass" if ok_scale else "FAIL"),
            f"first applied step {first_applied}; the scale doubles after {d.get('window')} clean steps"),
        Row(specs[2][0], specs[2][1],
            f"{len(applied)} applied" + (f"; {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else ""),
            specs[2][2], ended or ("pass" if ok_applied else "FAIL"), "losses of the applied steps")]
