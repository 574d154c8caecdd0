"""A randomly initialised tiny Hugging Face GPT-2 (room for 64 new tokens), saved and converted to our layout at
TP 1 and TP 2 once per session, and the TP 2 ranks' results on it (spawning ranks costs seconds: once)."""

from __future__ import annotations

import pytest
import torch
from gen_helpers import ragged_prompts, tp_rank_checks

from codegeex_train.formats.huggingface.gpt2 import config_from_hf_gpt2
from tests.harness import load_tool, run_distributed


@pytest.fixture(scope="session")
def hf_gpt2(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("hf_gen")
    hf_config = GPT2Config(vocab_size=100, n_positions=96, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, initializer_range=0.1,
                           bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    hf_model = GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():  # perturb everything (biases, LayerNorms too) so that each mapping matters and the
        for p in hf_model.parameters():  # greedy continuations do not collapse into one repeated token
            p.add_(torch.randn_like(p) * 0.3)
    hf_model.save_pretrained(root / "hf")
    convert = load_tool("convert_checkpoint")
    ckpt = {}
    for tp in (1, 2):
        ckpt[tp] = root / f"ckpt_tp{tp}"
        convert.main(["--from-hf", str(root / "hf"), "--save", str(ckpt[tp]), "--tensor-model-parallel-size", str(tp)])
    return {"hf_model": hf_model, "config": config_from_hf_gpt2(hf_config), "ckpt": ckpt,
            "prompts": ragged_prompts(hf_config.vocab_size)}


@pytest.fixture(scope="session")
def tp2_results(hf_gpt2):
    """Each of 2 TP ranks' tp_rank_checks on the TP 2 checkpoint."""
    return run_distributed(tp_rank_checks, world_size=2, tp_size=2, deadline_s=300,
                           ckpt_dir=str(hf_gpt2["ckpt"][2]), prompts=hf_gpt2["prompts"])
