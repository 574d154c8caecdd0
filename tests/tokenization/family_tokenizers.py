"""Small Hugging Face tokenizer directories of the model families (tokenizer.json + tokenizer_config.json), built
offline: a byte-level BPE trained on a slice of the stdlib, then each family's special tokens at the end, as the
published tokenizers have them, and its eos (and DeepSeek-Coder's bos) in tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path

from codegeex_train.preprocessing.default_corpus import default_corpus_files
from codegeex_train.tokenization.code_tokens import SENTINELS

BAR, LOW = "\uff5c", "\u2581"  # DeepSeek's fullwidth vertical bar and SentencePiece's word boundary
DEEPSEEK = {"bos": f"<{BAR}begin{LOW}of{LOW}sentence{BAR}>", "eos": f"<{BAR}end{LOW}of{LOW}sentence{BAR}>",
            "prefix": f"<{BAR}fim{LOW}begin{BAR}>", "suffix": f"<{BAR}fim{LOW}hole{BAR}>",
            "middle": f"<{BAR}fim{LOW}end{BAR}>"}
FAMILIES = {  # special tokens (in id order after the BPE's), eos, {sentinel: the family's name for it}
    "qwen2.5-coder": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
                       "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"], "<|endoftext|>",
                      {s: "<|" + s.strip("<>") + "|>" for s in SENTINELS}),
    "starcoder2": (["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<repo_name>",
                    "<file_sep>", "<issue_start>", "<jupyter_start>"], "<|endoftext|>", {s: s for s in SENTINELS}),
    "deepseek-coder": ([DEEPSEEK["bos"], DEEPSEEK["eos"], DEEPSEEK["suffix"], DEEPSEEK["prefix"], DEEPSEEK["middle"]],
                       DEEPSEEK["eos"], {"<fim_prefix>": DEEPSEEK["prefix"], "<fim_suffix>": DEEPSEEK["suffix"],
                                         "<fim_middle>": DEEPSEEK["middle"]}),
}


def write_family_tokenizer(out: Path, family: str) -> Path:
    """A small Hugging Face tokenizer directory with ``family``'s special tokens and eos."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials, eos, _ = FAMILIES[family]
    texts = [p.read_text(encoding="utf-8") for p in default_corpus_files(limit_bytes=40_000)]
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.add_special_tokens(specials)
    out.mkdir(parents=True, exist_ok=True)
    bpe.save(str(out / "tokenizer.json"))
    bos = DEEPSEEK["bos"] if family == "deepseek-coder" else None
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos, "pad_token": None,
         "add_bos_token": False, "model_max_length": 4096}, ensure_ascii=False))
    return out
