"""The pretraining command line as a person meets it: --help, one-line errors with "did you mean", and Megatron-LM's
spellings (config/megatron_flags.py): each alias parses to what our flag gives, each refusal is one line naming ours,
and docs/megatron-flags.md is the table."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from codegeex_train.config import megatron_flags
from codegeex_train.config.arguments import DESCRIPTION, SECTIONS, parse_args, parser
from codegeex_train.config.options import ALIAS, IGNORED, REFUSED, SAME, build_parser

ROOT = Path(__file__).resolve().parents[2]
TABLE = megatron_flags.PRETRAIN


def rows(kind):
    return [key for key, entry in TABLE.items() if entry.kind == kind]


@pytest.fixture(scope="module")
def help_text():
    return parser().format_help()


def flat(text: str) -> str:
    return " ".join(text.split())


def test_help_opens_with_what_it_does_then_examples(help_text):
    assert help_text.startswith(DESCRIPTION.splitlines()[0])
    head = help_text[:help_text.index("usage:")]  # all before the usage line and the flag groups
    assert "Pretrain a CodeGeeX-style GPT" in head and "examples:" in head
    for example in ("DS_ACCELERATOR=cpu python -m codegeex_train.pretrain --data-path", "deepspeed --num_gpus 8",
                    "bash scripts/pretrain_codegen.sh"):
        assert example in head, example
    assert "``parse_args``" not in help_text  # the module's developer docstring stays out
    assert help_text.index("usage:") < help_text.index("--num-layers")


def test_help_shows_every_default_and_the_choices(help_text):
    text = flat(help_text)
    for shown in ("--lr-warmup-iters LR_WARMUP_ITERS linear warm-up iterations (default: 0)",
                  "--min-lr MIN_LR learning rate at the end of the decay (default: 0.0)",
                  "--fp16 fp16 mixed precision with dynamic loss scaling (GPU) (default: False)",
                  "--save SAVE directory to save checkpoints to; one run's: when it holds a run",
                  "(see --start-over) (default: None)",
                  ("--top-query-layer, --no-top-query-layer CodeGeeX's top query layer after the decoder stack "
                   "(default: True)"),
                  "--lr-decay-style {constant,linear,cosine}", "--zero-stage {0,1,2}",
                  "--activation {gelu,gelu_tanh,fast_gelu}", "--optimizer {adam,sgd}",
                  "--tokenizer-type {HFTokenizer,GPT2BPETokenizer,SentencePieceTokenizer,CodeGeeXTokenizer}"):
        assert shown in text, shown
    assert "(default: True) (default: True)" not in text
    assert ("--checkpoint-activations recompute each layer's activations in backward (= --recompute-granularity "
            "full) (default: False) (also --recompute-activations)") in text
    for shown in ("--sequence-parallel Megatron's sequence parallelism (TP > 1)",
                  "--recompute-granularity {full,selective}", "--recompute-method {uniform,block}",
                  "--recompute-num-layers RECOMPUTE_NUM_LAYERS", "--recompute-modules RECOMPUTE_MODULES"):
        assert shown in text, shown


def one_error_line(capsys, argv, prefix="error: "):
    """Parse ``argv``; it must exit 2 with exactly one stderr line, ``error: ...``; returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


def test_unknown_flag_is_one_line_with_did_you_mean():
    result = subprocess.run([sys.executable, "-m", "codegeex_train.pretrain", "--data-path", "x",
                             "--lr-warmup-iter", "5"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                            check=False)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [("error: unrecognized argument --lr-warmup-iter (did you mean "
                                           "--lr-warmup-iters?); --help lists every flag")]


@pytest.mark.parametrize("argv,fragment", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size (did you mean --tensor-model-parallel-size?)"),
    (["--train_iters=3"], "--train_iters=3 (did you mean --train-iters?)"),
    (["--no-such-thing-at-all"], "unrecognized argument --no-such-thing-at-all;"),
    (["--zero-stage", "3"], "argument --zero-stage: invalid choice: 3"),
    (["--lr", "fast"], "argument --lr/--learning-rate: invalid float value: 'fast'"),
    (["--tokenizer-type", "HFTokeniser"], "argument --tokenizer-type: invalid choice: 'HFTokeniser'"),
])
def test_bad_flags_and_values_are_one_line(capsys, argv, fragment):
    assert fragment in one_error_line(capsys, ["--data-path", "x", *argv])


def test_tokenizer_choices_are_the_tokenizers():
    from codegeex_train.tokenization import tokenizer

    choices = parser()._option_string_actions["--tokenizer-type"].choices
    assert tuple(choices) == tokenizer.TOKENIZER_TYPES  # the flag offers the types build_tokenizer knows


def test_the_launchers_local_rank_is_still_accepted():
    assert parse_args(["--data-path", "x", "--local_rank=3"]) == parse_args(["--data-path", "x", "--local-rank", "1"])


def _sample_value(action: argparse.Action) -> list[str]:
    """A value for ``action`` that differs from its default ([] for a switch)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(c for c in action.choices if c != action.default))]
    kind = getattr(action.type, "__name__", "str")
    return {"int": ["3"], "float": ["0.5"]}.get(kind, ["somewhere"])


@pytest.mark.parametrize("key", rows(ALIAS))
def test_each_alias_parses_as_ours(key):
    entry = TABLE[key]
    ours = entry.ours.split()
    value = _sample_value(parser()._option_string_actions[ours[0]]) if len(ours) == 1 and " " not in key else []
    base = ["--data-path", "x"]
    theirs_args, ours_args = parse_args(base + key.split() + value), parse_args(base + ours + value)
    assert theirs_args == ours_args
    assert ours_args != parse_args(base)  # the value arrived (not the default on both sides)


@pytest.mark.parametrize("key", rows(IGNORED))
def test_each_ignored_flag_is_accepted_without_effect(key):
    base = ["--data-path", "x"]
    assert parse_args(base + [key]) == parse_args(base + [key, "mmap"]) == parse_args(base)  # with a value too


def _given(key: str) -> list[str]:
    return key.replace("*", "x").split()  # a pattern stands for any rest of the name


@pytest.mark.parametrize("key", rows(REFUSED))
def test_each_refused_flag_is_one_line_naming_ours(capsys, key):
    given = _given(key)
    line = one_error_line(capsys, ["--data-path", "x", *given, *(["1"] if len(given) == 1 else [])])
    assert f"{given[-1]} (Megatron-LM) is not supported here" in line  # the flag, or the value of --tokenizer-type
    assert f"ours: {TABLE[key].ours}" in line and megatron_flags.DOC in line


def test_several_refused_flags_are_reported_together(capsys):
    line = one_error_line(capsys, ["--data-path", "x", "--ds-sequence-parallel-size", "2", "--use-flash-attn",
                                   "--fp8-format", "hybrid"])
    for flag in ("--ds-sequence-parallel-size", "--use-flash-attn", "--fp8-format"):
        assert f"{flag} (Megatron-LM)" in line


@pytest.mark.parametrize("key", rows(SAME))
def test_each_same_flag_is_ours(key):
    flag, _, value = key.partition(" ")
    assert flag in parser()._option_string_actions  # the table says "same" for a flag we lack
    if value:
        assert parse_args(["--data-path", "x", flag, value]).data.tokenizer_type == value


def test_table_entries_other_than_same_are_not_our_flags():
    """Our own flag wins over a table row (add_foreign_flags skips it): such a row is stale, make it SAME."""
    ours = set(build_parser(SECTIONS, "")._option_string_actions)
    stale = [key for key, entry in TABLE.items() if entry.kind != SAME and key.split()[0] in ours
             and " " not in key]
    assert stale == []


def test_the_doc_is_the_table():
    doc = ROOT / megatron_flags.DOC
    assert doc.read_text() == megatron_flags.markdown(), (
        f"{megatron_flags.DOC} is stale: python -m codegeex_train.config.megatron_flags > {megatron_flags.DOC}")
    for key in TABLE:
        assert f"`{key}`" in doc.read_text()
