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
Only the first stage reads input ids and the last stage labels; middle stages never touch the data.

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

from codegeex_train.training.data import get_batch, position_ids


def masked_mean(loss_per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return (loss_per_token * loss_mask).sum() / loss_mask.sum()


class EngineStage:
    """Forward/backward of one stage for one optimizer step (or one evaluation pass)."""

    def __init__(self, engine, batches: Iterator[dict] | None, *, is_first: bool, is_last: bool,
                 micro_batch_size: int, seq_length: int, device: torch.device, num_microbatches: int,
                 first_forward_context=None, num_chunks: int = 1):
        self.engine, self.batches = engine, batches
        self.num_chunks = num_chunks
        self.first_forward_context = first_forward_context  # wraps micro-batch 0's forward (memory accounting)
        self.is_first, self.is_last = is_first, is_last
        self.shape, self.device = (micro_batch_size, seq_length), device
        self.num_microbatches = num_microbatches
        self.losses: list[torch.Tensor] = []
        self.backwards = 0

    def _first(self, chunk: int) -> bool:
        return self.is_first and chunk == 0

    def _last(self, chunk: int) -> bool:
        return self.is_last and chunk == self.num_chunks - 1

    def forward_step(self, mb: int, input_tensor: torch.Tensor | None, chunk: int = 0) -> torch.Tensor:
        first, last = self._first(chunk), self._last(chunk)
        batch = get_batch(next(self.batches), self.device) if (first or last) else None
        positions = batch["position_ids"] if batch else position_ids(*self.shape, self.device)
        if first:
            inputs = batch["input_ids"]
        else:
            inputs = input_tensor.requires_grad_(torch.is_grad_enabled())  # (b, s, h) from the previous stage
        context = self.first_forward_context if (mb, chunk) == (0, 0) and self.first_forward_context else nullcontext()
        chunk_kw = {"chunk": chunk} if self.num_chunks > 1 else {}
        with context:
            output = self.engine(inputs, positions, labels=batch["labels"] if last else None, **chunk_kw)
        if not last:
            return output  # (b, s, h)
        loss = masked_mean(output, batch["loss_mask"])
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
