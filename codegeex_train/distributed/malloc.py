"""Fixed glibc malloc thresholds for CPU runs.

glibc's mmap threshold is adaptive: each freed mmapped block raises it (up to 32 MiB on 64-bit), so after a
few steps the large, short-lived CPU tensors of a training step (activations, gradient buckets) come from the
heap instead of fresh mmaps, and the heap fragments: peak RSS per rank then climbs for a hundred iterations or
more (0.8 GB -> 2.3 GB for the default CPU model) although nothing leaks. Fixing both thresholds (which also
switches the adaptation off) keeps it flat. The value matters for speed: at glibc's initial 128 KiB every
tensor above it is a fresh mmap, zeroed and page-faulted on each step (the default model's step ~35% slower);
at 4 MiB the many mid-sized tensors are reused from the heap (as fast as the adaptive default, measured) while
the few large ones (logits, gradient buckets) still go back to the system when freed.

``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` only work when set before the process starts (glibc
reads them at its first malloc; setting ``os.environ`` later changes nothing), which scripts/pretrain_codegen.sh
does. For launches that bypass it (torchrun, deepspeed directly) ``fix_malloc_thresholds`` applies the same
values with ``mallopt`` at the start of ``pretrain.main``; a value the user set in the environment (or through
``GLIBC_TUNABLES``) wins, since glibc has applied it already.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

M_TRIM_THRESHOLD = -1  # malloc.h
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 4 * 1024 * 1024  # see the module docstring: flat RSS, and the speed of the adaptive default
_PARAMS = {"MALLOC_MMAP_THRESHOLD_": (M_MMAP_THRESHOLD, "glibc.malloc.mmap_threshold"),
           "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, "glibc.malloc.trim_threshold")}


def fix_malloc_thresholds(threshold: int = THRESHOLD_BYTES) -> dict[str, int]:
    """Set glibc's mmap and trim thresholds to ``threshold`` bytes, each unless the user chose it; return what
    was set (empty off glibc Linux)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return {}
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return {}
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    applied = {}
    for env, (param, tunable) in _PARAMS.items():
        if env in os.environ or tunable in tunables:
            continue  # the user's value, read by glibc at start-up
        if mallopt(param, threshold) == 1:
            applied[env] = threshold
    return applied
