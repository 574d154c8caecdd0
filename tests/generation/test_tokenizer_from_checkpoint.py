"""Checkpoints record their tokenizer: a tiny model trained with a non-default tokenizer (a byte-level BPE of the
default's size, 8192 ids, trained here without whitespace tokens, passed as ``--tokenizer-type HFTokenizer
--tokenizer-model tok.json``, a relative path) generates with ``tools/generate.py`` / ``tools/evaluate_humaneval.py``
without the tokenizer flags exactly as with them, and not as with the default tokenizer; explicit flags still win; a
recorded file that is gone is one ``error:`` line.

Why not the shipped tokenizer.json without whitespace encoding: it decodes every id as the default does, and a model
trained for a few steps is so near uniform that, at a fixed seed, it emits the same ids after either tokenizer's
prompt; the completions were the same text. Another vocabulary decodes any id differently."""

from __future__ import annotations

import json
import os

import pytest

from codegeex_train import pretrain
from codegeex_train.checkpoint.files import read_checkpoint_meta
from codegeex_train.checkpoint.universal import read_universal_meta
from codegeex_train.preprocessing.default_corpus import default_corpus_files
from codegeex_train.preprocessing.preprocess import TokenizerSpec, preprocess
from codegeex_train.tokenization.tokenizer import DEFAULT_TOKENIZER_PATH, build_tokenizer, default_tokenizer
from codegeex_train.tokenization.record import fingerprint_record
from codegeex_train.evaluation import write_jsonl
from tests.harness import load_tool, run_distributed, tiny_pretrain_args

PROMPT = "def add(a, b):\n    if a:\n        return a + b\n    return b\n\n\ndef f(x):\n        "
SAMPLED = ["--max-new-tokens", "16", "--temperature", "1.0", "--seed", "5"]


def train_in(topology, workdir: str, argv: list[str]) -> None:
    os.chdir(workdir)  # the relative --tokenizer-model is relative to this directory
    pretrain.main(argv)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tokenizer_ckpt")
    work = root / "work"
    work.mkdir()
    tokenizer_file = work / "tok.json"
    files = default_corpus_files()[:30]
    trained_bpe = load_tool("train_tokenizer").train_bpe_tokenizer([str(f) for f in files], 8192, str(tokenizer_file),
                                                                   whitespace_tokens_max_run=None, show_progress=False)
    assert trained_bpe.vocab_size == default_tokenizer().vocab_size  # the same model shapes
    summary = preprocess(files, str(root / "corpus"),
                         TokenizerSpec("HFTokenizer", str(tokenizer_file), whitespace_encoding=False),
                         append_eod=True, workers=1, progress=False)
    ckpt = root / "ckpt"
    run_distributed(train_in, world_size=1, deadline_s=600, workdir=str(work),
                    argv=tiny_pretrain_args(summary.output_prefixes[0], str(ckpt), 3, "--tokenizer-type",
                                            "HFTokenizer", "--tokenizer-model", "tok.json"))
    load_tool("convert_checkpoint").main(["--load", str(ckpt), "--to-universal", str(root / "universal")])
    flags = ["--tokenizer-type", "HFTokenizer", "--tokenizer-model", str(tokenizer_file)]
    default = ["--tokenizer-type", "HFTokenizer", "--tokenizer-model", DEFAULT_TOKENIZER_PATH, "--whitespace-encoding"]
    return {"root": root, "ckpt": ckpt, "tokenizer_file": tokenizer_file, "flags": flags, "default_flags": default}


def generate(trained, capsys, *args) -> tuple[str, str]:
    """(completion, stderr) of tools/generate.py --load CKPT --prompt PROMPT, sampled with a fixed seed (a barely
    trained model's greedy completion is the same run of spaces whatever the prompt's ids), in this process."""
    out = trained["root"] / "out.jsonl"
    load_tool("generate").main(["--load", str(trained["ckpt"]), "--prompt", PROMPT.replace("\n", "\\n"), *SAMPLED,
                                "--output", str(out), *args])
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    return record["completion"], capsys.readouterr().err


def tokenizer_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("tokenizer: ")]


def test_checkpoints_record_the_tokenizer_with_absolute_paths(trained):
    expected = {"tokenizer_type": "HFTokenizer", "tokenizer_model": str(trained["tokenizer_file"]),
                "vocab_file": None, "merge_file": None, "whitespace_encoding": False,
                **fingerprint_record(build_tokenizer("HFTokenizer", str(trained["tokenizer_file"])))}
    assert read_checkpoint_meta(trained["ckpt"])[1]["tokenizer"] == expected
    universal = trained["root"] / "universal"
    assert read_universal_meta(universal, (universal / "latest").read_text())["tokenizer"] == expected
    resharded = trained["root"] / "resharded"  # a re-split for another TP size keeps it too
    load_tool("convert_checkpoint").main(["--load", str(trained["ckpt"]), "--save", str(resharded),
                                          "--tensor-model-parallel-size", "2"])
    assert read_checkpoint_meta(resharded)[1]["tokenizer"] == expected


def test_generate_uses_the_recorded_tokenizer(trained, capsys):
    ours = build_tokenizer("HFTokenizer", str(trained["tokenizer_file"]))
    assert ours.encode(PROMPT) != default_tokenizer().encode(PROMPT)  # the two tokenizers differ on the prompt

    recorded, recorded_err = generate(trained, capsys)
    explicit, explicit_err = generate(trained, capsys, *trained["flags"])
    default, default_err = generate(trained, capsys, *trained["default_flags"])
    assert recorded == explicit
    assert default != explicit  # so the equality above can fail: the default tokenizer gives another completion
    assert tokenizer_lines(recorded_err) == [f"tokenizer: HFTokenizer {trained['tokenizer_file']} (recorded in "
                                             f"checkpoint {trained['ckpt']})"]
    assert tokenizer_lines(explicit_err) == [f"tokenizer: HFTokenizer {trained['tokenizer_file']} (from the command "
                                             f"line)"]
    assert tokenizer_lines(default_err) == [f"tokenizer: HFTokenizer {DEFAULT_TOKENIZER_PATH}, whitespace encoding "
                                            f"(from the command line)"]


def test_a_recorded_tokenizer_file_that_is_gone_is_one_error_line(trained, capsys):
    moved = trained["tokenizer_file"].with_name("moved.json")
    trained["tokenizer_file"].rename(moved)
    try:
        with pytest.raises(SystemExit) as e:
            generate(trained, capsys)
        assert e.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("generate.py: error: "), lines
        assert (f"records the tokenizer file {trained['tokenizer_file']} (--tokenizer-model), which no longer exists: "
                f"pass --tokenizer-type HFTokenizer --tokenizer-model TOKENIZER_MODEL with TOKENIZER_MODEL a copy of "
                f"it") in lines[0]
        # The flags it names work.
        _, err = generate(trained, capsys, "--tokenizer-type", "HFTokenizer", "--tokenizer-model", str(moved))
        assert tokenizer_lines(err) == [f"tokenizer: HFTokenizer {moved} (from the command line)"]
        with pytest.raises(SystemExit) as e:  # evaluate_humaneval.py says the same
            evaluate(trained, trained["root"] / "eval_gone")
        assert e.value.code == 2
        message = capsys.readouterr().err.strip().splitlines()[-1]
        assert message.startswith("evaluate_humaneval.py: error: ") and "no longer exists" in message
    finally:
        moved.rename(trained["tokenizer_file"])


def evaluate(trained, out_dir, *args) -> list[dict]:
    """tools/evaluate_humaneval.py --load CKPT on one problem whose prompt is PROMPT, sampled as ``generate``; its
    results."""
    out_dir.mkdir()
    write_jsonl(out_dir / "problems.jsonl", [{"task_id": "Tiny/0", "prompt": PROMPT, "entry_point": "f",
                                              "test": "def check(c):\n    assert c(1) == 1\n",
                                              "canonical_solution": "return x\n"}])
    load_tool("evaluate_humaneval").main(["--load", str(trained["ckpt"]), "--problems", str(out_dir / "problems.jsonl"),
                                          "--max-new-tokens", "16", "--temperature", "1.0", "--seed", "5",
                                          "--device", "cpu", "--workers", "1", "--timeout",
                                          "20", "--output", str(out_dir / "results.jsonl"), *args])
    return [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]


def test_evaluate_humaneval_uses_the_recorded_tokenizer(trained, capsys):
    recorded = evaluate(trained, trained["root"] / "eval_recorded")
    recorded_err = capsys.readouterr().err
    default = evaluate(trained, trained["root"] / "eval_default", *trained["default_flags"])
    explicit = evaluate(trained, trained["root"] / "eval_explicit", *trained["flags"])
    assert [r["completion"] for r in recorded] == [r["completion"] for r in explicit]
    assert [r["completion"] for r in default] != [r["completion"] for r in explicit]
    assert tokenizer_lines(recorded_err) == [
        f"tokenizer: HFTokenizer {trained['tokenizer_file']} (recorded in checkpoint {trained['ckpt']})"]


def test_a_checkpoint_without_a_recorded_tokenizer_uses_the_flags_or_the_default(tmp_path, capsys):
    from codegeex_train.checkpoint import save_model_checkpoint, split_state_dict
    from codegeex_train.model import CodeGeeXModel, ModelConfig

    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=default_tokenizer().vocab_size,
                         max_position_embeddings=64)
    state = CodeGeeXModel(config, None, None).state_dict()
    save_model_checkpoint(tmp_path / "ckpt", split_state_dict(state, config, 1), config, 1)  # records no tokenizer
    load_tool("generate").main(["--load", str(tmp_path / "ckpt"), "--prompt", "x", "--max-new-tokens", "2",
                                "--output", str(tmp_path / "out.jsonl")])
    assert tokenizer_lines(capsys.readouterr().err) == [
        f"tokenizer: the shipped default (with whitespace encoding) (checkpoint {tmp_path / 'ckpt'} records no "
        f"tokenizer; pass the tokenizer flags training used if it was another)"]
