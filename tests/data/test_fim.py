"""Fill-in-the-middle on the stored tokens (data/fim.py): layouts, the text round trip over 10,000 samples of real
code, the rates, whitespace, length, the cases left alone, determinism across resume / DP / workers, the flags and
what a checkpoint records."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from codegeex_train.checkpoint.files import checkpoint_fim, checkpoint_tokenizer, tokenizer_settings
from codegeex_train.config.arguments import DataConfig
from codegeex_train.tokenization.code_tokens import code_tokens, held_code_tokens
from codegeex_train.preprocessing.default_corpus import default_corpus_files
from codegeex_train.data.fim import FIM, FIMDataset, fim_from_flags, sample_rng
from codegeex_train.data.gpt_dataset import build_train_valid_test_datasets
from codegeex_train.data.sampler import build_pretraining_data_loader
from codegeex_train.tokenization.tokenizer import default_tokenizer, load_tokenizer
from tests.harness import write_indexed_dataset

SEQ_LENGTH, NUM_SAMPLES, SEED = 64, 10_000, 1234


@pytest.fixture(scope="module")
def tok():
    tokenizer = default_tokenizer()
    return tokenizer, code_tokens(tokenizer)


class Draws:
    """A stand-in generator that returns chosen draws: ``random()`` 0 (FIM; SPM when spm_rate > 0), the cut
    points given."""

    def __init__(self, lo, hi, random=0.0):
        self.cut, self.value = np.array([hi, lo]), random  # unsorted on purpose

    def random(self):
        return self.value

    def integers(self, low, high, size):
        assert (low, size) == (0, 2) and high > self.cut.max()
        return self.cut


def restore(segment, tokenizer, t):
    """An independent reading of one transformed segment: (original text, suffix length in characters), or None
    when it is not a FIM example. Both orders put the suffix between <fim_suffix> and <fim_middle>; what follows
    <fim_middle> is the middle (PSM) or prefix + middle (SPM), and what PSM puts between <fim_prefix> and
    <fim_suffix> is the prefix (SPM: nothing)."""
    ids = list(segment)
    if not ids or ids[0] != t.fim_prefix:
        return None
    s, m = ids.index(t.fim_suffix), ids.index(t.fim_middle)
    assert 1 <= s < m
    prefix, suffix, after = (tokenizer.decode(ids[a:b]) for a, b in ((1, s), (s + 1, m), (m + 1, len(ids))))
    return prefix + after + suffix, len(suffix)


def test_layouts_are_starcoders(tok):
    """PSM and SPM token by token, written out here (not through code_tokens.fim_layout)."""
    tokenizer, t = tok
    text = "def add(a, b):\n    return a + b\n"
    ids = np.array(tokenizer.encode(text))
    lo, hi = 4, 19
    p, m, s = (tokenizer.encode(x) for x in (text[:lo], text[lo:hi], text[hi:]))
    psm = FIM(tokenizer, t, rate=1.0, spm_rate=0.0).apply(ids, Draws(lo, hi))
    spm = FIM(tokenizer, t, rate=1.0, spm_rate=1.0).apply(ids, Draws(lo, hi))
    full_psm = [t.fim_prefix, *p, t.fim_suffix, *s, t.fim_middle, *m]
    full_spm = [t.fim_prefix, t.fim_suffix, *s, t.fim_middle, *p, *m]
    assert psm.tolist() == full_psm[:len(ids)] and spm.tolist() == full_spm[:len(ids)]
    assert len(full_psm) > len(ids)  # the sample keeps its length: truncated


def test_a_cut_inside_a_run_of_spaces_leaves_two_runs(tok):
    tokenizer, t = tok
    text = "if x:\n      y = 1\n"  # a run of 6 spaces at 6..12
    ids = tokenizer.encode(text)
    run = {n: tokenizer.encode(" " * n) for n in (2, 4, 6)}
    assert all(len(r) == 1 for r in run.values()) and run[6][0] in ids  # one whitespace token each
    sample = np.array(ids + [tokenizer.eod] * 20)  # room for the sentinels: nothing truncated
    out = FIM(tokenizer, t, rate=1.0, spm_rate=0.0).apply(sample, Draws(8, 14)).tolist()
    prefix, middle = out[1:out.index(t.fim_suffix)], out[out.index(t.fim_middle) + 1:out.index(tokenizer.eod)]
    assert prefix[-1] == run[2][0] and middle[0] == run[4][0]
    assert restore(out[:out.index(tokenizer.eod)], tokenizer, t)[0] == text


def test_shorter_samples_are_padded_and_padding_has_no_loss(tok):
    """Stored ids that spell a word one character at a time re-encode shorter: <fim_pad> fills the end."""
    tokenizer, t = tok
    text = "return_value_of_the_function"
    ids = [i for c in text for i in tokenizer.encode(c)] + [tokenizer.eod]
    fim = FIM(tokenizer, t, rate=1.0, spm_rate=0.0)
    out = fim.apply(np.array(ids), Draws(7, 12))
    n = out.tolist().index(tokenizer.eod)
    assert len(out) == len(ids) and n < len(ids) - 1 and set(out[n + 1:].tolist()) == {t.fim_pad}
    assert restore(out[:n], tokenizer, t)[0] == text

    class Stored:
        def __getitem__(self, i):
            return {"text": np.array(ids)}

        def __len__(self):
            return 1

    item = FIMDataset(Stored(), fim, SEED)[0]
    labels = item["text"][1:]
    assert item["loss_mask"].dtype == np.float32 and len(item["loss_mask"]) == len(labels)
    assert np.array_equal(item["loss_mask"] == 0, labels == t.fim_pad) and (labels == t.fim_pad).any()


def test_every_eod_stays_and_empty_documents_stay_empty(tok):
    tokenizer, t = tok
    eod = tokenizer.eod
    a, b = tokenizer.encode("x = 1\n"), tokenizer.encode("y = 2\n")
    sample = np.array([eod, eod, *a, eod, eod, *b, eod] + [eod] * 12)
    out = FIM(tokenizer, t, rate=1.0).apply(sample, sample_rng(0, 0))
    where = np.flatnonzero(out == eod).tolist()
    assert where[:2] == [0, 1] and out[where[2] + 1] == eod  # the empty documents: nothing between their EODs
    assert [restore(out[i + 1:j], tokenizer, t)[0] for i, j in ((1, where[2]), (where[3], where[4]))] == \
        ["x = 1\n", "y = 2\n"]


def test_sentinels_and_cut_characters_are_left_as_stored(tok):
    tokenizer, t = tok
    fim = FIM(tokenizer, t, rate=1.0)
    with_sentinel = np.array([t.repo_name, *tokenizer.encode("org/project"), tokenizer.eod])
    assert np.array_equal(fim.apply(with_sentinel, sample_rng(0, 1)), with_sentinel)
    ids = tokenizer.encode("s = '中文'\n")
    for start in range(1, len(ids)):  # a sample that begins inside a multi-byte character
        if "\ufffd" in tokenizer.decode(ids[start:]):
            edge = np.array(ids[start:])
            break
    else:
        pytest.fail("no token of '中文' holds part of a character: pick another string")
    assert np.array_equal(fim.apply(edge, sample_rng(0, 2)), edge)


def test_split_sample_transforms_each_file_of_a_repository(tok):
    tokenizer, t = tok
    files = ["a.py\nimport os\n", "b.py\ndef f():\n    return 2\n", "c.py\nX = [1, 2, 3]\n"]
    doc = [t.repo_name, *tokenizer.encode("org/repo")]
    for f in files:
        doc += [t.file_sep, *tokenizer.encode(f)]
    sample = np.array(doc + [tokenizer.eod] * 40)
    flags = SimpleNamespace(fim_rate=1.0, fim_spm_rate=0.5, fim_split_sample="<file_sep>", fim_fragment_rate=None)
    fim = fim_from_flags(flags, tokenizer)
    assert fim.split_sample == t.file_sep
    out = fim.apply(sample, sample_rng(SEED, 3))
    body = out[:out.tolist().index(tokenizer.eod)]
    seps = np.flatnonzero(body == t.file_sep)
    assert len(seps) == 3 and body[:seps[0]].tolist() == doc[:seps[0]]  # the header (a sentinel) as stored
    fragments = np.split(body, seps)[1:]
    assert [restore(f[1:], tokenizer, t)[0] for f in fragments] == files
    # The document is chosen with --fim-rate, then each file with --fim-fragment-rate (Megatron's rule).
    none = FIM(tokenizer, t, rate=1.0, split_sample=t.file_sep, fragment_rate=0.0).apply(sample, sample_rng(0, 3))
    assert np.array_equal(none, sample)
    assert np.array_equal(FIM(tokenizer, t, rate=0.0, split_sample=t.file_sep, fragment_rate=1.0).apply(
        sample, sample_rng(0, 3)), sample)


@pytest.fixture(scope="module")
def code_corpus(tmp_path_factory, tok):
    """Short documents of real code (runs of 1-5 lines of the stdlib), stored with EOD as preprocessing does;
    {token ids: text} of each."""
    tokenizer, _ = tok
    rng = np.random.default_rng(0)
    texts, size = [], 0
    for path in default_corpus_files():
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        while lines and size < 200_000:
            n = int(rng.integers(1, 6))
            texts.append("".join(lines[:n]))
            lines, size = lines[n:], size + len(texts[-1])
        if size >= 200_000:
            break
    encoded = tokenizer.encode_batch(texts)
    prefix = str(tmp_path_factory.mktemp("fim") / "code")
    write_indexed_dataset(prefix, [ids + [tokenizer.eod] for ids in encoded])
    return prefix, {tuple(ids): text for ids, text in zip(encoded, texts)}


def _datasets(prefix, tokenizer, rate=0.5, spm_rate=0.5, split="1,0,0", num_samples=NUM_SAMPLES):
    flags = SimpleNamespace(fim_rate=rate, fim_spm_rate=spm_rate, fim_split_sample=None, fim_fragment_rate=None)
    return build_train_valid_test_datasets([prefix], split, SEQ_LENGTH, SEED, (num_samples, 16, 0),
                                           fim=fim_from_flags(flags, tokenizer))


def test_10000_samples_give_back_their_documents_at_the_flags_rates(code_corpus, tok):
    """Every complete document comes back character for character and re-encodes to its stored ids; the FIM and SPM
    fractions and the mean cut point sit within 3 standard errors of what the flags and uniform cuts predict."""
    tokenizer, t = tok
    prefix, documents = code_corpus
    rate, spm_rate = 0.5, 0.3
    train = _datasets(prefix, tokenizer, rate, spm_rate)[0]
    assert isinstance(train, FIMDataset)
    eod = tokenizer.eod
    chosen = segments = restored = complete = edges = edge_token_diffs = 0
    p_s, p_s_expected, p_s_var = 0, 0.0, 0.0  # <fim_prefix><fim_suffix>: SPM, or PSM with an empty prefix
    cut, cut_expected, cut_var = 0, 0.0, 0.0  # the second cut point, in characters
    for i in range(NUM_SAMPLES):
        stored, item = train.dataset[i]["text"], train[i]
        out = item["text"]
        assert len(out) == len(stored) == SEQ_LENGTH + 1
        assert np.array_equal(item["loss_mask"], (out[1:] != t.fim_pad).astype(np.float32))
        pads = int((out == t.fim_pad).sum())  # only ever at the end
        before = np.split(stored, np.flatnonzero(stored == eod))
        after = np.split(out[:len(out) - pads], np.flatnonzero(out == eod))
        for k, (old, new) in enumerate(zip(before, after)):
            old, new = old[int(k > 0):], new[int(k > 0):]  # each piece after the first starts with its EOD
            if not len(old) or not len(new):
                continue
            segments += 1
            chosen += new[0] == t.fim_prefix
            if k == len(after) - 1 and not pads:  # possibly cut by the truncation
                continue
            found = restore(new, tokenizer, t)
            if found is None:
                assert np.array_equal(new, old)
                continue
            text, suffix_len = found
            restored += 1
            if 0 < k < len(before) - 1:  # a whole document: its source text, exactly
                complete += 1
                assert text == documents[tuple(old.tolist())]
                assert tokenizer.encode(text) == old.tolist()
            else:  # the sample's edges: partial documents
                edges += 1
                assert text == tokenizer.decode(old.tolist())
                edge_token_diffs += tokenizer.encode(text) != old.tolist()
            n = len(text)
            q = 1 - (n / (n + 1)) ** 2  # P(the first cut is 0): the prefix is empty
            p = spm_rate + (1 - spm_rate) * q
            p_s, p_s_expected, p_s_var = p_s + (new[1] == t.fim_suffix), p_s_expected + p, p_s_var + p * (1 - p)
            j = np.arange(1, n + 1)
            tail = 1 - (j / (n + 1)) ** 2  # P(the larger of the two cuts >= j)
            cut, cut_expected = cut + n - suffix_len, cut_expected + tail.sum()
            cut_var += ((2 * j - 1) * tail).sum() - tail.sum() ** 2
    se = math.sqrt(rate * (1 - rate) / segments)
    print(f"\n{NUM_SAMPLES} samples: {segments} documents or parts, FIM {chosen / segments:.4f} (rate {rate}, "
          f"se {se:.4f}); {complete} whole documents restored exactly; {edges} sample edges, {edge_token_diffs} "
          f"({edge_token_diffs / max(edges, 1):.2%}) re-encode to other ids than stored; <fim_prefix><fim_suffix> "
          f"{p_s} vs {p_s_expected:.1f} expected (sd {math.sqrt(p_s_var):.1f}); mean second cut "
          f"{cut / restored:.2f} vs {cut_expected / restored:.2f} characters")
    assert abs(chosen / segments - rate) < 3 * se
    assert abs(p_s - p_s_expected) < 3 * math.sqrt(p_s_var)
    assert abs(cut - cut_expected) < 3 * math.sqrt(cut_var)
    assert complete > 1000 and edges > 1000


def _tokens(dataset, consumed, micro, dp_rank, dp_size, workers=0, total=64):
    loader = build_pretraining_data_loader(dataset, consumed, micro, dp_rank, dp_size, num_workers=workers,
                                           total_samples=total)
    return [batch["text"] for batch in loader]


def test_resume_dp_and_workers_read_the_same_tokens(code_corpus, tok):
    """Each run builds its datasets afresh, as a restarted process does."""
    tokenizer, t = tok
    prefix, _ = code_corpus
    build = lambda: _datasets(prefix, tokenizer, num_samples=64)[0]  # noqa: E731
    dp1 = _tokens(build(), 0, 4, 0, 1)
    assert sum(int((b == t.fim_prefix).sum()) for b in dp1) > 10  # FIM examples among them
    resumed = _tokens(build(), 24, 4, 0, 1)
    dp2 = [_tokens(build(), 0, 2, r, 2) for r in range(2)]
    workers = _tokens(build(), 0, 4, 0, 1, workers=2)
    full = np.concatenate(dp1)
    assert np.array_equal(np.concatenate(resumed), full[24:])
    assert np.array_equal(np.concatenate([b for step in zip(*dp2) for b in step]), full)
    assert np.array_equal(np.concatenate(workers), full)


def test_only_the_training_split_is_transformed(code_corpus, tok):
    tokenizer, t = tok
    train, valid, _ = _datasets(code_corpus[0], tokenizer, rate=1.0, split="9,1,0", num_samples=16)
    assert isinstance(train, FIMDataset) and not isinstance(valid, FIMDataset)
    assert all(t.fim_prefix not in valid[i]["text"] for i in range(16))
    assert any(t.fim_prefix in train[i]["text"] for i in range(16))


@pytest.mark.parametrize("value,message", [
    ("no such token here", "is not one token of the tokenizer"),
    ("<fim_pad>", "is EOD or a FIM sentinel"),
    ("<|endoftext|>", "is EOD or a FIM sentinel"),
])
def test_a_split_sample_that_is_not_a_file_separator_token_is_refused(tok, value, message):
    flags = SimpleNamespace(fim_rate=0.5, fim_spm_rate=0.5, fim_split_sample=value, fim_fragment_rate=None)
    with pytest.raises(ValueError, match=message) as e:
        fim_from_flags(flags, tok[0])  # a run's tokenizer: load_tokenizer added the sentinels
    assert str(e.value).startswith("--fim-split-sample") and "\n" not in str(e.value)


def test_fim_takes_the_sentinels_the_run_tokenizer_holds_and_adds_none():
    """The sentinels are added in one place (load_tokenizer under --fim-rate); building the FIM transform only reads
    them, and a tokenizer without them is refused, left as it was."""
    flags = DataConfig(fim_rate=0.5)
    run = load_tokenizer(flags)
    assert fim_from_flags(flags, run).tokens == held_code_tokens(run) == code_tokens(run)
    plain = default_tokenizer()
    assert held_code_tokens(plain) is None
    with pytest.raises(ValueError, match="^--fim-rate: the tokenizer lacks the FIM sentinels"):
        fim_from_flags(flags, plain)
    assert plain.vocab_size == 8192 and held_code_tokens(plain) is None


def test_the_datasets_take_the_runs_fim_or_refuse():
    """pretrain.py builds the FIM transform once and hands it to the datasets; one left out (or handed at --fim-rate
    0) would change what trains without a word, so it is refused before anything is built."""
    from codegeex_train.training.batches import build_datasets

    flags = DataConfig(fim_rate=0.5)
    with pytest.raises(ValueError, match="--fim-rate 0.5 without a FIM transform"):
        build_datasets(flags, None, None, 0)
    with pytest.raises(ValueError, match="--fim-rate 0.0 with a FIM transform"):
        build_datasets(DataConfig(), None, None, 0, fim=fim_from_flags(flags, load_tokenizer(flags)))


def test_flags_give_the_sentinels_and_the_checkpoint_records_the_order(tok):
    assert fim_from_flags(DataConfig(), default_tokenizer()) is None
    plain, fim_run = load_tokenizer(DataConfig()), load_tokenizer(DataConfig(fim_rate=0.5))
    t = code_tokens(fim_run)
    assert fim_run.vocab_size == plain.vocab_size + 6 == max(t.__dict__.values()) + 1
    flags = DataConfig(fim_rate=0.5, fim_spm_rate=1.0)
    meta = {"tokenizer": tokenizer_settings(flags)}
    assert checkpoint_fim(meta) == {"fim_rate": 0.5, "fim_spm_rate": 1.0, "fim_split_sample": None,
                                    "fim_fragment_rate": None, "order": "spm"}
    assert checkpoint_fim({"tokenizer": tokenizer_settings(DataConfig(fim_rate=0.5))})["order"] == "psm"
    assert checkpoint_fim({"tokenizer": tokenizer_settings(DataConfig())}) is None and checkpoint_fim({}) is None
    settings, _ = checkpoint_tokenizer("ckpt", meta, {})  # a tool rebuilds the vocabulary training had
    assert load_tokenizer(DataConfig(**settings)).vocab_size == fim_run.vocab_size


def test_a_split_sample_that_is_not_one_token_is_refused_before_any_process_group(capsys, tiny_data, tmp_path):
    from tests.harness import fails_with, tiny_pretrain_args

    fails_with(capsys, tiny_pretrain_args(tiny_data, str(tmp_path), 1, "--fim-rate", "0.5", "--fim-split-sample",
                                          "no such token"), "--fim-split-sample", "not one token")
