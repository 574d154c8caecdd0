"""The CodeGeeX model (GPT decoder + top query layer) with tensor parallelism: its config, layers, FLOPs and
summary. Reading, writing and converting its weights is ``codegeex_train.checkpoint``'s job.

The process groups reach the layers as one ``ModelGroups`` (groups.py, built from the Topology), beside the
``ParallelPlan`` that says what runs over them (sequence and context parallelism, recompute).

May import: ``config`` (its ``ModelConfig``), ``context_parallel`` (ring attention), ``tensor_parallel``, ``layout``
(the plan) and ``distributed`` (the Topology a bundle of groups is built from)."""

from codegeex_train.config.model_config import ModelConfig, ModelConfigError
from codegeex_train.model.codegeex import CodeGeeXModel
from codegeex_train.model.flops import model_flops_per_iteration
from codegeex_train.model.groups import ModelGroups
from codegeex_train.model.summary import count_parameters, model_summary

__all__ = ["CodeGeeXModel", "ModelConfig", "ModelConfigError", "ModelGroups", "model_flops_per_iteration",
           "count_parameters", "model_summary"]
