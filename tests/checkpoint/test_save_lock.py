"""One writer per --save directory (issue 34), with retention end to end in the same launch.

A process takes the directory's lock through the code path pretrain takes it by (``save_lock.hold_save_dir``) and
sleeps: a pretrain on that --save is refused with one ``error:`` line naming the directory and the holder (host,
pid), exit 2, before any process group; a dry run takes no lock and passes. The holder is killed with -9: the kernel
drops its lock, and the same command now trains - a real 20-save run (--save-interval 1) under
--keep-last-n-checkpoints 3 --keep-every-n-iterations 8, which ends holding exactly iterations 8, 16, 18, 19 and 20,
with `latest` naming 20 and every kept tag complete (ZeRO files included), nothing half-removed."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from codegeex_train import pretrain
from codegeex_train.checkpoint.files import read_latest
from codegeex_train.checkpoint.retention import tag_is_complete
from tests.harness import fails_with, run_distributed, run_pretrain, tiny_pretrain_args

ROOT = Path(__file__).resolve().parents[2]
HOLD = ("import sys, time\n"
        "from codegeex_train.checkpoint.save_lock import hold_save_dir\n"
        "lock = hold_save_dir(sys.argv[1])\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")


def test_second_run_refused_while_the_first_holds_save_then_accepted_after_kill_9(tmp_path, tiny_data, capsys):
    save = tmp_path / "run"
    argv = tiny_pretrain_args(tiny_data, str(save), 20, "--save-interval", "1", "--keep-last-n-checkpoints", "3",
                              "--keep-every-n-iterations", "8")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(save)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        line = fails_with(capsys, argv, f"--save {save} is in use by another run", f"pid {holder.pid}",
                          f"host {socket.gethostname()}", str(save / ".lock"))
        assert "Stop that run, or give this one another --save" in line
        assert pretrain.main([*argv, "--dry-run"]) is None  # a dry run takes no lock
        capsys.readouterr()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    run_distributed(run_pretrain, world_size=1, deadline_s=300, argv=argv)
    tags = sorted(name for name in os.listdir(save) if name.startswith("iter_"))
    assert tags == ["iter_0000008", "iter_0000016", "iter_0000018", "iter_0000019", "iter_0000020"]
    assert read_latest(save) == "iter_0000020"
    assert all(tag_is_complete(save / tag) for tag in tags)
    assert all("zero_pp_rank_0_mp_rank_00_optim_states.pt" in os.listdir(save / tag) for tag in tags)
    assert not [name for name in os.listdir(save) if name.endswith(".deleting")]
