"""The tokenizer files of a Hugging Face model directory, exact to ours:

    tokenizer.json             the `tokenizers` pipeline, whitespace encoding included (below)
    tokenizer_config.json      class PreTrainedTokenizerFast, eos = bos = eod, no pad, split_special_tokens,
                               model_max_length; "codegeex_train_fim": the run's FIM flags (if it trained FIM)
    special_tokens_map.json    eos, bos and the FIM sentinels (older transformers read it)

``AutoTokenizer.from_pretrained(dir)`` (no remote code) then encodes every text to our ids and decodes every id
list to our text. What makes that exact:

- CodeGeeX's whitespace encoding (``whitespace.py``) lives in tokenizer.json as added tokens whose content is the run
  itself ("  " .. " " * max_run, at the ids of ``<|extratoken_10|>`` ..): non-special and not normalized, so they are
  matched on the raw text, before the pre-tokenizer, leftmost-longest. On a run of n spaces that gives max_run-long
  tokens, then the rest (2..max_run-1) as one token, or a lone space left to the text after it: exactly
  ``split_whitespace_runs``, and the text between runs is encoded piece by piece as ours is. They decode to their
  content, the spaces (so ``skip_special_tokens=True`` keeps them). ``convert_ids_to_tokens`` shows "  " for them.
- ``split_special_tokens``: text spelling out ``<|endoftext|>`` or a sentinel is text, as in ``HFTokenizer``.
- ``clean_up_tokenization_spaces`` off: the byte-level decode is the text.

``pad_token_id`` is None, as in GPT-2's own files: no id was trained as padding, and eod is a token the model must
predict, so a collator that took pad = eod would mask the document ends out of fine-tuning's loss. Harnesses that
batch (lm-evaluation-harness, bigcode-evaluation-harness) set pad = eos themselves, with an attention mask.

SentencePiece models are refused: no tokenizer.json reproduces sentencepiece's segmentation and decode exactly.

A model family's own tokenizer (Qwen2.5-Coder's, StarCoder2's, DeepSeek-Coder's, ...) is not rewritten: --from-hf
copies its directory's files (``TOKENIZER_FILES``) beside the checkpoint and records the directory
(``hf_tokenizer_settings``: eod its tokenizer_config.json's eos_token; when it holds its family's FIM sentinels,
``FAMILY_FIM``), and --to-hf of a family's model copies them back as they were (``copy_hf_tokenizer``), its bos and
pad ids with them (``hf_special_ids``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import tokenizers

from codegeex_train.checkpoint.files import FIM_FIELDS, TOKENIZER_FIELDS
from codegeex_train.bounded_read import check_file, read_text
from codegeex_train.tokenization.code_tokens import code_tokens, holds_fim_sentinels
from codegeex_train.tokenization.tokenizer import (
    EOD_TOKEN,
    MAX_TOKENIZER_FILE_BYTES,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    WhitespaceEncodingTokenizer,
    hf_eos_token,
    load_tokenizer,
)
from codegeex_train.tokenization.whitespace import whitespace_token

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
FIM_KEY = "codegeex_train_fim"  # tokenizer_config.json: the FIM flags, for --from-hf to record again
# A Hugging Face tokenizer directory's files an import copies beside the checkpoint (those it has).
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, "chat_template.jinja")
# The FIM flags recorded for a published code model whose tokenizer holds its family's FIM sentinels: trained to
# infill, prompted in PSM (the order the DeepSeek-Coder, Qwen2.5-Coder and StarCoder2 model cards infill in).
FAMILY_FIM = {"fim_rate": 0.5, "fim_spm_rate": 0.0, "fim_split_sample": None, "fim_fragment_rate": None}


def save_hf_tokenizer(settings: dict, out_dir: str | os.PathLike, model_max_length: int) -> dict:
    """Write the tokenizer ``settings`` name (``tokenizer_settings``: the five tokenizer flags, and the FIM flags of a
    run that trained FIM, whose sentinels it then holds) into ``out_dir`` as above; return the ids for the model's
    config and generation config: ``{"eos_token_id": eod, "bos_token_id": eod, "pad_token_id": None}``. Raises
    TokenizerError for a SentencePiece model, or a vocabulary that already spells a whitespace run as a token."""
    ours = load_tokenizer(_flags(settings))
    inner, runs = _unwrap(ours)
    backend = json.loads(inner._tokenizer.to_str())
    for n, token_id in runs.items():
        _spell_as_spaces(backend, token_id, whitespace_token(n), " " * n)
    backend["truncation"] = backend["padding"] = None
    text = json.dumps(backend, ensure_ascii=False)
    _check_exact(text, ours)

    eos = inner._tokenizer.id_to_token(ours.eod)
    special: dict = {"bos_token": eos, "eos_token": eos}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "pad_token": None,
              "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
              "split_special_tokens": True, "clean_up_tokenization_spaces": False,
              "model_max_length": int(model_max_length)}
    if settings.get("fim_rate"):  # the sentinels training added (code_tokens: present, so no new ids)
        sentinels = [inner._tokenizer.id_to_token(i) for i in vars(code_tokens(ours)).values()]
        special["additional_special_tokens"] = config["additional_special_tokens"] = sentinels
        config[FIM_KEY] = {name: settings.get(name) for name in FIM_FIELDS}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / TOKENIZER_FILE).write_text(text, encoding="utf-8")
    (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / SPECIAL_TOKENS_MAP).write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return {"eos_token_id": ours.eod, "bos_token_id": ours.eod, "pad_token_id": None}


def hf_tokenizer_settings(hf_dir: str | os.PathLike) -> dict | None:
    """The tokenizer settings (``tokenizer_settings``' shape) a checkpoint converted from ``hf_dir`` records:
    HFTokenizer on the directory ``hf_dir`` (absolute; its tokenizer.json, eod the eos_token its
    tokenizer_config.json names, else ``<|endoftext|>``), whitespace encoding off (it is inside the file), and FIM
    flags: those ``save_hf_tokenizer`` kept, else, when the tokenizer holds its family's FIM sentinels (a published
    code model trained to infill), ``FAMILY_FIM``. ``load_tokenizer`` of them gives the ids ``AutoTokenizer``
    gives (for a foreign tokenizer.json: up to text spelling a special token, which stays text here). None when
    there is no tokenizer.json, or it names no eos_token and lacks ``<|endoftext|>`` (we would append a fresh one):
    the user passes the tokenizer flags."""
    path = Path(hf_dir) / TOKENIZER_FILE
    if not path.is_file():
        return None
    check_file(path, MAX_TOKENIZER_FILE_BYTES, "--from-hf")  # the library reads it whole
    config_path = Path(hf_dir) / TOKENIZER_CONFIG
    try:
        config = json.loads(read_text(config_path, MAX_TOKENIZER_FILE_BYTES, "--from-hf")) if config_path.is_file() \
            else {}
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{config_path}: not JSON ({e})") from None
    try:
        if hf_eos_token(config_path) is None and tokenizers.Tokenizer.from_file(str(path)).token_to_id(
                EOD_TOKEN) is None:
            return None
    except Exception as e:  # the Rust library raises a bare Exception for a malformed file
        raise TokenizerError(f"{path}: cannot load it: {' '.join(str(e).split())}") from None
    settings = {name: None for name in TOKENIZER_FIELDS}
    settings.update(tokenizer_type="HFTokenizer", tokenizer_model=str(Path(hf_dir).resolve()),
                    whitespace_encoding=False)
    fim = config.get(FIM_KEY) if isinstance(config, dict) else None
    if isinstance(fim, dict) and isinstance(fim.get("fim_rate"), (int, float)) and fim["fim_rate"] > 0:
        settings.update({name: fim.get(name) for name in FIM_FIELDS})
    elif holds_fim_sentinels(load_tokenizer(_flags(settings))):
        settings.update(FAMILY_FIM)
    return settings


def copy_hf_tokenizer(hf_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Copy the tokenizer files (``TOKENIZER_FILES``) ``hf_dir`` has into the new directory ``out_dir``, which then
    works as ``--tokenizer-model`` as ``hf_dir`` did; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        source = Path(hf_dir) / name
        if source.is_file():
            check_file(source, MAX_TOKENIZER_FILE_BYTES, "--from-hf")
            shutil.copyfile(source, out / name)
    return out


def hf_special_ids(tokenizer_dir: str | os.PathLike, tokenizer: Tokenizer) -> dict:
    """The model config's token ids of a Hugging Face tokenizer directory's files as they are: eos = eod, bos and
    pad those tokenizer_config.json names (None when it names none)."""
    config = json.loads(read_text(Path(tokenizer_dir) / TOKENIZER_CONFIG, MAX_TOKENIZER_FILE_BYTES, "--to-hf"))
    inner, _ = _unwrap(tokenizer)

    def token_id(key: str) -> int | None:
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return inner._tokenizer.token_to_id(token) if isinstance(token, str) else None

    return {"eos_token_id": tokenizer.eod, "bos_token_id": token_id("bos_token"), "pad_token_id": token_id("pad_token")}


def _flags(settings: dict) -> SimpleNamespace:
    """``settings`` as the flags ``load_tokenizer`` reads (FIM fields absent: no FIM)."""
    return SimpleNamespace(**{name: settings.get(name) for name in TOKENIZER_FIELDS},
                           **{name: settings.get(name) for name in FIM_FIELDS})


def _unwrap(tokenizer: Tokenizer) -> tuple[HFTokenizer, dict[int, int]]:
    """(the `tokenizers`-backed tokenizer, {run length: id} of its whitespace encoding, empty if off)."""
    runs: dict[int, int] = {}
    inner = tokenizer
    if isinstance(tokenizer, WhitespaceEncodingTokenizer):
        inner = tokenizer.inner
        lengths = range(2, tokenizer.max_run + 1)
        runs = dict(zip(lengths, inner.add_tokens([whitespace_token(n) for n in lengths])))  # present: no growth
    if not isinstance(inner, HFTokenizer):
        raise TokenizerError(f"cannot write a Hugging Face tokenizer.json for a {type(inner).__name__}: no "
                             f"tokenizer.json reproduces its ids exactly; export without the tokenizer and load "
                             f"it with the flags training used (--tokenizer-type ... --tokenizer-model FILE)")
    return inner, runs


def _spell_as_spaces(backend: dict, token_id: int, name: str, spaces: str) -> None:
    """Rename whitespace token ``name`` (id ``token_id``) to ``spaces`` in the serialized ``backend``: a non-special,
    raw-text added token, so the file itself does the encoding."""
    vocab = backend["model"].get("vocab")
    if isinstance(vocab, dict) and spaces in vocab or any(t["content"] == spaces for t in backend["added_tokens"]):
        raise TokenizerError(f"the tokenizer already has a token spelled as {len(spaces)} spaces, so its whitespace "
                             f"encoding cannot be written into tokenizer.json")
    if isinstance(vocab, dict) and vocab.get(name) == token_id:
        vocab[spaces] = vocab.pop(name)
    entry = next(t for t in backend["added_tokens"] if t["id"] == token_id)
    entry.update(content=spaces, special=False, normalized=False, lstrip=False, rstrip=False, single_word=False)


# Where a written file could part from ours were the vocabulary unusual (an added token holding spaces, say): every
# run length around the limits, line ends, text spelling special tokens; each added token's text is added.
PROBES = ([f"a{' ' * n}b" for n in range(1, 32)] + [" " * n for n in range(1, 32)]
          + ["\t  x\r\n   y  \n", "é  ☃ \u00a0 z", EOD_TOKEN + "  " + whitespace_token(2)])


def _check_exact(text: str, ours: Tokenizer) -> None:
    """The tokenizer.json ``text``, loaded as AutoTokenizer loads it, keeps every added token's id and gives our ids
    and our decode on ``PROBES``: a cheap guard for tokenizer files this module's reasoning did not foresee."""
    written = tokenizers.Tokenizer.from_str(text)
    written.encode_special_tokens = True  # split_special_tokens
    added = json.loads(text)["added_tokens"]
    for token in added:
        if written.token_to_id(token["content"]) != token["id"]:
            raise TokenizerError(f"cannot write an exact tokenizer.json for this tokenizer: its token "
                                 f"{token['content']!r} would not keep id {token['id']}")
    for probe in PROBES + [t["content"] for t in added]:
        ids = written.encode(probe, add_special_tokens=False).ids
        if ids != ours.encode(probe) or written.decode(ids, skip_special_tokens=False) != ours.decode(ids):
            raise TokenizerError(f"cannot write an exact tokenizer.json for this tokenizer: {probe!r} would encode "
                                 f"or decode differently")
