"""Communication accounting: the counter sees every collective, and the TP bytes of a real model's forward and
backward equal seed 000's formula exactly (phi = b*s*h elements: 4 phi per MLP and per attention, an
all-reduce counted as 2 x its size), checked against a count written out here by hand."""

import pytest
import torch
import torch.distributed as dist

from codegeex_train.accounting import CommCounter, Workload, comm_bytes_per_step
from codegeex_train.accounting.memory import SavedActivations
from codegeex_train.accounting.theory import activation_bytes_per_microbatch
from codegeex_train.config.model import ModelConfig
from codegeex_train.distributed.layout import Layout
from codegeex_train.distributed.topology import ParallelDims
from codegeex_train.model.codegeex import CodeGeeXModel
from codegeex_train.tensor_parallel import model_parallel_seed
from codegeex_train.testing import run_distributed

# (micro-batch b, seq s, hidden h, heads, layers, top query layer, recompute)
SHAPES = [(2, 8, 16, 4, 2, True, False), (1, 16, 32, 8, 3, True, True), (3, 4, 8, 4, 1, False, False)]


def seed_formula(b, s, h, layers, top_query, recompute, e=4):
    """Seed 000, term by term (fp32, one micro-batch, PP 1)."""
    phi = b * s * h * e
    mlp, attention = 4 * phi, 4 * phi  # one all-reduce (2 phi) forward, one backward, each
    per_layer = mlp + attention + (2 * phi + 2 * phi if recompute else 0)  # recompute repeats both forward ones
    total = layers * per_layer
    if top_query:  # a layer too, plus the f its position queries enter the TP region through (backward)
        total += per_layer + 2 * phi
    total += 2 * phi  # vocab-parallel embedding: all-reduce of the masked lookups, forward
    total += 2 * phi  # output layer (tied word table): all-reduce of its input gradient, backward
    total += 2 * (b * s * 4) + 2 * (2 * b * s * 4)  # loss: row max; then sum of exp and target logit, fp32
    return total


def count_model_bytes(topo, shapes):
    out = []
    for b, s, h, heads, layers, top_query, recompute in shapes:
        config = ModelConfig(num_layers=layers, hidden_size=h, num_attention_heads=heads, max_position_embeddings=s,
                             vocab_size=250, make_vocab_size_divisible_by=64, hidden_dropout=0.0,
                             attention_dropout=0.0, top_query_layer=top_query)
        tracker = model_parallel_seed(5, topo.tp_rank)
        model = CodeGeeXModel(config, topo.tp_group, tracker, seed=5, checkpoint_activations=recompute).train()
        ids = torch.randint(0, config.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(s).expand(b, s)
        with CommCounter(topo.named_groups(), record=True) as comm:
            model(ids, positions, labels=ids).mean().backward()
        theory = comm_bytes_per_step(Workload(config, s, Layout(topo.dims, b, 1), checkpoint_activations=recompute))
        out.append((comm.take(), {op for op, _, _ in comm.calls}, theory["tp"]))
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_bytes_equal_the_seed_formula(tp):
    for rank_results in run_distributed(count_model_bytes, world_size=tp, tp_size=tp, shapes=SHAPES):
        for shape, (measured, ops, theory) in zip(SHAPES, rank_results):
            b, s, h, _, layers, top_query, recompute = shape
            expected = seed_formula(b, s, h, layers, top_query, recompute)
            assert measured == {"tp": expected}, shape  # every byte in the TP group, none elsewhere
            assert ops == {"all_reduce"}, shape  # no all-gather of logits or activations
            assert theory == expected, shape  # the formula behind metrics and the planner


def counter_semantics(topo):
    x = torch.ones(10)
    parts = [torch.empty(10) for _ in range(topo.dp_size)]
    before = dist.all_reduce
    with CommCounter(topo.named_groups(), record=True) as comm:
        dist.all_reduce(x, group=topo.dp_group)  # 40 bytes -> 80
        dist.all_gather(parts, x, group=topo.dp_group)  # the gathered whole: 80
        dist.broadcast(x, src=0)  # default group: "world", 40
        dist.all_reduce(x, group=topo.tp_group)  # a group of one rank: nothing moves
        sends = [dist.P2POp(dist.isend, x, 1 - topo.rank, topo.dp_group),
                 dist.P2POp(dist.irecv, torch.empty(10), 1 - topo.rank, topo.dp_group)]
        for work in dist.batch_isend_irecv(sends):
            work.wait()  # the send counts (40), the receive is the peer's send
        inside = dist.all_reduce
    return comm.take(), comm.calls, inside is not before and dist.all_reduce is before  # patched, then restored


def test_counter_volumes_groups_and_restore():
    for taken, calls, restored in run_distributed(counter_semantics, world_size=2):
        assert taken == {"dp": 80 + 80 + 40, "world": 40}
        assert [op for op, _, _ in calls] == ["all_reduce", "all_gather", "broadcast", "send"]
        assert restored


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "fast_gelu"])
def test_saved_activations_match_theory_for_each_activation(activation):
    """What autograd keeps for one micro-batch, measured, against the theory the planner and the start-up report
    use: every activation keeps its input alone (fast GeLU recomputes its sigmoid; keeping it too was 17% more)."""
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                         hidden_dropout=0.0, attention_dropout=0.0, activation=activation, vocab_size=512)
    b, s = 4, 64
    model = CodeGeeXModel(config, None, None, seed=5).train()
    ids = torch.randint(0, 512, (b, s))
    with SavedActivations(model) as saved:
        model(ids, torch.arange(s).expand(b, s), labels=ids)
    theory = activation_bytes_per_microbatch(Workload(config, s, Layout(ParallelDims(1), b, 1), device="cpu"))
    assert saved.bytes == pytest.approx(theory, rel=0.08)
