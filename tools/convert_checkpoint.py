"""Convert model checkpoints: Hugging Face GPT-2 <-> codegeex_train, at any tensor-parallel size.

    # HF GPT-2 (save_pretrained dir) -> our checkpoint split for TP=2
    python tools/convert_checkpoint.py --from-hf HF_DIR --save OUT_DIR --tensor-model-parallel-size 2
    # our checkpoint (any TP) -> HF GPT-2 (needs --no-top-query-layer, --activation gelu_tanh)
    python tools/convert_checkpoint.py --load CKPT_DIR --to-hf HF_OUT_DIR
    # re-split our checkpoint for another TP size
    python tools/convert_checkpoint.py --load CKPT_DIR --save OUT_DIR --tensor-model-parallel-size 4

The output uses the training checkpoint layout (OUT_DIR/latest, OUT_DIR/iter_0000000/mp_rank_XX_model_states.pt),
so ``--load OUT_DIR`` in training picks it up.
"""

from __future__ import annotations

import argparse
import sys

from codegeex_train.model.checkpoint import CheckpointError, load_full_state_dict, save_model_checkpoint
from codegeex_train.model.sharding import (
    config_from_hf_gpt2,
    full_to_hf_gpt2,
    hf_gpt2_config,
    hf_gpt2_to_full,
    split_state_dict,
)


def from_hf(hf_dir: str, save_dir: str, tp_size: int, make_vocab_size_divisible_by: int) -> None:
    from transformers import GPT2LMHeadModel

    hf_model = GPT2LMHeadModel.from_pretrained(hf_dir)
    config = config_from_hf_gpt2(hf_model.config, make_vocab_size_divisible_by)
    full = hf_gpt2_to_full(hf_model.state_dict(), config)
    save_model_checkpoint(save_dir, split_state_dict(full, config, tp_size), config, tp_size)


def to_hf(load_dir: str, hf_dir: str) -> None:
    from transformers import GPT2LMHeadModel

    full, config, _ = load_full_state_dict(load_dir)
    hf_model = GPT2LMHeadModel(hf_gpt2_config(config))
    hf_model.load_state_dict(full_to_hf_gpt2(full, config))
    hf_model.save_pretrained(hf_dir)


def reshard(load_dir: str, save_dir: str, tp_size: int) -> None:
    full, config, meta = load_full_state_dict(load_dir)
    save_model_checkpoint(save_dir, split_state_dict(full, config, tp_size), config, tp_size,
                          iteration=meta["iteration"], tag=f"iter_{meta['iteration']:07d}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="HF_DIR", help="a GPT2LMHeadModel saved with save_pretrained")
    src.add_argument("--load", metavar="CKPT_DIR", help="a codegeex_train checkpoint directory (with 'latest')")
    dst = p.add_mutually_exclusive_group(required=True)
    dst.add_argument("--save", metavar="OUT_DIR", help="write a codegeex_train checkpoint here")
    dst.add_argument("--to-hf", metavar="HF_OUT_DIR", help="write a GPT2LMHeadModel (save_pretrained) here")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size of the written checkpoint")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this (with --from-hf)")
    args = p.parse_args(argv)
    if args.from_hf and args.to_hf:
        p.error("--from-hf with --to-hf converts nothing: use --save")
    try:
        if args.from_hf:
            from_hf(args.from_hf, args.save, args.tensor_model_parallel_size, args.make_vocab_size_divisible_by)
        elif args.to_hf:
            to_hf(args.load, args.to_hf)
        else:
            reshard(args.load, args.save, args.tensor_model_parallel_size)
    except (CheckpointError, ValueError) as e:  # ModelConfigError is a ValueError
        sys.exit(f"convert_checkpoint.py: error: {e}")
    print(f"wrote {args.save or args.to_hf}")


if __name__ == "__main__":
    main()
