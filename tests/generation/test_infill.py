"""Fill-in-the-middle at inference on a tiny random checkpoint whose metadata records FIM training (fim_rate,
fim_spm_rate beside the tokenizer settings, as training checkpoints do): the exact PSM and SPM prompt ids, the order
chosen from the recorded spm rate, the middle ending at EOD or a sentinel, tools/generate.py's --infill and
--prefix/--suffix (TP 1 in this process, TP 2 under torchrun) and its one-line refusals."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from codegeex_train.checkpoint import save_model_checkpoint, split_state_dict
from codegeex_train.checkpoint.files import read_checkpoint_meta
from codegeex_train.tokenization.tokenizer import default_tokenizer
from codegeex_train.generation import Generator, InfillError, SamplingParams, fim_format, recorded_fim
from codegeex_train.tokenization.code_tokens import trained_order
from codegeex_train.generation.infill import split_at_marker
from codegeex_train.model import CodeGeeXModel, ModelConfig
from tests.harness import free_port, load_tool, run_process_group

ROOT = Path(__file__).resolve().parents[2]
TOOL = str(ROOT / "tools" / "generate.py")
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\n\nprint(add(1, 2))\n"
GREEDY = SamplingParams(max_new_tokens=12)
SENTINEL_NAMES = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<repo_name>", "<file_sep>")
TOKENIZER = {"tokenizer_type": None, "tokenizer_model": None, "vocab_file": None, "merge_file": None,
             "whitespace_encoding": False}  # the shipped default (whitespace encoding on)


def sentinel_ids(tokenizer) -> dict[str, int]:
    """The sentinels' ids looked up by name in the tokenizer's own vocabulary (not through code_tokens)."""
    return {name: tokenizer.inner._tokenizer.token_to_id(name) for name in SENTINEL_NAMES}


def fim_tokenizer():
    tokenizer = default_tokenizer()
    fim_format({"tokenizer": {"fim_rate": 0.5}}, tokenizer)  # appends the sentinels, as training does
    return tokenizer


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict:
    """One tiny model saved several times: its metadata recording FIM with spm rates 0.5, 1.0 and 0, FIM rate 0,
    and nothing (a converted checkpoint); and at TP 2."""
    root = tmp_path_factory.mktemp("infill")
    tokenizer = fim_tokenizer()
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=tokenizer.vocab_size,
                         max_position_embeddings=96, init_method_std=0.2)
    full = CodeGeeXModel(config, None, None, seed=3).state_dict()
    records = {"psm": {"fim_rate": 0.5, "fim_spm_rate": 0.5}, "spm": {"fim_rate": 0.9, "fim_spm_rate": 1.0},
               "psm_only": {"fim_rate": 0.5, "fim_spm_rate": 0.0}, "no_fim": {"fim_rate": 0.0, "fim_spm_rate": 0.5},
               "unrecorded": None}
    dirs = {}
    for name, fim in records.items():
        dirs[name] = root / name
        save_model_checkpoint(dirs[name], split_state_dict(full, config, 1), config, 1,
                              tokenizer=None if fim is None else {**TOKENIZER, **fim})
    dirs["tp2"] = root / "tp2"
    save_model_checkpoint(dirs["tp2"], split_state_dict(full, config, 2), config, 2,
                          tokenizer={**TOKENIZER, **records["spm"]})
    return {"root": root, "tokenizer": tokenizer, **dirs}


def meta(path) -> dict:
    return read_checkpoint_meta(path)[1]


def test_prompt_ids_are_the_trained_layouts(ckpts):
    tok = ckpts["tokenizer"]
    ids = sentinel_ids(tok)
    assert ids == dict(zip(SENTINEL_NAMES, range(8192, 8198)))  # appended after the shipped 8192, in this order
    pre, suf = tok.encode(PREFIX), tok.encode(SUFFIX)
    psm = fim_format(meta(ckpts["psm"]), tok)
    spm = fim_format(meta(ckpts["spm"]), tok)
    assert (psm.order, spm.order) == ("psm", "spm")
    assert psm.prompt_ids(tok, PREFIX, SUFFIX) == [ids["<fim_prefix>"], *pre, ids["<fim_suffix>"], *suf,
                                                   ids["<fim_middle>"]]
    assert spm.prompt_ids(tok, PREFIX, SUFFIX) == [ids["<fim_prefix>"], ids["<fim_suffix>"], *suf,
                                                   ids["<fim_middle>"], *pre]
    assert tok.vocab_size == 8198  # asking again adds nothing


@pytest.mark.parametrize("spm_rate, order", [(0.0, "psm"), (0.5, "psm"), (0.51, "spm"), (1.0, "spm")])
def test_the_order_is_spm_only_when_the_model_never_saw_psm(spm_rate, order):
    assert trained_order(spm_rate) == order
    assert fim_format({"tokenizer": {"fim_rate": 0.5, "fim_spm_rate": spm_rate}}, fim_tokenizer()).order == order
    assert fim_format({"tokenizer": {"fim_rate": 0.5, "fim_spm_rate": spm_rate}}, fim_tokenizer(), "spm").order == "spm"


def test_no_fim_recorded_means_no_infilling(ckpts):
    assert recorded_fim(meta(ckpts["no_fim"])) is None and recorded_fim(meta(ckpts["unrecorded"])) is None
    assert recorded_fim(meta(ckpts["spm"])) == (0.9, 1.0)
    for name in ("no_fim", "unrecorded"):
        with pytest.raises(InfillError, match="was not trained with fill-in-the-middle"):
            fim_format(meta(ckpts[name]), default_tokenizer())
    with pytest.raises(InfillError, match="records fim_rate 'x'"):
        recorded_fim({"tokenizer": {"fim_rate": "x"}})
    assert split_at_marker("a<FILL_HERE>b", "<FILL_HERE>", "f") == ("a", "b")
    for text, count in (("ab", "no"), ("<FILL_HERE>a<FILL_HERE>", "2")):
        with pytest.raises(InfillError, match=f"f: holds {count} <FILL_HERE> marker"):
            split_at_marker(text, "<FILL_HERE>", "f")


def first_new(ids: list[int], start: int) -> int:
    """The first index >= start whose id does not occur before it."""
    return next(k for k in range(start, len(ids)) if ids[k] not in ids[:k])


@pytest.mark.parametrize("order", ["psm", "spm"])
def test_the_middle_ends_at_eod_or_a_sentinel(ckpts, order):
    """Against the unstopped greedy ids of the hand-built prompt: the middle is their text up to the first id that
    ends a document (EOD) or is a sentinel. Which id that is comes from the unstopped run (a random model emits
    neither of its own accord): the generator's EOD, and the format's <fim_pad>, are set to it."""
    tok = ckpts["tokenizer"]
    gen = Generator.from_checkpoint(ckpts[order], tok)
    fim = fim_format(meta(ckpts[order]), tok)
    ids = sentinel_ids(tok)
    pre, suf = tok.encode(PREFIX), tok.encode(SUFFIX)
    prompt = ([ids["<fim_prefix>"], *pre, ids["<fim_suffix>"], *suf, ids["<fim_middle>"]] if order == "psm" else
              [ids["<fim_prefix>"], ids["<fim_suffix>"], *suf, ids["<fim_middle>"], *pre])
    gen.eod = -1  # nothing ends the reference run early
    reference = gen.generate_ids([prompt], GREEDY)[0]
    assert len(reference) == GREEDY.max_new_tokens

    def text(middle_ids):  # as it reads after the prefix
        return tok.decode(pre + middle_ids)[len(PREFIX):]

    assert gen.infill([PREFIX], [SUFFIX], GREEDY, fim) == [text(reference)]
    k = first_new(reference, 1)
    gen.eod = reference[k]
    assert gen.generate_ids([prompt], GREEDY)[0] == reference[:k]
    assert gen.infill([PREFIX], [SUFFIX], GREEDY, fim) == [text(reference[:k])]
    gen.eod = -1
    j = first_new(reference, k + 1)
    pad = dataclasses.replace(fim, tokens=dataclasses.replace(fim.tokens, fim_pad=reference[j]))
    assert gen.infill([PREFIX], [SUFFIX], GREEDY, pad) == [text(reference[:j])]
    # A batch of ragged prompts: each row as alone.
    batch = gen.infill([PREFIX, "x = ", ""], [SUFFIX, "\n", "y = 1\n"], GREEDY, pad)
    assert batch[0] == text(reference[:j])
    assert batch[1:] == [gen.infill([p], [s], GREEDY, pad)[0] for p, s in (("x = ", "\n"), ("", "y = 1\n"))]


def test_tool_infills_in_the_recorded_order(ckpts, capsys):
    root, tok = ckpts["root"], ckpts["tokenizer"]
    source = root / "module.py"
    source.write_text(PREFIX + "<FILL_HERE>" + SUFFIX)
    expected = {order: Generator.from_checkpoint(ckpts["psm"], tok).infill(
        [PREFIX], [SUFFIX], GREEDY, fim_format(meta(ckpts["psm"]), tok, order))[0] for order in ("psm", "spm")}
    assert expected["psm"] != expected["spm"]  # so the order the tool picks shows in its output

    def infill(ckpt, *extra) -> dict:
        out = root / "out.jsonl"
        load_tool("generate").main(["--load", str(ckpts[ckpt]), "--infill", str(source), "--max-new-tokens", "12",
                                    "--output", str(out), *extra])
        [record] = [json.loads(line) for line in out.read_text().splitlines()]
        assert record["prefix"] == PREFIX and record["suffix"] == SUFFIX and record["infill"] == str(source)
        return record["completion"]

    assert infill("psm") == expected["psm"]
    assert infill("psm_only") == expected["psm"]
    assert infill("spm") == expected["spm"]  # the same weights, recorded as trained with SPM only
    assert infill("psm", "--fim-order", "spm") == expected["spm"]
    capsys.readouterr()
    load_tool("generate").main(["--load", str(ckpts["spm"]), "--prefix", PREFIX.replace("\n", "\\n"), "--suffix",
                                SUFFIX.replace("\n", "\\n"), "--max-new-tokens", "12"])
    assert capsys.readouterr().out == PREFIX + expected["spm"] + SUFFIX + "\n"  # the filled-in text


@pytest.mark.parametrize("args, message", [
    (["--load", "{no_fim}", "--infill", "{good}"], "--infill: checkpoint {no_fim} was not trained with "
                                                   "fill-in-the-middle (it records no --fim-rate above 0)"),
    (["--load", "{unrecorded}", "--prefix", "x"], "--prefix/--suffix: checkpoint {unrecorded} was not trained with "
                                                  "fill-in-the-middle"),
    (["--load", "{psm}", "--infill", "{none}"], "--infill {none}: holds no <FILL_HERE> marker"),
    (["--load", "{psm}", "--infill", "{good}", "--infill-marker", "@@"], "--infill {good}: holds no @@ marker"),
    (["--load", "{psm}", "--infill", "{missing}"], "--infill {missing}: no such file"),
    (["--load", "{psm}", "--infill", "/dev/null"], "--infill /dev/null: a character device, not a regular file"),
    (["--load", "{psm}", "--prompt", "x", "--suffix", "y"], "--prefix/--suffix: not with --prompt"),
    (["--load", "{psm}", "--prompt", "x", "--fim-order", "spm"], "--fim-order and --infill-marker go with --infill"),
    (["--load", "{psm}", "--prefix", " ".join(map(str, range(200)))], "--prefix/--suffix: prefix and suffix are"),
])
def test_bad_infill_input_is_one_error_line(ckpts, capsys, args, message):
    root = ckpts["root"]
    (root / "good.py").write_text("a<FILL_HERE>b")
    (root / "none.py").write_text("ab")
    names = {k: str(v) for k, v in ckpts.items() if isinstance(v, Path)}
    names.update(good=str(root / "good.py"), none=str(root / "none.py"), missing=str(root / "missing.py"))
    with pytest.raises(SystemExit) as e:
        load_tool("generate").main([a.format(**names) for a in args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("generate.py: error: ") and message.format(**names) in err[-1], err
    assert "Traceback" not in "\n".join(err)
    if "--fim-order" not in args and "--suffix" not in args:  # argparse's refusals come with its usage line
        assert len(err) == 1, err


@pytest.mark.slow
def test_torchrun_tp2_infills_as_tp1(ckpts):
    root = ckpts["root"]
    source = root / "tp.py"
    source.write_text(PREFIX + "<FILL_HERE>" + SUFFIX)
    expected = Generator.from_checkpoint(ckpts["spm"], ckpts["tokenizer"]).infill(
        [PREFIX], [SUFFIX], GREEDY, fim_format(meta(ckpts["spm"]), ckpts["tokenizer"]))[0]
    launched = run_process_group(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         TOOL, "--load", str(ckpts["tp2"]), "--tensor-model-parallel-size", "2", "--infill", str(source),
         "--max-new-tokens", "12", "--output", str(root / "tp2.jsonl")],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert launched.returncode == 0, launched.stderr
    [record] = [json.loads(line) for line in (root / "tp2.jsonl").read_text().splitlines()]
    assert record["completion"] == expected
