"""The continued-pretraining recipe end to end on a tiny model (docs/model-families.md has it at a preset's scale):

    a Hugging Face directory (Qwen2ForCausalLM: GQA, QKV biases, untied; its Qwen2.5-Coder-style tokenizer)
    -> tools/convert_checkpoint.py --from-hf at TP 2 x PP 2
    -> data preprocessed with the family's tokenizer (its eos ends each document)
    -> pretrain --finetune at TP 2 x PP 2 on it with FIM in the family's sentinels and document masking
    -> tools/convert_checkpoint.py --to-hf
    -> transformers loads the native class (no remote code) and its logits equal ours.

One spawn of 4 gloo ranks preprocesses nothing and converts nothing: rank 0 does both, the 4 ranks fine-tune.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from codegeex_train.checkpoint.files import load_full_state_dict
from codegeex_train.config.arguments import DataConfig
from codegeex_train.model import CodeGeeXModel
from codegeex_train.tokenization.tokenizer import load_tokenizer
from tests.harness import load_tool, metrics_records, run_distributed, tiny_pretrain_args
from tests.tokenization.family_tokenizers import write_family_tokenizer

ITERS = 3
QWEN2 = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "48",
         "--seq-length", "32", "--max-position-embeddings", "64", "--position-embedding-type", "rope",
         "--rotary-base", "1000000", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu",
         "--disable-bias-linear", "--add-qkv-bias", "--group-query-attention", "--num-query-groups", "2",
         "--untie-embeddings-and-output-weights", "--no-top-query-layer"]


def recipe(topology, root: str) -> None:
    """Rank 0 converts the HF directory (TP 2 x PP 2) and preprocesses the data with its tokenizer; then every rank
    fine-tunes."""
    from codegeex_train import pretrain
    from codegeex_train.preprocessing.default_corpus import default_corpus_files
    from codegeex_train.preprocessing.preprocess import TokenizerSpec, preprocess

    if topology.rank == 0:
        load_tool("convert_checkpoint").main(["--from-hf", f"{root}/hf", "--save", f"{root}/imported",
                                              "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                                              "2"])
        preprocess([str(p) for p in default_corpus_files()[:40]], f"{root}/data/code",
                   TokenizerSpec("HFTokenizer", f"{root}/imported/tokenizer"), append_eod=True, workers=1,
                   progress=False)
    dist.barrier()
    tokenizer = ["--tokenizer-type", "HFTokenizer", "--tokenizer-model", f"{root}/imported/tokenizer"]
    argv = tiny_pretrain_args(f"{root}/data/code_text_document", f"{root}/finetuned", ITERS, *QWEN2, *tokenizer,
                              "--load", f"{root}/imported", "--finetune", "--tensor-model-parallel-size", "2",
                              "--pipeline-model-parallel-size", "2", "--fim-rate", "0.5", "--reset-attention-mask",
                              "--reset-position-ids")
    pretrain.main(argv)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("recipe")
    write_family_tokenizer(root / "hf", "qwen2.5-coder")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=416, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                         tie_word_embeddings=False, rms_norm_eps=1e-6, eos_token_id=400))
    model.save_pretrained(root / "hf")
    run_distributed(recipe, world_size=4, tp_size=2, pp_size=2, deadline_s=600, root=str(root))
    load_tool("convert_checkpoint").main(["--load", str(root / "finetuned"), "--to-hf", str(root / "exported")])
    return root, model


def test_the_recipe_fine_tunes_and_exports_the_native_class_with_our_logits(run):
    from transformers import AutoModelForCausalLM

    root, original = run
    records = metrics_records(root / "finetuned")
    assert sorted(records) == list(range(1, ITERS + 1)) and all(r["loss"] > 0 for r in records.values())
    ours, config, meta = load_full_state_dict(root / "finetuned")
    assert (meta["tp_size"], meta["pp_size"], config.num_query_groups, config.tied_output) == (2, 2, 2, False)
    assert meta["tokenizer"]["fim_rate"] == 0.5  # the run trained FIM, in the family's sentinels
    tokenizer = load_tokenizer(DataConfig(tokenizer_type="HFTokenizer", tokenizer_model=str(root / "imported" /
                                                                                            "tokenizer")))
    assert tokenizer.eod == 400 and tokenizer.vocab_size == config.vocab_size == 409  # nothing appended
    start = original.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    moved = (ours["layers.0.attention.query_key_value.weight"][:32] - start).abs().max().item()
    assert 0 < moved <= ITERS * 2e-3 * 1.5  # trained from HF's weights: Adam moves each by about --lr a step

    exported = root / "exported"
    written = json.loads((exported / "config.json").read_text())
    assert written["architectures"] == ["Qwen2ForCausalLM"] and "auto_map" not in written
    hf = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    model = CodeGeeXModel(config, None, None).eval()
    model.load_state_dict(ours)
    ids = torch.tensor([tokenizer.encode("def add(a, b):\n    return a + b\n")])
    with torch.no_grad():
        theirs = hf(ids).logits
        mine = model(ids, torch.arange(ids.shape[1])[None], gather_logits=True)[..., :config.vocab_size]
    assert (theirs - mine).abs().max().item() <= 1e-5
