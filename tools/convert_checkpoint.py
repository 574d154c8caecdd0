"""Convert model checkpoints: Hugging Face GPT-2 and the released CodeGeeX weights <-> codegeex_train, at any tensor-
and pipeline-parallel size.

    # HF GPT-2 (save_pretrained dir) -> our checkpoint split for TP=2, PP=2
    python tools/convert_checkpoint.py --from-hf HF_DIR --save OUT_DIR --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2
    # our checkpoint (any TP, PP) -> HF GPT-2 (needs --no-top-query-layer, --activation gelu_tanh)
    python tools/convert_checkpoint.py --load CKPT_DIR --to-hf HF_OUT_DIR
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
safetensors; --to-codegeex a torch.save file of tensors only, like the released one. Bad input ends with one
``convert_checkpoint.py: error: ...`` line and a non-zero exit. The CodeGeeX name mapping (separate Q, K, V <->
our fused query_key_value; the top query layer's K, V <-> key_value) is in codegeex_train/model/codegeex_weights.py.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from codegeex_train.checkpoint.codegeex_weights import (
    codegeex_checkpoint,
    codegeex_state_dict,
    codegeex_to_full,
    config_from_codegeex,
    full_to_codegeex,
)
from codegeex_train.checkpoint.files import (
    CheckpointError,
    load_full_state_dict,
    read_checkpoint_meta,
    save_model_checkpoint,
)
from codegeex_train.checkpoint.hf_gpt2 import config_from_hf_gpt2, full_to_hf_gpt2, hf_gpt2_config, hf_gpt2_to_full
from codegeex_train.checkpoint.safe_load import file_kind, open_regular, safe_torch_load, verify_files
from codegeex_train.checkpoint.sharding import split_model_parallel
from codegeex_train.checkpoint.universal import to_universal
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.pipeline.stages import (
    chunked_stage_layers,
    rank_chunk_layers,
    stage_layer_ranges,
    virtual_pipeline_size,
)

PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth")  # what an HF directory may hold besides safetensors
# The index files of sharded weights (save_pretrained): {"weight_map": {parameter name: shard file name}}.
HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
HF_FILES = (".json", ".safetensors", ".bin", ".pt", ".pth")  # what transformers may open in HF_DIR
MAX_INDEX_BYTES = 64 << 20


class Layout(NamedTuple):  # not a dataclass: tests load this file as a module outside sys.modules
    """The model-parallel layout of a written checkpoint: TP size, PP size, the uneven-split flags and the layers
    per virtual stage (interleaved 1F1B)."""

    tp_size: int = 1
    pp_size: int = 1
    first: int | None = None
    last: int | None = None
    layers_per_virtual_stage: int | None = None

    def num_chunks(self, config: ModelConfig) -> int:
        return virtual_pipeline_size(config.num_layers, self.pp_size, self.layers_per_virtual_stage, self.first,
                                     self.last)

    def stage_layers(self, config: ModelConfig) -> list:
        """Each stage's layers (all its chunks'); checks TP and the split against ``config`` before any weight is
        read."""
        config.validate(self.tp_size)
        v = self.num_chunks(config)
        if v > 1:
            return list(chunked_stage_layers(rank_chunk_layers(config.num_layers, self.pp_size, v)))
        return stage_layer_ranges(config.num_layers, self.pp_size, self.first, self.last)


def _regular(path: Path, what: str) -> None:
    """``path`` (links followed: the Hub's cache links each file to its blob) must exist and be a regular file."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise CheckpointError(f"--from-hf: {what} {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"--from-hf: {what} {path} is {file_kind(mode)}, not a regular file")


def hf_weight_files(hf_dir: str) -> list[Path]:
    """The pickled weight files of ``hf_dir`` to check before transformers opens any: those in it and every shard
    its index files name. Every file transformers may open (``HF_FILES``) must be a regular file; an index that is
    not JSON, or names a shard that is missing, not a regular file, or not a plain name inside ``hf_dir`` (``../``,
    a path), is refused."""
    hf = Path(hf_dir)
    for path in sorted(hf.iterdir()):
        if path.name.endswith(HF_FILES):
            _regular(path, "file")
    pickled = {p for pattern in PICKLED_WEIGHTS for p in hf.glob(pattern)}
    for index_name in HF_INDEXES:
        index = hf / index_name
        if not os.path.lexists(index):
            continue
        fd = open_regular(index)
        try:
            data = os.read(fd, MAX_INDEX_BYTES + 1)
        finally:
            os.close(fd)
        try:
            weight_map = json.loads(data).get("weight_map") if len(data) <= MAX_INDEX_BYTES else None
        except (ValueError, AttributeError):  # not JSON, or JSON but not an object
            weight_map = None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"--from-hf: {index} is not a weights index (a JSON object whose 'weight_map' maps "
                                  f"parameter names to shard file names)")
        for shard in sorted(set(weight_map.values())):
            if shard in ("", ".", "..") or os.path.basename(shard) != shard or "\\" in shard:
                raise CheckpointError(f"--from-hf: {index} names the shard {shard[:80]!r}, which is not a file name "
                                      f"inside {hf_dir}: refused")
            _regular(hf / shard, f"shard named by {index.name}:")
            if not shard.endswith(".safetensors"):  # anything else is read as a pickle
                pickled.add(hf / shard)
    return sorted(pickled)


def from_hf(hf_dir: str, save_dir: str, layout: Layout, make_vocab_size_divisible_by: int) -> None:
    if not (Path(hf_dir) / "config.json").is_file():  # and never a Hub lookup of a mistyped path
        raise CheckpointError(f"--from-hf {hf_dir}: not a Hugging Face model directory (no config.json)")
    weight_files = hf_weight_files(hf_dir)  # before transformers opens anything (its config.json included)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = config_from_hf_gpt2(GPT2Config.from_pretrained(hf_dir, local_files_only=True),
                                 make_vocab_size_divisible_by)
    stage_layers = layout.stage_layers(config)  # a bad split fails before the weights load
    # Pickled weights (older save_pretrained, or named by an index) pass our weights-only check before transformers
    # opens them.
    verify_files(weight_files)
    hf_model = GPT2LMHeadModel.from_pretrained(hf_dir, local_files_only=True)
    full = hf_gpt2_to_full(hf_model.state_dict(), config)
    save_model_checkpoint(save_dir, split_model_parallel(full, config, layout.tp_size, stage_layers), config,
                          layout.tp_size, pp_size=layout.pp_size, num_chunks=layout.num_chunks(config))


def to_hf(load_dir: str, hf_dir: str) -> None:
    from transformers import GPT2LMHeadModel

    full, config, _ = load_full_state_dict(load_dir)
    hf_model = GPT2LMHeadModel(hf_gpt2_config(config))
    hf_model.load_state_dict(full_to_hf_gpt2(full, config))
    # model.safetensors, no pickle; transformers 5 always writes safetensors (and ignores the flag).
    hf_model.save_pretrained(hf_dir, safe_serialization=True)


def from_codegeex(path: str, save_dir: str, layout: Layout, num_attention_heads: int) -> None:
    if not Path(path).is_file():
        raise CheckpointError(f"--from-codegeex {path}: no such file")
    checkpoint = safe_torch_load(path, mmap=True)  # weights-only: a pickle that would run code is refused
    try:
        flat = codegeex_state_dict(checkpoint)
        config = config_from_codegeex(flat, num_attention_heads)
    except ValueError as e:
        raise CheckpointError(f"--from-codegeex {path}: {e}") from None
    stage_layers = layout.stage_layers(config)  # TP / PP checked before any tensor is copied
    try:
        full = codegeex_to_full(flat, config)
    except ValueError as e:
        raise CheckpointError(f"--from-codegeex {path}: {e}") from None
    save_model_checkpoint(save_dir, split_model_parallel(full, config, layout.tp_size, stage_layers), config,
                          layout.tp_size, pp_size=layout.pp_size, num_chunks=layout.num_chunks(config))


def to_codegeex(load_dir: str, path: str) -> None:
    full, config, _ = load_full_state_dict(load_dir)
    checkpoint = codegeex_checkpoint(full_to_codegeex(full, config))  # refuses a model that is not CodeGeeX's
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, out)  # never a half-written file under the final name


def reshard(load_dir: str, save_dir: str, layout: Layout) -> None:
    _, meta = read_checkpoint_meta(load_dir)  # metadata only: a bad split fails before the weights load
    stage_layers = layout.stage_layers(ModelConfig(**meta["model_config"]))
    full, config, meta = load_full_state_dict(load_dir)
    save_model_checkpoint(save_dir, split_model_parallel(full, config, layout.tp_size, stage_layers), config,
                          layout.tp_size, pp_size=layout.pp_size, iteration=meta["iteration"],
                          num_chunks=layout.num_chunks(config),
                          tag=f"iter_{meta['iteration']:07d}", tokenizer=meta.get("tokenizer"))


_LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                 "--num-layers-per-virtual-pipeline-stage")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="HF_DIR", help="a GPT2LMHeadModel saved with save_pretrained")
    src.add_argument("--from-codegeex", metavar="FILE", help="the released CodeGeeX weights (e.g. codegeex_13b.pt): "
                     "{'module': {'language_model': ...}} of the codegeex package's CodeGeeXModel; needs "
                     "--num-attention-heads")
    src.add_argument("--load", metavar="CKPT_DIR", help="a codegeex_train checkpoint directory (with 'latest'), "
                     "at any TP / PP")
    dst = p.add_mutually_exclusive_group(required=True)
    dst.add_argument("--save", metavar="OUT_DIR", help="write a codegeex_train checkpoint here")
    dst.add_argument("--to-hf", metavar="HF_OUT_DIR", help="write a GPT2LMHeadModel (save_pretrained) here")
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
    args = p.parse_args(argv)
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
    try:
        if args.from_hf:
            from_hf(args.from_hf, args.save, layout_of(args), args.make_vocab_size_divisible_by)
        elif args.from_codegeex:
            from_codegeex(args.from_codegeex, args.save, layout_of(args), args.num_attention_heads)
        elif args.to_codegeex:
            to_codegeex(args.load, args.to_codegeex)
        elif args.to_hf:
            to_hf(args.load, args.to_hf)
        elif args.to_universal:
            to_universal(args.load, args.to_universal)
        else:
            reshard(args.load, args.save, layout_of(args))
    # Our errors for bad input (ModelConfigError, PipelineSplitError and the converters' are ValueErrors);
    # OSError: unreadable or unwritable paths, and transformers' report of an incomplete HF directory.
    except (CheckpointError, ValueError, OSError) as e:
        sys.exit(f"convert_checkpoint.py: error: {' '.join(str(e).split())}")
    print(f"wrote {args.save or args.to_hf or args.to_universal or args.to_codegeex}")


if __name__ == "__main__":
    main()
