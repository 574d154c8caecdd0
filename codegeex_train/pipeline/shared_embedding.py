"""The word embedding tied between the first stage (input) and the last stage (output layer).

With PP > 1 each end holds a copy, ``word_embeddings.weight`` (V/TP x h per TP rank). They start equal
(``sync_shared_embedding`` broadcasts the first stage's over the embedding group, at start and after a
checkpoint load) and stay equal because, before every optimizer step, both hold the same gradient: the sum
of the two stages' gradients (``allreduce_shared_embedding_grads``). Same weights, same gradients, same
optimizer states: the same update on both, bit for bit. The last stage's copy carries
``ds_pipe_replicated`` so DeepSpeed's gradient norm counts the tied weight once.

Why not Megatron's way. Megatron all-reduces ``.grad`` of the two copies over the embedding group at the
accumulation boundary, then reduces over DP. ZeRO-2 reduces (and frees) every gradient over DP inside
every micro-batch's backward, so at the boundary no ``.grad`` exists: each DP rank only holds its own
partition of the DP-averaged gradient. Alternatives rejected:
  - ``engine.coalesce_grad_reduction()`` keeps full gradients until the boundary: full-gradient memory on
    every rank, which is what ZeRO-2 is for.
  - All-reducing per micro-batch inside the backward: in 1F1B the last stage runs backward k long before the
    first stage does, so a blocking collective between them would stall (or deadlock) the pipeline.
  - Training only the first copy and broadcasting it after each step: one more transfer of V/TP x h per step
    than the design below, and the last stage would need its own gradient sent over anyway.
What we do, after the boundary backward's ZeRO epilogue and before ``engine.step()``, on the first- and
last-stage ranks only (every DP rank of them, together):
  1. ``safe_get_full_grad``: each DP rank writes its partition slice into a zeroed V/TP x h fp32 buffer and
     the buffer is all-reduced over DP -> the full DP-averaged gradient of this copy (adding zeros: exact).
  2. all-reduce over the embedding group (first, last) -> g_first + g_last, identical on both ends.
  3. ``safe_set_full_grad``: each rank writes its own slice back into ZeRO's partition (no communication).
Cost per optimizer step, per first/last-stage rank, with W = V/TP x h x 4 bytes (fp32 gradient):
    Megatron:  one all-reduce of W over the embedding group (2 ranks).
    ours:      the same all-reduce of W over the embedding group, plus one all-reduce of W over DP (none
               when DP = 1). Once per step, never per micro-batch; middle stages send nothing.
For CodeGeeX-13B (V 52,224, h 5,120, TP 8): W = 134 MB, next to the ~1.5 GB of a stage's own ZeRO reductions.
With PP = 1 the one weight serves both ends and every function here returns at once; so does every function for a
model with an untied output layer (--untie-embeddings-and-output-weights: the word table on the first stage, its own
``output_layer`` on the last, no copy), on every stage alike, so no stage waits in a collective the other skips.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from codegeex_train.distributed.topology import Topology


def shared_embedding_weight(module: torch.nn.Module) -> torch.nn.Parameter | None:
    """The word table when the output layer is tied to it (tagged ``shared_embedding``); None for an untied model,
    whose word table (first stage) and ``output_layer`` (last stage) are trained apart: nothing to sync or sum."""
    weight = getattr(getattr(module, "word_embeddings", None), "weight", None)
    return weight if getattr(weight, "shared_embedding", False) else None


def _tied(module: torch.nn.Module, topology: Topology) -> torch.nn.Parameter | None:
    if topology.pp_size == 1 or not topology.in_embedding_group:
        return None
    return shared_embedding_weight(module)


def mark_shared_embedding_copy(module: torch.nn.Module, topology: Topology) -> None:
    """Tag the last stage's copy so DeepSpeed's grad norm skips it (the first stage's counts the sum)."""
    weight = _tied(module, topology)
    if weight is not None and topology.is_last_stage:
        weight.ds_pipe_replicated = True


@torch.no_grad()
def sync_shared_embedding(module: torch.nn.Module, topology: Topology) -> None:
    """Copy the first stage's word embedding into the last stage's (model weight and, under ZeRO, the fp32
    master partition). Collective over the embedding group."""
    weight = _tied(module, topology)
    if weight is None:
        return
    dist.broadcast(weight.data, src=topology.first_stage_rank, group=topology.embedding_group)
    if hasattr(weight, "_hp_mapping"):  # under a ZeRO optimizer: its fp32 master copy must follow
        from deepspeed.utils import safe_set_full_fp32_param

        safe_set_full_fp32_param(weight, weight.data.float())


@torch.no_grad()
def allreduce_shared_embedding_grads(module: torch.nn.Module, topology: Topology) -> None:
    """Sum the two copies' gradients; call after the boundary backward, before ``engine.step()``."""
    weight = _tied(module, topology)
    if weight is None:
        return
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    grad = safe_get_full_grad(weight)  # (V/TP, h) fp32, DP-averaged; a collective over DP
    dist.all_reduce(grad, group=topology.embedding_group)
    safe_set_full_grad(weight, grad)
