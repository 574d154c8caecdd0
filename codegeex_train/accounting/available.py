"""How much memory a rank may still take, read before anything is allocated: the host's (what the kernel would
give: MemAvailable, the cgroup's limit, RLIMIT_AS) and the accelerator's (free memory of this rank's GPU).

Each reader returns an ``Available``: bytes and the words saying where the figure comes from, for error lines.
Tests replace ``host_memory`` / ``device_memory`` (module attributes, looked up at each call) to stand for a small
machine.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a huge multiple of the page size


@dataclass(frozen=True)
class Available:
    bytes: int
    source: str  # e.g. "MemAvailable in /proc/meminfo"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def mem_available(proc: Path = Path("/proc")) -> Available | None:
    """MemAvailable: what new allocations can get without swapping (free memory plus reclaimable caches)."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return Available(int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_dirs(proc: Path) -> list[tuple[Path, str, str]]:
    """(directory, limit file, usage file) of this process's memory cgroup and each of its ancestors up to the
    mount's root: a limit anywhere above applies too. cgroup v2 (memory.max) and v1 (memory.limit_in_bytes)."""
    try:
        groups = (proc / "self" / "cgroup").read_text().splitlines()
        mounts = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    paths = {}  # "v2" or "v1" -> this process's cgroup path
    for line in groups:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            paths.setdefault("v2", path)
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    dirs = []
    for line in mounts:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        root, mount_point = fields[3], fields[4]
        fstype, *rest = line.split(" - ", 1)[1].split()
        options = rest[1] if len(rest) > 1 else ""
        if fstype == "cgroup2" and "v2" in paths:
            version, files = "v2", ("memory.max", "memory.current")
        elif fstype == "cgroup" and "memory" in options.split(",") and "v1" in paths:
            version, files = "v1", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        path = paths[version]
        relative = path[len(root):] if root != "/" and path.startswith(root) else path
        here = Path(mount_point) / relative.lstrip("/")
        top = Path(mount_point)
        while True:
            dirs.append((here, *files))
            if here == top or top not in here.parents:
                break
            here = here.parent
    return dirs


def cgroup_available(proc: Path = Path("/proc")) -> Available | None:
    """The tightest (limit - usage) of this process's memory cgroup and its ancestors; None without a limit."""
    best = None
    for directory, limit_file, usage_file in _cgroup_dirs(proc):
        limit = _read_int(directory / limit_file)
        if limit is None or limit >= _UNLIMITED:
            continue
        usage = _read_int(directory / usage_file) or 0
        left = max(0, limit - usage)
        if best is None or left < best.bytes:
            best = Available(left, f"the cgroup limit {directory / limit_file} ({limit / 2**30:.2f} GiB, "
                                   f"{usage / 2**30:.2f} GiB used)")
    return best


def address_space_available(proc: Path = Path("/proc")) -> Available | None:
    """RLIMIT_AS (ulimit -v) minus this process's address space now (VmSize); None when unlimited. Per process:
    every rank has its own."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    size = 0
    try:
        for line in (proc / "self" / "status").read_text().splitlines():
            if line.startswith("VmSize:"):
                size = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return Available(max(0, soft - size), f"RLIMIT_AS (ulimit -v {soft // 1024}) less this process's "
                                          f"{size / 2**30:.2f} GiB of address space")


def host_memory() -> tuple[Available | None, Available | None]:
    """(shared by the ranks of this host: the smaller of MemAvailable and the cgroup's room; per process:
    RLIMIT_AS's room). Either is None when unknown or unlimited."""
    shared = [a for a in (mem_available(), cgroup_available()) if a is not None]
    return (min(shared, key=lambda a: a.bytes) if shared else None), address_space_available()


def device_memory(local_rank: int) -> Available | None:
    """Free memory of CUDA device ``local_rank`` (the one training will use), read through NVML when torch can
    (no CUDA context at all), else with cudaMemGetInfo on that device only; None when it cannot be read."""
    import torch

    device = torch.device("cuda", local_rank)
    try:
        total = torch.cuda.get_device_properties(device).total_memory
        used = torch.cuda.device_memory_used(device)  # NVML; raises without pynvml
        return Available(max(0, total - used), f"free memory of GPU {local_rank} (NVML: {total / 2**30:.1f} GiB, "
                                               f"{used / 2**30:.1f} GiB in use)")
    except Exception:  # noqa: BLE001 - no NVML (or an older torch): ask CUDA on that device
        pass
    try:
        free, total = torch.cuda.mem_get_info(device)
    except Exception:  # noqa: BLE001 - a device we cannot query is not a reason to refuse the run
        return None
    return Available(free, f"free memory of GPU {local_rank} ({total / 2**30:.1f} GiB total)")


def local_world_size(world_size: int, env=os.environ) -> int:
    """Ranks on this host: the launcher's LOCAL_WORLD_SIZE (torchrun), LOCAL_SIZE (DeepSpeed) or
    SLURM_NTASKS_PER_NODE; without any, all of them (one host)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        if env.get(name, "").isdigit() and int(env[name]) > 0:
            return min(int(env[name]), world_size)
    return world_size
