"""Where the ranks run, and joining them into one job without hanging.

A rank's *node* is the launcher's identity for it, not the host name: two hostfile entries can be the same
machine (loopback "hosts" in our tests, containers sharing a host name), and one machine can hold several
entries. So each rank reports the node its launcher placed it on (DeepSpeed: the hostfile entry and
``--node_rank``; torchrun: ``GROUP_RANK``; SLURM: ``SLURM_NODEID``) with the host name beside it, and the
start-up report and the TP-spans-nodes warning are built from those reports, not from rank arithmetic.

``join_process_group`` holds a roll call before forming the process group: each rank writes its place into
the rendezvous store, and the ranks wait for each other for at most ``--distributed-timeout-minutes``. A node
that never comes up then ends the job with a message naming the missing ranks and their node, instead of
torch's "2/4 clients joined" or a hang.
"""

from __future__ import annotations

import base64
import json
import os
import socket
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from codegeex_train.distributed.topology import build_rank_groups
from codegeex_train.layout.dims import ParallelDims


class ClusterError(RuntimeError):
    """The job could not form: a node missing, the rendezvous unreachable. One line, names what and where."""


@dataclass(frozen=True)
class RankPlace:
    rank: int
    local_rank: int
    node_rank: int
    node: str  # the launcher's name for the node: the hostfile entry, the SLURM node, or "node K"
    hostname: str
    pid: int


def _deepspeed_world_info() -> dict[str, list[int]] | None:
    """The hostfile as DeepSpeed's per-node launcher received it (``--world_info``, base64 JSON of host ->
    slots), read from the parent's command line: DeepSpeed does not export it to the ranks."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    if "deepspeed.launcher.launch" not in argv:
        return None
    for arg in argv:
        if arg.startswith("--world_info="):
            try:
                return json.loads(base64.urlsafe_b64decode(arg.split("=", 1)[1]))
            except ValueError:
                return None
    return None


def _int_env(env, *names: str) -> int | None:
    for name in names:
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def rank_env_from_slurm(env=os.environ) -> None:
    """Under ``srun`` (no launcher of ours in between) take RANK, WORLD_SIZE and LOCAL_RANK from SLURM's
    variables; MASTER_ADDR and MASTER_PORT come from the batch script."""
    if "RANK" not in env and "SLURM_PROCID" in env:
        env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"], LOCAL_RANK=env["SLURM_LOCALID"])


def this_rank_place(env=os.environ) -> RankPlace:
    rank, local_rank = int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0"))
    # DeepSpeed's launcher: CROSS_RANK; torchrun: GROUP_RANK; SLURM (srun): SLURM_NODEID.
    node_rank = _int_env(env, "CROSS_RANK", "GROUP_RANK", "SLURM_NODEID")
    local_size = _int_env(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
    if node_rank is None:
        node_rank = rank // local_size if local_size else 0
    world_info = _deepspeed_world_info() if "CROSS_RANK" in env else None
    if world_info and node_rank < len(world_info):
        node = list(world_info)[node_rank]
    elif env.get("SLURMD_NODENAME"):
        node = env["SLURMD_NODENAME"]
    else:
        node = f"node {node_rank}"
    return RankPlace(rank, local_rank, node_rank, node, socket.gethostname(), os.getpid())


def expected_node_of_rank(world_size: int, env=os.environ) -> dict[int, str]:
    """Where the launcher meant each rank to run (for naming missing ranks): from DeepSpeed's hostfile when
    we have it, else contiguous blocks of the local world size (torchrun's and srun's block placement)."""
    world_info = _deepspeed_world_info() if "CROSS_RANK" in env else None
    if world_info:
        ranks = iter(range(world_size))
        return {next(ranks): f"{host} (node {i})" for i, (host, slots) in enumerate(world_info.items())
                for _ in slots}
    local = _int_env(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE") or world_size
    return {r: f"node {r // local}" for r in range(world_size)}


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _missing_message(missing: list[int], world_size: int, timeout: timedelta, where: str) -> str:
    nodes: dict[str, list[int]] = {}
    expected = expected_node_of_rank(world_size)
    for r in missing:
        nodes.setdefault(expected.get(r, "?"), []).append(r)
    on = "; ".join(f"{node}: ranks {_ranks_text(rs)}" for node, rs in nodes.items())
    return (f"{world_size - len(missing)} of {world_size} ranks joined within --distributed-timeout-minutes "
            f"{timeout.total_seconds() / 60:g}; missing {on}. Check that every node was launched (with --no_ssh "
            f"or torchrun: one command per node, each with its --node_rank) and reaches {where}")


def join_process_group(backend: str, timeout: timedelta, device: torch.device | None = None) -> None:
    """Form the default process group from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT),
    every wait bounded by ``timeout``; a rank missing at the roll call raises ClusterError naming it."""
    env = os.environ
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    where = f"MASTER_ADDR {addr}:{port}"
    # Under torchrun the agent already serves the store on MASTER_PORT: every rank is a client of it.
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=rank == 0 and not agent_store, timeout=timeout,
                              wait_for_workers=False)
    except RuntimeError as e:  # DistNetworkError/DistStoreError
        raise ClusterError(f"rank {rank} could not reach the rendezvous at {where} (served by rank 0) within "
                           f"--distributed-timeout-minutes {timeout.total_seconds() / 60:g}: rank 0's node never "
                           f"came up, or MASTER_ADDR/MASTER_PORT are wrong ({str(e).splitlines()[0]})") from None
    prefix = f"codegeex_train/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(f"{prefix}rank/{rank}", json.dumps(asdict(this_rank_place())))
    keys = [f"{prefix}rank/{r}" for r in range(world_size)]
    # Rank 0 serves the store and names the missing ranks; the others wait a little longer, so that its message
    # comes first, and then only say that they gave up (the store may be gone with rank 0 by then).
    grace = timedelta(0) if rank == 0 else timedelta(seconds=10)
    try:
        store.wait(keys, timeout + grace)  # blocks in the store's server: no polling by thousands of ranks
    except RuntimeError:  # DistStoreError on timeout, DistNetworkError when rank 0 has gone
        if rank == 0:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            raise ClusterError(_missing_message(missing, world_size, timeout, where)) from None
        raise ClusterError(f"rank {rank}: not every rank joined within --distributed-timeout-minutes "
                           f"{timeout.total_seconds() / 60:g} (rank 0 names the missing ones)") from None
    kwargs = {}
    if backend == "nccl" and device is not None:
        kwargs["device_id"] = device  # bind the communicator to this rank's GPU up front, as DeepSpeed does
    dist.init_process_group(backend, store=dist.PrefixStore(prefix + "pg/", store), rank=rank,
                            world_size=world_size, timeout=timeout, **kwargs)


def gather_places() -> list[RankPlace]:
    """Every rank's place, as the ranks themselves report it (a collective over the world)."""
    places: list = [None] * dist.get_world_size()
    dist.all_gather_object(places, asdict(this_rank_place()))
    return [RankPlace(**p) for p in places]


def tp_groups_spanning_nodes(places: list[RankPlace], dims: ParallelDims) -> list[tuple[list[int], list[str]]]:
    node = {p.rank: p.node for p in places}
    spanning = []
    for group in build_rank_groups(dims).tp:
        nodes = sorted({node[r] for r in group})
        if len(nodes) > 1:
            spanning.append((group, nodes))
    return spanning


def cluster_report(places: list[RankPlace], dims: ParallelDims) -> tuple[str, dict]:
    """The topology actually formed, as text for rank 0's console and as run metadata."""
    nodes: dict[str, list[RankPlace]] = {}
    for p in sorted(places, key=lambda p: p.rank):
        nodes.setdefault(p.node, []).append(p)
    groups = build_rank_groups(dims)
    spanning = tp_groups_spanning_nodes(places, dims)
    lines = [f"cluster: {len(nodes)} node(s), world {dims.world_size} = TP {dims.tp_size} x DP {dims.dp_size} "
             f"x PP {dims.pp_size}"]
    for name, members in nodes.items():
        hosts = ", ".join(sorted({p.hostname for p in members}))
        lines.append(f"  {name} (node rank {members[0].node_rank}, host {hosts}): ranks "
                     f"{_ranks_text([p.rank for p in members])}")
    for kind, all_groups in groups.as_dict().items():
        if kind in ("tp", "pp", "dp"):
            lines.append(f"  {kind} groups: " + " ".join(str(g) for g in all_groups))
    for group, names in spanning:
        lines.append(f"  WARNING: TP group {group} spans nodes {', '.join(names)}: its all-reduces cross the "
                     f"network; use a --tensor-model-parallel-size that divides the ranks per node")
    meta = {
        "nodes": [{"node": name, "node_rank": m[0].node_rank, "hostnames": sorted({p.hostname for p in m}),
                   "ranks": [p.rank for p in m]} for name, m in nodes.items()],
        "tp_groups": groups.tp, "pp_groups": groups.pp, "dp_groups": groups.dp,
        "tp_groups_spanning_nodes": [group for group, _ in spanning],
    }
    return "\n".join(lines), meta
