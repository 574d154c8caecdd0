"""What is recorded of a tokenizer, beside a dataset and in a checkpoint: its flags, and a fingerprint of what gives
its ids their meaning (a path says where a file was, not what it held).

The fingerprint is the first 16 hex digits of the SHA-256 of one canonical JSON text: the model's kind, every token
with its id and whether it is special, sorted by id; the BPE merges in their order (the order is their priority); a
Unigram's (or SentencePiece's) scores. Paths, normalizer, pre-tokenizer and decoder are not in it, so a tokenizer.json
and the Hugging Face directory holding it give the same one. It is taken of the tokenizer as the pipeline uses it:
whitespace tokens and sentinels appended, ``<|endoftext|>`` and the sentinels special (``HFTokenizer``).

A record (``fingerprint_record``) is the fingerprint and ``vocab_size``, the number of ids it covers. Appending tokens
leaves the older ids' meaning alone (--fim-rate appends the code sentinels to the tokenizer data was made with), so
a tokenizer matches a record when its first ``vocab_size`` ids have the recorded fingerprint (``mismatch``).

Preprocessing writes ``PREFIX.meta.json`` beside each dataset ``PREFIX.bin/.idx`` (``dataset_meta_text``):
``{"tokenizer": {"fingerprint", "vocab_size", and the five tokenizer flags, file paths absolute}}``. Data preprocessed
before it existed has none, and is not checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from codegeex_train.bounded_read import FileReadError, read_bytes
from codegeex_train.tokenization.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer

# DataConfig's tokenizer flags, as a record holds them; the file ones with the flag that names them.
TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "whitespace_encoding")
TOKENIZER_FILE_FLAGS = {"tokenizer_model": "--tokenizer-model", "vocab_file": "--vocab-file",
                        "merge_file": "--merge-file"}
FINGERPRINT_DIGITS = 16
_FINGERPRINT = re.compile(f"[0-9a-f]{{{FINGERPRINT_DIGITS}}}")
META_SUFFIX = ".meta.json"
MAX_META_BYTES = 1 << 16  # a record and its paths, many times over


def _hf_vocabulary(inner: HFTokenizer, num_ids: int) -> dict:
    hf = inner._tokenizer
    backend = json.loads(hf.to_str())
    model = backend["model"]
    special = {t["id"] for t in backend.get("added_tokens", []) if t.get("special")}
    tokens = sorted((i, t, i in special) for t, i in hf.get_vocab(with_added_tokens=True).items() if i < num_ids)
    out: dict = {"kind": model.get("type"), "tokens": tokens}
    if "merges" in model:  # "a b" in older files, ["a", "b"] in newer: one form
        out["merges"] = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model["merges"]]
    if model.get("type") == "Unigram":
        out["scores"] = [score for _, score in model["vocab"][:num_ids]]
    return out


def _sentencepiece_vocabulary(inner: SentencePieceTokenizer, num_ids: int) -> dict:
    sp = inner._sp
    pieces = [(i, sp.id_to_piece(i), sp.get_score(i), sp.is_control(i), sp.is_unknown(i), sp.is_byte(i),
               sp.is_unused(i)) for i in range(min(num_ids, sp.get_piece_size()))]
    reserved = sorted((i, t) for t, i in inner._added.items() if i < num_ids)
    return {"kind": "SentencePiece", "tokens": pieces, "reserved": reserved}


def tokenizer_fingerprint(tokenizer: Tokenizer, num_ids: int | None = None) -> str | None:
    """The fingerprint of ``tokenizer``'s first ``num_ids`` ids (default: all); None for a tokenizer of no kind
    known here."""
    num_ids = tokenizer.vocab_size if num_ids is None else num_ids
    inner = getattr(tokenizer, "inner", tokenizer)  # WhitespaceEncodingTokenizer wraps the vocabulary's owner
    if isinstance(inner, HFTokenizer):
        vocabulary = _hf_vocabulary(inner, num_ids)
    elif isinstance(inner, SentencePieceTokenizer):
        vocabulary = _sentencepiece_vocabulary(inner, num_ids)
    else:
        return None
    text = json.dumps(vocabulary, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:FINGERPRINT_DIGITS]


def fingerprint_record(tokenizer: Tokenizer) -> dict:
    """``{"fingerprint", "vocab_size"}`` of ``tokenizer``; empty when it has no fingerprint."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    return {} if fingerprint is None else {"fingerprint": fingerprint, "vocab_size": tokenizer.vocab_size}


def check_record(record: object, where: str) -> dict | None:
    """``record`` (a tokenizer record read from a file) if it holds a fingerprint; None if it holds none (written
    before fingerprints); ValueError naming ``where`` if it is malformed."""
    if isinstance(record, dict) and "fingerprint" not in record:
        return None
    ok = (isinstance(record, dict) and isinstance(record["fingerprint"], str)
          and _FINGERPRINT.fullmatch(record["fingerprint"]) is not None
          and type(record.get("vocab_size")) is int and record["vocab_size"] > 0)
    if not ok:
        raise ValueError(f"{where}: its tokenizer record is malformed (a fingerprint of {FINGERPRINT_DIGITS} hex "
                         f"digits and a vocab_size above 0 expected)")
    return record


def describe_record(record: dict) -> str:
    """'fingerprint 0123456789abcdef, 8192 ids'."""
    return f"fingerprint {record['fingerprint']}, {record['vocab_size']} ids"


def mismatch(record: dict, tokenizer: Tokenizer) -> str | None:
    """None when ``tokenizer``'s first ``record["vocab_size"]`` ids have the recorded fingerprint; else what it has
    instead ('has fingerprint ... over those ids', 'has only N ids')."""
    n = record["vocab_size"]
    if tokenizer.vocab_size < n:
        return f"has only {tokenizer.vocab_size} ids"
    ours = tokenizer_fingerprint(tokenizer, n)
    if ours is None or ours == record["fingerprint"]:
        return None
    return f"has fingerprint {ours} over {'those' if n == tokenizer.vocab_size else f'its first {n}'} ids"


def describe_tokenizer(settings: dict) -> str:
    """Tokenizer flags ``settings`` in a few words, e.g. 'HFTokenizer /data/tok.json' or 'the shipped default'."""
    if settings.get("tokenizer_type") is None:
        return "the shipped default (with whitespace encoding)"
    files = [settings[name] for name in TOKENIZER_FILE_FLAGS if settings.get(name)]
    return " ".join([settings["tokenizer_type"], *files]) + (
        ", whitespace encoding" if settings.get("whitespace_encoding") else "")


def tokenizer_flags(settings: dict, placeholders: dict[str, str] | None = None) -> str:
    """The command-line flags that name the tokenizer of ``settings`` (``placeholders``: field -> what to write
    instead of its value); 'no tokenizer flags' for the shipped default."""
    if settings.get("tokenizer_type") is None:
        return "no tokenizer flags (the shipped default)"
    placeholders = placeholders or {}
    flags = [f"--tokenizer-type {settings['tokenizer_type']}"] + [
        f"{flag} {placeholders.get(name, settings[name])}"
        for name, flag in TOKENIZER_FILE_FLAGS.items() if settings.get(name) is not None]
    return " ".join(flags + (["--whitespace-encoding"] if settings.get("whitespace_encoding") else []))


def absolute_settings(flags) -> dict:
    """The tokenizer fields of ``flags`` (anything with them), file paths made absolute against the current
    directory, so that a record is understood wherever it is read."""
    settings = {name: getattr(flags, name, None) for name in TOKENIZER_FIELDS}
    for name in TOKENIZER_FILE_FLAGS:
        if settings[name] is not None:
            settings[name] = os.path.abspath(settings[name])
    return settings


# --- beside a dataset --------------------------------------------------------------------------------------------

def dataset_meta_path(prefix: str) -> str:
    return prefix + META_SUFFIX


def dataset_meta_text(tokenizer: Tokenizer, flags) -> str:
    """What ``dataset_meta_path`` holds for a dataset written with ``tokenizer``, built from ``flags``."""
    return json.dumps({"tokenizer": {**absolute_settings(flags), **fingerprint_record(tokenizer)}}, indent=1) + "\n"


def read_dataset_record(prefix: str) -> dict | None:
    """The tokenizer record beside dataset ``prefix`` (``check_record``'s), None when there is none; ValueError
    naming the file when it is unreadable, too large or malformed."""
    path = dataset_meta_path(prefix)
    if not os.path.lexists(path):
        return None
    try:
        meta = json.loads(read_bytes(path, MAX_META_BYTES))
    except FileReadError:
        raise
    except ValueError:
        raise ValueError(f"{path}: not JSON, not what tools/preprocess_data.py writes: re-run it, or delete the "
                         f"file to skip the tokenizer check") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a JSON object, not what tools/preprocess_data.py writes")
    record = meta.get("tokenizer")
    return None if record is None else check_record(record, path)
