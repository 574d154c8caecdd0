"""The native Hugging Face families (formats/huggingface/llama.py, qwen2.py, starcoder2.py, native.py) through
tools/convert_checkpoint.py, against transformers' own classes as the reference.

For each family a small randomly initialised model of transformers' class in fp32 (Llama with linear and with
Llama-3 RoPE scaling, tied; Qwen2 with QKV biases, 2 key-value groups, untied; StarCoder2 with biases, LayerNorm and a
window shorter than the sequence; and a Mistral, GQA and a window, untied), saved with save_pretrained:

- imported (--from-hf) at (TP, PP) = (1, 1), (2, 1), (2, 2), (4, 1), each layout's files run as written (TP ranks
  over gloo, the PP stages chained): logits within 1e-5 of HF's on the same ids, a whole batch and left-padded
  prompts (HF with its attention mask, ours each prompt alone). TP 4 with 2 key-value groups is refused in one line
  naming the largest TP; a Qwen2 with 4 groups runs at TP 4;
- exported back (--to-hf) from TP 2 x PP 2: the same class (no remote code), every tensor equal bit for bit, the
  same logits from AutoModelForCausalLM;
- greedy decoding of our generator (KV cache of groups, the window) equals HF ``generate`` over 64 tokens.

Each conversion runs once (``Family.ckpt``); the TP 2 and TP 4 ranks are spawned once each for all cases.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from codegeex_train.checkpoint.files import load_model_checkpoint, read_checkpoint_meta
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.stages import stage_layer_ranges
from codegeex_train.model import CodeGeeXModel
from codegeex_train.model.groups import ModelGroups
from tests.harness import load_tool, run_distributed

TOL = 1e-5
SEQ, NEW_TOKENS = 20, 64
PROMPT_LENGTHS = (5, 13, 9)
SHAPE = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=96, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
CASES = {  # name: (transformers class names, its config fields)
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(  # wavelengths on both sides of 16 / 4 and between
        tie_word_embeddings=True, rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                                   "rope_theta": 500000.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=False,
                                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(num_key_value_heads=2, use_bias=True,
                                                                      sliding_window=6, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=7, head_dim=8,
                                                            tie_word_embeddings=False)),
    # a family shape whose groups TP 4 divides: 8 heads in 4 groups
    "qwen2_4_groups": ("Qwen2Config", "Qwen2ForCausalLM", dict(hidden_size=64, num_attention_heads=8,
                                                               num_key_value_heads=4, tie_word_embeddings=False)),
}
TWO_GROUPS = ("qwen2", "starcoder2", "mistral")  # refused at TP 4


def hf_model(case: str):
    import transformers

    config_class, model_class, fields = CASES[case]
    config = getattr(transformers, config_class)(**{**SHAPE, **fields})
    torch.manual_seed(sorted(CASES).index(case))
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # HF starts biases at 0 and norms at 1: perturb everything so that each mapping matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.15)
    return model


def batches(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"ids": torch.randint(0, vocab, (2, SEQ), generator=g),
            "prompts": [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]}


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids, mask = torch.zeros(len(prompts), width, dtype=torch.long), torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    return ids, mask


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Family(dict):
    """One case: the HF model, its directory, HF's logits on the batches, and ``ckpt(tp, pp)``: its import at that
    layout (converted once, when first asked for)."""

    def ckpt(self, tp: int, pp: int) -> str:
        out = self["root"] / f"tp{tp}_pp{pp}"
        if not out.exists():
            load_tool("convert_checkpoint").main(["--from-hf", str(self["root"] / "hf"), "--save", str(out),
                                                  "--tensor-model-parallel-size", str(tp),
                                                  "--pipeline-model-parallel-size", str(pp)])
        return str(out)


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Family]:
    out = {}
    for case in CASES:
        root = tmp_path_factory.mktemp(case)
        model = hf_model(case)
        model.save_pretrained(root / "hf")
        data = batches(model.config.vocab_size)
        with torch.no_grad():
            padded, mask = left_padded(data["prompts"])
            data["hf_logits"] = model(data["ids"]).logits
            data["hf_padded_logits"] = model(padded, attention_mask=mask).logits
        out[case] = Family(model=model, root=root, **data)
    return out


@torch.no_grad()
def logits_at_layout(ckpt: str, pp: int, ids: torch.Tensor, groups: ModelGroups | None = None) -> torch.Tensor:
    """The whole model's gathered logits (b, s, padded V) from ``ckpt``'s files at its TP (``groups``) x PP: each
    stage built and loaded as that PP rank would, the stages chained in this process."""
    config = ModelConfig(**read_checkpoint_meta(ckpt)[1]["model_config"])
    stage_layers = stage_layer_ranges(config.num_layers, pp)
    x, positions = ids, torch.arange(ids.shape[1]).expand_as(ids)
    for rank, layers in enumerate(stage_layers):
        stage = CodeGeeXModel(config, groups, pre_process=rank == 0, post_process=rank == pp - 1,
                              layer_numbers=layers).eval()
        load_model_checkpoint(ckpt, stage, pp_size=pp, pp_rank=rank)  # strict: exactly this stage's tensors
        x = stage(x, positions, gather_logits=True) if rank == pp - 1 else stage(x, positions)
    return x


def run_layouts(topology, runs: list) -> dict:
    """On each TP rank: for each (case, ckpt, pp, ids, prompts), the batch's logits and each prompt's alone."""
    groups = None if topology is None else ModelGroups.from_topology(topology)
    out = {}
    for case, ckpt, pp, ids, prompts in runs:
        out[(case, pp)] = {"batch": logits_at_layout(ckpt, pp, ids, groups).numpy(),
                           "prompts": [logits_at_layout(ckpt, pp, torch.tensor([p]), groups)[0].numpy()
                                       for p in prompts]}
    return out


def layout_results(families: dict, tp: int, pps: tuple[int, ...]) -> dict:
    runs = [(case, f.ckpt(tp, pp), pp, f["ids"], f["prompts"]) for case, f in families.items() for pp in pps
            if not (tp == 4 and case in TWO_GROUPS)]
    results = run_distributed(run_layouts, world_size=tp, tp_size=tp, deadline_s=600, runs=runs)
    for other in results[1:]:  # every TP rank gathered the same logits
        for key, r in other.items():
            assert (r["batch"] == results[0][key]["batch"]).all(), key
    return results[0]


@pytest.fixture(scope="module")
def at_tp2(families):
    return layout_results(families, 2, (1, 2))


@pytest.fixture(scope="module")
def at_tp4(families):
    return layout_results(families, 4, (1,))


def check_logits(f: dict, result: dict, where: str) -> None:
    v = f["model"].config.vocab_size
    batch, prompts = torch.as_tensor(result["batch"]), [torch.as_tensor(p) for p in result["prompts"]]
    assert batch.shape[-1] == 128 and (batch[..., v:] == 0).all()  # the padding rows: zeros on import
    assert max_err(batch[..., :v], f["hf_logits"]) <= TOL, where
    for i, (alone, prompt) in enumerate(zip(prompts, f["prompts"])):  # HF left-padded with its mask, ours alone
        assert max_err(f["hf_padded_logits"][i, -len(prompt):], alone[:, :v]) <= TOL, (where, i)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_at_tp1_pp1_equal_hf(families, case):
    f = families[case]
    results = run_layouts(None, [(case, f.ckpt(1, 1), 1, f["ids"], f["prompts"])])
    check_logits(f, results[(case, 1)], f"{case} TP 1 PP 1")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_logits_at_tp2_pp1_and_pp2_equal_hf(families, at_tp2, case):
    for pp in (1, 2):
        check_logits(families[case], at_tp2[(case, pp)], f"{case} TP 2 PP {pp}")


@pytest.mark.slow
def test_tp4_runs_where_it_divides_the_groups_and_is_refused_in_one_line_where_not(families, at_tp4):
    for case, f in families.items():
        if case in TWO_GROUPS:
            with pytest.raises(SystemExit) as refused:
                f.ckpt(4, 1)
            message = refused.value.code
            assert isinstance(message, str) and "\n" not in message, message
            assert "2" in message and "largest" in message.lower(), message
            assert not (f["root"] / "tp4_pp1").exists()
        else:
            check_logits(f, at_tp4[(case, 1)], f"{case} TP 4")


@pytest.mark.parametrize("case", list(CASES))
def test_export_from_tp2_pp2_gives_the_original_tensors_and_loads_as_the_native_class(families, case, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    f = families[case]
    load_tool("convert_checkpoint").main(["--load", f.ckpt(2, 2), "--to-hf", str(tmp_path / "hf")])
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    original = json.loads((f["root"] / "hf" / "config.json").read_text())
    assert written["architectures"] == [CASES[case][1]] and "auto_map" not in written
    assert not list((tmp_path / "hf").glob("*.py"))  # no remote code
    for key in ("model_type", "rope_parameters", "tie_word_embeddings", "num_key_value_heads", "sliding_window",
                "head_dim",
                "rms_norm_eps", "norm_epsilon", "use_bias", "attention_bias", "layer_types", "vocab_size"):
        assert written.get(key) == original.get(key), key
    theirs, ours = load_file(f["root"] / "hf" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, dtype=torch.float32).eval()
    assert type(model).__name__ == CASES[case][1]
    with torch.no_grad():
        assert torch.equal(model(f["ids"]).logits, f["hf_logits"])


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_greedy_generation_with_a_cache_of_groups_equals_hf_generate(families, case):
    from codegeex_train.generation import Generator, SamplingParams

    f = families[case]
    generator = Generator.from_checkpoint(f.ckpt(1, 1), None)
    config = generator.model.config
    cache = generator.model.new_kv_cache(1, 8)
    assert [tuple(k.shape) for k in cache.keys] == [(1, config.kv_groups, 8, config.head_dim)] * config.num_layers
    ours = generator.generate_ids(f["prompts"], SamplingParams(max_new_tokens=NEW_TOKENS))
    padded, mask = left_padded(f["prompts"])
    theirs = f["model"].generate(padded, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0)
    assert theirs[:, padded.shape[1]:].tolist() == ours, case
    assert len(set(sum(ours, []))) >= 8  # tiny random models loop, but not on one token: the match means something
