"""The released CodeGeeX weights file: the adapter (``adapter.py``: ``from_codegeex``, ``to_codegeex``) and the
release's parameter names against ours (``weights.py``)."""
