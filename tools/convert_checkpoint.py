"""Convert model checkpoints: Hugging Face (Llama / Mistral, Qwen2, StarCoder2, GPT-2, and CodeGeeX as remote code),
the released CodeGeeX weights and the universal checkpoint <-> codegeex_train, at any tensor- and pipeline-parallel
size.

    # a Hugging Face directory (LlamaForCausalLM: DeepSeek-Coder, CodeLlama; MistralForCausalLM; Qwen2ForCausalLM:
    # Qwen2.5-Coder; Starcoder2ForCausalLM; GPT-2; a CodeGeeX export) -> our checkpoint for TP=2, PP=2
    python tools/convert_checkpoint.py --from-hf HF_DIR --save OUT_DIR --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2
    # our checkpoint (any TP, PP, any model) -> a Hugging Face directory: a Llama-, Qwen2- or StarCoder2-shaped model
    # as that native class, a GPT-2-shaped one (--no-top-query-layer --activation gelu_tanh, learned positions) as
    # GPT2LMHeadModel, any other as CodeGeeX remote code (trust_remote_code=True); with the tokenizer the checkpoint
    # records (a family's own files, as imported) and a generation config
    python tools/convert_checkpoint.py --load CKPT_DIR --to-hf HF_OUT_DIR --max-shard-size 5GB
    # re-split our checkpoint (any TP, PP) for another TP / PP; uneven layer splits as in training
    python tools/convert_checkpoint.py --load CKPT_DIR --save OUT_DIR --tensor-model-parallel-size 4 \\
        --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 11
    # ... or for interleaved 1F1B: each rank's file holds its model chunks (here 2 layers per virtual stage)
    python tools/convert_checkpoint.py --load CKPT_DIR --save OUT_DIR --pipeline-model-parallel-size 2 \\
        --num-layers-per-virtual-pipeline-stage 2
    # a training checkpoint (any TP, PP, DP; with its ZeRO optimizer state) -> universal: resume at any layout
    python tools/convert_checkpoint.py --load CKPT_DIR --to-universal OUT_DIR
    # the released CodeGeeX-13B weights (codegeex_13b.pt: the codegeex package's CodeGeeXModel) -> ours at TP 8
    python tools/convert_checkpoint.py --from-codegeex codegeex_13b.pt --num-attention-heads 40 --save OUT_DIR \\
        --tensor-model-parallel-size 8
    # our checkpoint (a CodeGeeX model: top query layer, fast_gelu) -> the released CodeGeeX layout, same dtypes
    python tools/convert_checkpoint.py --load CKPT_DIR --to-codegeex codegeex.pt

The output uses the training checkpoint layout (OUT_DIR/latest, OUT_DIR/iter_0000000/mp_rank_XX_model_states.pt),
so ``--load OUT_DIR`` in training with the same TP / PP flags picks it up. Every file read is unpickled
weights-only (codegeex_train/checkpoint/safe_load.py): one whose pickle would run code is refused. --to-hf writes
safetensors (sharded past --max-shard-size, with model.safetensors.index.json), streaming one tensor at a time with
a progress bar on stderr, into a temporary directory renamed into place at the end; --to-codegeex a torch.save file
of tensors only, like the released one. The last line says what was written and the peak memory (max RSS). Bad
input ends with one ``convert_checkpoint.py: error: ...`` line and a non-zero exit.

This tool only parses and dispatches; each format has its adapter in codegeex_train/formats/: huggingface/ (its
adapter.py; one file per family: llama.py, qwen2.py, starcoder2.py, gpt2.py, codegeex.py) and codegeex_release/
(the released CodeGeeX weights); codegeex_train/checkpoint/ has universal.py and convert.py (re-splitting between
layouts).
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import sys

from codegeex_train.formats.codegeex_release.adapter import from_codegeex, to_codegeex
from codegeex_train.checkpoint.convert import Layout, reshard
from codegeex_train.checkpoint.files import TOKENIZER_FIELDS, CheckpointError
from codegeex_train.formats.huggingface.files import hf_weight_files, parse_size
from codegeex_train.formats.huggingface.adapter import DEFAULT_MAX_SHARD_BYTES, from_hf, to_hf
from codegeex_train.checkpoint.retention import reading_checkpoint
from codegeex_train.checkpoint.run_dir import new_checkpoint_dir
from codegeex_train.checkpoint.save_lock import SaveLockError
from codegeex_train.checkpoint.universal import to_universal
from codegeex_train.config.options import Default, add_config_flags
from codegeex_train.config.tokenizer_flags import TokenizerFlags

__all__ = ["Layout", "hf_weight_files", "main", "parse_args"]  # Layout, hf_weight_files: tests use them from here

_LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                 "--num-layers-per-virtual-pipeline-stage")
RECORDED = Default(None, "the checkpoint's")  # a tokenizer flag not given: the one the checkpoint records


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="HF_DIR", help="a Hugging Face model directory: LlamaForCausalLM, "
                     "MistralForCausalLM, Qwen2ForCausalLM, Starcoder2ForCausalLM, GPT2LMHeadModel (model_type llama, "
                     "mistral, qwen2, starcoder2, gpt2) or a CodeGeeX one (model_type codegeex, --to-hf's); sharded "
                     "or not; its tokenizer files, if any, are copied beside the checkpoint and recorded")
    src.add_argument("--from-codegeex", metavar="FILE", help="the released CodeGeeX weights (e.g. codegeex_13b.pt): "
                     "{'module': {'language_model': ...}} of the codegeex package's CodeGeeXModel; needs "
                     "--num-attention-heads")
    src.add_argument("--load", metavar="CKPT_DIR", help="a codegeex_train checkpoint directory (with 'latest'), "
                     "at any TP / PP")
    dst = p.add_mutually_exclusive_group(required=True)
    dst.add_argument("--save", metavar="OUT_DIR", help="write a codegeex_train checkpoint here")
    dst.add_argument("--to-hf", metavar="HF_OUT_DIR", help="write a Hugging Face model directory here (a new "
                     "directory): AutoModelForCausalLM.from_pretrained(HF_OUT_DIR) and AutoTokenizer.from_pretrained("
                     "HF_OUT_DIR) load it; a Llama-, Qwen2-, StarCoder2- or GPT-2-shaped model is transformers' own "
                     "class, any other CodeGeeX remote code (trust_remote_code=True)")
    dst.add_argument("--to-codegeex", metavar="FILE", help="write the released CodeGeeX layout (loadable by the "
                     "codegeex package's CodeGeeXModel.load_state_dict(sd['module'])) here, tensors in the dtype "
                     "they have in CKPT_DIR")
    dst.add_argument("--to-universal", metavar="OUT_DIR", help="write a layout-free training checkpoint here "
                     "(weights, Adam moments and step, LR schedule, counters): --load it at any TP / PP / DP")
    # Defaults None so that a layout flag given with --to-hf (which has no layout) is an error, not ignored.
    p.add_argument("--tensor-model-parallel-size", type=int, metavar="N",
                   help="TP size of the written checkpoint (default 1)")
    p.add_argument("--pipeline-model-parallel-size", type=int, metavar="N",
                   help="PP size of the written checkpoint (default 1)")
    p.add_argument("--decoder-first-pipeline-num-layers", type=int, metavar="N",
                   help="layers on the first pipeline stage, as in training (default: an even split)")
    p.add_argument("--decoder-last-pipeline-num-layers", type=int, metavar="N",
                   help="layers on the last pipeline stage, as in training (default: an even split)")
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, metavar="N",
                   help="interleaved 1F1B, as in training: each rank's file holds its layers / (PP x N) model chunks "
                   "(default: one chunk per rank)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this (with --from-hf; --from-codegeex keeps the "
                   "file's padded vocabulary, CodeGeeX-13B's 52224)")
    p.add_argument("--num-attention-heads", type=int, metavar="N",
                   help="attention heads of the --from-codegeex model (its weights do not say; CodeGeeX-13B: 40)")
    hf = p.add_argument_group("--to-hf", "the tokenizer written is the one the checkpoint records (or, recording none, "
                              "the shipped default); any tokenizer flag given replaces it, as in training")
    hf.add_argument("--max-shard-size", metavar="SIZE", help="largest safetensors file, e.g. 5GB, 500MiB (default "
                    "5GB, transformers 4's; a larger tensor gets a file of its own); past it: "
                    "model-0000i-of-0000n.safetensors and model.safetensors.index.json")
    add_config_flags(hf, TokenizerFlags, defaults=dict.fromkeys(TOKENIZER_FIELDS, RECORDED))
    args = p.parse_args(argv)
    args.tokenizer_flags = {name: getattr(args, name) for name in TOKENIZER_FIELDS}
    hf_only = [f"--{name.replace('_', '-')}" for name, v in args.tokenizer_flags.items() if v]
    hf_only += ["--max-shard-size"] if args.max_shard_size is not None else []
    if hf_only and not args.to_hf:
        p.error(f"{', '.join(hf_only)}: these apply to --to-hf only")
    try:
        args.max_shard_bytes = parse_size(args.max_shard_size) if args.max_shard_size else DEFAULT_MAX_SHARD_BYTES
    except ValueError as e:
        p.error(str(e))
    if args.from_hf and args.to_hf:
        p.error("--from-hf with --to-hf converts nothing: use --save")
    if args.to_codegeex and not args.load:
        p.error("--to-codegeex converts our checkpoint: use it with --load CKPT_DIR")
    if args.from_codegeex and not args.save:
        p.error("--from-codegeex converts to our checkpoint: use --save OUT_DIR")
    if args.from_codegeex and args.num_attention_heads is None:
        p.error("--from-codegeex needs --num-attention-heads (the weights do not say it; CodeGeeX-13B: 40)")
    if args.num_attention_heads is not None and not args.from_codegeex:
        p.error("--num-attention-heads applies to --from-codegeex only (our checkpoints carry their config)")
    if args.num_attention_heads is not None and args.num_attention_heads < 1:
        p.error(f"--num-attention-heads {args.num_attention_heads}: must be >= 1")
    given = [f for f in _LAYOUT_FLAGS if getattr(args, f[2:].replace("-", "_")) is not None]
    if args.to_hf and given:
        p.error(f"{', '.join(given)}: --to-hf writes one unsplit Hugging Face model; these apply to --save")
    if args.to_codegeex and given:
        p.error(f"{', '.join(given)}: --to-codegeex writes one unsplit CodeGeeX file; these apply to --save")
    if args.to_universal and (given or args.from_hf):
        p.error(f"{', '.join(given) or '--from-hf'}: --to-universal converts a training checkpoint (--load) to no "
                f"layout at all; pick the layout when you resume from it")
    for flag in _LAYOUT_FLAGS[:2]:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            p.error(f"{flag} {value}: must be >= 1")
    return args


def layout_of(args: argparse.Namespace) -> Layout:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    return Layout(1 if tp is None else tp, 1 if pp is None else pp,
                  args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
                  args.num_layers_per_virtual_pipeline_stage)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    detail = ""
    # Writing a new checkpoint: the directory's lock (no run or tool writes there meanwhile), and never over a run.
    out = ("--save", args.save) if args.save else ("--to-universal", args.to_universal) if args.to_universal else None
    try:
        with new_checkpoint_dir(out[1], out[0]) if out else contextlib.nullcontext():
            if args.from_hf:
                from_hf(args.from_hf, args.save, layout_of(args), args.make_vocab_size_divisible_by)
            elif args.from_codegeex:
                from_codegeex(args.from_codegeex, args.save, layout_of(args), args.num_attention_heads)
            else:  # reading --load: a run saving there with --keep-last-n-checkpoints keeps its tag until done
                with reading_checkpoint(args.load):
                    if args.to_codegeex:
                        to_codegeex(args.load, args.to_codegeex)
                    elif args.to_hf:
                        detail = f": {to_hf(args.load, args.to_hf, args.max_shard_bytes, args.tokenizer_flags)}"
                    elif args.to_universal:
                        to_universal(args.load, args.to_universal)
                    else:
                        reshard(args.load, args.save, layout_of(args))
    # Our errors for bad input (ModelConfigError, the layout's LayoutError and the converters' are ValueErrors);
    # OSError: unreadable or unwritable paths, and transformers' report of an incomplete HF directory.
    except (CheckpointError, SaveLockError, ValueError, OSError) as e:
        sys.exit(f"convert_checkpoint.py: error: {' '.join(str(e).split())}")
    print(f"wrote {args.save or args.to_hf or args.to_universal or args.to_codegeex}{detail} (peak memory "
          f"{peak_memory_bytes() / 2**30:.2f} GiB, max RSS)")


def peak_memory_bytes() -> int:
    """This process's peak resident memory (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


if __name__ == "__main__":
    main()
