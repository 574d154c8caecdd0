"""The Hugging Face adapter (``adapter.py``: ``from_hf``, ``to_hf``) and its parts: an HF directory's weight files
(``files.py``), GPT-2 and CodeGeeX state dicts (``gpt2.py``, ``codegeex.py``, whose remote code is ``remote/``) and
tokenizer files (``tokenizer.py``)."""
