"""The released CodeGeeX weights (``codegeex_13b.pt``: the codegeex package's ``CodeGeeXModel``) <-> our checkpoint.
The name mapping is ``codegeex_weights.py``'s; this adapter reads and writes the files."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from codegeex_train.formats.codegeex_release.weights import (
    codegeex_checkpoint,
    codegeex_shapes,
    codegeex_state_dict,
    codegeex_to_full,
    config_from_codegeex,
    full_to_codegeex,
)
from codegeex_train.checkpoint.convert import Layout, save_at_layout
from codegeex_train.checkpoint.files import CheckpointError, load_full_state_dict
from codegeex_train.formats.import_checks import check_fits_files, check_tensors
from codegeex_train.checkpoint.safe_load import safe_torch_load


def from_codegeex(path: str, save_dir: str, layout: Layout, num_attention_heads: int) -> None:
    """The released file ``path`` -> our checkpoint at ``layout`` (the heads are not in the file: the caller's)."""
    if not Path(path).is_file():
        raise CheckpointError(f"--from-codegeex {path}: no such file")
    checkpoint = safe_torch_load(path, mmap=True)  # weights-only: a pickle that would run code is refused
    try:
        flat = codegeex_state_dict(checkpoint)
        config = config_from_codegeex(flat, num_attention_heads)
    except ValueError as e:
        raise CheckpointError(f"--from-codegeex {path}: {e}") from None
    where = f"--from-codegeex: {path}"
    check_fits_files(config, flat, where)
    layout.stage_layers(config)  # TP / PP checked before any tensor is copied
    described = (f"{path} (a {config.num_layers}-layer CodeGeeX model of hidden size {config.hidden_size}, MLP "
                 f"width {config.ffn_hidden_size}: read off its shapes)")
    check_tensors(flat, codegeex_shapes(config), lambda name: path, described, "--from-codegeex")
    try:
        full = codegeex_to_full(flat, config)
    except ValueError as e:
        raise CheckpointError(f"--from-codegeex {path}: {e}") from None
    save_at_layout(save_dir, full.__getitem__, config, layout)


def to_codegeex(load_dir: str, path: str) -> None:
    """Our checkpoint (a CodeGeeX model: top query layer, fast_gelu) -> the released layout in ``path``, same
    dtypes; written to a temporary file renamed into place."""
    full, config, _ = load_full_state_dict(load_dir)
    checkpoint = codegeex_checkpoint(full_to_codegeex(full, config))  # refuses a model that is not CodeGeeX's
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, out)  # never a half-written file under the final name
