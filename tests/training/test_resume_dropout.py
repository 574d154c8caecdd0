"""A resume is exact with dropout on: every random stream (the default generator that replicated dropout
draws from, the TP tracker's sharded-dropout stream) continues where the interrupted run left it, on every
TP, DP and PP rank, and nothing draws from them around the resume (the data loader has its own generator); also under
sequence parallelism, where the hidden dropout in the sequence-split region draws from the TP tracker's stream too
(with selective recompute at PP 2: the recomputed attention replays its masks). That dropout is really on in these
runs is checked too: turning either kind off changes the first iteration's loss (at TP 2), and each dropout site
draws a new mask on every call in training mode."""

import pytest
import torch

from codegeex_train.model import CodeGeeXModel, ModelConfig
from tests.harness import checkpoint_at, metrics_records, run_distributed, run_pretrain, tiny_pretrain_args

ITERS, SAVED_AT = 8, 4
DROPOUT = ["--num-layers", "4", "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--save-interval",
           str(SAVED_AT)]


SP = ["--sequence-parallel"]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp,extra", [(2, 1, 1, []), (1, 1, 2, []), (1, 2, 1, []), (2, 1, 1, SP),
                                            (2, 2, 1, SP + ["--recompute-granularity", "selective"])],
                         ids=["tp2", "dp2", "pp2", "tp2sp", "tp2pp2sp"])
def test_resume_with_dropout_is_bitwise_exact(tmp_path, tiny_data, tp, pp, dp, extra):
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra]
    full = tmp_path / "full"
    run_distributed(run_pretrain, world_size=tp * pp * dp, tp_size=tp, pp_size=pp, deadline_s=600,
                    argv=tiny_pretrain_args(tiny_data, str(full), ITERS, *DROPOUT, *layout))
    resumed = checkpoint_at(full, tmp_path / "resumed", SAVED_AT)
    run_distributed(run_pretrain, world_size=tp * pp * dp, tp_size=tp, pp_size=pp, deadline_s=600,
                    argv=tiny_pretrain_args(tiny_data, resumed, ITERS, *DROPOUT, *layout, "--load", resumed))
    a, b = metrics_records(full), metrics_records(resumed)
    assert sorted(b) == list(range(SAVED_AT + 1, ITERS + 1))
    # The control, once (TP 2 draws from both streams: replicated and sharded dropout): the same first iteration
    # (same seed, weights, data) with hidden or attention dropout off. The unit test below covers every site.
    for kind in ("--hidden-dropout", "--attention-dropout") if tp == 2 and not extra else ():
        control = tmp_path / f"no{kind}"
        run_distributed(run_pretrain, world_size=tp * pp * dp, tp_size=tp, pp_size=pp, deadline_s=600,
                        argv=tiny_pretrain_args(tiny_data, str(control), ITERS, *DROPOUT, *layout, kind, "0",
                                                "--exit-interval", "1"))
        assert metrics_records(control)[1]["loss"] != a[1]["loss"], f"{kind} 0.1 is not in effect"
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
