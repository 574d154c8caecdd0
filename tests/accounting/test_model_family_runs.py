"""Training runs of the Hugging Face families' options log what they moved and held beside the theory, as
test_accounting_runs.py and test_context_parallel_runs.py do for CodeGeeX's shape.

Three layouts of 4 gloo ranks through the CLI, 3 iterations each, a tiny model with grouped-query attention (4 heads
in 2 groups: 1 per TP rank), SwiGLU, RMSNorm, an untied output layer and only the QKV bias (Qwen2's options), or
StarCoder2's (LayerNorm and biases, GeLU-tanh, a sliding window shorter than the sequence):

  TP 2 x PP 2, Qwen2, SP and selective recompute: TP bytes (all-gathers, reduce-scatters, re-gathers), the pipeline's
      (b, s/t, h) sends, and no embedding-group traffic (untied: the output layer is the last stage's own);
  PP 2 x DP 2, Qwen2, dropout (CPU's math path: K/V repeated to the heads): ZeRO's DP bytes without the tied copy's
      all-reduce, the partitioned state;
  TP 2 x CP 2, StarCoder2 with its window: the ring's K/V hops of g/t groups (not a/t heads), ZeRO over DP x CP.

Every train record's bytes by group equal the theory to the byte (ZeRO's within DeepSpeed's gradient-norm scalars);
the memory record's parts equal the theory within test_accounting_runs.py's tolerances (activations: to the byte
here)."""

import json
import os

import pytest

from codegeex_train import pretrain
from tests.harness import run_distributed

pytestmark = pytest.mark.slow  # three 4-rank runs; the formulas' fast tests: test_model_family_accounting.py

H, HEADS, SEQ, MICRO, GLOBAL = 32, 4, 32, 2, 8
QWEN2 = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--add-qkv-bias", "--no-top-query-layer", "--ffn-hidden-size", "48"]
STARCODER2 = ["--position-embedding-type", "rope", "--activation", "gelu_tanh", "--group-query-attention",
              "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--window-size", "12",
              "--no-top-query-layer"]
NO_DROPOUT = ["--hidden-dropout", "0.0", "--attention-dropout", "0.0"]
# (TP, CP, PP, DP) -> flags beyond the shared ones
LAYOUTS = {
    (2, 1, 2, 1): [*QWEN2, *NO_DROPOUT, "--sequence-parallel", "--recompute-granularity", "selective"],
    (1, 1, 2, 2): [*QWEN2, "--hidden-dropout", "0.1", "--attention-dropout", "0.1"],
    (2, 2, 1, 1): [*STARCODER2, *NO_DROPOUT, "--sequence-parallel"],
}


def run_pretrain(topology, argv):
    pretrain.main(argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    """layout -> its metrics records; each layout trained once, when a test first asks for it."""
    done = {}

    def get(layout):
        if layout not in done:
            tp, cp, pp, dp = layout
            save = str(tmp_path_factory.mktemp(f"tp{tp}cp{cp}pp{pp}dp{dp}"))
            argv = ["--num-layers", "2", "--hidden-size", str(H), "--num-attention-heads", str(HEADS),
                    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size",
                    str(MICRO), "--global-batch-size", str(GLOBAL), "--train-iters", "3", "--log-interval", "1",
                    "--eval-interval", "2", "--eval-iters", "1", "--data-path", tiny_data, "--split", "90,9,1",
                    "--save", save, "--save-interval", "1000", "--no-progress-bar", "--num-workers", "0",
                    "--tensor-model-parallel-size", str(tp), "--context-parallel-size", str(cp),
                    "--pipeline-model-parallel-size", str(pp), *LAYOUTS[layout]]
            run_distributed(run_pretrain, world_size=tp * cp * pp * dp, tp_size=tp, pp_size=pp, cp_size=cp,
                            deadline_s=600, argv=argv)
            with open(os.path.join(save, "metrics.jsonl")) as f:
                done[layout] = [json.loads(line) for line in f]
        return done[layout]

    return get


def split(rows, name):
    return [r for r in rows if r.get("split") == name]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_by_group_equal_theory(runs, layout):
    tp, cp, pp, dp = layout
    train = split(runs(layout), "train")
    assert [r["iteration"] for r in train] == [1, 2, 3]
    zero = "dp_cp" if cp > 1 else "dp"
    for r in train:
        for group in ("tp", "pp", "embedding", *(("cp",) if cp > 1 else ())):
            assert r[f"comm_{group}_bytes"] == r[f"comm_{group}_bytes_theory"], (group, r["iteration"])
        # DeepSpeed adds a few scalar reductions (the gradient norm) to ZeRO's buckets
        assert r[f"comm_{zero}_bytes"] == pytest.approx(r[f"comm_{zero}_bytes_theory"], rel=1e-5, abs=64)
        assert (r["comm_tp_bytes"] > 0) == (tp > 1) and (r["comm_pp_bytes"] > 0) == (pp > 1)
        assert (r[f"comm_{zero}_bytes"] > 0) == (dp * cp > 1)
        assert r.get("comm_embedding_bytes", 0) == 0  # untied: no word-table all-reduce between the ends
        if cp > 1:
            # the ring moves this rank's g/t = 1 key-value group, not its a/t = 2 heads: per attention and
            # micro-batch, (n - 1) hops forward, (n - 1) + n backward, of 2 b (s/n) d e bytes
            m, kv = GLOBAL // MICRO, 2 * MICRO * (SEQ // cp) * (H // HEADS) * 4
            assert r["comm_cp_bytes"] == m * 2 * ((cp - 1) + (2 * cp - 1)) * kv


@pytest.mark.parametrize("layout", LAYOUTS)
def test_memory_parts_equal_theory(runs, layout):
    (record,) = split(runs(layout), "memory")
    assert record["iteration"] == 2  # the first step with the optimizer's state
    for part in ("weights", "optimizer"):
        assert record[f"memory_{part}_bytes"] == pytest.approx(record[f"memory_{part}_bytes_theory"], rel=1e-3)
    assert record["memory_gradients_bytes"] == pytest.approx(record["memory_gradients_bytes_theory"], rel=0.10)
    assert record["memory_activations_bytes"] == pytest.approx(record["memory_activations_bytes_theory"], rel=0.02)
    known = ("weights", "optimizer", "gradients", "activations")
    measured = sum(record[f"memory_{p}_bytes"] for p in known)
    assert measured == pytest.approx(sum(record[f"memory_{p}_bytes_theory"] for p in known), rel=0.10)

