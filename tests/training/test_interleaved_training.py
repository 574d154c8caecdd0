"""Interleaved 1F1B end to end under DeepSpeed ZeRO-2, on real gloo ranks: each rank holds v model chunks
(``--num-layers-per-virtual-pipeline-stage``). Losses and grad norms equal the single-process run at (PP, v) =
(2, 2) with TP 2, (4, 2), and (2, 3) with DP 2, top query layer on; the tied word table is bit-identical on rank 0
(chunk 0) and rank p-1 (chunk v-1) after training; breaking the tied-gradient sum is caught; checkpoints move
between v = 2, v = 1 and PP 1 through the universal format exactly, and a v = 2 training checkpoint resumes exactly.
The schedule itself (order, transfers, activations in flight) is tested in tests/pipeline/test_executor_interleaved.py.
"""

import numpy as np
import pytest
import torch

from codegeex_train.checkpoint.sharding import split_model_parallel
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.model.codegeex import CodeGeeXModel
from codegeex_train.layout.stages import rank_chunk_layers
from tests.harness import (
    checkpoint_at,
    load_tool,
    metrics_records,
    run_distributed,
    run_pretrain,
    tiny_model_args,
    read_metrics,
    tiny_pretrain_args,
)
from test_bad_input import fails_with
from test_pipeline_training import full_table, train_and_return_embedding

ITERS = 10
CLIP = 0.5


def interleaved_args(data, save, layers, tp=1, pp=1, dp=1, vpp=None, iters=ITERS, *extra):
    # 8 sequences per step = 4 micro-batches per DP rank (micro 2 at DP 1, 1 at DP 2): divisible by PP 2 and 4.
    virtual = ["--num-layers-per-virtual-pipeline-stage", str(vpp)] if vpp else []
    return tiny_pretrain_args(data, str(save), iters, "--num-layers", str(layers), "--micro-batch-size", str(2 // dp),
                              "--clip-grad", str(CLIP), "--tensor-model-parallel-size", str(tp),
                              "--pipeline-model-parallel-size", str(pp), *virtual, *extra)


def run(tmp_path, data, name, layers, tp=1, pp=1, dp=1, vpp=None, break_hook=False, extra=()):
    save = tmp_path / name
    ranks = run_distributed(train_and_return_embedding, world_size=tp * pp * dp, tp_size=tp, pp_size=pp,
                            deadline_s=600, argv=interleaved_args(data, save, layers, tp, pp, dp, vpp, ITERS, *extra),
                            break_hook=break_hook)
    return metrics_records(save), ranks


class Baselines(dict):
    """The (1, 1, 1) run of each model depth, trained when a test first asks for it: (records, ranks, run dir)."""

    def __init__(self, out, data):
        super().__init__()
        self.out, self.data = out, data

    def __missing__(self, layers):
        self[layers] = (*run(self.out, self.data, f"base{layers}", layers), self.out / f"base{layers}")
        return self[layers]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, tiny_data):
    return Baselines(tmp_path_factory.mktemp("interleaved_base"), tiny_data)


# (TP, PP, DP, layers per virtual stage, layers): v = layers / (PP x N)
CASES = {"pp2_v2_tp2": (2, 2, 1, 2, 8), "pp4_v2": (1, 4, 1, 1, 8), "pp2_v3_dp2": (1, 2, 2, 1, 6)}


@pytest.mark.parametrize("case", [c if c == "pp4_v2" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_interleaved_matches_single_process(tmp_path, tiny_data, baselines, case):
    tp, pp, dp, vpp, layers = CASES[case]
    base, base_ranks, base_dir = baselines[layers]
    got, ranks = run(tmp_path, tiny_data, case, layers, tp, pp, dp, vpp)
    assert sorted(got) == list(range(1, ITERS + 1))
    assert base[ITERS]["loss"] < base[1]["loss"]  # it learns
    assert max(base[it]["grad_norm"] for it in base) > CLIP  # clipping is active: the norm counts the tied copy once
    for it in range(1, ITERS + 1):
        assert got[it]["loss"] == pytest.approx(base[it]["loss"], rel=1e-5), (case, it)
        assert got[it]["grad_norm"] == pytest.approx(base[it]["grad_norm"], rel=1e-5), (case, it)
    # Evaluation runs the interleaved order forwards only: the final test loss too
    test_loss = [[r["test_loss"] for r in read_metrics(d) if r.get("split") == "test"]
                 for d in (tmp_path / case, base_dir)]
    assert len(test_loss[0]) == 1 and test_loss[0] == pytest.approx(test_loss[1], rel=1e-5), test_loss
    # The tied word table: rank 0's (chunk 0, input) and rank p-1's (chunk v-1, output layer), bit for bit, on every
    # TP and DP rank; middle ranks hold none.
    by_coords = {r["coords"]: r for r in ranks}
    for (t, p, d), r in by_coords.items():
        if p == pp - 1:
            assert np.array_equal(r["weight"], by_coords[(t, 0, d)]["weight"]), (case, t, p, d)
        elif p > 0:
            assert r["weight"] is None
    torch.testing.assert_close(full_table(ranks, tp, pp - 1), full_table(base_ranks, 1, 0), rtol=0, atol=1e-5)


def test_skipping_the_tied_gradient_allreduce_is_caught(tmp_path, tiny_data, baselines):
    base, _, _ = baselines[4]
    got, ranks = run(tmp_path, tiny_data, "broken", 4, pp=2, vpp=1, break_hook=True)
    worst = max(abs(got[it]["loss"] / base[it]["loss"] - 1) for it in base)
    assert worst > 1e-4, worst  # the parity test above would fail
    assert not np.array_equal(full_table(ranks, 1, 0), full_table(ranks, 1, 1))  # and the copies drift apart


SAVED_AT = 4


def assert_resumed_like(resumed_dir, reference, where):
    resumed = metrics_records(resumed_dir)
    assert sorted(resumed) == list(range(SAVED_AT + 1, ITERS + 1)), where
    for it in resumed:
        assert resumed[it]["consumed_samples"] == reference[it]["consumed_samples"], (where, it)
        for key in ("loss", "grad_norm", "lr"):
            assert resumed[it][key] == pytest.approx(reference[it][key], rel=1e-5), (where, it, key)


def train_save_and_convert(tmp_path, data, name, layers, pp, vpp):
    """A run saving at SAVED_AT and ITERS, its uninterrupted metrics, and its SAVED_AT checkpoint as is and as
    universal."""
    full = tmp_path / name
    run_distributed(run_pretrain, world_size=pp, pp_size=pp, deadline_s=600,
                    argv=interleaved_args(data, full, layers, 1, pp, 1, vpp, ITERS, "--save-interval", str(SAVED_AT)))
    at_save = checkpoint_at(full, tmp_path / f"{name}_at_save", SAVED_AT)
    universal = str(tmp_path / f"{name}_universal")
    load_tool("convert_checkpoint").main(["--load", at_save, "--to-universal", universal])
    return metrics_records(full), at_save, universal


@pytest.mark.slow
def test_v2_checkpoint_resumes_exactly_at_v1_pp1_and_back(tmp_path, tiny_data, capsys, monkeypatch):
    """PP 2 x v 2 (4 layers): its training checkpoint resumes at the same layout, and its universal one at v = 1 and
    at PP 1, each continuing exactly as the uninterrupted run; a v = 1 run's universal checkpoint resumes at v = 2."""
    reference, at_save, universal = train_save_and_convert(tmp_path, tiny_data, "v2", 4, 2, 1)
    # Not converted, at another v: refused before any process group, naming the fix.
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = fails_with(capsys, interleaved_args(tiny_data, tmp_path / "refused", 4, 1, 2, 1, None, ITERS, "--load",
                                              at_save), "virtual pipeline chunks per rank 2 (this run 1)")
    assert "--to-universal" in err
    resumed = tmp_path / "v2_again"
    run_distributed(run_pretrain, world_size=2, pp_size=2, deadline_s=600,
                    argv=interleaved_args(tiny_data, resumed, 4, 1, 2, 1, 1, ITERS, "--load", at_save))
    assert_resumed_like(resumed, reference, "training checkpoint, v 2")
    for name, pp, vpp in (("at_v1", 2, None), ("at_pp1", 1, None)):
        save = tmp_path / name
        run_distributed(run_pretrain, world_size=pp, pp_size=pp, deadline_s=600,
                        argv=interleaved_args(tiny_data, save, 4, 1, pp, 1, vpp, ITERS, "--load", universal))
        assert_resumed_like(save, reference, name)

    reference, _, universal = train_save_and_convert(tmp_path, tiny_data, "v1", 4, 2, None)
    save = tmp_path / "back_at_v2"
    run_distributed(run_pretrain, world_size=2, pp_size=2, deadline_s=600,
                    argv=interleaved_args(tiny_data, save, 4, 1, 2, 1, 1, ITERS, "--load", universal))
    assert_resumed_like(save, reference, "v 1 -> universal -> v 2")


# --- model chunks, single process ------------------------------------------------------------------------------

def tiny_config(layers: int) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, vocab_size=200,
                       max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)


@pytest.mark.parametrize("pp,v,layers", [(2, 2, 4), (2, 3, 6), (4, 2, 8)])
def test_chunks_chain_to_the_whole_model(pp, v, layers):
    """Each rank's chunked model, loaded (strict) from the whole model's weights split as a v-chunk checkpoint, run
    virtual stage by virtual stage (rank r chunk c = stage c·p + r), gives the whole model's per-token loss."""
    config = tiny_config(layers)
    whole = CodeGeeXModel(config, None, None, seed=3)
    chunks = rank_chunk_layers(layers, pp, v)
    stage_layers = [[i for c in rank for i in c] for rank in chunks]
    shards = split_model_parallel(whole.state_dict(), config, 1, stage_layers)
    ranks = []
    for r in range(pp):
        model = CodeGeeXModel(config, None, None, seed=99, pre_process=r == 0, post_process=r == pp - 1,
                              chunk_layers=chunks[r])
        model.load_state_dict(shards[r])  # strict: the same names as the checkpoint's
        ranks.append(model)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, 1)
    positions = torch.arange(16).expand(2, 16)
    x = ids
    for k in range(pp * v):
        c, r = divmod(k, pp)
        x = ranks[r](x, positions, labels=labels if k == pp * v - 1 else None, chunk=c)
    torch.testing.assert_close(x, whole(ids, positions, labels=labels), rtol=0, atol=0)


def test_convert_checkpoint_writes_and_reads_chunked_layouts(tmp_path):
    """tools/convert_checkpoint.py: PP 1 -> PP 2 x v 2 (each rank's file holds its two chunks, recorded) -> PP 1:
    the weights come back bit for bit; a split the layers cannot take is one error line."""
    from codegeex_train.checkpoint.files import load_full_state_dict, read_checkpoint_meta, save_model_checkpoint

    config = tiny_config(8)
    full = CodeGeeXModel(config, None, None, seed=5).state_dict()
    save_model_checkpoint(tmp_path / "src", [full], config, 1)
    tool = load_tool("convert_checkpoint")
    tool.main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "v2"), "--pipeline-model-parallel-size", "2",
               "--num-layers-per-virtual-pipeline-stage", "2"])
    _, meta = read_checkpoint_meta(tmp_path / "v2")
    assert (meta["pp_size"], meta["num_chunks"]) == (2, 2)
    rank0 = torch.load(tmp_path / "v2" / "iter_0000000" / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    assert sorted({int(k.split(".")[1]) for k in rank0 if k.startswith("layers.")}) == [0, 1, 4, 5]
    tool.main(["--load", str(tmp_path / "v2"), "--save", str(tmp_path / "back")])
    back, _, _ = load_full_state_dict(tmp_path / "back")
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
    with pytest.raises(SystemExit) as e:
        tool.main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "bad"), "--pipeline-model-parallel-size",
                   "2", "--num-layers-per-virtual-pipeline-stage", "3"])
    assert "is not divisible into --pipeline-model-parallel-size 2" in str(e.value.code)


# --- bad input: one error line, before any process group ------------------------------------------------------

@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield
    assert list(cwd.iterdir()) == []


def test_bad_virtual_pipeline_flags(capsys, monkeypatch, tiny_data, empty_cwd):
    model = tiny_model_args()
    base = [*model, "--data-path", tiny_data, "--num-layers", "8"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    fails_with(capsys, base + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
               "--num-layers 8 is not divisible into --pipeline-model-parallel-size 2 x "
               "--num-layers-per-virtual-pipeline-stage 3", "[1, 2, 4]")
    # 3 micro-batches per step (global 6 / micro 2) for 2 stages
    fails_with(capsys, base + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
                               "--micro-batch-size", "2", "--global-batch-size", "6"],
               "micro-batches per step (3", "divisible by --pipeline-model-parallel-size 2")
    fails_with(capsys, base + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
                               "--decoder-first-pipeline-num-layers", "2"],
               "--num-layers-per-virtual-pipeline-stage splits the layers evenly")
    monkeypatch.setenv("WORLD_SIZE", "1")
    fails_with(capsys, base + ["--num-layers-per-virtual-pipeline-stage", "2"],
               "--num-layers-per-virtual-pipeline-stage 2 needs --pipeline-model-parallel-size > 1")
