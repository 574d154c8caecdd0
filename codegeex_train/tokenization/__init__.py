"""Tokenizers, in one place: ``load_tokenizer`` (tokenizer.py) builds the tokenizer the data flags name (an HF
tokenizer.json or directory, GPT-2's files, SentencePiece, CodeGeeX's; the shipped default in ``assets/``), the code
sentinels (code_tokens.py: FIM and repository tokens), CodeGeeX's whitespace tokens (whitespace.py) and the
fingerprint a dataset and a checkpoint record (record.py).

May import ``bounded_read`` only.
"""
