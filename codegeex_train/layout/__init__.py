"""The run's layout, as pure values and rules (no process group): the parallel dimensions and rank order
(dims.py), the parallel plan every consumer takes (plan.py), the pipeline's stage and chunk splits (stages.py) and the
activation-recompute choice (recompute.py).

May import nothing else of codegeex_train: every layer above takes its layout from here.
"""
