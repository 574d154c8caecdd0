"""A resume is exact with dropout on: every random stream (the default generator that replicated dropout
draws from, the TP tracker's sharded-dropout stream) continues where the interrupted run left it, on every
TP, DP and PP rank, and nothing draws from them around the resume (the data loader has its own generator)."""

import pytest
from test_universal_resume import checkpoint_at

from codegeex_train.testing import metrics_records, run_distributed, run_pretrain, tiny_pretrain_args

ITERS, SAVED_AT = 8, 4
DROPOUT = ["--num-layers", "4", "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--save-interval",
           str(SAVED_AT)]


@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (1, 1, 2), (1, 2, 1)], ids=["tp2", "dp2", "pp2"])
def test_resume_with_dropout_is_bitwise_exact(tmp_path, tiny_data, tp, pp, dp):
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    full = tmp_path / "full"
    run_distributed(run_pretrain, world_size=tp * pp * dp, tp_size=tp, pp_size=pp, deadline_s=600,
                    argv=tiny_pretrain_args(tiny_data, str(full), ITERS, *DROPOUT, *layout))
    resumed = checkpoint_at(full, tmp_path / "resumed", SAVED_AT)
    run_distributed(run_pretrain, world_size=tp * pp * dp, tp_size=tp, pp_size=pp, deadline_s=600,
                    argv=tiny_pretrain_args(tiny_data, resumed, ITERS, *DROPOUT, *layout, "--load", resumed))
    a, b = metrics_records(full), metrics_records(resumed)
    assert sorted(b) == list(range(SAVED_AT + 1, ITERS + 1))
    assert a[ITERS]["loss"] != metrics_records(full)[1]["loss"]
    for it in b:
        assert b[it]["loss"] == a[it]["loss"], it  # bitwise: the same masks, the same data, the same weights
        assert b[it]["grad_norm"] == a[it]["grad_norm"], it
