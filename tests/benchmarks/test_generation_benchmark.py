"""benchmarks/generation.py's evaluation workload end to end on a tiny GPT-2-shaped checkpoint (random weights,
given with --load, so the default model is never trained here): the checkpoint is exported by our converter and
run by HF generate; every row of the table is printed, the figures add up, and greedy decoding gives HF's tokens.
The useful-token count both sides are measured by is checked against a plain linear scan of the decoded text.
Timings are never asserted."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from codegeex_train.checkpoint.files import save_model_checkpoint
from codegeex_train.tokenization.tokenizer import default_tokenizer
from codegeex_train.generation import HUMANEVAL_STOP, Generator
from codegeex_train.model import CodeGeeXModel, ModelConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "generation.py"
P, N, NEW = 2, 3, 6


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("generation_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tiny_model() -> CodeGeeXModel:
    """GPT-2 shaped (exports as GPT2LMHeadModel), the shipped tokenizer's vocabulary, room for HumanEval prompts;
    weights large enough that the logits' top two are far apart (greedy is then exactly comparable)."""
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=1024,
                         vocab_size=default_tokenizer().vocab_size, hidden_dropout=0.0, attention_dropout=0.0,
                         activation="gelu_tanh", top_query_layer=False, init_method_std=0.2)
    torch.manual_seed(0)
    return CodeGeeXModel(config, None, None).eval()


def test_evaluation_workload_prints_every_row_and_greedy_matches_hf(bench, tmp_path, capsys):
    model = tiny_model()
    save_model_checkpoint(tmp_path / "ckpt", [model.state_dict()], model.config, 1)
    threads = torch.get_num_threads()
    try:
        figures = bench.main(["--load", str(tmp_path / "ckpt"), "--prompts", str(P), "--samples", str(N),
                              "--new-tokens", str(NEW), "--reps", "2", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    for who in ("ours", "HF"):
        row = [line for line in lines if line[:1] == [who] and line[1].isdigit()]  # the table's row
        assert len(row) == 1 and len(row[0]) == 5 + 2, out  # name, 4 figures, 2 runs
        f = figures[who]
        assert int(row[0][1]) == f["useful_tokens"] == sum(f["lengths"]) and len(f["lengths"]) == P * N
        assert all(1 <= k <= NEW for k in f["lengths"])
        assert f["tokens_per_s"] == pytest.approx(f["useful_tokens"] / f["median_s"])
        assert f["s_per_sample"] == pytest.approx(f["median_s"] / (P * N)) and len(f["runs_s"]) == 2
        assert sum(line[:3] == ["useful", "lengths", f"{who}:"] for line in lines) == 1, out
    assert figures["hf_mode"] in ("per-prompt", "batched") and set(figures["hf_trial_s"]) == {"per-prompt", "batched"}
    assert f"HF baseline: {figures['hf_mode']}" in out and "ours / HF useful tokens/s:" in out
    assert "HumanEval prompts (HumanEval/0 .. HumanEval/82" in out  # spread over the file
    assert "greedy tokens equal: True" in out and figures["greedy_equal"] is True


def test_useful_tokens_end_at_the_first_stop_string_or_end_of_text(bench):
    tokenizer = default_tokenizer()
    gen = Generator(tiny_model(), tokenizer)
    prompt = tokenizer.encode('def f(x):\n    """Twice x."""\n')
    body = tokenizer.encode("    return 2 * x\n\n\ndef g():\n    pass\n# done\n")

    def scan(ids):  # the reference: the first prefix whose plain decoding holds a stop string
        return next((k for k in range(1, len(ids) + 1) if any(s in tokenizer.decode(ids[:k]) for s in HUMANEVAL_STOP)),
                    None)

    first = scan(body)
    assert first is not None and "\ndef" in tokenizer.decode(body[:first]) and first < len(body)
    assert bench.useful(gen, prompt, body, HUMANEVAL_STOP) == (first, "stop")
    assert bench.useful(gen, prompt, body[:first - 1] + [tokenizer.eod] + body, HUMANEVAL_STOP) == (first - 1, "eod")
    assert bench.useful(gen, prompt, body[:first - 1], HUMANEVAL_STOP) == (first - 1, "max")
    padded = body + [tokenizer.eod] * 5  # HF pads finished rows with the end-of-text id
    assert bench.useful(gen, prompt, padded, HUMANEVAL_STOP) == (first, "stop")
