"""The GPU check (issue 21, item 2): one command, four sections, one table at the end.

  (a) bf16 vs fp32: a small CodeGeeX (top query layer on) trained 50 iterations on the same code tokens from the
      same initial weights, once in fp32 and once in bf16, both through our full training step
      (training/trainer.py train_step on a build_engine ZeRO-2 engine, as pretrain.py runs it). Reported: the
      largest |loss_bf16 - loss_fp32| / loss_fp32 over the iterations and the final losses.
  (b) fp16 dynamic loss scaling: the same model in fp16 with an initial loss scale of 2^32, so that the first
      steps overflow. Reported: the steps DeepSpeed skipped, the loss scale at every step (it must come down
      until steps apply), the applied steps and their losses.
  (c) training throughput and MFU of a ~1.3B CodeGeeX (configs/codegeex-1.3b.yaml, --config: 24 layers, hidden 2048,
      16 heads, vocab 50400 padded to 52224, top query layer on, sequence 2048) in bf16 under ZeRO-2 on one GPU, without and with activation
      recomputation (--checkpoint-activations): warm-up iterations, then N timed iterations, each between two
      torch.cuda.synchronize. MFU = model FLOP/s (codegeex_train/model/flops.py, Megatron's formula, without the
      recomputed forward) / the peak (--peak-tflops), next to the project's bar (>= 50%).
  (d) generation: our KV-cached greedy decoding against Hugging Face ``generate`` on the same GPU, the same weights
      (a ~1.3B model without the top query layer converted to GPT2LMHeadModel, as benchmarks/generation.py
      does), the same left-padded prompts, batch 8, 256 new tokens.

Each section runs in a process of its own (a torch.distributed world of one: NCCL on CUDA, gloo on CPU, joined
the way pretrain.py joins it) under a wall-clock budget: a section that raises (an OOM, say) or runs out of time
shows as error/timeout rows in the table and the other sections still run. An OOM in (c) is retried once at half
the micro-batch, inside the same budget. The table is printed at the end and written as JSON and Markdown
(gpu_check.json, gpu_check.md, and one log per section under logs/) to --output-dir ($OUT when set).

    python benchmarks/gpu.py          # one GPU; bash scripts/gpu_check.sh is the same (budgets: at most 5.5 minutes)
    python benchmarks/gpu.py --sections c --c-micro-batch-size 4   # one section again, other settings
    python benchmarks/gpu.py --device cpu --smoke       # no GPU: tiny shapes, every section, about a minute

Exit status: 0 when no row is an error, a timeout or a failed check (a measurement below its bar is not a failure).

This file is the command (flags, units in turn, the table); what each section measures is in benchmarks/gpu_check/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

_STARTED = time.time()  # this process's start (a child reports its start-up: imports, CUDA, process group)
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_check import decoding, mfu, parent, precision  # noqa: E402
from benchmarks.gpu_check.child import run_child  # noqa: E402
from benchmarks.gpu_check.mfu import MFU_REFERENCE  # noqa: E402
from benchmarks.gpu_check.report import BAD, Row, render_markdown, render_text, unit_rows  # noqa: E402
from codegeex_train.config.config_file import ConfigFileError, preset_path, section  # noqa: E402

# NVIDIA's datasheet: H100 SXM and H200 SXM, BF16/FP16 Tensor Core 1,979 TFLOP/s "with sparsity", i.e. 989 dense.
# (H200 NVL: 1,671 with sparsity, 835 dense: pass --peak-tflops 835 there.)
H200_SXM_DENSE_BF16_TFLOPS = 989.0
MFU_BAR = 0.50

UNITS = ("a", "b", "c", "c-recompute", "d")  # one process each; --sections a b c d (c = both c units)
DEFAULT_BUDGETS_S = {"a": 60, "b": 45, "c": 75, "c-recompute": 70, "d": 75}  # 325 s: under 6 minutes in all
SMOKE_BUDGETS_S = {"a": 60, "b": 60, "c": 60, "c-recompute": 60, "d": 60}
ROW_KEYS = ("a.max_rel_diff", "a.final_loss", "b.skipped", "b.loss_scale", "b.applied",
            "c.tokens_per_s", "c.mfu", "c-recompute.tokens_per_s", "c-recompute.mfu",
            "d.ours", "d.hf", "d.ratio", "d.greedy")
# A unit's two halves: what its process measures (a, state, topology, device, deadline) and the rows built from that
# (state, a). The sections' code: benchmarks/gpu_check/.
SECTIONS = {
    "a": (precision.unit_a, precision.rows_a),
    "b": (precision.unit_b, precision.rows_b),
    "c": (partial(mfu.unit_c, recompute=False), partial(mfu.rows_c, unit="c")),
    "c-recompute": (partial(mfu.unit_c, recompute=True), partial(mfu.rows_c, unit="c-recompute")),
    "d": (decoding.unit_d, decoding.rows_d),
}


def _budget(text: str) -> tuple[str, float]:
    unit, _, seconds = text.partition("=")
    if unit not in UNITS or not seconds:
        raise argparse.ArgumentTypeError(f"expected UNIT=SECONDS with UNIT one of {', '.join(UNITS)}: {text!r}")
    return unit, float(seconds)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and few iterations (for --device cpu)")
    p.add_argument("--sections", nargs="+", choices=("a", "b", "c", "d"), default=["a", "b", "c", "d"])
    p.add_argument("--output-dir", default=None, help="where the JSON, Markdown and logs go (default: $OUT when "
                   "set, else outputs/gpu_check)")
    p.add_argument("--peak-tflops", type=float, default=H200_SXM_DENSE_BF16_TFLOPS,
                   help="the device's dense bf16 peak, TFLOP/s (default: H200 SXM, 989)")
    p.add_argument("--mfu-bar", type=float, default=MFU_BAR, help="the project's MFU bar (default 0.50)")
    p.add_argument("--budget", type=_budget, action="append", default=[], metavar="UNIT=SECONDS",
                   help=f"wall-clock budget of one unit ({', '.join(UNITS)}); defaults {DEFAULT_BUDGETS_S}")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--config", default=SHAPE_PRESET, metavar="NAME",
                   help=f"(c, d) the ~1.3B shape: a preset, configs/NAME.yaml, or a .yaml file (default {SHAPE_PRESET}; "
                        "(c) builds its whole model: section, e.g. a Qwen2's grouped-query attention and SwiGLU, with "
                        "its planner: vocabulary; the --c-*/--d-* flags below override it; --smoke ignores it)")
    # (a) and (b): a small CodeGeeX on code tokens
    p.add_argument("--small-num-layers", type=int, default=None, help="(a, b) default 12 (smoke 2)")
    p.add_argument("--small-hidden-size", type=int, default=None, help="(a, b) default 768 (smoke 32)")
    p.add_argument("--small-seq-length", type=int, default=None, help="(a, b) default 1024 (smoke 32)")
    p.add_argument("--small-micro-batch-size", type=int, default=None, help="(a, b) default 8 (smoke 2)")
    p.add_argument("--a-iters", type=int, default=None, help="(a) iterations per precision; default 50 (smoke 6)")
    p.add_argument("--bf16-rtol", type=float, default=0.03,
                   help="(a) largest |loss_bf16 - loss_fp32| / loss_fp32 that passes (default 0.03)")
    p.add_argument("--b-iters", type=int, default=None, help="(b) fp16 iterations; default 40 (smoke 10)")
    p.add_argument("--fp16-initial-scale-power", type=int, default=None,
                   help="(b) DeepSpeed fp16.initial_scale_power; default 32 (smoke 20): the first steps overflow")
    p.add_argument("--fp16-loss-scale-window", type=int, default=None,
                   help="(b) clean steps before the scale doubles again; default 20 (smoke 8)")
    p.add_argument("--no-force-fp16-on-cpu", dest="force_fp16_on_cpu", action="store_false",
                   help="(b) on CPU, skip the section instead of forcing DeepSpeed's fp16 (which it refuses there)")
    # (c): throughput
    p.add_argument("--c-num-layers", type=int, default=None, help="(c) default 24 (smoke 2)")
    p.add_argument("--c-hidden-size", type=int, default=None, help="(c) default 2048 (smoke 64)")
    p.add_argument("--c-num-attention-heads", type=int, default=None, help="(c) default 16 (smoke 4)")
    p.add_argument("--c-seq-length", type=int, default=None, help="(c) default 2048 (smoke 64)")
    p.add_argument("--c-micro-batch-size", type=int, default=None, help="(c) without recomputation; default 8 "
                   "(smoke 2); halved once on OOM")
    p.add_argument("--c-recompute-micro-batch-size", type=int, default=None,
                   help="(c) with recomputation; default 8 (smoke 2); halved once on OOM")
    p.add_argument("--c-num-microbatches", type=int, default=None,
                   help="(c) micro-batches per optimizer step (gradient accumulation); default 4 (smoke 2)")
    p.add_argument("--c-warmup-iters", type=int, default=None, help="(c) default 3 (smoke 1)")
    p.add_argument("--c-iters", type=int, default=None, help="(c) timed iterations; default 8 (smoke 2)")
    # (d): generation
    p.add_argument("--d-num-layers", type=int, default=None, help="(d) default 24 (smoke 2)")
    p.add_argument("--d-hidden-size", type=int, default=None, help="(d) default 2048 (smoke 64)")
    p.add_argument("--d-num-attention-heads", type=int, default=None, help="(d) default 16 (smoke 4)")
    p.add_argument("--d-batch-size", type=int, default=None, help="(d) prompts per call; default 8 (smoke 3)")
    p.add_argument("--d-new-tokens", type=int, default=None, help="(d) default 256 (smoke 8)")
    p.add_argument("--d-prompt-lengths", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="(d) prompt lengths spread over [MIN, MAX]; default 64 256 (smoke 4 12)")
    p.add_argument("--d-reps", type=int, default=None, help="(d) timed runs of each, interleaved; default 2 (smoke 1)")
    p.add_argument("--d-dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="(d) weights and activations of both; default bf16 on CUDA, fp32 on CPU")
    # tests only
    p.add_argument("--inject-error", action="append", default=[], choices=UNITS, help=argparse.SUPPRESS)
    p.add_argument("--inject-hang", action="append", default=[], choices=UNITS, help=argparse.SUPPRESS)
    p.add_argument("--inject-oom", action="append", default=[], choices=("c", "c-recompute"), help=argparse.SUPPRESS)
    # internal: one unit in this process
    p.add_argument("--child", choices=UNITS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-state", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-deadline", type=float, default=None, help=argparse.SUPPRESS)
    return p


# Shapes and iteration counts: FULL on a GPU, SMOKE (--smoke) on a CPU; any flag given wins. On a GPU the (c) and
# (d) shape is the preset's (preset_shape): the one training, the script and the planner read.
SHAPE_PRESET = "codegeex-1.3b"
FULL = {
    "small_num_layers": 12, "small_hidden_size": 768, "small_seq_length": 1024, "small_micro_batch_size": 8,
    "a_iters": 50, "b_iters": 40, "fp16_initial_scale_power": 32, "fp16_loss_scale_window": 20,
    "c_num_microbatches": 4, "c_warmup_iters": 3, "c_iters": 8, "d_batch_size": 8,
    "d_new_tokens": 256, "d_prompt_lengths": (64, 256), "d_reps": 2,
}


def preset_shape(name: str) -> dict:
    """(c) and (d)'s shape from a preset: layers, width and heads (d: the same, without the top query layer), and
    (c) the sequence and micro-batch (with and without recompute), the rest of the preset's model: section
    (``c_model``: its architecture, e.g. grouped-query attention, SwiGLU, RMSNorm, the untied output layer; checked
    as ModelConfig fields in the section's process) and its planner: vocabulary (``c_vocab_size``)."""
    path = preset_path(name)
    model, train = section(path, "model"), section(path, "train")
    try:
        shape = {"num_layers": model["num_layers"], "hidden_size": model["hidden_size"],
                 "num_attention_heads": model["num_attention_heads"]}
        micro = train["micro_batch_size"]
        return {**{f"{u}_{k}": v for u in "cd" for k, v in shape.items()}, "c_seq_length": train["seq_length"],
                "c_micro_batch_size": micro, "c_recompute_micro_batch_size": micro,
                "c_model": {k: v for k, v in model.items() if k not in shape},
                "c_vocab_size": section(path, "planner").get("vocab_size")}
    except KeyError as e:
        raise ConfigFileError(f"--config {path}: no {e.args[0]} (the GPU check's shape needs model.num_layers, "
                              f"hidden_size, num_attention_heads, train.seq_length and micro_batch_size)") from None
SMOKE = {
    "small_num_layers": 2, "small_hidden_size": 32, "small_seq_length": 32, "small_micro_batch_size": 2,
    "a_iters": 6, "b_iters": 10, "fp16_initial_scale_power": 20, "fp16_loss_scale_window": 8,
    "c_num_layers": 2, "c_hidden_size": 64, "c_num_attention_heads": 4, "c_seq_length": 64,
    "c_micro_batch_size": 2, "c_recompute_micro_batch_size": 2, "c_num_microbatches": 2, "c_warmup_iters": 1,
    "c_iters": 2, "d_num_layers": 2, "d_hidden_size": 64, "d_num_attention_heads": 4, "d_batch_size": 3,
    "d_new_tokens": 8, "d_prompt_lengths": (4, 12), "d_reps": 1, "c_model": {}, "c_vocab_size": None,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser()
    a = p.parse_args(argv)
    try:
        defaults = SMOKE if a.smoke else {**FULL, **preset_shape(a.config)}
    except ConfigFileError as e:
        p.error(str(e))
    for key, value in defaults.items():
        if getattr(a, key, None) is None:  # c_model, c_vocab_size: the preset's alone (no flag)
            setattr(a, key, value)
    if a.d_dtype is None:
        a.d_dtype = "bf16" if a.device == "cuda" else "fp32"
    return a


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse(argv)
    if a.child:
        return run_child(a, SECTIONS[a.child][0], _STARTED)
    wall_start = time.monotonic()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, parent.on_signal)  # take the running unit's process (own session) down with us
    out_dir = Path(a.output_dir or os.environ.get("OUT") or ROOT / "outputs" / "gpu_check").resolve()
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    if a.device == "cuda":
        import torch  # the CPU path leaves torch to the children: the parent stays light

        if not torch.cuda.is_available():
            print("error: --device cuda but no GPU is visible to torch (use --device cpu --smoke on a CPU machine)",
                  file=sys.stderr)
            return 2
    budgets = dict(SMOKE_BUDGETS_S if a.smoke else DEFAULT_BUDGETS_S)
    budgets.update(dict(a.budget))
    units = [u for u in UNITS if u[0] in a.sections]
    print(f"gpu check: units {', '.join(units)} on {a.device}{' (smoke)' if a.smoke else ''}; budgets "
          + ", ".join(f"{u} {budgets[u]:.0f} s" for u in units) + f"; output {out_dir}", flush=True)
    states: dict[str, dict] = {}
    rows: list[Row] = []
    interrupted = None
    for unit in units:
        if interrupted is not None:  # still one row per check: the table keeps its shape
            states[unit] = {"data": {}, "skipped_by_parent": f"not run: {interrupted}"}
            rows += unit_rows(unit, SECTIONS[unit][1], states[unit], a)
            continue
        try:
            state = parent.run_unit(unit, argv, a, budgets[unit], out_dir)
        except parent.Interrupted as e:  # SIGTERM/SIGINT (an outer timeout): its process is down; report what ran
            interrupted = e
            state = getattr(e, "state", None) or {"data": {}, "error": f"{e} while running", "seconds": 0.0}
        states[unit] = state
        how = "timeout" if state.get("timeout") else "error" if state.get("error") else "ok"
        print(f"[{unit}] {how} in {state['seconds']:.1f} s (start-up {state.get('startup_seconds', 0):.1f} s)"
              + (f": {state['error']}" if state.get("error") else "")
              + (f" (log {out_dir / state['log']})" if state.get("log") else ""), flush=True)
        rows += unit_rows(unit, SECTIONS[unit][1], state, a)
    present = {r.key for r in rows}
    for key in ROW_KEYS:  # every check of the units run has its row, whatever happened (else a bug here)
        if key.split(".")[0] in units and key not in present:
            rows.append(Row(key, key, "-", "-", "error", "row missing from the report (a bug in benchmarks/gpu_check)"))
    seen = next((s for s in states.values() if s.get("device")), {})
    header = [(f"device: {seen.get('device', a.device)} (backend {seen.get('backend', '?')}); torch "
               f"{seen.get('torch', '?')}, deepspeed {seen.get('deepspeed', '?')}; peak {a.peak_tflops:g} TFLOP/s "
               f"bf16 dense; MFU bar {a.mfu_bar:.0%} ({MFU_REFERENCE})"),
              (f"{'smoke (tiny shapes) ' if a.smoke else ''}run of {time.strftime('%Y-%m-%d %H:%M:%S')}, "
               f"{time.monotonic() - wall_start:.0f} s wall; units in separate processes, each a torch.distributed "
               f"world of one under ZeRO-2")]
    text = render_text(rows, header)
    (out_dir / "gpu_check.md").write_text(render_markdown(rows, header))
    (out_dir / "gpu_check.json").write_text(json.dumps(
        {"header": header, "argv": argv, "rows": [asdict(r) for r in rows], "units": states,
         "wall_seconds": time.monotonic() - wall_start}, indent=1, default=str))
    print("\n" + text, flush=True)
    print(f"\nwritten: {out_dir / 'gpu_check.json'}, {out_dir / 'gpu_check.md'}", flush=True)
    if interrupted is not None:
        return 128 + interrupted.signum
    return 1 if any(r.status in BAD for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
