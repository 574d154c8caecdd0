"""`deepspeed --hostfile` through pdsh and ssh to two loopback "hosts", exactly as a cluster user launches."""

import json
import time

import pytest

pytestmark = pytest.mark.slow  # every test in this file is in the slow tier (tests/conftest.py)

PROBE = r'''
import argparse, json, os, sys
from datetime import timedelta

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int)  # deepspeed.launcher.launch passes --local_rank=N
args = parser.parse_args()

names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "CODEGEEX_PROBE", "CODEGEEX_PROBE_SPACES", "GLOO_SOCKET_IFNAME", "DS_ACCELERATOR", "SSH_CONNECTION",
         "PYTHONPATH")
seen = {k: os.environ.get(k) for k in names}
seen["argv_local_rank"] = args.local_rank
seen["cwd"] = os.getcwd()

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
seen["all_reduce"] = value.item()
seen["dist_rank"], seen["dist_world_size"] = dist.get_rank(), dist.get_world_size()
dist.destroy_process_group()

with open(os.path.join(args.out, f"rank{seen['RANK']}.json"), "w") as f:
    json.dump(seen, f)
'''


def test_deepspeed_hostfile_reaches_both_hosts(loopback_cluster, tmp_path):
    cluster = loopback_cluster
    cwd = tmp_path / "launch"
    out = tmp_path / "out"
    cwd.mkdir()
    out.mkdir()
    script = cwd / "probe.py"
    script.write_text(PROBE)
    hostfile = cluster.write_hostfile(cwd / "hostfile")
    cluster.write_deepspeed_env(cwd, CODEGEEX_PROBE=1, CODEGEEX_PROBE_SPACES="two words")

    cmd = cluster.deepspeed_cmd(hostfile, script.name, "--out", out)
    start = time.monotonic()
    result = cluster.run(cmd, cwd=cwd, timeout=180)
    elapsed = time.monotonic() - start
    log = f"cmd: {cmd}\n--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    assert result.returncode == 0, log
    print(f"deepspeed --hostfile launch took {elapsed:.1f} s")

    ranks = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: int(r["RANK"]))
    assert [r["RANK"] for r in ranks] == ["0", "1", "2", "3"], log
    assert [r["CROSS_RANK"] for r in ranks] == ["0", "0", "1", "1"]
    assert [r["LOCAL_RANK"] for r in ranks] == ["0", "1", "0", "1"]
    assert [r["argv_local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert {r["WORLD_SIZE"] for r in ranks} == {"4"}
    assert {r["CROSS_SIZE"] for r in ranks} == {"2"}
    assert {r["MASTER_ADDR"] for r in ranks} == {cluster.master_addr}
    assert [r["dist_rank"] for r in ranks] == [0, 1, 2, 3]
    assert {r["dist_world_size"] for r in ranks} == {4}
    assert {r["all_reduce"] for r in ranks} == {1.0 + 2 + 3 + 4}

    # Each node's ranks came in over our sshd, on the host the hostfile names for that node rank.
    for r in ranks:
        host = cluster.hosts[int(r["CROSS_RANK"])]
        server_addr, server_port = r["SSH_CONNECTION"].split()[2:4]
        assert (server_addr, int(server_port)) == (host, cluster.ssh_port), r

    # Forwarded only through .deepspeed_env (the runner exports PYTHON*/MLFLOW*/MV2*/UCX* and nothing else):
    # values arrive stripped of the file's newline, and one with a space survives the runner's quoting.
    assert {r["CODEGEEX_PROBE"] for r in ranks} == {"1"}
    assert {r["CODEGEEX_PROBE_SPACES"] for r in ranks} == {"two words"}
    assert {r["GLOO_SOCKET_IFNAME"] for r in ranks} == {"lo"}
    assert {r["DS_ACCELERATOR"] for r in ranks} == {"cpu"}
    # The runner prepends its cwd to PYTHONPATH and exports it; the launch cd's there on every host.
    assert {r["PYTHONPATH"].split(":")[0] for r in ranks} == {str(cwd)}
    assert {r["cwd"] for r in ranks} == {str(cwd)}

    leftover = cluster.launched(grace=10)
    assert not leftover, [(p.pid, p.cmdline()) for p in leftover]
