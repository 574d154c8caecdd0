"""Interleaved 1F1B in the accounting (codegeex_train/accounting/theory.py): the pipeline bytes of v model chunks,
each chunk's saved activations (measured on real chunked models, no process group) and the activations a rank holds
at its schedule's peak, replayed through the real executor."""

import pytest
import torch

from codegeex_train.accounting.memory import ChunkActivations
from codegeex_train.accounting.theory import (
    Workload,
    activation_bytes_per_microbatch,
    activations_in_flight,
    chunk_activation_bytes,
    comm_bytes_per_step,
    expected_memory_report,
    memory_per_rank,
    microbatches_in_flight,
    tp_bytes_per_microbatch,
)
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.recompute import Recompute
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.model.codegeex import CodeGeeXModel
from codegeex_train.pipeline import interleaved_one_f_one_b, run_schedule, with_p2p_ops
from codegeex_train.layout.stages import rank_chunk_layers

B, S, H = 2, 32, 32


def _config(layers, dropout=0.1):
    return ModelConfig(num_layers=layers, hidden_size=H, num_attention_heads=4, max_position_embeddings=S,
                       vocab_size=256, make_vocab_size_divisible_by=64, hidden_dropout=dropout,
                       attention_dropout=dropout)


def _workload(layers, tp=1, pp=2, v=2, m=4, **kw):
    plan = ParallelPlan.derive(ParallelDims(tp * pp, tp, pp), micro_batch_size=B, num_microbatches=m, num_layers=layers,
                               num_chunks=v, seq_length=S, **kw)
    return Workload(_config(layers), plan, device="cpu")


def test_the_workload_splits_the_layers_into_chunks_as_training_does():
    w = _workload(8, pp=2, v=2)
    assert w.plan.chunk_layers == tuple(rank_chunk_layers(8, 2, 2))
    assert w.plan.stage_layers == ((0, 1, 4, 5), (2, 3, 6, 7)) and w.chunk_sizes(1) == [2, 2]
    assert [w.first_chunk(0, c) for c in (0, 1)] == [True, False]
    assert [w.last_chunk(1, c) for c in (0, 1)] == [False, True]
    with pytest.raises(ValueError, match="not divisible"):
        _workload(6, pp=2, v=2)  # 6 layers do not make 4 chunks


@pytest.mark.parametrize("pp,v,m", [(2, 1, 4), (2, 2, 4), (2, 3, 2), (4, 2, 8), (3, 4, 3)])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
def test_pipeline_bytes_are_2mv_less_the_ends(pp, v, m, tp, sp):
    """Per micro-batch every chunk sends its output on and its input gradient back, but for the loss's (the last
    stage's last chunk) and the ids' (the first stage's chunk 0): (2 m v - m [r = 0] - m [r = p - 1]) phi."""
    w = _workload(pp * v * 2, tp=tp, pp=pp, v=v, m=m, sequence_parallel=sp)
    phi = B * (S // tp if sp else S) * H * 4
    for r in range(pp):
        assert comm_bytes_per_step(w, r)["pp"] == (2 * m * v - m * (r == 0) - m * (r == pp - 1)) * phi, r


def test_full_recompute_units_are_per_chunk():
    """Megatron recomputes per model chunk: --recompute-method block re-runs the first N layers of every chunk."""
    block = Recompute("full", "block", 1)
    for v, recomputed in ((1, 1), (2, 2)):
        w = _workload(8, tp=2, pp=2, v=v, recompute=block)
        phi = B * S * H * 4
        assert tp_bytes_per_microbatch(w, 0)["recompute"] == recomputed * 4 * phi


@pytest.mark.parametrize("pp,v,m", [(2, 2, 2), (2, 2, 4), (2, 3, 4), (4, 2, 4), (4, 2, 8), (3, 2, 6)])
def test_activations_in_flight_replay_the_executor(pp, v, m):
    """The theory's replay of the schedule gives the executor's peak: a stage that adds each chunk's bytes at its
    forward and frees them at its backward, run by run_schedule over the real interleaved ops."""
    for r in range(pp):
        per_chunk = [1000 * (c + 1) + 7 * r for c in range(v)]  # unequal chunks: which pairs are held matters
        ops = with_p2p_ops(interleaved_one_f_one_b(pp, r, m, v), r == 0, r == pp - 1, v)
        stage = _BytesStage(per_chunk)
        stats = run_schedule(ops, stage, _LoopbackComm())
        assert activations_in_flight(per_chunk, pp, r, m) == stage.peak
        assert stats.peak_in_flight == microbatches_in_flight(_workload(pp * v, pp=pp, v=v, m=m), r)
        assert activations_in_flight([5] * v, pp, r, m) == 5 * stats.peak_in_flight


def test_one_chunk_keeps_1f1b():
    w = Workload(_config(4), ParallelPlan.derive(ParallelDims(4, 1, 4), micro_batch_size=B, num_microbatches=3,
                                                 num_layers=4, seq_length=S), device="cpu")
    for r in range(4):
        held = activation_bytes_per_microbatch(w, r) * min(4 - r, 3)
        assert microbatches_in_flight(w, r) == min(4 - r, 3) and memory_per_rank(w, r).activations == held
        assert chunk_activation_bytes(w, r) == [activation_bytes_per_microbatch(w, r)]


def test_chunks_hold_their_share_and_memory_their_peak():
    w = _workload(8, pp=2, v=2, m=4)
    first, last = chunk_activation_bytes(w, 0), chunk_activation_bytes(w, 1)
    assert first[0] > first[1] == last[0] < last[1]  # the embedding on chunk 0, the head on the last chunk
    assert sum(first) == activation_bytes_per_microbatch(w, 0) and sum(last) == activation_bytes_per_microbatch(w, 1)
    # rank 1 holds at most 2(p - r - 1) + (v - 1)p + 1 = 3 pairs: micro-batches 0 and 1 of chunk 0 and 0 of chunk 1
    assert microbatches_in_flight(w, 1) == 3 and memory_per_rank(w, 1).activations == 2 * last[0] + last[1]
    # rank 0: 5 pairs, at most four of them of chunk 0 (after forward 5: micro-batches 0-3 of chunk 0, 1 of chunk 1)
    assert microbatches_in_flight(w, 0) == 5 and memory_per_rank(w, 0).activations == 4 * first[0] + first[1]
    report = expected_memory_report(w)
    assert "interleaved 1F1B with 2 chunks per rank" in report and "up to 5 (micro-batch, chunk) pairs" in report


def test_each_chunk_saves_what_theory_says():
    """Two ranks' chunked models in one process (TP 1, dropout on: CPU's math-path attention), a micro-batch sent
    through the four virtual stages: ChunkActivations measures each chunk's forward, equal to theory (to the byte
    with torch 2.13 on CPU)."""
    config, pp, v = _config(8), 2, 2
    w = Workload(config, ParallelPlan.derive(ParallelDims(pp, 1, pp), micro_batch_size=B, num_microbatches=pp,
                                             num_layers=8, num_chunks=v, seq_length=S), device="cpu")
    chunks = rank_chunk_layers(8, pp, v)
    models = [CodeGeeXModel(config, None, None, seed=5, pre_process=r == 0, post_process=r == pp - 1,
                            chunk_layers=chunks[r]).train() for r in range(pp)]
    ids = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(S).repeat(B, 1)
    measured = [ChunkActivations(model) for model in models]
    hidden = ids
    for c in range(v):
        for r in range(pp):
            last = (r, c) == (pp - 1, v - 1)
            with measured[r]:
                hidden = models[r](hidden, positions, labels=ids if last else None, chunk=c)
            if not last:
                hidden = hidden.detach().requires_grad_()
    for r in range(pp):
        assert measured[r].per_chunk(v) == pytest.approx(chunk_activation_bytes(w, r), rel=0.01), r


class _BytesStage:
    """Chunked stage whose activations are plain byte counts: the peak of what it holds at once."""

    def __init__(self, per_chunk):
        self.per_chunk, self.held, self.peak = per_chunk, 0, 0

    def forward_step(self, mb, chunk, input_tensor):
        self.held += self.per_chunk[chunk]
        self.peak = max(self.peak, self.held)
        return torch.zeros(1)

    def backward_step(self, mb, chunk, input_tensor, output, output_grad):
        self.held -= self.per_chunk[chunk]
        return torch.zeros(1)


class _LoopbackComm:
    """Every receive gets a zero tensor at once: one rank's ops run alone, in their order."""

    def exchange(self, transfers):
        return [None if t.is_send else torch.zeros(1) for t, _ in transfers]
