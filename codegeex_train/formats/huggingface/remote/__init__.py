"""Hugging Face remote code for the CodeGeeX architecture (``trust_remote_code=True``).

``configuration_codegeex.py`` and ``modeling_codegeex.py`` are copied next to an exported ``config.json``
(``formats/huggingface/codegeex.py``: ``copy_remote_code``); they import only torch, transformers and each other. This
package exists so that setup.py ships them; nothing in codegeex_train imports them.
"""
