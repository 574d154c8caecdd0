"""Everything that reads, writes or converts a checkpoint.

==================  ==========================================================================================
``files.py``        the layout on disk: ``latest``, tags, one model file per model-parallel rank, its metadata
``safe_load.py``    weights-only unpickling of every file we read: a file whose pickle would run code is refused
``deepspeed_files.py``  the structure of DeepSpeed's model and ZeRO files, checked before anything indexes them
``sharding.py``     full (TP = 1) <-> TP-sharded state dicts, full -> pipeline stages
``convert.py``      our checkpoint between layouts (``Layout``, re-splitting), streamed one tensor at a time
``hf_format.py``    the Hugging Face adapter (--to-hf / --from-hf): GPT-2-shaped models as GPT2LMHeadModel, every
                    other as CodeGeeX remote code; config, tokenizer, generation config, sharded safetensors
``hf_files.py``     an HF directory's weight files: sharded safetensors written as they fill, read back checked
``hf_gpt2.py``      Hugging Face GPT-2 <-> our full state dict
``hf_codegeex.py``  Hugging Face CodeGeeX (remote code in ``hf_remote/``) <-> our full state dict
``hf_tokenizer.py`` our tokenizer <-> an HF directory's tokenizer files
``import_checks.py``  what an import (--from-hf, --from-codegeex) checks before it writes: field types, sizes
                    against the files, each tensor's dtype, shape and finiteness
``codegeex_release.py``  the released CodeGeeX weights file <-> our checkpoint (the adapter)
``codegeex_weights.py``  the released CodeGeeX checkpoint layout <-> our full state dict (the name mapping)
``train_state.py``  the counters and RNG streams a resume needs beyond model and optimizer
``deepspeed_checkpoint.py``  training checkpoints through DeepSpeed (model, ZeRO partitions, train state); its
                    checkpoint engine (weights-only loads, failed saves reported); the commit that moves ``latest``
``async_save.py``   --async-save: host snapshots written by a background thread per rank, committed at a step boundary
``retention.py``    --keep-last-n-checkpoints / --keep-every-n-iterations after each commit; readers hold what they read
``save_lock.py``    one run per --save directory (a kernel lock the holder's death releases)
``universal.py``    the layout-free training checkpoint: resume at any TP / PP / DP
``resume.py``       ``--load`` checked before any process group (``Resume``), then ``restore()`` once
==================  ==========================================================================================

May import: ``model``, ``pipeline``, ``tensor_parallel``, ``distributed``, ``config`` (and its redaction of
credentials in what a checkpoint records), ``data`` (tokenizers, for the exports). Nothing here trains.
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
from codegeex_train.checkpoint.hf_gpt2 import config_from_hf_gpt2, full_to_hf_gpt2, hf_gpt2_config, hf_gpt2_to_full
from codegeex_train.checkpoint.sharding import merge_state_dicts, partition_spec, split_model_parallel, split_state_dict

__all__ = [
    "CheckpointError", "checkpoint_tag", "load_full_state_dict", "load_model_checkpoint", "load_model_shard",
    "read_checkpoint_meta", "read_latest", "save_model_checkpoint",
    "config_from_hf_gpt2", "full_to_hf_gpt2", "hf_gpt2_config", "hf_gpt2_to_full",
    "merge_state_dicts", "partition_spec", "split_model_parallel", "split_state_dict",
]
