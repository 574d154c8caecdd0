"""The Hugging Face CodeGeeX export (formats/huggingface/codegeex.py + the remote code in formats/huggingface/remote/): for tiny
random models covering the top query layer on and off, each activation and learned vs RoPE positions, a directory
written from our state dict loads with ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` and
computes our model's logits (with and without left padding) and our generator's greedy tokens through its own KV
cache; the name map round-trips exactly."""

from __future__ import annotations

import json

import pytest
import torch

from codegeex_train.formats.huggingface.codegeex import (
    config_from_hf_codegeex,
    copy_remote_code,
    full_to_hf_codegeex,
    hf_codegeex_config,
    hf_codegeex_to_full,
    is_gpt2_shaped,
)
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.generation import Generator, SamplingParams
from codegeex_train.model import CodeGeeXModel

TOL = 1e-5
NEW_TOKENS = 64
PROMPT_LENGTHS = (3, 11, 6)
CASES = {  # together: top query on / off, every activation, learned / RoPE (both pair layouts, half the channels)
    "codegeex": {},  # the default architecture: top query layer, fast_gelu, learned positions
    "no_top_query_gelu": {"top_query_layer": False, "activation": "gelu"},
    "rope_top_query": {"position_embedding_type": "rope", "rotary_percent": 0.5},
    "rope_interleaved_gelu_tanh": {"position_embedding_type": "rope", "rotary_percent": 0.5,
                                   "rotary_interleaved": True, "activation": "gelu_tanh", "top_query_layer": False,
                                   "init_method_std": 0.3},  # at 0.2 its greedy rows repeat one token
}


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, max_position_embeddings=80,
                  make_vocab_size_divisible_by=128, hidden_dropout=0.0, attention_dropout=0.0,
                  activation="fast_gelu", top_query_layer=True, init_method_std=0.2, layernorm_epsilon=1e-4)
    return ModelConfig(**{**fields, **overrides})


def random_model(config: ModelConfig) -> CodeGeeXModel:
    """Our model with every parameter perturbed (biases and LayerNorms start at 0 / 1: each mapping must matter)."""
    model = CodeGeeXModel(config, None, None, seed=11).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def export(model: CodeGeeXModel, out) -> None:
    """The directory --to-hf writes, reduced to what transformers needs to load the model."""
    from safetensors.torch import save_file

    (out / "config.json").write_text(json.dumps(hf_codegeex_config(model.config)))
    save_file(full_to_hf_codegeex(model.state_dict(), model.config), out / "model.safetensors")
    copy_remote_code(out)


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    return ids, mask


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Decoding a tiny model is one small op after another: a second thread only adds synchronisation (measured on
    the busy 2-core CI machine: this file 71 s -> 21 s, 35 -> 9 s of CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    """(case, our model, the transformers model loaded from its export)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(**CASES[request.param])
    model = random_model(config)
    out = tmp_path_factory.mktemp(f"hf_{request.param}")
    export(model, out)
    hf, info = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, local_files_only=True,
                                                    dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # every tensor read, none missing (lm_head: tied to the word table)
    assert hf.lm_head.weight.data_ptr() == hf.transformer.word_embeddings.weight.data_ptr()
    return request.param, model, hf.eval()


def test_the_name_map_round_trips_exactly():
    for overrides in CASES.values():
        config = tiny_config(**overrides)
        full = random_model(config).state_dict()
        full["word_embeddings.weight"][config.vocab_size:] = 0  # the padding rows: not exported, zeros on import
        hf = full_to_hf_codegeex(full, config)
        assert hf["transformer.word_embeddings.weight"].shape[0] == config.vocab_size  # padding rows trimmed
        back = hf_codegeex_to_full(hf, config)
        assert list(back) == list(full) and all(torch.equal(back[k], full[k]) for k in full)
        again = full_to_hf_codegeex(back, config)
        assert again.keys() == hf.keys() and all(torch.equal(again[k], hf[k]) for k in hf)
        with pytest.raises(ValueError, match="missing"):
            full_to_hf_codegeex({k: t for k, t in full.items() if k != "final_layernorm.bias"}, config)
        assert config_from_hf_codegeex(hf_codegeex_config(config), config.make_vocab_size_divisible_by) == config
    gpt2 = {"top_query_layer": False, "activation": "gelu_tanh"}
    assert is_gpt2_shaped(tiny_config(**gpt2))
    for other in ({"top_query_layer": True}, {"activation": "gelu"}, {"position_embedding_type": "rope"}):
        assert not is_gpt2_shaped(tiny_config(**{**gpt2, **other}))


@torch.no_grad()
def test_logits_equal_ours_with_and_without_left_padding(exported):
    case, model, hf = exported
    v = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, v, (2, 20), generator=g)
    ours = model(ids, torch.arange(20).expand(2, 20), gather_logits=True)[..., :v]  # (b, s, V)
    assert max_err(hf(ids).logits, ours) <= TOL, case
    prompts = [torch.randint(0, v, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    padded, mask = left_padded(prompts)
    theirs = hf(padded, attention_mask=mask).logits  # (b, width, V)
    for i, p in enumerate(prompts):  # each row as it computes alone, unpadded, in our model
        alone = model(torch.tensor([p]), torch.arange(len(p))[None], gather_logits=True)[0, :, :v]
        assert max_err(theirs[i, -len(p):], alone) <= TOL, (case, i)


@torch.no_grad()
def test_greedy_generate_with_its_cache_equals_our_generator(exported):
    from transformers import DynamicCache

    case, model, hf = exported
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    ours = Generator(model, None).generate_ids(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    padded, mask = left_padded(prompts)
    out = hf.generate(padded, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                      return_dict_in_generate=True)
    assert isinstance(out.cache, DynamicCache)  # generate decoded through the model's own KV cache
    assert out.cache.get_seq_length() == padded.shape[1] + NEW_TOKENS - 1
    assert len(out.cache.layers) == model.config.num_layers + model.config.top_query_layer
    assert out.sequences[:, padded.shape[1]:].tolist() == ours, case
    assert len(set(sum(ours, []))) >= 8  # tiny random models loop, but not on one token: the match means something


@torch.no_grad()
def test_loss_and_half_precision(exported):
    """The labels loss is the mean next-token cross entropy of our logits (over the real vocabulary); bf16 and fp16
    loads run and stay near fp32."""
    from transformers import AutoModelForCausalLM

    case, model, hf = exported
    if case != "codegeex":
        pytest.skip("one architecture suffices")
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    logits = model(ids, torch.arange(16).expand(2, 16), gather_logits=True)[:, :-1, :model.config.vocab_size]
    ours = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())  # over the real vocabulary
    assert abs(hf(ids, labels=ids).loss.item() - ours.item()) <= TOL
    reference = hf(ids).logits
    for dtype in (torch.bfloat16, torch.float16):
        half = AutoModelForCausalLM.from_pretrained(hf.name_or_path, trust_remote_code=True, local_files_only=True,
                                                    dtype=dtype).eval()
        logits = half(ids).logits
        assert logits.dtype == dtype
        assert max_err(logits, reference) <= 0.05 * reference.abs().max().item(), dtype
