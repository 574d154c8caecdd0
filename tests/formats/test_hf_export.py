"""tools/convert_checkpoint.py --to-hf / --from-hf end to end on trained runs: a CodeGeeX model (top query layer,
fast_gelu: remote code) and a GPT-2-shaped one (plain GPT2LMHeadModel). transformers loads each export and gives
our logits, our greedy text (its own KV cache against tools/generate.py) and our tokenizer's ids; --from-hf of the
export, fine-tuned at TP 2, logs the losses the original checkpoint logs fine-tuned at TP 1. Sharded exports load
the same; an interrupted export leaves nothing under its name.

Everything that trains runs in one spawn of 2 gloo ranks (pretraining, the conversions on rank 0, fine-tuning)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from codegeex_train import pretrain
from codegeex_train.checkpoint.files import load_full_state_dict, read_checkpoint_meta
from codegeex_train.tokenization.tokenizer import default_tokenizer
from codegeex_train.generation import Generator, SamplingParams
from tests.harness import load_tool, metrics_records, run_distributed, tiny_pretrain_args

ITERS, FINETUNE_ITERS, NEW_TOKENS = 3, 2, 64
ARCHS = {"codegeex": ["--activation", "fast_gelu"],  # the default architecture: top query layer
         "gpt2": ["--no-top-query-layer", "--activation", "gelu_tanh"]}
# Room for a prompt and 64 new tokens; weights large enough that every part moves the logits well past the
# tolerance (at the default std, the top query row of another position moved them by 5e-7; at 0.2 by 0.27).
ROOM = ["--max-position-embeddings", "128", "--init-method-std", "0.2"]
PROMPT = "import os\n\n\ndef read_config(path):\n    "
TEXTS = [PROMPT, "class A:\n        def f(self):\n\t\treturn  1   +    2\r\n",
         "naïve — 数据 <|endoftext|>\n" + " " * 40]


def train_convert_finetune(topology, root: str, data: str) -> None:
    """On every rank: pretrain each architecture (TP 1, DP 2); rank 0 exports each (--to-hf) and converts the export
    back at TP 2 (--from-hf); then fine-tune the original at TP 1 and the round trip at TP 2."""
    for arch, flags in ARCHS.items():
        pretrain.main(tiny_pretrain_args(data, f"{root}/{arch}", ITERS, *flags, *ROOM))
    if topology.rank == 0:
        convert = load_tool("convert_checkpoint")
        for arch in ARCHS:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                convert.main(["--load", f"{root}/{arch}", "--to-hf", f"{root}/{arch}_hf"])
            Path(f"{root}/{arch}_export.log").write_text(err.getvalue())  # the progress bar
            convert.main(["--from-hf", f"{root}/{arch}_hf", "--save", f"{root}/{arch}_back",
                          "--tensor-model-parallel-size", "2"])
    dist.barrier()
    for arch, flags in ARCHS.items():
        for source, tp in ((arch, 1), (f"{arch}_back", 2)):
            pretrain.main(tiny_pretrain_args(data, f"{root}/{arch}_finetuned_tp{tp}", FINETUNE_ITERS, *flags, *ROOM,
                                             "--load", f"{root}/{source}", "--finetune",
                                             "--tensor-model-parallel-size", str(tp)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("hf_export")
    run_distributed(train_convert_finetune, world_size=2, deadline_s=600, root=str(root), data=tiny_data)
    return root


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, local_files_only=True,
                                                dtype=torch.float32).eval()


def our_greedy_text(ckpt, prompt: str) -> str:
    """tools/generate.py's greedy completion (in this process: one rank)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        load_tool("generate").main(["--load", str(ckpt), "--prompt", prompt.replace("\n", "\\n"),
                                    "--max-new-tokens", str(NEW_TOKENS)])
    return out.getvalue()[len(prompt):-1]  # print() adds the last newline


@pytest.mark.parametrize("arch", list(ARCHS))
def test_transformers_computes_what_we_compute(runs, arch):
    from transformers import AutoTokenizer

    export = runs / f"{arch}_hf"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == (["GPT2LMHeadModel"] if arch == "gpt2" else ["CodeGeeXForCausalLM"])
    assert ("auto_map" in config) == (arch == "codegeex")
    assert sorted(p.name for p in export.glob("*.py")) == ([] if arch == "gpt2" else
                                                          ["configuration_codegeex.py", "modeling_codegeex.py"])
    assert "100%" in (runs / f"{arch}_export.log").read_text()  # the progress bar, on stderr
    ours = default_tokenizer()
    generation = json.loads((export / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["bos_token_id"], generation["do_sample"]) == (ours.eod,) * 2 + (
        False,)

    # transformers 5 reads config.json first: auto_map asks for remote code (a plain tokenizer all the same)
    tokenizer = AutoTokenizer.from_pretrained(export, **({"trust_remote_code": True} if arch == "codegeex" else {}))
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == ours.encode(text) and tokenizer.decode(ids) == ours.decode(ids) == text

    model = hf_model(export)
    assert type(model).__name__ == ("GPT2LMHeadModel" if arch == "gpt2" else "CodeGeeXForCausalLM")
    generator = Generator.from_checkpoint(runs / arch, ours)
    ids = torch.tensor([ours.encode(TEXTS[0] + TEXTS[1])])
    with torch.no_grad():
        theirs = model(ids).logits  # (1, s, V)
        mine = generator.model(ids, torch.arange(ids.shape[1])[None])[..., : ours.vocab_size]
    gap = (theirs - mine).abs().max().item()
    assert gap <= 1e-5, gap

    prompt_ids = torch.tensor([ours.encode(PROMPT)])
    with torch.no_grad():
        new = model.generate(prompt_ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt_ids.shape[1]:].tolist()
    assert len(new) == NEW_TOKENS and ours.eod not in new
    assert new == generator.generate_ids(prompt_ids.tolist(), SamplingParams(max_new_tokens=NEW_TOKENS))[0]
    assert tokenizer.decode(new) == our_greedy_text(runs / arch, PROMPT)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_from_hf_of_the_export_finetunes_at_tp2_as_the_original_at_tp1(runs, arch):
    original, _, _ = load_full_state_dict(runs / arch)
    back, config, meta = load_full_state_dict(runs / f"{arch}_back")
    assert meta["tp_size"] == 2 and list(back) == list(original)
    assert all(torch.equal(back[k], original[k]) for k in original)  # padding rows included: zero both sides
    recorded = meta["tokenizer"]  # the export's tokenizer.json, copied beside the checkpoint
    assert recorded["tokenizer_type"] == "HFTokenizer" and recorded["tokenizer_model"].startswith(str(runs))
    tp1, tp2 = (metrics_records(runs / f"{arch}_finetuned_tp{tp}") for tp in (1, 2))
    assert sorted(tp1) == sorted(tp2) == list(range(1, FINETUNE_ITERS + 1))
    for it in tp1:
        assert abs(tp2[it]["loss"] - tp1[it]["loss"]) <= 1e-5, (it, tp1[it]["loss"], tp2[it]["loss"])
    assert read_checkpoint_meta(runs / f"{arch}_finetuned_tp2")[1]["tp_size"] == 2


def test_sharded_export_loads_identically_and_an_interrupted_one_leaves_nothing(runs, tmp_path, monkeypatch):
    from codegeex_train.checkpoint import convert as layouts
    from codegeex_train.formats.huggingface import files as hf_files

    convert = load_tool("convert_checkpoint")
    monkeypatch.setattr(layouts, "REMAP_BYTES", 100_000)  # the rank files mapped again every few tensors
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        convert.main(["--load", str(runs / "codegeex"), "--to-hf", str(tmp_path / "sharded"), "--max-shard-size",
                      "40KB"])
    assert "peak memory" in out.getvalue() and "safetensors files" in out.getvalue()
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(shards) >= 3 and sorted(set(index["weight_map"].values())) == shards
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    whole, sharded = hf_model(runs / "codegeex_hf").state_dict(), hf_model(tmp_path / "sharded").state_dict()
    assert sorted(whole) == sorted(sharded) and all(torch.equal(whole[k], sharded[k]) for k in whole)
    convert.main(["--from-hf", str(tmp_path / "sharded"), "--save", str(tmp_path / "back")])
    original, _, _ = load_full_state_dict(runs / "codegeex")
    back, _, _ = load_full_state_dict(tmp_path / "back")
    assert all(torch.equal(back[k], original[k]) for k in original)

    real_write, calls = hf_files.write_safetensors, []

    def save_then_crash(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt  # the second shard: after a first one was written
        return real_write(*args, **kwargs)

    monkeypatch.setattr(hf_files, "write_safetensors", save_then_crash)
    with pytest.raises(KeyboardInterrupt), contextlib.redirect_stderr(io.StringIO()):
        convert.main(["--load", str(runs / "codegeex"), "--to-hf", str(tmp_path / "crashed"), "--max-shard-size",
                      "40KB"])
    assert len(calls) == 2 and not (tmp_path / "crashed").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "sharded"]  # no partial directory left either
