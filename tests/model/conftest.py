"""A randomly initialised tiny Hugging Face GPT-2, saved and converted once per session."""

from __future__ import annotations

import pytest
import torch
from model_helpers import S, hf_batch

from codegeex_train.formats.huggingface.gpt2 import config_from_hf_gpt2
from tests.harness import load_tool


@pytest.fixture(scope="session")
def convert():
    """tools/convert_checkpoint.py as a module, to call its main()."""
    return load_tool("convert_checkpoint")


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory, convert):
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("hf")
    hf_config = GPT2Config(vocab_size=100, n_positions=S, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5)
    torch.manual_seed(0)
    hf_model = GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():  # HF inits biases to 0 and LayerNorms to 1/0: perturb all so each mapping matters
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf_model.save_pretrained(root / "hf")
    config = config_from_hf_gpt2(hf_config)
    ids, pos = hf_batch(config)
    with torch.no_grad():
        logits = hf_model(input_ids=ids, position_ids=pos).logits
    ckpt = {}
    for tp in (1, 2):
        ckpt[tp] = root / f"ckpt_tp{tp}"
        convert.main(["--from-hf", str(root / "hf"), "--save", str(ckpt[tp]), "--tensor-model-parallel-size", str(tp)])
    return {"root": root, "hf_model": hf_model, "config": config, "logits": logits, "ckpt": ckpt}
