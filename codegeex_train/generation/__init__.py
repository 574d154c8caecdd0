"""Text generation from a trained CodeGeeX checkpoint: KV-cached incremental decoding at any TP size.

    from codegeex_train.generation import HUMANEVAL_STOP, Generator, SamplingParams
    gen = Generator.from_checkpoint(load_dir, tokenizer, tp_group=topology.tp_group)
    gen.generate(prompts, SamplingParams(max_new_tokens=128, temperature=0.8, top_p=0.95, stop=HUMANEVAL_STOP))

``tools/generate.py`` is the command line around it; ``generator.py`` explains the cache, the padding and
how the TP ranks agree on every token; ``infill.py`` the fill-in-the-middle prompt (``Generator.infill``).

May import: ``checkpoint``, ``model``, ``data`` and below.
"""

from codegeex_train.generation.generator import Generator
from codegeex_train.generation.infill import FimFormat, InfillError, fim_format, recorded_fim, split_at_marker
from codegeex_train.generation.sampling import (
    SamplingParams,
    choose_tokens,
    row_seed,
    sample_next_tokens,
    top_k_mask,
    top_p_mask,
)
from codegeex_train.generation.text import HUMANEVAL_STOP, decode_whitespace_tokens, truncate_at_stop

__all__ = [
    "Generator",
    "FimFormat",
    "InfillError",
    "fim_format",
    "recorded_fim",
    "split_at_marker",
    "SamplingParams",
    "HUMANEVAL_STOP",
    "sample_next_tokens",
    "choose_tokens",
    "row_seed",
    "top_k_mask",
    "top_p_mask",
    "truncate_at_stop",
    "decode_whitespace_tokens",
]
