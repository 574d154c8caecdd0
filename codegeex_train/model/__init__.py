"""The CodeGeeX model (GPT decoder + top query layer) with tensor parallelism: its config, layers, FLOPs and
summary. Reading, writing and converting its weights is ``codegeex_train.checkpoint``'s job.

May import: ``config`` (its ``ModelConfig``) and ``tensor_parallel``."""

from codegeex_train.config.model_config import ModelConfig, ModelConfigError
from codegeex_train.model.codegeex import CodeGeeXModel
from codegeex_train.model.flops import model_flops_per_iteration
from codegeex_train.model.summary import count_parameters, model_summary

__all__ = ["CodeGeeXModel", "ModelConfig", "ModelConfigError", "model_flops_per_iteration", "count_parameters",
           "model_summary"]
