"""What training reads: Megatron's indexed datasets (.bin/.idx), packed GPT samples, blends, samplers,
fill-in-the-middle on the stored tokens, the token-id range check. Datasets are built by
``codegeex_train.preprocessing``; tokenizers live in ``codegeex_train.tokenization``.

May import ``tokenization`` and ``bounded_read``.
"""
