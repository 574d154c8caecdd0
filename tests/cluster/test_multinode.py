"""Two "nodes" on this machine (loopback hosts 127.0.0.2 and 127.0.0.3, 2 ranks each), TP 2 inside each node
and DP 2 across, launched the three ways clusters launch: `deepspeed --hostfile` over pdsh and ssh (through
`scripts/pretrain_codegen.sh`, which writes the `.deepspeed_env` the other node needs), `deepspeed --no_ssh
--node_rank K` once per node, and `torchrun --nnodes 2`. Each run's losses equal the single-node run of the same
configuration (one in-process run of the same flags, the script's config file among them, shared by the three), and
its start-up report shows the two nodes, with every TP group inside one."""

import os
import re
import subprocess
import sys

import pytest
from launch_helpers import ROOT, finish, script_env, start_script, train_losses

from codegeex_train import pretrain
from codegeex_train.distributed.cluster import RankPlace, cluster_report
from codegeex_train.layout.dims import ParallelDims
from tests.harness import free_port, read_metrics, run_distributed

pytestmark = pytest.mark.slow  # every test in this file is in the slow tier (tests/conftest.py)

ITERS = 6

# What the script passes in front of its own flags: the other launches pass it too, so that every launch (the
# script's own flags overridden by tiny_argv's) trains the same model as the in-process reference.
CONFIG = ["--config", str(ROOT / "configs" / "default.yaml")]


def tiny_argv(data, save):
    return ["--deepspeed-config", str(ROOT / "ds_configs" / "cpu_fp32_zero2.json"),
            "--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "64",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3", "--lr-warmup-iters", "2",
            "--train-iters", str(ITERS), "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
            "--data-path", data, "--split", "90,9,1", "--seed", "7", "--save", str(save), "--no-progress-bar",
            "--num-workers", "0", "--distributed-timeout-minutes", "2"]


def _run_pretrain(topology, argv):
    pretrain.main(argv)


@pytest.fixture(scope="module")
def single_node(tmp_path_factory, tiny_data):
    """The reference: the same flags on 4 ranks of one node (in-process ranks), for every launcher below."""
    save = tmp_path_factory.mktemp("single_node")
    run_distributed(_run_pretrain, world_size=4, tp_size=2, deadline_s=300,
                    argv=[*CONFIG, *tiny_argv(tiny_data, save)])
    return train_losses(save)


def assert_losses_match(save, reference):
    losses = train_losses(save)
    assert sorted(losses) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
        assert losses[it] == pytest.approx(reference[it], rel=1e-4), it


def assert_two_nodes_reported(log: str, save, names: tuple[str, str]):
    assert "cluster: 2 node(s), world 4 = TP 2 x DP 2 x PP 1" in log, log[-3000:]
    for node_rank, (name, ranks) in enumerate(zip(names, ("0, 1", "2, 3"))):
        assert re.search(rf"  {re.escape(name)} \(node rank {node_rank}, host [^)]+\): ranks {ranks}\n", log), log
    assert "WARNING: TP group" not in log
    meta = read_metrics(save)
    cluster = next(r["cluster"] for r in meta if r["split"] == "metadata")
    assert [(n["node"], n["ranks"]) for n in cluster["nodes"]] == [(names[0], [0, 1]), (names[1], [2, 3])]
    assert cluster["tp_groups"] == [[0, 1], [2, 3]] and cluster["tp_groups_spanning_nodes"] == []


def test_report_warns_about_tp_groups_that_span_reported_nodes():
    # Both "hosts" share a host name: the nodes are what the launcher says, not socket.gethostname().
    places = [RankPlace(r, r % 2, r // 2, f"10.0.0.{r // 2}", "same-host", 100 + r) for r in range(4)]
    text, meta = cluster_report(places, ParallelDims(4, 4, 1))
    assert "cluster: 2 node(s)" in text
    assert "WARNING: TP group [0, 1, 2, 3] spans nodes 10.0.0.0, 10.0.0.1" in text
    assert meta["tp_groups_spanning_nodes"] == [[0, 1, 2, 3]]
    text, meta = cluster_report(places, ParallelDims(4, 2, 1))
    assert "WARNING" not in text and meta["tp_groups_spanning_nodes"] == []


def test_deepspeed_hostfile_over_pdsh_and_ssh(loopback_cluster, tmp_path, tiny_data, single_node):
    cluster = loopback_cluster
    hostfile = cluster.write_hostfile(tmp_path / "hostfile")
    multi = tmp_path / "multi"
    env = script_env(multi, tiny_data, train_iters=ITERS, tp=2, base=cluster.env, HOSTFILE=str(hostfile),
                     WANDB_API_KEY="secret-marker-0123456789")
    env["LAUNCHER_ARGS"] = (f"--ssh_port {cluster.ssh_port} --master_addr {cluster.master_addr} "
                            f"--master_port {free_port()}")
    proc = start_script(env, *tiny_argv(tiny_data, multi))  # after the script's CONFIG and flags: these win
    try:
        log = finish(proc)
    finally:
        cluster.kill_launched()
    assert proc.returncode == 0, log[-4000:]
    assert_losses_match(multi, single_node)
    assert_two_nodes_reported(log, multi, cluster.hosts)

    # .deepspeed_env: written by the script into OUTPUT_DIR, read by the runner, exported on both hosts; it
    # carries what the other node needs and no credential.
    env_file = multi / ".deepspeed_env"
    forwarded = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert {"DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS"} <= forwarded.keys()
    assert "WANDB_API_KEY" not in forwarded and "secret-marker" not in env_file.read_text()
    assert f"deepspeed_env file = {env_file}" in log
    pdsh_cmd = next(line for line in log.splitlines() if "cmd = pdsh" in line)
    assert "export GLOO_SOCKET_IFNAME=lo;" in pdsh_cmd and "export DS_ACCELERATOR=cpu;" in pdsh_cmd


def _launch_per_node(cmds, cwd, timeout=300):
    procs = [subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo",
                                                           "OMP_NUM_THREADS": "1"})
             for cmd in cmds]
    logs = []
    try:
        for proc in procs:
            logs.append(finish(proc, timeout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-4000:]
    return logs


def test_deepspeed_no_ssh_one_launch_per_node(tmp_path, tiny_data, single_node):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.2 slots=2\n127.0.0.3 slots=2\n")
    save, port = tmp_path / "no_ssh", free_port()
    cmds = [[sys.executable, "-m", "deepspeed.launcher.runner", "--no_ssh", "--node_rank", str(k), "--hostfile",
             str(hostfile), "--master_addr", "127.0.0.1", "--master_port", str(port),
             str(ROOT / "codegeex_train" / "pretrain.py"), *CONFIG, *tiny_argv(tiny_data, save)] for k in (0, 1)]
    logs = _launch_per_node(cmds, tmp_path)
    assert_losses_match(save, single_node)
    assert_two_nodes_reported(logs[0], save, ("127.0.0.2", "127.0.0.3"))


def test_torchrun_two_nodes(tmp_path, tiny_data, single_node):
    save, port = tmp_path / "torchrun", free_port()
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(k),
             "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
             "-m", "codegeex_train.pretrain", *CONFIG, *tiny_argv(tiny_data, save)] for k in (0, 1)]
    logs = _launch_per_node(cmds, tmp_path)
    assert_losses_match(save, single_node)
    assert_two_nodes_reported(logs[0], save, ("node 0", "node 1"))
