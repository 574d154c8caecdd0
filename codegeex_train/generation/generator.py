"""Incremental decoding of a CodeGeeXModel at any TP size, with a key/value cache for every attention.

    gen = Generator.from_checkpoint("outputs/codegen-default", default_tokenizer(), tp_group=topology.tp_group)
    completions = gen.generate(["def fib(n):\\n"], SamplingParams(max_new_tokens=64, stop=HUMANEVAL_STOP))

**Cache.** ``model.new_kv_cache(b, capacity)`` holds, for each regular layer and for the top query layer,
this rank's heads' keys and values (b, heads/tp, capacity, d); see ``codegeex_train/model/attention.py``.
The top query layer caches like the others: its keys and values come from the final hidden states of
each position, its query from the top query embedding of the position being processed, so one decoding
step is the same maths as the full forward's last position.

**Batches of prompts of different lengths** are left-padded: row i's prompt occupies the last len_i
columns, its positions count 0 .. len_i - 1 from its first real token, and padding is masked out of every
attention (keys) -- so each row computes what it would alone, and every row's next token comes from the
last column. Each step then appends one token per row.

**TP ranks agree** because one rank chooses: every rank computes its vocabulary shard of the last
position's logits, the shards are all-gathered (b x padded vocab floats per step), the group's first rank
applies temperature/top-k/top-p and samples with a ``torch.Generator`` seeded from ``SamplingParams.seed``,
and broadcasts the chosen ids (b int64) to the group. Every rank therefore feeds the same tokens back, and
the stopping decisions (end-of-document id, stop strings on the decoded text, max new tokens) -- made from
those tokens alone -- are the same everywhere.

Padded vocabulary rows (ids >= the tokenizer's vocabulary) are never chosen. The end-of-document id ends a
row and is not part of its completion (``infill`` ends rows at the FIM sentinels too: ``infill.py``).
Pipeline-parallel stages are refused: gather the checkpoint to PP 1 with tools/convert_checkpoint.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist

from codegeex_train.checkpoint.files import CheckpointError, load_model_checkpoint, read_checkpoint_meta
from codegeex_train.checkpoint.retention import reading_checkpoint
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.data.tokenizer import Tokenizer, WhitespaceEncodingTokenizer, check_tokenizer_fits_vocab
from codegeex_train.generation.infill import FimFormat
from codegeex_train.generation.sampling import SamplingParams, sample_next_tokens
from codegeex_train.generation.text import decode_whitespace_tokens, truncate_at_stop
from codegeex_train.model.codegeex import CodeGeeXModel
from codegeex_train.tensor_parallel import RNGStatesTracker
from codegeex_train.tensor_parallel.mappings import ProcessGroup, group_rank, group_size

_CONTEXT_TOKENS = 8  # prompt tokens decoded before a completion, so that its first characters decode as in context


def _gather_hint(load_dir, tp_size: int) -> str:
    return (f"gather to PP 1 with tools/convert_checkpoint.py --load {load_dir} --save NEW_DIR "
            f"--tensor-model-parallel-size {tp_size} --pipeline-model-parallel-size 1")


def check_checkpoint_layout(load_dir, tp_size: int) -> tuple[str, dict]:
    """(tag, metadata) of ``load_dir``'s latest checkpoint after checking it can generate at TP ``tp_size``: one
    pipeline stage, this TP size; the error says how to launch or convert instead."""
    tag, meta = read_checkpoint_meta(load_dir)
    split = f"checkpoint {load_dir} ({tag}) is split for TP {meta['tp_size']} x PP {meta['pp_size']}"
    if meta["pp_size"] != 1:
        raise CheckpointError(f"{split}; generation runs the whole model on each TP rank: "
                              f"{_gather_hint(load_dir, tp_size)}")
    if meta["tp_size"] != tp_size:
        raise CheckpointError(f"{split}; this run has TP {tp_size}: run with --tensor-model-parallel-size "
                              f"{meta['tp_size']} (torchrun --nproc_per_node {meta['tp_size']}), or re-split it with "
                              f"tools/convert_checkpoint.py --load {load_dir} --save NEW_DIR "
                              f"--tensor-model-parallel-size {tp_size}")
    return tag, meta


class Generator:
    """Generates completions from a whole CodeGeeXModel (PP 1) on every rank of its TP group."""

    def __init__(self, model: CodeGeeXModel, tokenizer: Tokenizer | None,
                 device: torch.device | str = torch.device("cpu")):
        config: ModelConfig = model.config
        whole = model.pre_process and model.post_process and list(model.layer_numbers) == list(range(config.num_layers))
        if not whole:
            raise ValueError(f"generation runs the whole model on each TP rank, but this model is one pipeline stage "
                             f"(layers {model.layer_numbers.start}..{model.layer_numbers.stop - 1} of "
                             f"{config.num_layers}): {_gather_hint('CKPT', model.tp_size)}")
        if tokenizer is not None:
            check_tokenizer_fits_vocab(tokenizer, config.padded_vocab_size)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.config = config
        self.tp_group: ProcessGroup | None = model.tp_group
        self.tp_size, self.tp_rank = group_size(self.tp_group), group_rank(self.tp_group)
        self._src = dist.get_global_rank(self.tp_group, 0) if self.tp_size > 1 else 0  # the rank that samples
        self.eod = getattr(tokenizer, "eod", None)
        # A tokenizer without the whitespace wrapper prints CodeGeeX's whitespace tokens literally.
        self._literal_whitespace = tokenizer is not None and not isinstance(tokenizer, WhitespaceEncodingTokenizer)

    @classmethod
    def from_checkpoint(cls, load_dir: str | Path, tokenizer: Tokenizer | None, *, tp_group: ProcessGroup | None = None,
                        rng_tracker: RNGStatesTracker | None = None, device: torch.device | str = torch.device("cpu"),
                        dtype: torch.dtype = torch.float32) -> "Generator":
        """The latest checkpoint of ``load_dir`` (our layout, weights-only loading), at the TP size of ``tp_group``
        (this rank's shard); every rank of the group calls it."""
        tp_size = group_size(tp_group)
        tag, meta = check_checkpoint_layout(load_dir, tp_size)
        config = ModelConfig(**meta["model_config"])
        if tokenizer is not None:
            check_tokenizer_fits_vocab(tokenizer, config.padded_vocab_size)
            if tokenizer.vocab_size != config.vocab_size:
                warnings.warn(f"the tokenizer has {tokenizer.vocab_size} ids but checkpoint {load_dir} was trained "
                              f"with {config.vocab_size}: pass the tokenizer flags training used", stacklevel=2)
        model = CodeGeeXModel(config, tp_group, rng_tracker, dtype=dtype, device=device)
        with reading_checkpoint(load_dir):  # a run saving there with --keep-last-n-checkpoints keeps it meanwhile
            load_model_checkpoint(load_dir, model)
        return cls(model, tokenizer, device)

    # --- text ---------------------------------------------------------------------------------------------

    def generate(self, prompts: list[str], params: SamplingParams) -> list[str]:
        """The completion of each prompt (the text after it), cut before the first stop string."""
        if self.tokenizer is None:
            raise ValueError("Generator.generate needs a tokenizer; use generate_ids for token ids")
        prompt_ids = self.tokenizer.encode_batch(list(prompts))
        for i, (text, ids) in enumerate(zip(prompts, prompt_ids)):
            if not ids:
                raise ValueError(f"prompt {i} ({text!r}) encodes to no tokens: give at least one character")
        outputs = self.generate_ids(prompt_ids, params)
        return [truncate_at_stop(self.completion_text(p, o), params.stop) for p, o in zip(prompt_ids, outputs)]

    def infill(self, prefixes: list[str], suffixes: list[str], params: SamplingParams, fim: FimFormat) -> list[str]:
        """The middle of each (prefix, suffix) from a model trained with fill-in-the-middle, prompted in ``fim``'s
        order (``infill.py``); a middle ends at EOD or any sentinel, and is cut before the first stop string. It
        is decoded as it reads after the prefix."""
        if self.tokenizer is None:
            raise ValueError("Generator.infill needs a tokenizer")
        if len(prefixes) != len(suffixes):
            raise ValueError(f"{len(prefixes)} prefixes but {len(suffixes)} suffixes")
        prompt_ids = [fim.prompt_ids(self.tokenizer, p, s) for p, s in zip(prefixes, suffixes)]
        outputs = self.generate_ids(prompt_ids, params, end_ids=fim.end_ids)
        prefix_ids = self.tokenizer.encode_batch(list(prefixes))
        return [truncate_at_stop(self.completion_text(p, o), params.stop) for p, o in zip(prefix_ids, outputs)]

    def completion_text(self, prompt_ids: list[int], completion_ids: list[int]) -> str:
        """The text of ``completion_ids`` as it reads after the prompt, whitespace tokens as spaces."""
        context = prompt_ids[-_CONTEXT_TOKENS:]
        before, full = self.tokenizer.decode(context), self.tokenizer.decode(context + completion_ids)
        text = full[len(before):] if full.startswith(before) else self.tokenizer.decode(completion_ids)
        return decode_whitespace_tokens(text) if self._literal_whitespace else text

    # --- tokens -------------------------------------------------------------------------------------------

    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams, *,
                     use_cache: bool = True, end_ids: Collection[int] = ()) -> list[list[int]]:
        """New token ids for each prompt (a batch of any lengths). A row ends at max_new_tokens, at the
        end-of-document id or one of ``end_ids`` (not returned) or once its decoded completion contains a stop
        string (the ids returned then include the token that completed it; ``generate`` cuts the text).

        ``use_cache=False`` recomputes the whole sequence at every step (the reference and the benchmark's
        baseline); the tokens are the same."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (Generator(model, tokenizer))")
        prompt_ids = [list(map(int, p)) for p in prompt_ids]
        max_new = self._check_prompts(prompt_ids, params.max_new_tokens)
        if not prompt_ids or max_new == 0:
            return [[] for _ in prompt_ids]
        with torch.no_grad():
            return self._decode(prompt_ids, params, max_new, use_cache, frozenset(map(int, end_ids)))

    def _check_prompts(self, prompt_ids: list[list[int]], max_new_tokens: int) -> int:
        """Validate the prompts; the number of new tokens that fit the model's positions."""
        vocab = self.config.vocab_size
        for i, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt {i} is empty: give at least one token")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"prompt {i} holds token id {min(ids) if min(ids) < 0 else max(ids)}, outside the "
                                 f"model's vocabulary 0..{vocab - 1}")
        if not prompt_ids:
            return 0
        longest, positions = max(map(len, prompt_ids)), self.config.max_position_embeddings
        if longest > positions:
            raise ValueError(f"a prompt of {longest} tokens exceeds the model's {positions} positions "
                             f"(--max-position-embeddings)")
        # The k-th new token is fed back at position len + k - 1; the last one is never fed back.
        fits = positions - longest + 1
        if max_new_tokens > fits:
            warnings.warn(f"max_new_tokens {max_new_tokens} cut to {fits}: the longest prompt ({longest} tokens) "
                          f"plus the new tokens must fit the model's {positions} positions", stacklevel=3)
        return min(max_new_tokens, fits)

    def _decode(self, prompt_ids: list[list[int]], params: SamplingParams, max_new: int,
                use_cache: bool, end_ids: frozenset[int]) -> list[list[int]]:
        b, lengths = len(prompt_ids), [len(p) for p in prompt_ids]
        width = max(lengths)
        tokens = torch.zeros(b, width + max_new - 1, dtype=torch.long, device=self.device)
        real = torch.zeros(b, width + max_new - 1, dtype=torch.bool, device=self.device)
        for i, ids in enumerate(prompt_ids):  # left padding: every prompt ends in column width - 1
            tokens[i, width - len(ids):width] = torch.tensor(ids, dtype=torch.long)
            real[i, width - len(ids):width] = True
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # 0 at each row's first real token
        real[:, width:] = True  # the new tokens
        positions[:, width:] = torch.tensor(lengths, device=self.device)[:, None] + torch.arange(max_new - 1,
                                                                                               device=self.device)
        padded = min(lengths) < width
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        outputs: list[list[int]] = [[] for _ in range(b)]
        active = [True] * b

        cache = self.model.new_kv_cache(b, width + max_new - 1) if use_cache else None
        end = width
        logits = self._logits(tokens[:, :end], positions[:, :end], real[:, :end] if padded else None, cache)
        for step in range(max_new):
            chosen = self._choose(logits, params, generator)  # (b,), the same on every TP rank
            for i, token in enumerate(chosen.tolist()):
                if not active[i]:
                    continue
                if token == self.eod or token in end_ids:
                    active[i] = False
                    continue
                outputs[i].append(token)
                if params.stop and any(s in self.completion_text(prompt_ids[i], outputs[i]) for s in params.stop):
                    active[i] = False
            if not any(active) or step == max_new - 1:
                break
            tokens[:, end] = chosen
            end += 1
            if use_cache:  # one new position per row
                logits = self._logits(tokens[:, end - 1:end], positions[:, end - 1:end], None, cache)
            else:  # the whole sequence again, in a fresh cache
                logits = self._logits(tokens[:, :end], positions[:, :end], real[:, :end] if padded else None, None)
        return outputs

    def _logits(self, tokens: torch.Tensor, positions: torch.Tensor, real: torch.Tensor | None,
                cache) -> torch.Tensor:
        """Full-vocabulary fp32 logits (b, v) of the last column; padded vocabulary ids at -inf."""
        if cache is None:  # no-cache decoding: a throwaway cache sized for this one forward
            cache = self.model.new_kv_cache(tokens.shape[0], tokens.shape[1])
        logits = self.model(tokens, positions, kv_cache=cache, attention_mask=real, gather_logits=True,
                            last_token_only=True)[:, -1].float()  # (b, padded v), gathered over TP
        logits[:, self.config.vocab_size:] = float("-inf")
        return logits

    def _choose(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
        """The TP group's first rank chooses, the others receive its choice."""
        if self.tp_size == 1:
            return sample_next_tokens(logits, params, generator)
        if self.tp_rank == 0:
            chosen = sample_next_tokens(logits, params, generator).contiguous()
        else:
            chosen = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        dist.broadcast(chosen, src=self._src, group=self.tp_group)
        return chosen
