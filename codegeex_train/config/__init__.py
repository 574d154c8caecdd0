"""Configuration: the typed sections behind the pretraining command line, checked once.

==================  ======================================================================================
``options.py``      ``option()``: a dataclass field that is also a flag; argparse generated from the dataclasses
``model_config.py``  ``ModelConfig``: the model's shape and maths (``--num-layers``, ``--hidden-size``, ...)
``tokenizer_flags.py``  the tokenizer flags, declared once for training's ``DataConfig`` and every tool
``arguments.py``    the other sections (parallel, train, optim, data, logging), ``parse_args`` and ``validate``:
                    every cross-section rule in one place, deriving the run's ``ParallelPlan`` (``layout/plan.py``)
``lr_schedule.py``  the LR schedule's values as flags give them and checkpoints record them; the resume rule
``deepspeed.py``    the DeepSpeed JSON built from the flags (a user's ``--deepspeed-config`` may only add to it)
``config_file.py``  ``--config FILE.yaml`` (the presets in configs/): a file's values become flags before the
                    command line's; ``dump_resolved`` writes a run's whole config back as such a file
``strict_yaml.py``  the YAML reader of config files: values as the command line reads the words, or one line
``script_values.py``  what scripts/pretrain_codegen.sh reads of a config file, read as pretraining reads it
``redaction.py``    credentials out of everything that records the flags (config files, checkpoints, metrics)
==================  ======================================================================================

``megatron_flags.py``: Megatron-LM's flags, each the same as ours, an alias, accepted without effect, or refused with
ours named; the parsers' aliases and refusals and docs/megatron-flags.md are generated from its tables.

May import: ``pipeline``, ``layout`` (the plan, its dimensions and splits), ``distributed``, ``tokenization``,
``bounded_read`` (the user's files). Nothing here creates a process group: a bad flag is refused before any exists.
"""
