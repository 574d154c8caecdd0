"""Other checkpoint formats, one adapter each, to and from our checkpoint (``codegeex_train.checkpoint``):

==========================  ====================================================================================
``huggingface/``            --to-hf / --from-hf: the native classes of the code-model families (Llama and
                            Mistral, Qwen2, StarCoder2: one adapter each over one tensor map), GPT-2-shaped models
                            as GPT2LMHeadModel, every other as CodeGeeX remote code (``remote/``); config,
                            tokenizer files, generation config, sharded safetensors; ``--load HF_DIR`` converted
                            on the fly for the tools
``codegeex_release/``       --to-codegeex / --from-codegeex: the released CodeGeeX-13B weights file
``import_checks.py``        what every import checks before it writes: field types, sizes against the files, each
                            tensor's dtype, shape and finiteness
==========================  ====================================================================================

A further family is one more adapter file beside these. May import ``checkpoint`` and everything below it; nothing
here trains.
"""
