"""What fill-in-the-middle buys, measured: the same tiny model trained with --fim-rate 0.5 and with 0.

    python benchmarks/fim_usefulness.py                       # ~25 min on 2 CPU cores: prepare, train x 2, score
    python benchmarks/fim_usefulness.py --train-iters 100     # shorter
    python benchmarks/fim_usefulness.py --skip-training       # score the two runs already under --work-dir

1. The stdlib's .py files (the embedded corpus) are split by a hash of their path: ~10% held out, never trained on.
   One tokenizer for both runs: the shipped one with the code sentinels appended (tokenization/code_tokens.py), so both
   models have the same shape.
2. scripts/pretrain_codegen.sh's default model and schedule trains twice, same seed and iterations, once with
   --fim-rate 0.5 (--fim-spm-rate 0.5, Megatron's and StarCoder's) and once without.
3. On held-out spans, single-line (one line of a held-out file) and multi-line (2 to 6 consecutive lines), with at
   most PREFIX prefix tokens and SUFFIX suffix tokens around them:
   - the mean loss of the middle's tokens, FIM model given prefix and suffix (PSM and SPM prompts) against the
     left-to-right model given the prefix only, with the prefix the same length and, as it would be used, with
     the prefix filling the whole context budget (PREFIX + SUFFIX tokens); paired over spans, 95% intervals;
   - the exact match of the greedy middle on the first 200 spans: FIM (PSM) stops at EOD or a sentinel and must equal the middle; left to
     right stops at the middle's length in characters (a kinder rule) or at EOD;
   - each model's left-to-right loss on the held-out files' first 256 tokens (what FIM costs plain completion).
The figures are printed and written to WORK_DIR/fim_usefulness.json; docs/code-data.md quotes them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from codegeex_train.checkpoint.files import load_full_state_dict  # noqa: E402
from codegeex_train.tokenization.code_tokens import code_tokens, fim_prompt  # noqa: E402
from codegeex_train.preprocessing.default_corpus import default_corpus_files, stdlib_source_dir  # noqa: E402
from codegeex_train.tokenization.tokenizer import default_tokenizer  # noqa: E402
from codegeex_train.model import CodeGeeXModel  # noqa: E402

PREFIX, SUFFIX, MAX_MIDDLE = 96, 64, 48
EXACT_MATCH_SPANS = 200


def held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 10 == 0


def prepare(work: Path, python: str) -> tuple[Path, list[Path]]:
    """The training jsonl (preprocessed) and the held-out files; the tokenizer with sentinels at work/tokenizer.json."""
    root = stdlib_source_dir()
    files = default_corpus_files()
    train = [p for p in files if not held_out(p.relative_to(root).as_posix())]
    test = [p for p in files if held_out(p.relative_to(root).as_posix())]
    tokenizer = default_tokenizer()
    code_tokens(tokenizer)
    tokenizer.inner._tokenizer.save(str(work / "tokenizer.json"))
    prefix = work / "train"
    if not Path(f"{prefix}_text_document.idx").exists():
        with open(work / "train.jsonl", "w") as f:
            for p in train:
                f.write(json.dumps({"text": p.read_text(encoding="utf-8", errors="replace")}) + "\n")
        subprocess.run([python, str(ROOT / "tools/preprocess_data.py"), "--input", str(work / "train.jsonl"),
                        "--output-prefix", str(prefix), "--tokenizer-type", "HFTokenizer", "--tokenizer-model",
                        str(work / "tokenizer.json"), "--whitespace-encoding", "--append-eod", "--workers", "2"],
                       check=True)
    return Path(f"{prefix}_text_document"), test


def train(work: Path, data: Path, name: str, fim_rate: float, iters: int, python: str) -> Path:
    out = work / name
    if (out / "latest").exists():
        return out
    env = {**os.environ, "OUTPUT_DIR": str(out), "DATA_PATH": str(data), "TRAIN_ITERS": str(iters),
           "DEVICE": "cpu", "PYTHON": python,
           "TOKENIZER_ARGS": f"--tokenizer-type HFTokenizer --tokenizer-model {work / 'tokenizer.json'} "
                             "--whitespace-encoding"}
    extra = ["--fim-rate", str(fim_rate)] if fim_rate else []
    subprocess.run(["bash", str(ROOT / "scripts/pretrain_codegen.sh"), "--eval-interval", str(iters), *extra],
                   env=env, check=True)
    return out


def load(directory: Path) -> CodeGeeXModel:
    state, config, _ = load_full_state_dict(directory)
    model = CodeGeeXModel(config, None, None)
    model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def token_losses(model, ids: list[int]) -> torch.Tensor:
    """Loss of predicting ids[1:] from what precedes each."""
    x = torch.tensor([ids[:-1]])
    pos = torch.arange(x.shape[1]).unsqueeze(0)
    return model(x, pos, labels=torch.tensor([ids[1:]]))[0]


@torch.no_grad()
def greedy(model, ids: list[int], max_new: int, stop: set[int]) -> list[int]:
    out: list[int] = []
    for _ in range(max_new):
        seq = ids + out
        logits = model(torch.tensor([seq]), torch.arange(len(seq)).unsqueeze(0), gather_logits=True)
        nxt = int(logits[0, -1].argmax())
        if nxt in stop:
            break
        out.append(nxt)
    return out


def spans(test: list[Path], count: int, seed: int) -> list[dict]:
    """Single-line and multi-line spans of held-out files, alternately, at most 10 per file."""
    rng = random.Random(seed)
    files = list(test)
    rng.shuffle(files)
    out = []
    for path in files:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        code = [i for i, line in enumerate(lines) if len(line.strip()) >= 8 and not line.strip().startswith("#")]
        for _ in range(min(10, len(code))):
            kind = "single-line" if len(out) % 2 == 0 else "multi-line"
            start = rng.choice(code)
            end = start + 1 if kind == "single-line" else min(len(lines), start + rng.randint(2, 6))
            out.append({"file": path.name, "kind": kind, "prefix": "".join(lines[:start]),
                        "middle": "".join(lines[start:end]), "suffix": "".join(lines[end:])})
            if len(out) == count:
                return out
    return out


def interval(diffs: list[float]) -> tuple[float, float, float]:
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    return mean, mean - 1.96 * sd / math.sqrt(n), mean + 1.96 * sd / math.sqrt(n)


def score(work: Path, test: list[Path], count: int, seed: int) -> dict:
    tokenizer = default_tokenizer()
    tokens = code_tokens(tokenizer)
    fim_model, l2r_model = load(work / "fim"), load(work / "l2r")
    stop = {tokenizer.eod, tokens.fim_pad, tokens.file_sep, tokens.fim_prefix, tokens.fim_suffix, tokens.fim_middle}
    rows = []
    for span in spans(test, count * 2, seed):
        middle = tokenizer.encode(span["middle"])
        if not 0 < len(middle) <= MAX_MIDDLE:
            continue
        prefix = tokenizer.encode(span["prefix"])
        suffix = tokenizer.encode(span["suffix"])[:SUFFIX]
        fim_in = [tokenizer.eod] + fim_prompt("psm", prefix[-PREFIX:], suffix, tokens)  # as after a packed EOD
        spm_in = [tokenizer.eod] + fim_prompt("spm", prefix[-PREFIX:], suffix, tokens)
        n = len(middle)
        fim_loss = token_losses(fim_model, fim_in + middle)[-n:].mean().item()
        spm_loss = token_losses(fim_model, spm_in + middle)[-n:].mean().item()
        short = prefix[-PREFIX:]
        long = prefix[-(PREFIX + SUFFIX):]
        l2r_short = token_losses(l2r_model, [tokenizer.eod] + short + middle)[-n:].mean().item()
        l2r_long = token_losses(l2r_model, [tokenizer.eod] + long + middle)[-n:].mean().item()
        row = {"kind": span["kind"], "tokens": n, "fim": fim_loss, "fim_spm": spm_loss, "l2r_same_prefix": l2r_short,
               "l2r_full_budget": l2r_long}
        if len(rows) < EXACT_MATCH_SPANS:  # greedy decoding is most of the time: exact match on the first spans
            fim_text = tokenizer.decode(greedy(fim_model, fim_in, n + 8, stop))
            l2r_text = tokenizer.decode(greedy(l2r_model, [tokenizer.eod] + long, n + 8, {tokenizer.eod}))
            row.update(fim_exact=fim_text == span["middle"], l2r_exact=l2r_text[:len(span["middle"])] == span["middle"])
        rows.append(row)
        if len(rows) == count:
            break
    result = {"spans": len(rows)}
    for kind in ("all", "single-line", "multi-line"):
        sel = [r for r in rows if kind == "all" or r["kind"] == kind]
        entry = {"spans": len(sel), "fim_psm_loss": sum(r["fim"] for r in sel) / len(sel),
                 "fim_spm_loss": sum(r["fim_spm"] for r in sel) / len(sel)}
        for base in ("l2r_same_prefix", "l2r_full_budget"):
            entry[base + "_loss"] = sum(r[base] for r in sel) / len(sel)
            for order, key in (("psm", "fim"), ("spm", "fim_spm")):  # (mean, low, high) of L2R - FIM, paired
                entry[f"{base}_minus_fim_{order}_95"] = interval([r[base] - r[key] for r in sel])
        matched = [r for r in sel if "fim_exact" in r]
        entry["exact_match_spans"] = len(matched)
        entry["fim_exact_match"] = sum(r["fim_exact"] for r in matched) / max(1, len(matched))
        entry["l2r_exact_match"] = sum(r["l2r_exact"] for r in matched) / max(1, len(matched))
        result[kind] = entry
    windows = [tokenizer.encode(p.read_text(encoding="utf-8", errors="replace"))[:255] for p in test]
    windows = [[tokenizer.eod] + w for w in windows if len(w) >= 32]
    for name, model in (("fim", fim_model), ("l2r", l2r_model)):
        losses = [token_losses(model, w) for w in windows]
        result[f"{name}_heldout_l2r_loss"] = (sum(x.sum().item() for x in losses) / sum(x.numel() for x in losses))
    result["heldout_files"] = len(windows)
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", default=str(ROOT / ".cache/fim_usefulness"), help="data, runs and results")
    p.add_argument("--train-iters", type=int, default=400, help="iterations of each of the two runs")
    p.add_argument("--spans", type=int, default=600, help="held-out spans scored (half single-, half multi-line)")
    p.add_argument("--seed", type=int, default=1, help="seed of the span choice")
    p.add_argument("--skip-training", action="store_true", help="score the runs already in --work-dir")
    return p


def main() -> None:
    args = parser().parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    data, test = prepare(work, python)
    if not args.skip_training:
        train(work, data, "l2r", 0.0, args.train_iters, python)
        train(work, data, "fim", 0.5, args.train_iters, python)
    result = {"train_iters": args.train_iters, **score(work, test, args.spans, args.seed)}
    (work / "fim_usefulness.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
