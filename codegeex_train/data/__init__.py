"""Data: tokenizers, corpus readers, Megatron's indexed datasets (.bin/.idx), packed GPT samples, blends and
samplers. ``load_tokenizer`` (tokenizer.py) builds the tokenizer the data flags name. ``bounded_read.py`` reads any
file a user names (every package's: it is the lowest layer they share) as a regular file, never past a bound.

May import nothing else of codegeex_train.
"""
