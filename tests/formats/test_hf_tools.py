"""A family model with its own tokenizer through the tools: a small Qwen2ForCausalLM (GQA, QKV biases, untied) whose
directory holds a Qwen2.5-Coder-style tokenizer (tokenizer.json + tokenizer_config.json; 409 ids, the model 416
rows, as Qwen2.5-Coder has fewer ids than rows):

- --from-hf records the tokenizer (its files copied beside the checkpoint) and, its FIM sentinels being there,
  PSM infilling; --to-hf copies the files back as they were, and the config and generation config name its eos;
- tools/generate.py --load HF_DIR converts on the fly (one line says so; nothing left behind) and completes a
  prompt as HF's greedy ``generate`` does, and infills with the family's sentinels;
- tools/evaluate_humaneval.py --load HF_DIR scores the starting model's completions (our generator's on the
  converted checkpoint).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from codegeex_train.checkpoint.files import read_checkpoint_meta
from codegeex_train.config.arguments import DataConfig
from codegeex_train.tokenization.tokenizer import load_tokenizer
from tests.harness import load_tool
from tests.tokenization.family_tokenizers import write_family_tokenizer

PROMPT = "def add(a, b):\n    "
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("qwen_tools")
    write_family_tokenizer(root / "hf", "qwen2.5-coder")
    tokenizer = load_tokenizer(DataConfig(tokenizer_type="HFTokenizer", tokenizer_model=str(root / "hf"),
                                          whitespace_encoding=False))
    torch.manual_seed(4)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=416, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         tie_word_embeddings=False, eos_token_id=tokenizer.eod, bos_token_id=None,
                                         initializer_range=0.1)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(root / "hf")
    load_tool("convert_checkpoint").main(["--from-hf", str(root / "hf"), "--save", str(root / "ckpt"),
                                          "--tensor-model-parallel-size", "2"])
    return {"root": root, "model": model, "tokenizer": tokenizer}


def run(tool: str, argv: list[str]) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        load_tool(tool).main(argv)
    return out.getvalue(), err.getvalue()


def test_import_records_the_tokenizer_and_export_copies_it_back(qwen, tmp_path):
    from transformers import AutoTokenizer

    root, tokenizer = qwen["root"], qwen["tokenizer"]
    recorded = read_checkpoint_meta(root / "ckpt")[1]["tokenizer"]
    assert recorded["tokenizer_model"] == str((root / "ckpt" / "tokenizer").resolve())
    assert recorded["fim_rate"] > 0 and recorded["fim_spm_rate"] == 0  # the family's FIM sentinels: PSM
    out, _ = run("convert_checkpoint", ["--load", str(root / "ckpt"), "--to-hf", str(tmp_path / "hf")])
    assert "Qwen2ForCausalLM" in out and "copied" in out
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (root / "hf" / name).read_bytes(), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == tokenizer.eod and config["vocab_size"] == 416
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = PROMPT + "return a + b  # <|fim_prefix|>\n"
    assert theirs.encode(text, add_special_tokens=False)[:8] == tokenizer.encode(text)[:8]


def test_generate_loads_an_hf_directory_directly(qwen):
    root, model, tokenizer = qwen["root"], qwen["model"], qwen["tokenizer"]
    out, err = run("generate", ["--load", str(root / "hf"), "--prompt", PROMPT.replace("\n", "\\n"),
                                "--max-new-tokens", str(NEW_TOKENS)])
    note = re.search(r"converted on the fly to a TP 1 checkpoint in (\S+) ", err)
    assert note and not Path(note.group(1)).exists(), err  # said once, removed at exit
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
    if tokenizer.eod in new:
        new = new[:new.index(tokenizer.eod)]
    assert len(new) >= 8 and out == PROMPT + tokenizer.decode(new) + "\n"
    # infilling: a converted family model records its FIM training (PSM in its own sentinels)
    out, err = run("generate", ["--load", str(root / "hf"), "--prefix", "x = ", "--suffix", "\\n",
                                "--max-new-tokens", "6"])
    assert out.startswith("x = ") and out.endswith("\n\n"), (out, err)


@pytest.mark.slow
def test_evaluate_humaneval_scores_an_hf_directory_directly(qwen, tmp_path):
    from codegeex_train.evaluation import default_params, read_problems, write_jsonl
    from codegeex_train.generation import Generator

    root, tokenizer = qwen["root"], qwen["tokenizer"]
    problems = [{"task_id": f"Tiny/{i}", "prompt": f"def f{i}(a, b):\n", "entry_point": f"f{i}",
                 "test": "def check(c):\n    assert c(1, 2) == 3\n", "canonical_solution": "    return a + b\n"}
                for i in range(2)]
    write_jsonl(tmp_path / "problems.jsonl", problems)
    out, err = run("evaluate_humaneval", ["--load", str(root / "hf"), "--problems", str(tmp_path / "problems.jsonl"),
                                          "--max-new-tokens", "8", "--device", "cpu", "--workers", "1",
                                          "--output", str(tmp_path / "results.jsonl")])
    assert "converted on the fly" in err and "pass@1:" in out
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    tp1 = tmp_path / "tp1"
    load_tool("convert_checkpoint").main(["--load", str(root / "ckpt"), "--save", str(tp1)])
    expected = Generator.from_checkpoint(tp1, tokenizer).generate(
        [p["prompt"] for p in read_problems(tmp_path / "problems.jsonl").values()],
        default_params(1, max_new_tokens=8))
    assert [r["completion"] for r in results] == expected
