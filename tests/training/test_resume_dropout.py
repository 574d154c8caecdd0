"""A resume is exact with dropout on: every random stream (the default generator that replicated dropout
draws from, the TP tracker's sharded-dropout stream) continues where the interrupted run left it, on every
TP, DP and PP rank, and nothing draws from them around the resume (the data loader has its own generator); also under
sequence parallelism, where the hidden dropout in the sequence-split region draws from the TP tracker's stream too
(with selective recompute at PP 2: the recomputed attention replays its masks). That dropout is really on in these
runs is checked too: turning either kind off changes the first iteration's loss (at TP 2), and each dropout site
draws a new mask on every call in training mode. Each layout is one spawn: the ranks train, cut the checkpoint,
resume it (and run the controls) in turn."""

import pytest
import torch
import torch.distributed as dist

from codegeex_train import pretrain
from codegeex_train.model import CodeGeeXModel, ModelConfig
from tests.harness import checkpoint_at, metrics_records, run_distributed, tiny_pretrain_args

ITERS, SAVED_AT = 6, 3
DROPOUT = ["--num-layers", "4", "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--save-interval",
           str(SAVED_AT)]


SP = ["--sequence-parallel"]


def train_cut_resume(topology, full_argv, full, resumed, resumed_argv, controls):
    """``full_argv`` (saving to ``full``); rank 0 cuts its checkpoint at SAVED_AT into ``resumed``; ``resumed_argv``
    resumes it; then each argv of ``controls``."""
    pretrain.main(full_argv)
    if topology.rank == 0:
        checkpoint_at(full, resumed, SAVED_AT)
    dist.barrier()
    for argv in (resumed_argv, *controls):
        pretrain.main(argv)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp,extra", [(2, 1, 1, []), (1, 1, 2, []), (1, 2, 1, []), (2, 1, 1, SP),
                                            (2, 2, 1, SP + ["--recompute-granularity", "selective"])],
                         ids=["tp2", "dp2", "pp2", "tp2sp", "tp2pp2sp"])
def test_resume_with_dropout_is_bitwise_exact(tmp_path, tiny_data, tp, pp, dp, extra):
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = lambda save, *more: tiny_pretrain_args(tiny_data, str(save), ITERS, *DROPOUT, *layout, *more)  # noqa: E731
    # The control, once (TP 2 draws from both streams: replicated and sharded dropout): the same first iteration
    # (same seed, weights, data) with hidden or attention dropout off. The unit test below covers every site.
    kinds = ("--hidden-dropout", "--attention-dropout") if tp == 2 and not extra else ()
    controls = [args(tmp_path / f"no{kind}", kind, "0", "--exit-interval", "1") for kind in kinds]
    run_distributed(train_cut_resume, world_size=tp * pp * dp, tp_size=tp, pp_size=pp, deadline_s=600,
                    full_argv=args(full), full=str(full), resumed=str(resumed),
                    resumed_argv=args(resumed, "--load", str(resumed)), controls=controls)
    a, b = metrics_records(full), metrics_records(resumed)
    assert sorted(b) == list(range(SAVED_AT + 1, ITERS + 1))
    for kind in kinds:
        assert metrics_records(tmp_path / f"no{kind}")[1]["loss"] != a[1]["loss"], f"{kind} 0.1 is not in effect"
    for it in b:
        assert b[it]["loss"] == a[it]["loss"], it  # bitwise: the same masks, the same data, the same weights
        assert b[it]["grad_norm"] == a[it]["grad_norm"], it


@pytest.mark.parametrize("kind", ["hidden_dropout", "attention_dropout"])
def test_every_dropout_site_is_on_in_training_mode(kind):
    """With only ``kind`` at 0.1, each site it covers (the embedding's output for hidden dropout, a regular layer,
    the top query layer) gives another output on a second call in training mode, and the same in eval mode."""
    rates = {"hidden_dropout": 0.0, "attention_dropout": 0.0, kind: 0.1}
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=100,
                         max_position_embeddings=64, top_query_layer=True, **rates)
    model = CodeGeeXModel(config, None, None, seed=3)
    embedding_only = CodeGeeXModel(config, None, None, seed=3, post_process=False, layer_numbers=range(0))
    x, positions = torch.randn(2, 16, 32), torch.arange(16)[None].expand(2, 16)
    tokens = torch.randint(0, 100, (2, 16))
    sites = {"layer": lambda: model.layers["0"](x),
             "top query layer": lambda: model.top_query_layer(x, model.top_query_embeddings(positions))}
    if kind == "hidden_dropout":
        sites["embedding"] = lambda: embedding_only(tokens, positions)
    with torch.no_grad():
        for name, site in sites.items():
            model.train()
            embedding_only.train()
            assert not torch.equal(site(), site()), f"{kind} is not applied in the {name}"
            model.eval()
            embedding_only.eval()
            assert torch.equal(site(), site()), name
