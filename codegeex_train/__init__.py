"""codegeex_train: pretraining CodeGeeX-style code models with Megatron TP, PP and DeepSpeed ZeRO-2."""

__version__ = "0.1.0"
