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
                 first_forward_context=None):
        self.engine, self.batches = engine, batches
        self.first_forward_context = first_forward_context  # wraps micro-batch 0's forward (memory accounting)
        self.is_first, self.is_last = is_first, is_last
        self.shape, self.device = (micro_batch_size, seq_length), device
        self.num_microbatches = num_microbatches
        self.losses: list[torch.Tensor] = []
        self.backwards = 0

    def forward_step(self, mb: int, input_tensor: torch.Tensor | None) -> torch.Tensor:
        batch = get_batch(next(self.batches), self.device) if (self.is_first or self.is_last) else None
        positions = batch["position_ids"] if batch else position_ids(*self.shape, self.device)
        if self.is_first:
            inputs = batch["input_ids"]
        else:
            inputs = input_tensor.requires_grad_(torch.is_grad_enabled())  # (b, s, h) from the previous stage
        context = self.first_forward_context if mb == 0 and self.first_forward_context else nullcontext()
        with context:
            output = self.engine(inputs, positions, labels=batch["labels"] if self.is_last else None)
        if not self.is_last:
            return output  # (b, s, h)
        loss = masked_mean(output, batch["loss_mask"])
        self.losses.append(loss.detach())
        return loss

    def backward_step(self, mb: int, input_tensor: torch.Tensor | None, output: torch.Tensor,
                      output_grad: torch.Tensor | None) -> torch.Tensor | None:
        engine = self.engine
        if self.is_last:
            engine.backward(output)
        else:
            surrogate = (output * output_grad).sum()
            scale = getattr(engine.optimizer, "cur_scale", 1.0) if engine.fp16_enabled() else 1.0
            engine.backward(surrogate / scale if scale != 1.0 else surrogate, scale_wrt_gas=False)
        self.backwards += 1
        # DeepSpeed steps at the accumulation boundary; the boundary's step is the caller's (the tied
        # embedding's gradients are summed between the last backward and the optimizer step).
        if self.backwards < self.num_microbatches:
            engine.step()
        return None if input_tensor is None else input_tensor.grad

    def mean_loss(self) -> torch.Tensor:
        """This step's mean loss on the last stage (no host sync); zero elsewhere."""
        return torch.stack(self.losses).mean() if self.losses else torch.zeros((), device=self.device)
