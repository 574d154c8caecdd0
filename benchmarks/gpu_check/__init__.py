"""The pieces of the GPU check; ``benchmarks/gpu.py`` is its command (flags, the order of the units, the table).

child.py      what a unit runs in: its own process, a torch.distributed world of one, a results file, a deadline
precision.py  (a) bf16 vs fp32 losses and (b) fp16 dynamic loss scaling, on a small CodeGeeX
mfu.py        (c) training tokens/s and MFU of a ~1.3B CodeGeeX, without and with recomputation
decoding.py   (d) our KV-cached greedy decoding against Hugging Face ``generate``
parent.py     running each unit in a process of its own under its budget, reading back what it measured
report.py     the table's rows, as text and Markdown

Each section module holds what its child process measures (``unit_*``, run in the child) and the rows the parent
builds from it (``rows_*``). Nothing here imports torch at module level: the parent stays light.
"""
