"""The Hugging Face adapter (``adapter.py``: ``from_hf``, ``to_hf``) and its parts: an HF directory's weight files
(``files.py``), the native families' config adapters (``llama.py``, ``qwen2.py``, ``starcoder2.py``) over one tensor
map (``native.py``), GPT-2 and CodeGeeX state dicts (``gpt2.py``, ``codegeex.py``, whose remote code is
``remote/``), tokenizer files (``tokenizer.py``) and ``--load HF_DIR`` for the tools (``on_the_fly.py``)."""
