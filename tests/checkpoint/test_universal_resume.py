"""Resume at another (TP, PP, DP): a ZeRO-2 training checkpoint converted to a universal one
(`tools/convert_checkpoint.py --to-universal`) continues at any layout exactly as the uninterrupted run did:
Adam moments and step, LR schedule, consumed samples and data order all come back."""

import pytest

from tests.harness import (
    checkpoint_at,
    fails_with,
    load_tool,
    metrics_records,
    run_distributed,
    run_pretrain,
    tiny_pretrain_args,
)

ITERS, SAVED_AT = 8, 4
# (TP, PP, DP) saved -> resumed at: each save changes every size on the way (TP 2 -> 1 and DP 2 -> 1; PP 2 -> 1
# and TP 1 -> 2); with the pair below every cut is undone and redone at least once, and every resumed layout seen.
RESUME_LAYOUTS = {(2, 1, 2): [(1, 1, 1), (1, 2, 1)], (1, 2, 2): [(1, 1, 2), (2, 1, 1)]}


def layout_args(data, save, tp, pp, *extra):
    return tiny_pretrain_args(data, str(save), ITERS, "--tensor-model-parallel-size", str(tp),
                              "--pipeline-model-parallel-size", str(pp), "--save-interval", str(SAVED_AT), *extra)


def check_universal_resume(tmp_path, data, saved, resume_layouts):
    """Train ``saved`` = (TP, PP, DP) for ITERS iterations, convert its checkpoint at SAVED_AT to universal, resume it
    at each of ``resume_layouts``: every resumed iteration logs what the uninterrupted run logged."""
    tp, pp, dp = saved
    full = tmp_path / "full"
    run_distributed(run_pretrain, world_size=tp * pp * dp, tp_size=tp, pp_size=pp, deadline_s=600,
                    argv=layout_args(data, full, tp, pp))
    reference = metrics_records(full)
    at_save = checkpoint_at(full, tmp_path / "at_save", SAVED_AT)
    universal = str(tmp_path / "universal")
    load_tool("convert_checkpoint").main(["--load", at_save, "--to-universal", universal])

    for tp2, pp2, dp2 in resume_layouts:
        save = tmp_path / f"resumed_tp{tp2}_pp{pp2}_dp{dp2}"
        # At TP > 1 the resumed run adds sequence parallelism, which the saved one did not use: it changes no
        # parameter, so the checkpoint resumes exactly (tests/training/test_sequence_parallel.py: the other way).
        sp = ["--sequence-parallel"] if tp2 > 1 else []
        run_distributed(run_pretrain, world_size=tp2 * pp2 * dp2, tp_size=tp2, pp_size=pp2, deadline_s=600,
                        argv=layout_args(data, save, tp2, pp2, "--load", universal, *sp))
        resumed = metrics_records(save)
        assert sorted(resumed) == list(range(SAVED_AT + 1, ITERS + 1))
        for it in resumed:
            where = (saved, (tp2, pp2, dp2), it)
            assert resumed[it]["consumed_samples"] == reference[it]["consumed_samples"], where
            assert resumed[it]["lr"] == pytest.approx(reference[it]["lr"], rel=1e-12), where
            assert resumed[it]["loss"] == pytest.approx(reference[it]["loss"], rel=1e-5), where
            assert resumed[it]["grad_norm"] == pytest.approx(reference[it]["grad_norm"], rel=1e-5), where


@pytest.mark.slow
@pytest.mark.parametrize("saved", list(RESUME_LAYOUTS), ids=lambda layout: "saved_tp{}_pp{}_dp{}".format(*layout))
def test_universal_checkpoint_resumes_at_any_layout(tmp_path, tiny_data, saved):
    check_universal_resume(tmp_path, tiny_data, saved, RESUME_LAYOUTS[saved])


def test_universal_checkpoint_from_dp2_resumes_at_pp2(tmp_path, tiny_data):
    """One pair (the fast tier's): DP 2's ZeRO partitions and the whole model -> two pipeline stages."""
    check_universal_resume(tmp_path, tiny_data, (1, 1, 2), [(1, 2, 1)])


@pytest.mark.slow
def test_layout_mismatch_without_conversion_names_the_fix(tmp_path, tiny_data, capsys, monkeypatch):
    full = tmp_path / "full"
    run_distributed(run_pretrain, world_size=2, tp_size=1, deadline_s=600,
                    argv=tiny_pretrain_args(tiny_data, str(full), 2, "--save-interval", "2"))
    monkeypatch.setenv("WORLD_SIZE", "1")  # the same TP and PP, DP 1 instead of 2: ZeRO's partitions differ
    fails_with(capsys, tiny_pretrain_args(tiny_data, str(tmp_path / "resumed"), 4, "--load", str(full)),
               "saved at another parallel layout: DP 2 (this run 1)", "--to-universal")
