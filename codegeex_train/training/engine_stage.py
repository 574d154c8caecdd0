"""One pipeline stage's forward and backward steps over its DeepSpeed engine (the executor's contract,
``pipeline.schedules.PipelineStage``).

Every stage has its own ZeRO-2 engine over the same DP groups; each backward is ONE top-level
``engine.backward`` per micro-batch, so ZeRO's per-micro-batch reduction and its boundary epilogue run
exactly as with PP = 1:
  - last stage: ``engine.backward(loss)`` scales by 1/GAS (and the fp16 loss scale) as usual;
  - other stages: the gradient received from the next stage already carries both scales, so they backward
    the surrogate ``sum(output * output_grad)`` (its gradient w.r.t. the output is ``output_grad`` exactly)
    with ``scale_wrt_gas=False``, divided by the fp16 loss scale that ``engine.backward`` multiplies in
    (a power of two: exact).
Only the first stage reads input ids and the last stage labels; middle stages never touch the data, except with
--reset-attention-mask: then every stage (every chunk) reads the same micro-batch for its document ids, since each
attention needs the mask. Stages read the DP rank's loader in the same order (every TP/PP rank of a DP rank has
the same sampler), so micro-batch mb is the loader's mb-th batch on every stage.

Interleaved 1F1B (``num_chunks`` = v > 1): the rank's v model chunks are one module under one engine, so a
micro-batch makes v top-level backwards here, m·v per step. ZeRO-2 must see the step's accumulation boundary at
the last of them only (at a boundary a backward rebuilds the averaged gradients from its own gradients alone), so
the boundary is set explicitly before each backward (``engine.set_gradient_accumulation_boundary``) instead of
counting ``engine.step()`` calls; the 1/GAS scale is still applied once, by the loss's backward on the last
virtual stage (rank p-1's last chunk), every other chunk backwarding a received gradient that already carries it.
"first" and "last" are then the first and last virtual stage: chunk 0 of pipeline rank 0 reads the ids, chunk v-1
of rank p-1 the labels.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterator

import torch

from codegeex_train.layout.dims import RankCoords
from codegeex_train.layout.plan import ParallelPlan
from codegeex_train.training.batches import ContextParallelShare, DocumentMasking, get_batch, position_ids


def masked_mean(loss_per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean loss over the unmasked tokens; 0 (with zero gradients) when every token is masked (--eod-mask-loss on an
    all-EOD micro-batch) instead of 0/0. The mask is 0/1, so the clamp changes no other micro-batch's value."""
    return (loss_per_token * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


def context_parallel_loss(loss_per_token: torch.Tensor, loss_mask: torch.Tensor, loss_count: torch.Tensor,
                          cp_size: int) -> torch.Tensor:
    """A CP rank's share of the micro-batch's mean loss, times CP: its tokens' loss sum over the WHOLE sequence's
    unmasked count (``loss_count``, every CP rank knows it from the batch it sliced), so the shares of the CP ranks
    sum to ``masked_mean`` of the whole sequence. Times CP because DeepSpeed averages gradients over DP x CP
    (the CP ranks' sum is what a DP rank contributes); averaged over DP x CP for logging it is the mean again."""
    return (loss_per_token * loss_mask).sum() / loss_count.clamp(min=1.0) * cp_size


class EngineStage:
    """Forward/backward of one stage for one optimizer step (or one evaluation pass): the rank at ``coords`` (its
    pipeline stage, and its CP rank) of ``plan``, which gives the micro-batches, their shape, the model chunks and the
    CP split."""

    def __init__(self, engine, batches: Iterator[dict] | None, plan: ParallelPlan, *, coords: RankCoords,
                 device: torch.device, first_forward_context=None, masking: DocumentMasking | None = None):
        self.engine, self.batches = engine, batches
        pp_rank = coords.pp
        self.cp = ContextParallelShare(coords.cp, plan.cp_size) if plan.cp_size > 1 else None
        self.num_chunks = plan.num_chunks
        self.masking = masking if masking is not None and masking.enabled else None
        self.first_forward_context = first_forward_context  # wraps micro-batch 0's forward (memory accounting)
        self.is_first, self.is_last = pp_rank == 0, pp_rank == plan.pp_size - 1
        b, s = plan.micro_batch_size, plan.seq_length
        self.shape, self.device = (b, s), device  # the whole sequence, also under CP
        # Positions for chunks that read no batch (the top query layer looks queries up by position): this rank's
        # part of 0 .. s-1 under CP.
        self.positions = position_ids(b, s, device)
        if self.cp is not None:
            self.positions = self.cp.split(self.positions)
        self.num_microbatches = plan.num_microbatches
        self.losses: list[torch.Tensor] = []
        self.backwards = 0
        # Micro-batches read but still needed by a later chunk of this rank: mb -> tensors. Interleaved forwards
        # run p micro-batches per chunk, so at most p are held; without interleaving one, for one forward.
        self._held: dict[int, dict[str, torch.Tensor]] = {}
        self._read = 0
        readers = [c for c in range(self.num_chunks) if self._reads(c)]
        self._last_reader = readers[-1] if readers else None

    def _first(self, chunk: int) -> bool:
        return self.is_first and chunk == 0

    def _last(self, chunk: int) -> bool:
        return self.is_last and chunk == self.num_chunks - 1

    def _reads(self, chunk: int) -> bool:
        """Whether this chunk's forward needs the micro-batch: ids (first), labels (last), document ids (every
        chunk with --reset-attention-mask)."""
        masked = self.masking is not None and self.masking.reset_attention_mask
        return self._first(chunk) or self._last(chunk) or masked

    def _batch(self, mb: int, chunk: int) -> dict[str, torch.Tensor] | None:
        """Micro-batch ``mb``, read at its first forward on this rank (forwards reach new micro-batches in order),
        kept until the last chunk that needs it."""
        if not self._reads(chunk):
            return None
        if mb not in self._held:
            assert mb == self._read, f"micro-batch {mb} needed before {self._read}: the schedule's order changed"
            # masking off: called as always (tests record get_batch's calls with these two arguments)
            args = (self.device,) if self.masking is None else (self.device, self.masking)
            if self.cp is not None:
                args = (self.device, self.masking, self.cp)
            self._held[mb] = get_batch(next(self.batches), *args)
            self._read += 1
        return self._held.pop(mb) if chunk == self._last_reader else self._held[mb]

    def forward_step(self, mb: int, input_tensor: torch.Tensor | None, chunk: int = 0) -> torch.Tensor:
        first, last = self._first(chunk), self._last(chunk)
        batch = self._batch(mb, chunk)
        positions = batch["position_ids"] if batch else self.positions
        if first:
            inputs = batch["input_ids"]
        else:
            inputs = input_tensor.requires_grad_(torch.is_grad_enabled())  # (b, s, h) from the previous stage
        context = self.first_forward_context if (mb, chunk) == (0, 0) and self.first_forward_context else nullcontext()
        kw = {"chunk": chunk} if self.num_chunks > 1 else {}
        if batch is not None and "document_ids" in batch:  # (b, s): block-causal attention inside each document
            kw["document_ids"] = batch["document_ids"]
        with context:
            output = self.engine(inputs, positions, labels=batch["labels"] if last else None, **kw)
        if not last:
            return output  # (b, s, h)
        if self.cp is None:
            loss = masked_mean(output, batch["loss_mask"])
        else:
            loss = context_parallel_loss(output, batch["loss_mask"], batch["loss_count"], self.cp.cp_size)
        self.losses.append(loss.detach())
        return loss

    def backward_step(self, mb: int, input_tensor: torch.Tensor | None, output: torch.Tensor,
                      output_grad: torch.Tensor | None, chunk: int = 0) -> torch.Tensor | None:
        engine = self.engine
        if self.num_chunks > 1:  # m·v backwards: the boundary is the step's last one, said explicitly
            engine.set_gradient_accumulation_boundary(self.backwards + 1 == self.num_microbatches * self.num_chunks)
        if self._last(chunk):
            engine.backward(output)
        else:
            surrogate = (output * output_grad).sum()
            scale = getattr(engine.optimizer, "cur_scale", 1.0) if engine.fp16_enabled() else 1.0
            engine.backward(surrogate / scale if scale != 1.0 else surrogate, scale_wrt_gas=False)
        self.backwards += 1
        # DeepSpeed steps at the accumulation boundary; the boundary's step is the caller's (the tied
        # embedding's gradients are summed between the last backward and the optimizer step).
        if self.num_chunks == 1 and self.backwards < self.num_microbatches:
            engine.step()
        return None if input_tensor is None else input_tensor.grad

    def mean_loss(self) -> torch.Tensor:
        """This step's mean loss on the last stage (no host sync); zero elsewhere."""
        return torch.stack(self.losses).mean() if self.losses else torch.zeros((), device=self.device)


class ChunkedEngineStage(EngineStage):
    """``EngineStage`` as the executor calls a rank of interleaved 1F1B (``ChunkedPipelineStage``)."""

    def forward_step(self, mb: int, chunk: int, input_tensor: torch.Tensor | None) -> torch.Tensor:
        return super().forward_step(mb, input_tensor, chunk)

    def backward_step(self, mb: int, chunk: int, input_tensor: torch.Tensor | None, output: torch.Tensor,
                      output_grad: torch.Tensor | None) -> torch.Tensor | None:
        return super().backward_step(mb, input_tensor, output, output_grad, chunk)
