"""Data: tokenizers, corpus readers, Megatron's indexed datasets (.bin/.idx), packed GPT samples, blends and
samplers. ``load_tokenizer`` (tokenizer.py) builds the tokenizer the data flags name.

May import nothing else of codegeex_train.
"""
