"""Tokenizers behind one small interface, built from Megatron's `--tokenizer-type` names.

- HFTokenizer: a `tokenizer.json` (--tokenizer-model), e.g. the shipped default, or a Hugging Face tokenizer
  directory holding one (or GPT-2's `vocab.json` + `merges.txt`). A directory's `tokenizer_config.json` names the
  end-of-document token (its `eos_token`: the model family's, e.g. DeepSeek-Coder's `<｜end▁of▁sentence｜>`); a
  bare file's is `<|endoftext|>`, appended when missing. The code sentinels of the families it may hold (Qwen2.5-
  Coder's, StarCoder2's, DeepSeek-Coder's) are found by name (`code_tokens.py`).
- GPT2BPETokenizer: GPT-2 style `vocab.json` + `merges.txt` (--vocab-file, --merge-file).
- SentencePieceTokenizer: a SentencePiece `.model` file (--tokenizer-model), or a directory holding its
  `tokenizer.model`.
- CodeGeeXTokenizer: CodeGeeX-13B's, i.e. GPT-J's (GPT-2's 50,257 ids, then `<|extratoken_1|>` ..
  `<|extratoken_143|>` at ids 50,257..50,399) with CodeGeeX's whitespace encoding always on (runs of 2..10
  spaces -> `<|extratoken_10|>` .. `<|extratoken_18|>`). From GPT-2's `vocab.json` + `merges.txt`
  (--vocab-file, --merge-file; the extra tokens are appended) or from a `tokenizer.json` / Hugging Face
  tokenizer directory holding them (--tokenizer-model, e.g. a local copy of EleutherAI/gpt-j-6B's files).
  50,400 ids; the model pads them to 52,224 with `--make-vocab-size-divisible-by 52224`.

`whitespace_encoding=True` adds CodeGeeX's whitespace encoding on top of any of them (see
`whitespace.py`); extra tokens the tokenizer lacks are appended after its last id (so GPT-2's files with
GPT2BPETokenizer get them at 50,257..50,265, not at CodeGeeX's ids: use CodeGeeXTokenizer for those).

We call the `tokenizers` library directly rather than `PreTrainedTokenizerFast`: its decode is
byte-exact for byte-level BPE, with no `clean_up_tokenization_spaces` to undo.
"""

import abc
import json
import os
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from codegeex_train.bounded_read import FileReadError, check_file
from codegeex_train.tokenization.code_tokens import FAMILY_SENTINELS, SENTINELS, code_tokens
from codegeex_train.tokenization.whitespace import (
    DEFAULT_MAX_WHITESPACE_RUN,
    split_whitespace_runs,
    whitespace_token,
)

EOD_TOKEN = "<|endoftext|>"
TOKENIZER_TYPES = ("HFTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer", "CodeGeeXTokenizer")
DEFAULT_TOKENIZER_PATH = str(Path(__file__).parent / "assets" / "default_tokenizer.json")
# Every name a code sentinel has in some vocabulary: StarCoder's, and each family's (code_tokens.FAMILY_SENTINELS).
SENTINEL_NAMES = (*SENTINELS, *(name for names in FAMILY_SENTINELS.values() for name in names.values()))
TOKENIZER_CONFIG = "tokenizer_config.json"  # a Hugging Face tokenizer directory's: names its eos token


class TokenizerError(ValueError):
    """A tokenizer that cannot be built from the flags given; the message names the flag and file."""


class Tokenizer(abc.ABC):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    """Number of ids the tokenizer can emit (max id + 1), added tokens included."""
    eod: int
    """End-of-document id, appended after each document."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    @abc.abstractmethod
    def add_tokens(self, tokens: list[str]) -> list[int]:
        """Ids of `tokens`, appending those the vocabulary lacks (vocab_size grows)."""


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer`; `<|endoftext|>` is registered as a special token if missing.

    Text is only ever text: a document that literally contains `<|endoftext|>` (or a whitespace
    token) encodes to ordinary tokens, so it can neither fake a document boundary nor lose its
    exact round trip. Special ids come only from the pipeline itself (eod, whitespace runs).
    `<|endoftext|>` and the code sentinels the file holds (``code_tokens``) are made special whatever
    the file says: an added token marked non-special is matched in the text, so a file that leaves
    the flag off would turn a document's literal `<|endoftext|>` into a document boundary.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, eod_token: str = EOD_TOKEN):
        tokenizer.encode_special_tokens = True
        self._tokenizer = tokenizer
        self.eod = self.add_tokens([eod_token], special=True)[0]
        sentinels = [t for t in SENTINEL_NAMES if tokenizer.token_to_id(t) is not None]
        if sentinels:
            self.add_tokens(sentinels, special=True)  # same ids: only the flag changes

    @classmethod
    def from_file(cls, path: str) -> "HFTokenizer":
        return cls(tokenizers.Tokenizer.from_file(path))

    @classmethod
    def from_hf_directory(cls, tokenizer_file: str, config_file: str) -> "HFTokenizer":
        """A Hugging Face tokenizer directory's tokenizer.json, eod the eos_token its tokenizer_config.json names
        (the model family's: DeepSeek-Coder's ``<｜end▁of▁sentence｜>``, Llama's ``</s>``, Qwen2.5-Coder's and
        StarCoder2's ``<|endoftext|>``), or ``<|endoftext|>`` when it names none."""
        tokenizer = tokenizers.Tokenizer.from_file(tokenizer_file)
        eos = hf_eos_token(config_file)
        if eos is not None and tokenizer.token_to_id(eos) is None:
            raise RuntimeError(f"{config_file} names eos_token {eos[:40]!r}, which {tokenizer_file} lacks")
        return cls(tokenizer, eos or EOD_TOKEN)

    @classmethod
    def from_gpt2_files(cls, vocab_file: str, merge_file: str) -> "HFTokenizer":
        # transformers 5.x GPT2TokenizerFast(vocab_file=, merges_file=) silently builds an empty
        # tokenizer, so assemble GPT-2's pipeline ourselves.
        tokenizer = tokenizers.Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        return cls(tokenizer)

    def _refresh_vocab_size(self) -> None:
        # max id + 1, not get_vocab_size(): a hand-edited file may have holes in its ids (_require_dense_ids
        # refuses a file whose holes outnumber its tokens).
        ids = self._tokenizer.get_vocab(with_added_tokens=True).values()
        self.vocab_size, self.num_ids = max(ids) + 1, len(set(ids))

    def add_tokens(self, tokens: list[str], special: bool = False) -> list[int]:
        """Appends the missing ones as special tokens; ``special=True`` also makes those present special
        (same ids), so that text spelling them out encodes as text."""
        todo = tokens if special else [t for t in tokens if self._tokenizer.token_to_id(t) is None]
        if todo:
            self._tokenizer.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in todo]
            )
        self._refresh_vocab_size()
        return [self._tokenizer.token_to_id(t) for t in tokens]

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; eod is its `</s>` (or a `<|endoftext|>` piece if eos is off)."""

    def __init__(self, model_file: str):
        import sentencepiece  # optional dependency (the dev extra)

        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self._sp.get_piece_size()
        self._added: dict[str, int] = {}
        eod = self._sp.eos_id()
        if eod < 0:
            eod = self._sp.piece_to_id(EOD_TOKEN)
            if eod == self._sp.unk_id():
                raise TokenizerError(f"SentencePiece model {model_file}: no eos and no {EOD_TOKEN}")
        self.eod = eod

    def add_tokens(self, tokens: list[str]) -> list[int]:
        # Only reserves ids (whitespace encoding emits them itself); the .model file is untouched.
        for token in tokens:
            if token not in self._added:
                self._added[token] = self.vocab_size
                self.vocab_size += 1
        return [self._added[t] for t in tokens]

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)


class WhitespaceEncodingTokenizer(Tokenizer):
    """Wraps a tokenizer so each run of 2..max_run spaces is one extra token (CodeGeeX).

    Text between runs goes to the inner tokenizer, all pieces of a batch in one call. Decoding
    turns those ids back into spaces, so the round trip is exact whenever the inner tokenizer's
    is (byte-level BPE: always; SentencePiece: only if trained to keep whitespace).
    """

    def __init__(self, inner: Tokenizer, max_run: int = DEFAULT_MAX_WHITESPACE_RUN):
        self.inner = inner
        self.max_run = max_run
        run_lengths = range(2, max_run + 1)
        ids = inner.add_tokens([whitespace_token(n) for n in run_lengths])
        self._run_to_id = dict(zip(run_lengths, ids))
        self._id_to_run = {i: n for n, i in self._run_to_id.items()}
        self.eod = inner.eod

    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        return self.inner.vocab_size

    def add_tokens(self, tokens: list[str]) -> list[int]:
        return self.inner.add_tokens(tokens)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        split = [split_whitespace_runs(t, self.max_run) for t in texts]
        pieces = [p for parts in split for p in parts if isinstance(p, str)]
        encoded = iter(self.inner.encode_batch(pieces))
        out = []
        for parts in split:
            ids: list[int] = []
            for p in parts:
                ids.extend([self._run_to_id[p]] if isinstance(p, int) else next(encoded))
            out.append(ids)
        return out

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        start = 0
        for pos, i in enumerate(ids):
            if i in self._id_to_run:
                # Decode each stretch between runs on its own: runs sit at character boundaries.
                if start < pos:
                    out.append(self.inner.decode(ids[start:pos]))
                out.append(" " * self._id_to_run[i])
                start = pos + 1
        if start < len(ids):
            out.append(self.inner.decode(ids[start:]))
        return "".join(out)


def _require_file(path: str | None, flag: str, tokenizer_type: str) -> str:
    if path is None:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file (tokenizer type {tokenizer_type})")
    return path


def _model_source(tokenizer_model: str | None, kind: str) -> tuple[str, object, tuple]:
    """(description for errors, loader, its args) for --tokenizer-model: a file, or a Hugging Face tokenizer
    directory (``save_pretrained``'s: tokenizer.json, else GPT-2's vocab.json + merges.txt with added_tokens.json;
    for SentencePiece its tokenizer.model)."""
    if tokenizer_model is None:
        raise TokenizerError(f"--tokenizer-type {kind} needs --tokenizer-model")
    path = Path(tokenizer_model)
    what = f"--tokenizer-model {path}"
    sentencepiece = kind == "SentencePieceTokenizer"
    load = SentencePieceTokenizer if sentencepiece else HFTokenizer.from_file
    if path.is_file():
        return what, load, (str(path),)
    if not path.is_dir():
        raise FileNotFoundError(f"{what}: no such file or directory (tokenizer type {kind})")
    if sentencepiece:
        if (path / "tokenizer.model").is_file():
            return what, load, (str(path / "tokenizer.model"),)
    elif (path / "tokenizer.json").is_file() and kind == "HFTokenizer":  # its eos: tokenizer_config.json's
        return what, HFTokenizer.from_hf_directory, (str(path / "tokenizer.json"), str(path / TOKENIZER_CONFIG))
    elif (path / "tokenizer.json").is_file():
        return what, load, (str(path / "tokenizer.json"),)
    elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        return what, _from_gpt2_directory, (str(path / "vocab.json"), str(path / "merges.txt"),
                                            path / "added_tokens.json")
    wanted = "tokenizer.model" if sentencepiece else "tokenizer.json or vocab.json + merges.txt"
    raise TokenizerError(f"{what}: a directory without {wanted} (tokenizer type {kind})")


def hf_eos_token(config_file: str | os.PathLike) -> str | None:
    """The eos_token a Hugging Face tokenizer_config.json names (a string, or an added token's ``content``); None
    when the file is absent or names none. Read whole: call ``check_file`` on it first (``_load`` does)."""
    if not os.path.isfile(config_file):
        return None
    try:
        config = json.loads(Path(config_file).read_text(encoding="utf-8"))
    except ValueError as e:
        raise RuntimeError(f"{config_file}: not JSON ({e})") from None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is not None and not isinstance(eos, str):
        raise RuntimeError(f"{config_file}: eos_token is not a token (a string, or an object with its content)")
    return eos


def _from_gpt2_directory(vocab: str, merges: str, added_tokens: Path) -> "HFTokenizer":
    """vocab.json + merges.txt, and the added tokens of added_tokens.json (``{token: id}``) at their ids."""
    tokenizer = HFTokenizer.from_gpt2_files(vocab, merges)
    if added_tokens.is_file():
        try:
            table = json.loads(added_tokens.read_text(encoding="utf-8"))
            items = sorted(table.items(), key=lambda kv: kv[1])
        except (ValueError, TypeError, AttributeError) as e:
            raise RuntimeError(f"{added_tokens}: not a JSON object of token -> id ({e})") from None
        ids = tokenizer.add_tokens([token for token, _ in items])
        wrong = [(t, want, got) for (t, want), got in zip(items, ids) if want != got]
        if wrong:
            t, want, got = wrong[0]
            raise RuntimeError(f"{added_tokens}: {t} should have id {want} but the vocabulary gives it {got} "
                               f"({len(wrong)} such)")
    return tokenizer


SPARSE_ID_SLACK = 1024
"""Ids a tokenizer may leave unused beyond as many as it has tokens (reserved ranges) before it is refused."""


def _require_dense_ids(tokenizer: Tokenizer, what: str) -> None:
    """The model gets one embedding row per id up to the largest, so ids must number the tokens: one stray large id
    (a hand-edited file) would otherwise make a table of that many rows, nearly all of them for no token."""
    count = getattr(tokenizer, "num_ids", None)
    if count is not None and tokenizer.vocab_size > 2 * count + SPARSE_ID_SLACK:
        raise TokenizerError(
            f"{what}: its largest id is {tokenizer.vocab_size - 1} but it has only {count} tokens, so the model "
            f"would get {tokenizer.vocab_size} embedding rows, {tokenizer.vocab_size - count} of them for ids no "
            f"token has: renumber the tokens 0..{count - 1} (ids may leave at most {count + SPARSE_ID_SLACK} unused)")


MAX_TOKENIZER_FILE_BYTES = 256 << 20
"""The largest tokenizer file read (tokenizer.json, vocab.json, merges.txt, a SentencePiece model): the largest
public vocabularies' files are tens of MiB."""


def _load(what: str, load, *args) -> Tokenizer:
    """Run a tokenizer library's loader on user files; what it raises for a malformed, truncated or
    unreadable file (the Rust ``tokenizers`` a bare Exception, sentencepiece RuntimeError / OSError)
    becomes one TokenizerError naming ``what`` (the flags and files). Each file in ``args`` (the loaders' arguments
    are the files they read; an optional one may be missing) is first checked a regular file of at most
    ``MAX_TOKENIZER_FILE_BYTES``: the libraries read a file whole, whatever it is (/dev/zero until memory runs out)."""
    for path in args:
        if os.path.lexists(path):
            try:
                check_file(path, MAX_TOKENIZER_FILE_BYTES)
            except FileReadError as e:
                raise TokenizerError(f"{what}: {e}") from None
    try:
        tokenizer = load(*args)
    except ImportError as e:  # sentencepiece is optional
        raise TokenizerError(f"{what}: needs the {e.name} package (pip install {e.name})") from None
    except (RuntimeError, OSError) as e:
        reason = e
    except Exception as e:
        if type(e) is not Exception:  # only the bare Exception of `tokenizers` means a rejected file
            raise
        reason = e
    else:
        _require_dense_ids(tokenizer, what)
        return tokenizer
    raise TokenizerError(f"{what}: cannot load it: {' '.join(str(reason).split())}")


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    whitespace_encoding: bool = False,
    max_whitespace_run: int = DEFAULT_MAX_WHITESPACE_RUN,
) -> Tokenizer:
    """Build a tokenizer from Megatron-style flags; errors name the flag to fix."""
    if tokenizer_type in ("HFTokenizer", "SentencePieceTokenizer"):
        what, load, args = _model_source(tokenizer_model, tokenizer_type)
        tokenizer: Tokenizer = _load(what, load, *args)
    elif tokenizer_type == "GPT2BPETokenizer":
        vocab = _require_file(vocab_file, "--vocab-file", tokenizer_type)
        merges = _require_file(merge_file, "--merge-file", tokenizer_type)
        tokenizer = _load(f"--vocab-file {vocab} / --merge-file {merges}", HFTokenizer.from_gpt2_files, vocab,
                          merges)
    elif tokenizer_type == "CodeGeeXTokenizer":
        if max_whitespace_run != CODEGEEX_MAX_WHITESPACE_RUN:
            raise TokenizerError(f"CodeGeeXTokenizer encodes runs of up to {CODEGEEX_MAX_WHITESPACE_RUN} spaces, "
                                 f"not {max_whitespace_run}")
        return _codegeex_tokenizer(tokenizer_model, vocab_file, merge_file)  # whitespace encoding built in
    else:
        raise TokenizerError(
            f"unknown --tokenizer-type {tokenizer_type!r}; valid: {', '.join(TOKENIZER_TYPES)}"
        )
    if whitespace_encoding:
        tokenizer = WhitespaceEncodingTokenizer(tokenizer, max_whitespace_run)
    return tokenizer


# --- CodeGeeX ------------------------------------------------------------------------------------------

CODEGEEX_NUM_EXTRA_TOKENS = 143
"""GPT-J's `<|extratoken_1|>` .. `<|extratoken_143|>`, right after GPT-2's `<|endoftext|>` (id 50256)."""
CODEGEEX_MAX_WHITESPACE_RUN = DEFAULT_MAX_WHITESPACE_RUN  # CodeGeeX-13B: start id 10, max length 10


def codegeex_extra_tokens() -> list[str]:
    return [f"<|extratoken_{i}|>" for i in range(1, CODEGEEX_NUM_EXTRA_TOKENS + 1)]


def _codegeex_source(tokenizer_model: str | None, vocab_file: str | None,
                     merge_file: str | None) -> tuple[str, object, tuple]:
    """(description for errors, loader, its args) for the files the CodeGeeXTokenizer flags name."""
    kind = "CodeGeeXTokenizer"
    if vocab_file is not None or merge_file is not None:  # GPT-2's two files win over --tokenizer-model
        vocab = _require_file(vocab_file, "--vocab-file", kind)
        merges = _require_file(merge_file, "--merge-file", kind)
        return f"--vocab-file {vocab} / --merge-file {merges}", HFTokenizer.from_gpt2_files, (vocab, merges)
    if tokenizer_model is None:
        raise TokenizerError(f"--tokenizer-type {kind} needs --vocab-file and --merge-file (GPT-2's), or "
                             f"--tokenizer-model (a tokenizer.json or a Hugging Face tokenizer directory)")
    return _model_source(tokenizer_model, kind)


def _codegeex_tokenizer(tokenizer_model: str | None, vocab_file: str | None,
                        merge_file: str | None) -> "WhitespaceEncodingTokenizer":
    what, load, args = _codegeex_source(tokenizer_model, vocab_file, merge_file)
    inner = _load(what, load, *args)
    assert isinstance(inner, HFTokenizer)
    extras = codegeex_extra_tokens()
    # Special, so that a document's literal "<|extratoken_12|>" stays text (CodeGeeX's own tokenizer would read it
    # as the token); those missing are appended in order, after <|endoftext|>.
    ids = inner.add_tokens(extras, special=True)
    expected = list(range(inner.eod + 1, inner.eod + 1 + len(extras)))
    if inner.eod != inner.vocab_size - 1 - len(extras) or ids != expected:
        wrong = next((t, i) for t, i, e in zip(extras, ids, expected) if i != e) if ids != expected else None
        detail = (f"{wrong[0]} has id {wrong[1]}" if wrong else
                  f"the vocabulary has {inner.vocab_size} ids, not <|endoftext|>'s id + 1 + {len(extras)}")
        raise TokenizerError(f"{what}: not CodeGeeX's vocabulary (GPT-2's ids ending in {EOD_TOKEN} = "
                             f"{inner.eod}, then <|extratoken_1|>..<|extratoken_{len(extras)}|> at ids "
                             f"{expected[0]}..{expected[-1]}): {detail}")
    return WhitespaceEncodingTokenizer(inner, CODEGEEX_MAX_WHITESPACE_RUN)


def default_tokenizer(whitespace_encoding: bool = True) -> Tokenizer:
    """The shipped byte-level BPE (vocab 8192, trained on the stdlib's Python source).

    Whitespace encoding is on by default: the file already holds the extra tokens, so it costs
    no vocabulary, and indented code gets noticeably shorter.
    """
    path = DEFAULT_TOKENIZER_PATH
    return build_tokenizer("HFTokenizer", path, whitespace_encoding=whitespace_encoding)


def load_tokenizer(flags) -> Tokenizer:
    """The tokenizer the data flags name: ``flags`` has ``DataConfig``'s ``tokenizer_type``, ``tokenizer_model``,
    ``vocab_file``, ``merge_file`` and ``whitespace_encoding``; no ``--tokenizer-type`` means the shipped default.
    With ``fim_rate`` above 0 it holds the code sentinels (``code_tokens``), so the model's padded vocabulary has
    rows for them. Raises ``TokenizerError`` naming the flag."""
    tokenizer = _tokenizer_from_flags(flags)
    if getattr(flags, "fim_rate", 0):
        code_tokens(tokenizer)
    return tokenizer


def _tokenizer_from_flags(flags) -> Tokenizer:
    if flags.tokenizer_type is None:
        if flags.tokenizer_model or flags.vocab_file or flags.merge_file:
            raise TokenizerError("--tokenizer-model/--vocab-file/--merge-file given without --tokenizer-type")
        return default_tokenizer()
    try:
        return build_tokenizer(flags.tokenizer_type, flags.tokenizer_model, flags.vocab_file, flags.merge_file,
                               flags.whitespace_encoding)
    except TokenizerError:
        raise
    except (ValueError, OSError) as e:
        raise TokenizerError(str(e)) from None


def check_tokenizer_fits_vocab(tokenizer: Tokenizer, padded_vocab_size: int) -> None:
    """ValueError when the tokenizer can emit ids the model's embedding has no row for."""
    if tokenizer.vocab_size > padded_vocab_size:
        raise ValueError(
            f"tokenizer vocab size {tokenizer.vocab_size} (ids up to {tokenizer.vocab_size - 1}) "
            f"exceeds the model's padded vocab size {padded_vocab_size}: use a tokenizer file "
            f"with at most {padded_vocab_size} ids (--tokenizer-model / --vocab-file), or a model "
            f"vocab of at least {tokenizer.vocab_size} "
            "(--make-vocab-size-divisible-by)"
        )
