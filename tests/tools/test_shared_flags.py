"""Flags several commands take are declared once and every command's parser is generated from the declaration: the
tokenizer flags (config/tokenizer_flags.py: training's DataConfig and the four tools) and the sampling flags
(generation's SamplingParams: generate.py, evaluate_humaneval.py); the same spellings and help everywhere, each
command's own default where its meaning differs."""

import dataclasses

import pytest

from codegeex_train.config.arguments import DataConfig
from codegeex_train.config.options import Default, add_config_flags
from codegeex_train.config.tokenizer_flags import TokenizerFlags
from codegeex_train.generation import SamplingParams
from codegeex_train.tokenization.record import TOKENIZER_FIELDS
from codegeex_train.tokenization.tokenizer import DEFAULT_TOKENIZER_PATH
from tests.harness import load_tool

TRAINING = {f.name: f.default for f in dataclasses.fields(TokenizerFlags)}
SAMPLING = {name: getattr(SamplingParams(), name) for name in SamplingParams.FLAGS}
# command -> (the least it parses, its tokenizer defaults, its sampling defaults)
COMMANDS = {
    "generate": (["--load", "x"], TRAINING, SAMPLING),
    "evaluate_humaneval": (["--load", "x"], TRAINING,
                           {**SAMPLING, "max_new_tokens": 300, "temperature": None, "top_p": 0.95}),
    "preprocess_data": (["--output-prefix", "x"],
                        {**TRAINING, "tokenizer_type": "HFTokenizer", "tokenizer_model": DEFAULT_TOKENIZER_PATH}, {}),
    "convert_checkpoint": (["--load", "x", "--to-hf", "y"], dict.fromkeys(TRAINING), {}),  # None: the checkpoint's
}


def _unwrapped(text: str) -> str:
    return "".join(text.split())  # --help wraps lines (at hyphens too)


def test_training_lists_the_declared_tokenizer_flags():
    assert tuple(TRAINING) == TOKENIZER_FIELDS  # what checkpoints and datasets record
    data = {f.name: f for f in dataclasses.fields(DataConfig)}
    for declared in dataclasses.fields(TokenizerFlags):
        ours = data[declared.name]
        assert (ours.type, ours.default, ours.metadata) == (declared.type, declared.default, declared.metadata)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_generates_the_shared_flags(command, capsys):
    tool = load_tool(command)
    argv, tokenizer, sampling = COMMANDS[command]
    args = tool.parse_args(argv)
    assert {name: getattr(args, name) for name in tokenizer} == tokenizer
    assert {name: getattr(args, name) for name in sampling} == sampling
    with pytest.raises(SystemExit):
        tool.parse_args(["--help"])
    shown = _unwrapped(capsys.readouterr().out)
    declared = [*dataclasses.fields(TokenizerFlags), *(f for f in dataclasses.fields(SamplingParams)
                                                       if f.name in sampling)]
    for f in declared:
        assert _unwrapped(f"--{f.name.replace('_', '-')}") in shown and _unwrapped(f.metadata["help"]) in shown, f.name
    parsed = tool.parse_args([*argv, "--tokenizer-type", "CodeGeeXTokenizer", "--whitespace-encoding",
                              *(["--top-k", "5", "--temperature", "0.5"] if sampling else [])])
    assert (args.tokenizer_type, parsed.tokenizer_type, parsed.whitespace_encoding) == (tokenizer["tokenizer_type"],
                                                                                       "CodeGeeXTokenizer", True)
    if sampling:
        assert (parsed.top_k, parsed.temperature) == (5, 0.5)


def test_a_default_in_words_is_what_help_says():
    import argparse

    parser = argparse.ArgumentParser()
    add_config_flags(parser, SamplingParams, ("temperature", "seed"),
                     defaults={"temperature": Default(None, "greedy for one sample"), "seed": 7})
    text = parser.format_help()
    assert "(default:greedyforonesample)" in _unwrapped(text) and "(default:7)" in _unwrapped(text)
    assert vars(parser.parse_args([])) == {"temperature": None, "seed": 7}
