"""Data pipeline: tokenizers, corpus readers, indexed datasets and samplers."""
