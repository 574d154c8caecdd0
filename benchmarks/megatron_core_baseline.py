"""megatron-core's GPTModel as a tensor-parallel throughput baseline for benchmarks/throughput.py.

The same GPT-2 shape as ours (learned positions, tied embeddings, gelu tanh, dropout 0, fp32), built with
megatron-core's local (non Transformer Engine) layer spec on the ranks' existing process group, trained by a
plain loop: AdamW (our parameter groups and fused kernel), gradient clipping over the TP-sharded model.
Only TP x 1 layouts: no megatron data parallelism.

Optional: ``import megatron.core`` may fail, and ``available()`` says so.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from codegeex_train.config.arguments import OptimConfig
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.training.optim import build_optimizer

INSTALL = "pip install megatron-core==0.16.1"  # the version this baseline was written and checked against


def available() -> str | None:
    """None when megatron-core imports, else why not."""
    try:
        with warnings.catch_warnings():  # megatron warns at import that Apex / Transformer Engine are absent
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def build(config: ModelConfig, seq_length: int, tp_size: int, seed: int, optim: OptimConfig,
          device: torch.device):
    """(model, optimizer, TP group) on this rank; the default process group must hold exactly TP ranks."""
    # Megatron's GPU advice (Apex / TE absent, CUDA_DEVICE_MAX_CONNECTIONS, deprecated config defaults), also
    # raised later in forward: noise in a benchmark's output.
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

    if parallel_state.model_parallel_is_initialized():  # a launched process benches several layouts
        parallel_state.destroy_model_parallel()
    # new_group() with the default backend: gloo here. No extra gloo groups, megatron's optimizer is unused.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size, create_gloo_process_groups=False)
    if device.type != "cuda":
        parallel_state._GLOBAL_MEMORY_BUFFER = _device_buffer(device)
    # Dropout is 0, so no RNG stream is needed; the inference tracker's fork() is a no-op, where the training
    # one (model_parallel_cuda_manual_seed) would touch the CUDA generator.
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(seed)  # CPU initialisation draws full weights from the default generator, then slices
    tc = TransformerConfig(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, ffn_hidden_size=config.ffn_hidden_size,
        tensor_model_parallel_size=tp_size, sequence_parallel=False,
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=config.layernorm_epsilon,
        init_method_std=config.init_method_std, activation_func=functools.partial(F.gelu, approximate="tanh"),
        params_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=True,
        # Every fusion off: they need CUDA kernels (Apex / TE / Triton) that a CPU run does not have.
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        cross_entropy_loss_fusion=False)
    model = GPTModel(tc, get_gpt_layer_local_spec(), vocab_size=config.padded_vocab_size,
                     max_sequence_length=seq_length, share_embeddings_and_output_weights=True,
                     position_embedding_type="learned_absolute").to(device)
    return model, build_optimizer(model, optim), parallel_state.get_tensor_model_parallel_group()


def _device_buffer(device: torch.device):
    """megatron's reused scratch buffer (the attention scores' baddbmm input), allocated on ``device``: its own
    allocates on torch.cuda.current_device()."""
    from megatron.core.utils import GlobalMemoryBuffer

    class DeviceBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            numel = math.prod(tensor_shape)
            if (name, dtype) not in self.buffer or self.buffer[name, dtype].numel() < numel:
                self.buffer[name, dtype] = torch.empty(numel, dtype=dtype, device=device)
            return self.buffer[name, dtype][:numel].view(*tensor_shape)

    return DeviceBuffer()


@functools.lru_cache(maxsize=4)
def causal_mask(seq_length: int, device: torch.device) -> torch.Tensor:
    """(1, 1, s, s), True = masked. Passed explicitly: megatron's default causal mask is built on CUDA."""
    return torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).triu(1)[None, None]


def loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    position_ids = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # (b, s)
    # With labels GPTModel returns the (b, s) per-token loss (vocab-parallel cross entropy).
    return model(ids, position_ids, causal_mask(ids.shape[1], ids.device), labels=labels).mean()


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float, tp_group) -> torch.Tensor:
    """clip_grad_norm_ of the whole model: shards summed over the TP group, a replicated parameter counted once.
    (megatron-core's own clip_grads allocates on CUDA.)"""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and param_is_not_tensor_parallel_duplicate(p, tp_group)]
    square = torch.stack(torch._foreach_norm(counted)).square().sum()
    dist.all_reduce(square, group=tp_group)
    total = square.sqrt()
    torch._foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp(max=1.0))  # as torch's: no branch on the norm
    return total
