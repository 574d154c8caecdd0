"""Megatron-LM and Megatron-DeepSpeed flags people bring, and what our commands do with each.

One table per command (``PRETRAIN`` for ``codegeex_train.pretrain``, ``PREPROCESS_DATA`` for
``tools/preprocess_data.py``), Megatron's spelling -> ``ForeignFlag(kind, ours, note)``: the parsers' aliases and
refusal lines (``options.add_foreign_flags``) and docs/megatron-flags.md (``markdown()``, checked by
tests/config/test_megatron_flags.py) are generated from them, so code and doc cannot drift.

Regenerate the doc after editing a table:

    python -m codegeex_train.config.megatron_flags > docs/megatron-flags.md
"""

from __future__ import annotations

from codegeex_train.config.options import ALIAS, IGNORED, REFUSED, SAME, ForeignFlag

ORIGIN = "Megatron-LM"
DOC = "docs/megatron-flags.md"
SEE = f"see {DOC}"

DROP = "none (drop the flag)"


def _same(flags: str, note: str = "") -> dict[str, ForeignFlag]:
    return {flag: ForeignFlag(SAME, flag, note) for flag in flags.split()}


def _refused(flags: str, ours: str, note: str) -> dict[str, ForeignFlag]:
    return {flag: ForeignFlag(REFUSED, ours, note) for flag in flags.split()}


# --tokenizer-type values, shared by both commands. Ours: HFTokenizer GPT2BPETokenizer SentencePieceTokenizer
# CodeGeeXTokenizer (tokenization/tokenizer.py).
TOKENIZER_TYPES: dict[str, ForeignFlag] = {
    "--tokenizer-type HuggingFaceTokenizer": ForeignFlag(
        ALIAS, "--tokenizer-type HFTokenizer", "--tokenizer-model is a tokenizer.json file, not a hub name "
        "(nothing is downloaded)"),
    "--tokenizer-type GPT2BPETokenizer": ForeignFlag(SAME, "--tokenizer-type GPT2BPETokenizer",
                                                     "--vocab-file and --merge-file, GPT-2's"),
    "--tokenizer-type GPTSentencePieceTokenizer": ForeignFlag(
        ALIAS, "--tokenizer-type SentencePieceTokenizer", "the model's own pieces, EOD = its eos"),
    "--tokenizer-type SentencePieceTokenizer": ForeignFlag(
        SAME, "--tokenizer-type SentencePieceTokenizer", "the model's own pieces, EOD = its eos (Megatron's adds "
        "CLS, SEP, EOD, MASK, ... pieces above them: its datasets have other ids)"),
    **{f"--tokenizer-type {name}": ForeignFlag(
        REFUSED, "--tokenizer-type HFTokenizer --tokenizer-model tokenizer.json (or SentencePieceTokenizer "
        "--tokenizer-model tokenizer.model)", "no built-in model-family tokenizers: load the model's own file")
       for name in ("Llama2Tokenizer", "Llama3Tokenizer", "MistralTokenizer", "TikTokenizer")},
    **{f"--tokenizer-type {name}": ForeignFlag(
        REFUSED, "--tokenizer-type HFTokenizer (a BPE tokenizer.json)", "BERT WordPiece is for BERT-style "
        "models; these are GPT-style") for name in ("BertWordPieceLowerCase", "BertWordPieceCase")},
    "--tokenizer-type NullTokenizer": ForeignFlag(
        REFUSED, "tools/preprocess_data.py --input default (the shipped tokenizer and demo corpus)",
        "no null tokenizer"),
}

PRETRAIN: dict[str, ForeignFlag] = {
    # --- the same spelling and meaning ---
    **_same("--num-layers --hidden-size --num-attention-heads --ffn-hidden-size --max-position-embeddings "
            "--make-vocab-size-divisible-by --hidden-dropout --attention-dropout --init-method-std "
            "--tensor-model-parallel-size --pipeline-model-parallel-size --context-parallel-size "
            "--decoder-first-pipeline-num-layers "
            "--decoder-last-pipeline-num-layers --num-layers-per-virtual-pipeline-stage --distributed-timeout-minutes "
            "--micro-batch-size "
            "--global-batch-size --seq-length --seed --bf16 --checkpoint-activations --sequence-parallel "
            "--recompute-granularity --recompute-method --recompute-num-layers --save --load "
            "--save-interval --eval-interval --exit-interval --exit-signal-handler --exit-duration-in-mins "
            "--no-check-for-nan-in-loss-and-grad --optimizer --min-lr --lr-decay-iters --lr-warmup-iters "
            "--lr-warmup-fraction --weight-decay --clip-grad --adam-beta1 --adam-beta2 --adam-eps --sgd-momentum "
            "--data-path --train-data-path --valid-data-path --test-data-path --tokenizer-model --vocab-file "
            "--merge-file --num-workers --wandb-project --local_rank --finetune --no-load-optim --no-load-rng "
            "--reset-position-ids --reset-attention-mask --eod-mask-loss --fim-rate --fim-spm-rate "
            "--fim-split-sample --fim-fragment-rate"),
    **_same("--layernorm-epsilon", "Megatron-DeepSpeed's name (Megatron-LM: --norm-epsilon)"),
    **_same("--distributed-backend", "also auto (the default): nccl on GPU, gloo on CPU"),
    **_same("--fp16", "dynamic loss scaling by DeepSpeed (settings: fp16 section of --deepspeed-config)"),
    **_same("--train-iters", "default 100 (Megatron: no default)"),
    **_same("--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler",
            "as Megatron's: without one of them a resume whose LR schedule (lr, min lr, warm-up, decay iterations "
            "and style, global batch) differs from the checkpoint's is refused"),
    **_same("--lr", "default 3e-4 (Megatron: no default)"),
    **_same("--eval-iters", "default 10 (Megatron: 100)"),
    **_same("--log-interval", "default 10 (Megatron: 100)"),
    **_same("--lr-decay-style", "constant, linear, cosine; default cosine (Megatron: linear); no "
                                "inverse-square-root, WSD"),
    **_same("--split", "default 969,30,1"),
    **_same("--tokenizer-type", "HFTokenizer, GPT2BPETokenizer, SentencePieceTokenizer, CodeGeeXTokenizer; "
                                "default: the shipped tokenizer"),
    **_same("--zero-stage", "Megatron-DeepSpeed's; 0, 1 or 2, default 2"),
    **_same("--async-save", "writes DeepSpeed's own checkpoint files in the background (Megatron: needs "
                            "--ckpt-format torch_dist)"),
    # --- accepted under another name ---
    "--recompute-activations": ForeignFlag(ALIAS, "--checkpoint-activations", "full recompute of every layer"),
    "--deepspeed_config": ForeignFlag(ALIAS, "--deepspeed-config", "DeepSpeed's spelling"),
    "--batch-size": ForeignFlag(ALIAS, "--micro-batch-size", "Megatron's old name"),
    "--model-parallel-size": ForeignFlag(ALIAS, "--tensor-model-parallel-size", "Megatron's old name"),
    "--wandb-exp-name": ForeignFlag(ALIAS, "--wandb-name", "the wandb run name"),
    "--wandb-save-dir": ForeignFlag(ALIAS, "--wandb-dir", "where wandb writes its files"),
    "--logging-level": ForeignFlag(ALIAS, "--log-level", "logging's numbers (10 debug, 20 info, 30 warning, 40 "
                                   "error) or those names; rank 0's level (--log-all-ranks: every rank's)"),
    "--openai-gelu": ForeignFlag(ALIAS, "--activation gelu_tanh", "GPT-2's tanh approximation of GeLU"),
    **TOKENIZER_TYPES,
    # --- accepted, no effect: what they ask for is what happens ---
    "--deepspeed": ForeignFlag(IGNORED, "(always on)", "Megatron-DeepSpeed's switch: DeepSpeed is always used"),
    "--data-impl": ForeignFlag(IGNORED, "(always mmap)", "datasets are always the mmap .bin/.idx format"),
    "--log-throughput": ForeignFlag(IGNORED, "(always on)", "tokens/s and TFLOP/s per device are on every log line"),
    **{flag: ForeignFlag(IGNORED, "(always off)", "there are no fused kernels to turn off")
       for flag in ("--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm")},
    "--exit-on-missing-checkpoint": ForeignFlag(IGNORED, "(always on)", "a --load without a checkpoint is always "
                                                                      "an error"),
    # --- refused: the line names ours ---
    **_same("--recompute-modules", "core_attn (default), mlp_act (Megatron-core: moe_act for MoE), layernorm"),
    "--ds-sequence-parallel-size": ForeignFlag(REFUSED, "--sequence-parallel (Megatron's, within TP)",
                                               "not supported: DeepSpeed-Ulysses splits attention heads over ranks "
                                               "by all-to-all"),
    "--use-flash-attn": ForeignFlag(REFUSED, DROP, "attention is torch's scaled_dot_product_attention (SDPA), "
                                    "which picks a flash kernel by itself"),
    **_refused("--fp8-*", "--bf16 or --fp16", "no FP8 training (no Transformer Engine)"),
    **_refused("--transformer-impl --use-mcore-models --use-legacy-models", DROP,
               "one model implementation (CodeGeeX's, plain PyTorch), neither Megatron Core's nor Megatron's legacy"),
    "--num-virtual-stages-per-pipeline-rank": ForeignFlag(
        REFUSED, "--num-layers-per-virtual-pipeline-stage (layers / (PP x v))",
        "interleaving is set by layers per virtual stage, Megatron's older flag"),
    **_refused("--deepspeed-activation-checkpointing --partition-activations --checkpoint-in-cpu",
               "--recompute-granularity", "DeepSpeed's activation checkpointing is not used (ours recomputes "
               "whole layers or selected parts)"),
    "--train-samples": ForeignFlag(REFUSED, "--train-iters (= samples / --global-batch-size)",
                                   "training length is counted in iterations"),
    "--lr-decay-samples": ForeignFlag(REFUSED, "--lr-decay-iters", "the schedule is counted in iterations"),
    "--lr-warmup-samples": ForeignFlag(REFUSED, "--lr-warmup-iters or --lr-warmup-fraction",
                                       "the schedule is counted in iterations"),
    **_refused("--train-tokens --lr-decay-tokens --lr-warmup-tokens", "--train-iters, --lr-decay-iters, "
               "--lr-warmup-iters (tokens / (--global-batch-size x --seq-length))",
               "training is counted in iterations"),
    "--rampup-batch-size": ForeignFlag(REFUSED, "--global-batch-size (constant)", "no batch-size ramp-up"),
    "--use-distributed-optimizer": ForeignFlag(REFUSED, "--zero-stage 1 or 2 (2 by default)",
                                               "DeepSpeed ZeRO shards the optimizer state"),
    **_refused("--overlap-grad-reduce --overlap-param-gather", "zero_optimization.overlap_comm in a "
               "--deepspeed-config JSON", "DeepSpeed ZeRO does the gradient reduction"),
    "--loss-scale": ForeignFlag(REFUSED, "fp16.loss_scale in a --deepspeed-config JSON",
                                "fp16 loss scaling is DeepSpeed's"),
    "--initial-loss-scale": ForeignFlag(REFUSED, "fp16.initial_scale_power (log2) in a --deepspeed-config JSON",
                                        "fp16 loss scaling is DeepSpeed's"),
    "--min-loss-scale": ForeignFlag(REFUSED, "fp16.min_loss_scale in a --deepspeed-config JSON",
                                    "fp16 loss scaling is DeepSpeed's"),
    "--loss-scale-window": ForeignFlag(REFUSED, "fp16.loss_scale_window in a --deepspeed-config JSON",
                                       "fp16 loss scaling is DeepSpeed's"),
    "--hysteresis": ForeignFlag(REFUSED, "fp16.hysteresis in a --deepspeed-config JSON",
                                "fp16 loss scaling is DeepSpeed's"),
    **_refused("--expert-model-parallel-size --num-experts --moe-*", DROP, "no mixture of experts: a dense model"),
    **_same("--position-embedding-type", "learned_absolute (default) or rope"),
    **_same("--rotary-percent --rotary-base --rotary-interleaved"),
    "--use-rotary-position-embeddings": ForeignFlag(ALIAS, "--position-embedding-type rope", "Megatron's older "
                                                    "switch"),
    # Refused rather than ignored: without rope it would mean a model with no positions at all (NoPE), which we
    # do not build, and with rope it says nothing (a rope model has no learned table).
    "--no-position-embedding": ForeignFlag(REFUSED, "--position-embedding-type rope", "Megatron's deprecated "
                                           "switch: drop it (a rope model has no learned table; no positions at all "
                                           "is not supported)"),
    **{f"--position-embedding-type {kind}": ForeignFlag(REFUSED, "--position-embedding-type learned_absolute or rope",
                                                        note)
       for kind, note in (("mrope", "no multimodal RoPE (a text model)"),
                          ("relative", "no relative position buckets (T5's)"),
                          ("none", "no position-free (NoPE) models"))},
    **_same("--swiglu --normalization --group-query-attention --num-query-groups --untie-embeddings-and-output-weights "
            "--disable-bias-linear --add-qkv-bias --rope-scaling-factor --window-size --norm-epsilon"),
    "--use-rope-scaling": ForeignFlag(ALIAS, "--rope-scaling llama3", "Llama 3.1's scaling (with "
                                      "--rope-original-max-position-embeddings)"),
    "--rotary-seq-len-interpolation-factor": ForeignFlag(REFUSED, "--rope-scaling linear --rope-scaling-factor N",
                                                         "linear position interpolation is one of --rope-scaling's"),
    **_refused("--rotary-*", "--rope-scaling, --rotary-base", "RoPE's other knobs are --rope-scaling's"),
    **_refused("--squared-relu", "--activation gelu|gelu_tanh|fast_gelu or --swiglu", "no squared activations"),
    "--kv-channels": ForeignFlag(REFUSED, "--hidden-size / --num-attention-heads", "the head size is derived"),
    "--vocab-size": ForeignFlag(REFUSED, "the tokenizer's size, padded by --make-vocab-size-divisible-by",
                                "the vocabulary comes from the tokenizer"),
    "--use-checkpoint-args": ForeignFlag(REFUSED, "the model flags again (--load checks them against the "
                                         "checkpoint)", "the model shape is not read from the checkpoint"),
    **_refused("--no-save-optim --no-save-rng", DROP, "a checkpoint always holds the optimizer and RNG states "
               "(exact resume)"),
    "--mock-data": ForeignFlag(REFUSED, "tools/preprocess_data.py --input default, then --data-path",
                               "no synthetic data: the demo corpus is the Python stdlib"),
    "--dataloader-type": ForeignFlag(REFUSED, DROP, "one sampler: Megatron's 'single' (ordered, resumable)"),
    # --- TensorBoard and profiling (docs/profiling.md) ---
    **_same("--tensorboard-log-interval --tensorboard-queue-size --no-log-loss-scale-to-tensorboard "
            "--no-log-gradient-norm-to-tensorboard --profile-ranks"),
    **_same("--tensorboard-dir", "the scalars of metrics.jsonl under wandb's names (train/loss, valid/ppl, ...)"),
    **_same("--no-log-learnig-rate-to-tensorboard", "Megatron's spelling; also --no-log-learning-rate-to-tensorboard"),
    **_same("--profile", "always torch.profiler (Megatron: nsys unless --use-pytorch-profiler); traces in "
                         "<tensorboard-dir or save>/profile/"),
    **_same("--profile-step-start --profile-step-end", "as Megatron's: iterations start+1 .. end as logged"),
    **_same("--record-memory-history", "CUDA only; on the --profile-ranks (Megatron: the last rank), dumped once after "
                                       "--profile-step-end (Megatron: at every log line)"),
    **_same("--memory-snapshot-path", "default <tensorboard-dir or save>/profile/memory_snapshot_rank<R>.pickle "
                                      "(Megatron: snapshot.pickle)"),
    "--use-pytorch-profiler": ForeignFlag(IGNORED, "(always on)", "--profile always uses torch.profiler"),
    "--pytorch-profiler-collect-shapes": ForeignFlag(IGNORED, "(always on)", "--profile always records shapes"),
    "--log-timers-to-tensorboard": ForeignFlag(IGNORED, "(always on)", "train/iteration_time_ms (and tokens/s, "
                                               "TFLOP/s, MFU) are always in TensorBoard; no per-phase timers"),
    "--log-batch-size-to-tensorboard": ForeignFlag(IGNORED, "(always on)", "train/global_batch_size is always in "
                                                   "TensorBoard"),
    "--log-validation-ppl-to-tensorboard": ForeignFlag(IGNORED, "(always on)", "valid/ppl is always in TensorBoard"),
    "--log-memory-to-tensorboard": ForeignFlag(IGNORED, "(always on)", "train/memory_gb (and the memory record's "
                                               "bytes by part) are always in TensorBoard"),
    "--log-world-size-to-tensorboard": ForeignFlag(REFUSED, DROP, "the world size is constant: metrics.jsonl's "
                                                   "metadata line and wandb's run config hold the layout"),
    **_refused("--tensorboard-* --log-*-to-tensorboard", "--tensorboard-dir (the scalars of metrics.jsonl)",
               "no such TensorBoard option"),
    **_refused("--timing-log-level --timing-log-option", "ms/iter on every log line",
               "no per-phase timers"),
    **_refused("--log-params-norm --log-num-zeros-in-grad", "grad norm on every log line", "not computed"),
    "--no-pipeline-parallel": ForeignFlag(REFUSED, "--pipeline-model-parallel-size 1 (the default)",
                                          "Megatron-DeepSpeed's; one flag sets the stages"),
}

PREPROCESS_DATA: dict[str, ForeignFlag] = {
    **_same("--input --json-keys --tokenizer-model --vocab-file --merge-file --append-eod --output-prefix "
            "--log-interval"),
    **_same("--tokenizer-type", "default HFTokenizer with the shipped tokenizer (Megatron: required)"),
    **_same("--workers", "default 1 (Megatron: required); tokenizer processes, output identical for any count"),
    **TOKENIZER_TYPES,
    "--partitions": ForeignFlag(IGNORED, "--workers", "one reader feeds --workers tokenizer processes; a value "
                                "above 1 prints a note"),
    "--keep-sequential-samples": ForeignFlag(IGNORED, "(always on)", "documents are written in input order"),
    "--keep-newlines": ForeignFlag(IGNORED, "(always on)", "documents are tokenized whole, newlines included"),
    "--lang": ForeignFlag(IGNORED, "(unused)", "only for --split-sentences"),
    "--dataset-impl": ForeignFlag(IGNORED, "(always mmap)", "Megatron-DeepSpeed's: the output is always mmap "
                                                           ".bin/.idx"),
    "--split-sentences": ForeignFlag(REFUSED, DROP, "needs nltk's sentence splitter (for BERT-style data); "
                                     "documents are tokenized whole"),
    "--vocab-size": ForeignFlag(REFUSED, "--tokenizer-type HFTokenizer", "only for Megatron's NullTokenizer"),
}

TABLES = {"python -m codegeex_train.pretrain": PRETRAIN, "tools/preprocess_data.py": PREPROCESS_DATA}

_SECTIONS = (
    (SAME, "Accepted as is"),
    (ALIAS, "Accepted under another name"),
    (IGNORED, "Accepted, no effect (what it asks for happens anyway)"),
    (REFUSED, "Refused with one `error:` line that names ours"),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """docs/megatron-flags.md."""
    lines = ["# Coming from Megatron-LM / Megatron-DeepSpeed", "",
             ("Generated from `codegeex_train/config/megatron_flags.py` (a test checks that they agree); regenerate "
              "with"), "", "    python -m codegeex_train.config.megatron_flags > docs/megatron-flags.md", "",
             ("Our commands take Megatron's flag names. Megatron flags that mean the same are accepted under their own "
              "or another name; flags for features we do not have are refused with one `error:` line that names "
              "ours, and an unknown flag gets `did you mean --X?`. `--flag VALUE` rows are about one value of a flag; "
              "`*` stands for any rest of a flag's name.")]
    for command, table in TABLES.items():
        lines += ["", f"## `{command}`"]
        for kind, title in _SECTIONS:
            rows = [(key, entry) for key, entry in table.items() if entry.kind == kind]
            if not rows:
                continue
            lines += ["", f"### {title}", ""]
            if kind == SAME:  # the plain ones in one paragraph; a row each for those with a note
                lines += ["The same spelling and meaning: " + ", ".join(f"`{key}`" for key, e in rows if not e.note)
                          + ". With a note:", ""]
                rows = [(key, entry) for key, entry in rows if entry.note]
            lines += ["| ours | Megatron's | note |", "| --- | --- | --- |"]
            for key, entry in rows:
                ours = f"`{entry.ours}`" if kind in (SAME, ALIAS) else _cell(entry.ours)
                lines.append(f"| {ours} | `{key}` | {_cell(entry.note)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
