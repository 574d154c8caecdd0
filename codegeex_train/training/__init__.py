"""The training loop and what it drives.

==================  ======================================================================================
``trainer.py``      the loop: the pipeline schedule's micro-batches, the tied-embedding gradient sum, DeepSpeed's
                    step, then metrics, evaluation (a callback), checkpoints and exit conditions
``engine_stage.py``  one pipeline stage's forward and backward over its DeepSpeed engine
``engine.py``       ``build_engine``: model -> optimizer -> LR schedule -> ``deepspeed.initialize``
``optim.py``        AdamW with decay / no-decay groups, and Megatron's LR schedule
``batches.py``      the run's data: preflight checks, splits, per-rank loaders, batches (CP shares too)
``exit_conditions.py``  SIGTERM, wall-clock limit, NaN / Inf and fp16 skip limits: when and why to stop
``profiling.py``    ``--profile``: torch.profiler traces of chosen iterations; ``--record-memory-history``
``fault_injection.py``  tests only: bad numbers at chosen iterations (reached through ``Run.step_context``)
==================  ======================================================================================

May import: ``checkpoint``, ``metrics``, ``model``, ``config``, ``pipeline`` and below; never ``evaluation`` or
``generation`` (pretrain.py hands the loop its evaluation as a callback), never ``accounting`` (pretrain.py hands
it what to measure with: ``trainer.Measurement``; the loop gives the measured figures back after each step).
"""
