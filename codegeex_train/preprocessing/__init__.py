"""Building datasets (tools/preprocess_data.py): corpus reading (jsonl, parquet, text, source trees: corpus.py,
source_files.py, input_tree.py), repository documents, exact and MinHash deduplication, decontamination, the
worker pool, and the Megatron .bin/.idx it writes (preprocess.py, outputs.py). Training reads the result through
``codegeex_train.data``.

May import ``data`` (the indexed-dataset writer), ``tokenization`` and ``bounded_read``.
"""
