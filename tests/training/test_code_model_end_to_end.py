"""A StarCoder-style code model with nothing but this stack, end to end on the tiny model: source trees ->
repository documents (deduplicated) -> FIM per file with document masking at DP 2 -> a checkpoint that records
its FIM order and tokenizer -> ``tools/generate.py --infill``. Each step's exactness is proven in its own tests
(tests/preprocessing/test_repo_documents.py, test_fim.py, tests/training/test_document_masking.py,
tests/generation/test_infill.py); this one proves they fit together."""

import json
import shutil

from codegeex_train.checkpoint.files import checkpoint_fim, read_checkpoint_meta
from codegeex_train.preprocessing.default_corpus import default_corpus_files
from codegeex_train.data.indexed_dataset import MMapIndexedDataset
from codegeex_train.tokenization.tokenizer import build_tokenizer
from codegeex_train.tokenization.code_tokens import code_tokens
from codegeex_train.evaluation import read_problems
from tests.harness import load_tool, metrics_records, run_distributed, run_pretrain, tiny_pretrain_args


def test_repository_documents_train_with_fim_and_masking_and_infill(tmp_path, capsys):
    sources = [p for p in default_corpus_files() if 2_000 < p.stat().st_size < 6_000][:12]
    repos = []
    for i in range(4):  # four repositories of three files, one file duplicated into the next repository
        repo = tmp_path / "repos" / f"repo{i}"
        (repo / "pkg").mkdir(parents=True)
        for j, source in enumerate(sources[3 * i:3 * i + 3]):
            shutil.copy(source, repo / "pkg" / f"m{j}.py")
        repos.append(str(repo))
    shutil.copy(sources[0], tmp_path / "repos" / "repo1" / "copy.py")
    prefix = tmp_path / "code"
    load_tool("preprocess_data").main(["--input", *repos, "--output-prefix", str(prefix), "--document-level", "repo",
                                       "--repo-format", "starcoder2", "--dedup", "exact", "--whitespace-encoding",
                                       "--append-eod", "--workers", "1"])
    capsys.readouterr()
    assert json.loads((tmp_path / "code_dedup.json").read_text())["removed_exact"] == 1
    tokenizer_file = tmp_path / "code_tokenizer.json"
    tokenizer = build_tokenizer("HFTokenizer", str(tokenizer_file), whitespace_encoding=True)
    tokens = code_tokens(tokenizer)
    data = MMapIndexedDataset(f"{prefix}_text_document")
    assert len(data) == 4 and all(int(data[i][0]) == tokens.repo_name for i in range(4))

    # two single-line infilling problems, the benchmark's format, for the during-training callback
    problems = tmp_path / "HumanEval-SingleLineInfilling.jsonl"
    with problems.open("w") as f:
        for task, p in list(read_problems().items())[:2]:
            lines = p["canonical_solution"].splitlines(keepends=True)
            f.write(json.dumps({"task_id": f"SingleLineInfilling/{task}/L0", "entry_point": p["entry_point"],
                                "prompt": p["prompt"], "canonical_solution": lines[0], "suffix": "".join(lines[1:]),
                                "test": p["test"]}) + "\n")
    save = tmp_path / "run"
    argv = tiny_pretrain_args(f"{prefix}_text_document", str(save), 3, "--split", "1", "--tokenizer-type", "HFTokenizer", "--tokenizer-model", str(tokenizer_file),
                              "--whitespace-encoding", "--fim-rate", "0.9", "--fim-spm-rate", "0.9",
                              "--fim-split-sample", "<file_sep>", "--reset-position-ids", "--reset-attention-mask",
                              "--eod-mask-loss", "--max-position-embeddings", "512", "--eval-infilling-interval", "3", "--eval-infilling-problems",
                              str(problems), "--eval-infilling-tasks", "2", "--eval-infilling-max-new-tokens", "4")
    run_distributed(run_pretrain, world_size=2, deadline_s=300, argv=argv)  # DP 2
    assert sorted(metrics_records(save)) == [1, 2, 3]
    assert metrics_records(save, "infilling")[3]["infilling_single_line_pass@1"] == 0.0  # 3 steps learn no code
    _, meta = read_checkpoint_meta(save)
    assert checkpoint_fim(meta)["order"] == "spm" and meta["tokenizer"]["tokenizer_model"] == str(tokenizer_file)

    target = tmp_path / "hole.py"
    target.write_text("def add(a, b):\n    <FILL_HERE>\n\nprint(add(1, 2))\n")
    out = tmp_path / "middle.jsonl"
    load_tool("generate").main(["--load", str(save), "--infill", str(target), "--output", str(out),
                                "--max-new-tokens", "8", "--device", "cpu"])
    record = json.loads(out.read_text())
    assert record["prefix"] == "def add(a, b):\n    " and record["suffix"] == "\n\nprint(add(1, 2))\n"
    assert isinstance(record["completion"], str)
