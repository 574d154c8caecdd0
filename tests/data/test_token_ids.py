"""Every token id inside the vocabulary, at any TP size: the whole dataset's id range at start-up (one error line,
exit 2, before any process group), and every sample as it is read (data changed after the start-up check).

At TP >= 2 the vocab-parallel embedding and loss mask ids outside a shard, so a bad id would otherwise train
silently; these tests stop pretrain.main before it joins a process group (reaching one fails the test)."""

import json
import re
import shutil

import numpy as np
import pytest

from codegeex_train import pretrain
from codegeex_train.data import npy_cache, token_range
from codegeex_train.data.gpt_dataset import GPTDataset
from codegeex_train.data.indexed_dataset import MMapIndexedDataset, bin_path
from codegeex_train.data.sampler import build_pretraining_data_loader
from codegeex_train.preprocessing.default_corpus import default_corpus_files
from codegeex_train.preprocessing.preprocess import TokenizerSpec, preprocess
from codegeex_train.data.token_range import TokenIdError, check_token_ids
from codegeex_train.tokenization.tokenizer import DEFAULT_TOKENIZER_PATH
from tests.harness import another_tokenizer, fails_with, tiny_model_args, write_indexed_dataset

MODEL = tiny_model_args()  # the shipped tokenizer: 8192 ids, padded to 8192 at TP 1 and 2


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """pretrain.main in an empty working directory that must stay empty; joining a process group fails the test."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    def joined(*args, **kwargs):
        raise AssertionError("the bad data got past the start-up checks")

    monkeypatch.setattr(pretrain, "init_distributed", joined)
    yield
    assert list(cwd.iterdir()) == []



def test_negative_ids_are_refused_at_tp1(capsys, run_dir, tmp_path):
    write_indexed_dataset(tmp_path / "neg", [[1, 2, 3], [4, -7, 5]], np.int16)
    fails_with(capsys, MODEL + ["--data-path", str(tmp_path / "neg")], "--data-path", "neg.bin",
               "token id -7 at position 1 of document 1", "negative", "tools/preprocess_data.py")


def test_negative_ids_are_refused_at_tp2(capsys, run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    write_indexed_dataset(tmp_path / "neg", [[1, 2, 3], [4, 5], [-1]], np.int32)
    fails_with(capsys, MODEL + ["--data-path", str(tmp_path / "neg"), "--tensor-model-parallel-size", "2"],
               "--data-path", "token id -1 at position 0 of document 2", "negative")


def test_ids_beyond_the_vocabulary_after_the_first_2_24_tokens(capsys, run_dir, tmp_path):
    """The whole file is scanned, not a head: the bad id sits past the 2^24 tokens the old check read."""
    write_indexed_dataset(tmp_path / "long", [np.ones((1 << 24) + 5, np.uint16), [3, 9000, 4]], np.uint16)
    fails_with(capsys, MODEL + ["--train-data-path", str(tmp_path / "long")], "--train-data-path",
               "token id 9000 at position 1 of document 1", "8192 ids", "--tokenizer-type")


def test_ids_are_checked_against_the_tokenizers_own_ids(capsys, run_dir, tmp_path):
    """The padding rows are no token's: with the vocabulary padded to 16384, id 9000 is still outside the shipped
    tokenizer's 8192 ids (data made with a larger tokenizer)."""
    write_indexed_dataset(tmp_path / "d", [[1, 2, 3], [4, 9000]], np.uint16)
    fails_with(capsys, MODEL + ["--data-path", str(tmp_path / "d"), "--make-vocab-size-divisible-by", "16384"],
               "token id 9000 at position 1 of document 1", "beyond the vocabulary (8192 ids)", "--tokenizer-type")


# --- the tokenizer preprocessing recorded beside the data (PREFIX.meta.json) is the run's --------------------------

@pytest.fixture(scope="module")
def shipped_data(tmp_path_factory) -> str:
    """Stdlib files preprocessed with the shipped tokenizer, with whitespace encoding as pretrain's default has it."""
    out = tmp_path_factory.mktemp("recorded") / "stdlib"
    return preprocess(default_corpus_files()[:20], str(out), TokenizerSpec(whitespace_encoding=True), append_eod=True,
                      progress=False).output_prefixes[0]


def test_data_written_by_another_tokenizer_is_refused(capsys, run_dir, tmp_path, shipped_data):
    """Another tokenizer of the same size (the same padded vocabulary, every id in range) is refused by its
    fingerprint: one line naming both tokenizers, both fingerprints and the flags that fix it."""
    other = another_tokenizer(tmp_path / "other")
    line = fails_with(capsys, MODEL + ["--data-path", shipped_data, "--tokenizer-type", "HFTokenizer",
                                       "--tokenizer-model", other, "--whitespace-encoding"],
                      f"--data-path {shipped_data}: written with another tokenizer than this run's: HFTokenizer "
                      f"{DEFAULT_TOKENIZER_PATH}, whitespace encoding, fingerprint ",
                      f"8192 ids; this run's is HFTokenizer {other}, whitespace encoding, which has fingerprint ",
                      f"over those ids: pass --tokenizer-type HFTokenizer --tokenizer-model {DEFAULT_TOKENIZER_PATH} "
                      "--whitespace-encoding as tools/preprocess_data.py did")
    recorded = json.loads(open(shipped_data + ".meta.json").read())["tokenizer"]["fingerprint"]
    ours, theirs = re.findall(r"fingerprint ([0-9a-f]{16})", line)
    assert ours == recorded != theirs


def test_the_same_tokenizer_passes_by_any_path(tmp_path, shipped_data):
    """The shipped default, its file in a Hugging Face directory elsewhere, and either with FIM's sentinels appended
    (ids above the data's) are the tokenizer the data was written with."""
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(DEFAULT_TOKENIZER_PATH, hf / "tokenizer.json")
    by_dir = ["--tokenizer-type", "HFTokenizer", "--tokenizer-model", str(hf), "--whitespace-encoding"]
    for flags in ([], by_dir, ["--fim-rate", "0.5"], by_dir + ["--fim-rate", "0.5"]):
        pretrain.prepare(MODEL + ["--data-path", shipped_data, *flags])


def test_data_without_a_record_is_not_checked(tmp_path, shipped_data):
    """Data preprocessed before records existed: any tokenizer whose ids cover it passes, as before."""
    for suffix in (".bin", ".idx"):
        shutil.copy(shipped_data + suffix, tmp_path / f"legacy{suffix}")
    pretrain.prepare(MODEL + ["--data-path", str(tmp_path / "legacy"), "--tokenizer-type", "HFTokenizer",
                              "--tokenizer-model", another_tokenizer(tmp_path), "--whitespace-encoding"])


def test_a_corrupt_index_is_one_error_line(capsys, run_dir, tmp_path):
    """Pointers past the end of .bin used to pass the start-up check and fail mid-run (test_hostile_index.py: all)."""
    write_indexed_dataset(tmp_path / "d", [[1, 2, 3], [4, 5]], np.uint16)
    with open(tmp_path / "d.idx", "r+b") as f:
        f.seek(34 + 4 * 2 + 8)  # header, 2 lengths, pointer 0: pointer 1
        f.write(np.int64(40).tobytes())
    fails_with(capsys, MODEL + ["--data-path", str(tmp_path / "d")], "--data-path", "d.idx: sequence 1 (pointer 40",
               "past the end", "d.bin is 10 bytes", "tools/preprocess_data.py")


@pytest.mark.parametrize("dtype,bad,vocab", [(np.int8, -3, 100), (np.int16, -300, 100), (np.int32, 100, 100),
                                             (np.int64, -2**40, 100), (np.uint8, 200, 100), (np.uint16, 60000, 100),
                                             (np.float32, -1.0, 100), (np.int16, -20000, 50400)])  # CodeGeeX's vocab
def test_every_dtype(tmp_path, dtype, bad, vocab):
    write_indexed_dataset(tmp_path / "good", [[0, 1], [99, 5]], dtype)
    check_token_ids(MMapIndexedDataset(str(tmp_path / "good")), vocab)
    write_indexed_dataset(tmp_path / "bad", [[0, 1], [99, 5], [7, 7, bad]], dtype)
    with pytest.raises(TokenIdError, match=rf"token id {bad} at position 2 of document 2 in .*bad\.bin"):
        check_token_ids(MMapIndexedDataset(str(tmp_path / "bad")), vocab)


def test_every_chunk_is_scanned(tmp_path, monkeypatch):
    monkeypatch.setattr(token_range, "CHUNK_TOKENS", 3)
    write_indexed_dataset(tmp_path / "d", [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 1000]])
    with pytest.raises(TokenIdError, match="token id 1000 at position 10 of document 2"):
        check_token_ids(MMapIndexedDataset(str(tmp_path / "d")), 999)


def test_range_is_cached_beside_the_index_and_rescanned_when_the_data_changes(tmp_path, monkeypatch):
    prefix = str(tmp_path / "d")
    write_indexed_dataset(prefix, [[1, 2], [3, 4]], np.uint16)
    assert list(token_range.token_range(MMapIndexedDataset(prefix))) == [1, 4]
    assert len(list(tmp_path.glob("d_ids_*_range.npy"))) == 1

    def scan(tokens):
        scanned.append(tokens.size)
        return real_scan(tokens)

    scanned, real_scan = [], token_range.scan_token_range
    monkeypatch.setattr(token_range, "scan_token_range", scan)
    assert list(token_range.token_range(MMapIndexedDataset(prefix))) == [1, 4] and scanned == []  # from the cache
    write_indexed_dataset(prefix, [[1, 2], [3, 9000]], np.uint16)  # rebuilt: the same sizes, new files
    with pytest.raises(TokenIdError, match="token id 9000 at position 1 of document 1"):
        check_token_ids(MMapIndexedDataset(prefix), 8192)
    assert scanned == [4]
    for stale in tmp_path.glob("d_ids_*_range.npy"):
        stale.write_bytes(b"not a numpy file")  # an unreadable cache is a miss
    with pytest.raises(TokenIdError, match="token id 9000"):
        check_token_ids(MMapIndexedDataset(prefix), 8192)
    assert scanned == [4, 4]


def test_a_cache_that_cannot_be_written_is_no_error(tmp_path, monkeypatch):
    def read_only(path, array):
        raise PermissionError(13, "Read-only file system", path)

    monkeypatch.setattr(npy_cache, "_save_atomic", read_only)
    write_indexed_dataset(tmp_path / "d", [[1, 2], [3, -4]], np.int16)
    with pytest.raises(TokenIdError, match="token id -4"):
        check_token_ids(MMapIndexedDataset(str(tmp_path / "d")), 8192)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]


def test_every_sample_is_checked_as_it_is_read(tmp_path):
    """Data changed after the start-up check: the sample holding the bad id names the file and the document."""
    prefix = str(tmp_path / "d")
    write_indexed_dataset(prefix, [np.arange(10) + 10 * k for k in range(6)], np.int32)
    dataset = GPTDataset(MMapIndexedDataset(prefix), "train", (0, 6), 8, 7, seed=1, vocab_size=100)
    assert all(len(dataset[i]["text"]) == 9 for i in range(len(dataset)))
    data = np.memmap(bin_path(prefix), dtype=np.int32, mode="r+")
    data[43] = -5  # document 4, position 3
    data.flush()
    with pytest.raises(TokenIdError, match=rf"token id -5 at position 3 of document 4 in {bin_path(prefix)} is "
                                           "negative: the data changed after the start-up check"):
        for i in range(len(dataset)):
            dataset[i]
    loader = build_pretraining_data_loader(dataset, 0, 2, 0, 1, num_workers=1, total_samples=len(dataset))
    with pytest.raises(TokenIdError, match="token id -5 at position 3 of document 4") as raised:  # from a worker
        list(loader)
    line = raised.value.one_line()  # what pretrain.main prints: the message without the worker's traceback
    assert "\n" not in line and line.startswith("token id -5 at position 3 of document 4"), line
