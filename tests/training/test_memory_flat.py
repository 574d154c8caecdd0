"""Memory per rank stays flat after warm-up: 200 iterations of the tiny model on 2 gloo ranks, each rank's
current RSS (not the peak) sampled after a few optimizer steps. A leak that a long run would die of (each
step's loss kept with its graph, ...) grows it; the allocator's fragmentation is kept off by the fixed glibc
malloc thresholds that pretrain.main sets on CPU (codegeex_train/distributed/malloc.py)."""

import ctypes
import gc
import os

import pytest

from codegeex_train import pretrain
from tests.harness import run_distributed, tiny_pretrain_args
from codegeex_train.training import engine_stage as stage
from codegeex_train.training import trainer

ITERS = 200
WARM = 50  # iterations before the first sample: optimizer states, DeepSpeed buffers, caches all exist by then
SAMPLES = (WARM, 100, 150, ITERS)
# From iteration WARM to ITERS, per rank, with the fixed thresholds: +0.5 to +1.4 MB when first measured; later, on
# a busier machine, -2.9 to +5.2 MB over twelve runs and once +9.7 MB (a CI run), with no trend between samples.
# Each micro-batch's loss kept with its graph (leak="loss_graph") grows it by +120 to +184 MB and fails this.
MAX_GROWTH_MB = 16.0

pytestmark = [pytest.mark.slow,  # every test in this file is in the slow tier (tests/conftest.py)
              pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")]


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def train_and_sample_rss(topology, argv, leak=None, remedy=True):
    """pretrain.main, with this rank's current RSS recorded after the optimizer steps in SAMPLES."""
    samples, steps, kept = {}, [0], []
    real_step = trainer.train_step

    def train_step(run, batches, *rest):
        loss = real_step(run, batches, *rest)
        steps[0] += 1
        if steps[0] in SAMPLES:
            gc.collect()  # only garbage goes; what is still referenced (a leak) stays
            samples[steps[0]] = current_rss_mb()
        return loss

    trainer.train_step = train_step
    if leak == "loss_graph":  # the deliberately broken variant: every micro-batch's loss kept with its graph
        real_mean = stage.masked_mean

        def masked_mean(loss_per_token, loss_mask):
            loss = real_mean(loss_per_token, loss_mask)
            kept.append(loss)
            return loss

        stage.masked_mean = masked_mean
    if not remedy:  # glibc's adaptive thresholds, as before the fix
        pretrain.fix_malloc_thresholds = lambda: {}
    pretrain.main(argv)
    return samples


def rss_samples(tmp_path, data, **kw):
    argv = tiny_pretrain_args(data, str(tmp_path / "run"), ITERS, "--log-interval", "50")
    return run_distributed(train_and_sample_rss, world_size=2, deadline_s=300, argv=argv, **kw)


def growth(samples):
    return samples[ITERS] - samples[WARM]


def test_memory_per_rank_stays_flat(tmp_path, tiny_data):
    ranks = rss_samples(tmp_path, tiny_data)
    for rank, samples in enumerate(ranks):
        assert sorted(samples) == list(SAMPLES)
        assert growth(samples) < MAX_GROWTH_MB, (rank, samples)


def test_fixed_thresholds_leave_the_users_choice(monkeypatch):
    from codegeex_train.distributed import malloc

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the user's: glibc read it at start-up
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    try:
        ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        assert malloc.fix_malloc_thresholds() == {}
        return
    assert malloc.fix_malloc_thresholds() == {"MALLOC_TRIM_THRESHOLD_": malloc.THRESHOLD_BYTES}
