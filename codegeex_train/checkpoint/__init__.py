"""Our checkpoint format: what reads, writes, re-splits or resumes a checkpoint of this stack, and the run directory
around it. Other formats (Hugging Face, CodeGeeX's release) are ``codegeex_train.formats``'s adapters.

==================  ==========================================================================================
``files.py``        the layout on disk: ``latest``, tags, one model file per model-parallel rank, its metadata
``safe_load.py``    weights-only unpickling of every file we read: a file whose pickle would run code is refused
``deepspeed_files.py``  the structure of DeepSpeed's model and ZeRO files, checked before anything indexes them
``sharding.py``     full (TP = 1) <-> TP-sharded state dicts, full -> pipeline stages
``convert.py``      our checkpoint between layouts (``Layout``, re-splitting), streamed one tensor at a time
``train_state.py``  the counters and RNG streams a resume needs beyond model and optimizer
``deepspeed_checkpoint.py``  training checkpoints through DeepSpeed (model, ZeRO partitions, train state); its
                    checkpoint engine (weights-only loads, failed saves reported); a save's two halves, every rank's
                    files (``write_checkpoint``) and the commit that moves ``latest`` (``commit_save``)
``manager.py``      the run's checkpoints as the loop sees them (``CheckpointManager``): the --save lock for the run's
                    life, --start-over, which steps save, sync or async behind one interface, retention after each
                    commit, the preemption marker; the loop calls ``step`` once per step and ``finish`` on a stop
``async_save.py``   --async-save: host snapshots written by a background thread per rank, committed at a step boundary
``retention.py``    --keep-last-n-checkpoints / --keep-every-n-iterations after each commit; readers hold what they read
``save_lock.py``    one run per --save directory (a kernel lock the holder's death releases)
``run_dir.py``      a --save directory belongs to one run: run ids, resuming or moving a run aside, whose tags retention
                    may remove, the ``preempted`` marker
``universal.py``    the layout-free training checkpoint: resume at any TP / PP / DP
``resume.py``       ``--load`` checked before any process group (``Resume``), then ``restore()`` once
==================  ==========================================================================================

May import: ``model``, ``pipeline``, ``tensor_parallel``, ``distributed``, ``layout``, ``config`` (and its
redaction of credentials in what a checkpoint records), ``tokenization`` (the tokenizer a checkpoint records).
Nothing here trains.
"""

from codegeex_train.checkpoint.files import (
    CheckpointError,
    checkpoint_tag,
    load_full_state_dict,
    load_model_checkpoint,
    load_model_shard,
    read_checkpoint_meta,
    read_latest,
    save_model_checkpoint,
)
from codegeex_train.checkpoint.sharding import merge_state_dicts, partition_spec, split_model_parallel, split_state_dict

__all__ = [
    "CheckpointError", "checkpoint_tag", "load_full_state_dict", "load_model_checkpoint", "load_model_shard",
    "read_checkpoint_meta", "read_latest", "save_model_checkpoint",
    "merge_state_dicts", "partition_spec", "split_model_parallel", "split_state_dict",
]
