"""Incremental decoding of a CodeGeeXModel at any TP size, with a key/value cache for every attention.

    gen = Generator.from_checkpoint("outputs/codegen-default", default_tokenizer(), tp_group=topology.tp_group)
    completions = gen.generate(["def fib(n):\\n"], SamplingParams(max_new_tokens=64, stop=HUMANEVAL_STOP))

**Cache.** ``model.new_kv_cache(b, capacity)`` holds, for each regular layer and for the top query layer,
this rank's key-value groups' keys and values (b, groups/tp, capacity, d: the heads' without grouped-query attention;
the top query layer's are its heads'); see ``codegeex_train/model/attention.py``.
The top query layer caches like the others: its keys and values come from the final hidden states of
each position, its query from the top query embedding of the position being processed, so one decoding
step is the same maths as the full forward's last position.

**Batches** (``batching.py``): each prompt is prefilled once, alone, and its keys and values stored once as a
prefix that the decoding slot of each of its samples points at (``model/kv_slots.py``: a slot holds only its own
sample's new tokens; a step reads each prefix once for all its rows); a finished sample leaves its slot to the next
waiting one, and
stop strings are checked incrementally (``stops.py``). ``use_cache=False`` is the reference: every sample a row of
one left-padded batch recomputed whole at every step (padding masked out of every attention), stop strings looked
for in the whole text -- the same tokens.

**TP ranks agree** because one rank chooses: every rank computes its vocabulary shard of the last
position's logits, the shards are all-gathered (b x padded vocab floats per step), the group's first rank
applies temperature/top-k/top-p and samples (each sample with its own ``torch.Generator``, seeded from
``SamplingParams.seed``, the prompt's index and the sample's: ``batching.py``), and broadcasts the chosen ids (b
int64) to the group. Every rank therefore feeds the same tokens back, and
the stopping decisions (end-of-document id, stop strings on the decoded text, max new tokens) -- made from
those tokens alone -- are the same everywhere.

Padded vocabulary rows (ids >= the tokenizer's vocabulary) are never chosen. The end-of-document id ends a
row and is not part of its completion (``infill`` ends rows at the FIM sentinels too: ``infill.py``).
Pipeline-parallel stages are refused: gather the checkpoint to PP 1 with tools/convert_checkpoint.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from codegeex_train.checkpoint.files import CheckpointError, load_model_checkpoint, read_checkpoint_meta
from codegeex_train.checkpoint.retention import reading_checkpoint
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.tokenization.tokenizer import Tokenizer, WhitespaceEncodingTokenizer, check_tokenizer_fits_vocab
from codegeex_train.generation.infill import FimFormat
from codegeex_train.generation.batching import Row, sample_streams, stream_batches
from codegeex_train.generation.sampling import SamplingParams, choose_tokens
from codegeex_train.generation.stops import StopStrings
from codegeex_train.generation.text import decode_whitespace_tokens, truncate_at_stop
from codegeex_train.model.codegeex import CodeGeeXModel
from codegeex_train.model.groups import ModelGroups
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
            # The recorded tokenizer's size when there is one: an imported family model has more rows than its
            # tokenizer has ids (Qwen2.5-Coder: 152,064 for 151,665), which is no mismatch.
            recorded = meta.get("tokenizer")
            trained = recorded.get("vocab_size") if isinstance(recorded, dict) else None
            if tokenizer.vocab_size != trained if isinstance(trained, int) else tokenizer.vocab_size > config.vocab_size:
                warnings.warn(f"the tokenizer has {tokenizer.vocab_size} ids but checkpoint {load_dir} was trained "
                              f"with {trained or config.vocab_size}: pass the tokenizer flags training used",
                              stacklevel=2)
        model = CodeGeeXModel(config, ModelGroups(tp=tp_group), rng_tracker=rng_tracker, dtype=dtype, device=device)
        with reading_checkpoint(load_dir):  # a run saving there with --keep-last-n-checkpoints keeps it meanwhile
            load_model_checkpoint(load_dir, model)
        return cls(model, tokenizer, device)

    # --- text ---------------------------------------------------------------------------------------------

    def generate(self, prompts: list[str], params: SamplingParams, *, num_samples: int = 1,
                 batch_size: int | None = None) -> list[str]:
        """``num_samples`` completions of each prompt (the text after it, cut before the first stop string):
        prompt i's sample j at index i * num_samples + j. ``batch_size``: decoding slots (``stream``)."""
        return _in_order(self.stream(prompts, params, num_samples=num_samples, batch_size=batch_size),
                         len(prompts) * num_samples)

    def stream(self, prompts: list[str], params: SamplingParams, *, num_samples: int = 1,
               batch_size: int | None = None) -> Iterator[tuple[int, str]]:
        """(i * num_samples + j, completion) for sample j of every prompt i, as each finishes (continuous
        batching, ``batching.py``: ``batch_size`` rows decode together, default min(all, max(prompts, 64)))."""
        if self.tokenizer is None:
            raise ValueError("Generator.generate needs a tokenizer; use generate_ids for token ids")
        prompt_ids = self.tokenizer.encode_batch(list(prompts))
        for i, (text, ids) in enumerate(zip(prompts, prompt_ids)):
            if not ids:
                raise ValueError(f"prompt {i} ({text!r}) encodes to no tokens: give at least one character")
        for index, ids in self.stream_ids(prompt_ids, params, num_samples=num_samples, batch_size=batch_size):
            yield index, truncate_at_stop(self.completion_text(prompt_ids[index // num_samples], ids), params.stop)

    def infill(self, prefixes: list[str], suffixes: list[str], params: SamplingParams, fim: FimFormat, *,
               num_samples: int = 1, batch_size: int | None = None) -> list[str]:
        """The middle of each (prefix, suffix) from a model trained with fill-in-the-middle, prompted in ``fim``'s
        order (``infill.py``); a middle ends at EOD or any sentinel, and is cut before the first stop string. It
        is decoded as it reads after the prefix. Samples ordered as ``generate``'s."""
        return _in_order(self.stream_infill(prefixes, suffixes, params, fim, num_samples=num_samples,
                                            batch_size=batch_size), len(prefixes) * num_samples)

    def stream_infill(self, prefixes: list[str], suffixes: list[str], params: SamplingParams, fim: FimFormat, *,
                      num_samples: int = 1, batch_size: int | None = None) -> Iterator[tuple[int, str]]:
        """``infill``'s middles as (index, middle), in the order they finish."""
        if self.tokenizer is None:
            raise ValueError("Generator.infill needs a tokenizer")
        if len(prefixes) != len(suffixes):
            raise ValueError(f"{len(prefixes)} prefixes but {len(suffixes)} suffixes")
        prompt_ids = [fim.prompt_ids(self.tokenizer, p, s) for p, s in zip(prefixes, suffixes)]
        prefix_ids = self.tokenizer.encode_batch(list(prefixes))
        for index, ids in self.stream_ids(prompt_ids, params, end_ids=fim.end_ids, num_samples=num_samples,
                                          batch_size=batch_size):
            yield index, truncate_at_stop(self.completion_text(prefix_ids[index // num_samples], ids), params.stop)

    def completion_text(self, prompt_ids: list[int], completion_ids: list[int]) -> str:
        """The text of ``completion_ids`` as it reads after the prompt, whitespace tokens as spaces."""
        context = prompt_ids[-_CONTEXT_TOKENS:]
        before, full = self.tokenizer.decode(context), self.tokenizer.decode(context + completion_ids)
        if not full.startswith(before):
            return self._decode_alone(completion_ids)
        text = full[len(before):]
        return decode_whitespace_tokens(text) if self._literal_whitespace else text

    def _decode_alone(self, ids: list[int]) -> str:
        """The text of ``ids`` decoded on their own, whitespace tokens as spaces."""
        text = self.tokenizer.decode(ids)
        return decode_whitespace_tokens(text) if self._literal_whitespace else text

    # --- tokens -------------------------------------------------------------------------------------------

    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams, *, use_cache: bool = True,
                     end_ids: Collection[int] = (), num_samples: int = 1,
                     batch_size: int | None = None) -> list[list[int]]:
        """New token ids for ``num_samples`` samples of each prompt (of any lengths), prompt i's sample j at
        index i * num_samples + j. A row ends at max_new_tokens, at the end-of-document id or one of ``end_ids``
        (not returned) or once its decoded completion contains a stop string (the ids returned then include the
        token that completed it; ``generate`` cuts the text).

        ``use_cache=False`` recomputes the whole padded batch at every step and checks stop strings on the whole
        text (the reference and the benchmark's baseline); the tokens are the same."""
        if not use_cache:
            self._check_args(params, num_samples, batch_size)
            prompt_ids = [list(map(int, p)) for p in prompt_ids]
            max_new = self._check_prompts(prompt_ids, params.max_new_tokens)
            with torch.no_grad():
                return self._decode_without_cache(prompt_ids, params, max_new, num_samples,
                                                  frozenset(map(int, end_ids)))
        return _in_order(self.stream_ids(prompt_ids, params, end_ids=end_ids, num_samples=num_samples,
                                         batch_size=batch_size), len(prompt_ids) * num_samples)

    def stream_ids(self, prompt_ids: list[list[int]], params: SamplingParams, *, end_ids: Collection[int] = (),
                   num_samples: int = 1, batch_size: int | None = None) -> Iterator[tuple[int, list[int]]]:
        """``generate_ids``' samples as (index, ids), in the order they finish (``batching.py``)."""
        self._check_args(params, num_samples, batch_size)
        prompt_ids = [list(map(int, p)) for p in prompt_ids]
        max_new = self._check_prompts(prompt_ids, params.max_new_tokens)
        live = [i for i, m in enumerate(max_new) if m > 0]
        for i in (i for i, m in enumerate(max_new) if m == 0):
            for j in range(num_samples):
                yield i * num_samples + j, []
        if not live:
            return
        slots = batch_size or min(len(prompt_ids) * num_samples, max(len(prompt_ids), 64))
        stops = StopStrings(params.stop, self.completion_text, self._decode_alone)
        with torch.no_grad():
            for index, ids in stream_batches(self, [prompt_ids[i] for i in live], params, [max_new[i] for i in live],
                                             num_samples=num_samples, slots=slots,
                                             end_ids=frozenset(map(int, end_ids)), stops=stops):
                yield live[index // num_samples] * num_samples + index % num_samples, ids

    def _check_args(self, params: SamplingParams, num_samples: int, batch_size: int | None) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (Generator(model, tokenizer))")
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples {num_samples!r}: must be an integer >= 1")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size {batch_size!r}: must be an integer >= 1 (rows decoded together)")

    def _check_prompts(self, prompt_ids: list[list[int]], max_new_tokens: int) -> list[int]:
        """Validate the prompts; for each, the number of new tokens that fit the model's positions."""
        vocab = self.config.vocab_size
        for i, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt {i} is empty: give at least one token")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"prompt {i} holds token id {min(ids) if min(ids) < 0 else max(ids)}, outside the "
                                 f"model's vocabulary 0..{vocab - 1}")
        if not prompt_ids:
            return []
        longest, positions = max(map(len, prompt_ids)), self.config.max_position_embeddings
        if longest > positions:
            raise ValueError(f"a prompt of {longest} tokens exceeds the model's {positions} positions "
                             f"(--max-position-embeddings)")
        # The k-th new token is fed back at position len + k - 1; the last one is never fed back.
        fits = [positions - len(ids) + 1 for ids in prompt_ids]
        if max_new_tokens > min(fits):
            warnings.warn(f"max_new_tokens {max_new_tokens} cut to {min(fits)} for the longest prompt ({longest} "
                          f"tokens): a prompt plus its new tokens must fit the model's {positions} positions",
                          stacklevel=4)
        return [min(max_new_tokens, n) for n in fits]

    def _decode_without_cache(self, prompt_ids: list[list[int]], params: SamplingParams, max_new: list[int],
                              num_samples: int, end_ids: frozenset[int]) -> list[list[int]]:
        """The reference: every sample a row of one left-padded batch, the whole batch recomputed at every step,
        stop strings looked for in the whole text; the same random streams as ``stream_batches``."""
        rows = [(i, j) for i in range(len(prompt_ids)) for j in range(num_samples) if max_new[i] > 0]
        outputs: list[list[int]] = [[] for _ in range(len(prompt_ids) * num_samples)]
        if not rows:
            return outputs
        lengths = [len(prompt_ids[i]) for i, _ in rows]
        b, width, steps = len(rows), max(lengths), max(max_new[i] for i, _ in rows)
        tokens = torch.zeros(b, width + steps - 1, dtype=torch.long, device=self.device)
        real = torch.zeros(b, width + steps - 1, dtype=torch.bool, device=self.device)
        for r, (i, _) in enumerate(rows):  # left padding: every prompt ends in column width - 1
            tokens[r, width - lengths[r]:width] = torch.tensor(prompt_ids[i], dtype=torch.long)
            real[r, width - lengths[r]:width] = True
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # 0 at each row's first real token
        real[:, width:] = True  # the new tokens
        positions[:, width:] = torch.tensor(lengths, device=self.device)[:, None] + torch.arange(steps - 1,
                                                                                              device=self.device)
        decoding = [Row(i, j, max_new[i], sample_streams(params, i, j)) for i, j in rows]
        stop_ids = {self.eod, *end_ids} - {None}
        active = list(range(b))
        for end in range(width, width + steps):
            logits = self._logits(tokens[active, :end], positions[active, :end], real[active, :end], None)
            chosen = self.choose(logits, params, [decoding[r] for r in active]).tolist()
            still = []
            for r, token in zip(active, chosen):
                i, j = rows[r]
                out = decoding[r].tokens
                if token in stop_ids:
                    continue
                out.append(token)
                if len(out) < max_new[i] and not (params.stop and any(
                        s in self.completion_text(prompt_ids[i], out) for s in params.stop)):
                    still.append(r)
                    if end < tokens.shape[1]:
                        tokens[r, end] = token
            active = still
            if not active:
                break
        for row in decoding:
            outputs[row.prompt * num_samples + row.sample] = row.tokens
        return outputs

    def prefill(self, prompt_ids: list[int]):
        """(KVCache of the prompt's positions, logits (1, v) of its last one): one unpadded batch-1 forward."""
        cache = self.model.new_kv_cache(1, len(prompt_ids))
        tokens = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(len(prompt_ids), device=self.device)[None]
        return cache, self._logits(tokens, positions, None, cache)

    def decode_step(self, tokens: torch.Tensor, slots) -> torch.Tensor:
        """Logits (b, v) after feeding ``tokens`` (b, 1) to KVSlots rows 0..b-1 at their own positions."""
        return self._logits(tokens, slots.positions(), None, slots)

    def _logits(self, tokens: torch.Tensor, positions: torch.Tensor, real: torch.Tensor | None,
                cache) -> torch.Tensor:
        """Full-vocabulary fp32 logits (b, v) of the last column; padded vocabulary ids at -inf."""
        if cache is None:  # no-cache decoding: a throwaway cache sized for this one forward
            cache = self.model.new_kv_cache(tokens.shape[0], tokens.shape[1])
        logits = self.model(tokens, positions, kv_cache=cache, attention_mask=real, gather_logits=True,
                            last_token_only=True)[:, -1].float()  # (b, padded v), gathered over TP
        logits[:, self.config.vocab_size:] = float("-inf")
        return logits

    def choose(self, logits: torch.Tensor, params: SamplingParams, rows: list[Row]) -> torch.Tensor:
        """The next token of each row (b,), the same on every TP rank: the group's first rank chooses (row i's
        uniform from ``rows[i].stream``, sampling.py) and broadcasts its choice."""
        if self.tp_size == 1 or self.tp_rank == 0:
            uniforms = None if params.greedy else torch.tensor(
                [torch.rand((), generator=row.stream, dtype=torch.float64).item() for row in rows],
                dtype=torch.float64)
            chosen = choose_tokens(logits, params, uniforms)
            if self.tp_size == 1:
                return chosen
            chosen = chosen.contiguous()
        else:
            chosen = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        dist.broadcast(chosen, src=self._src, group=self.tp_group)
        return chosen


def _in_order(stream: Iterator[tuple[int, object]], total: int) -> list:
    """A stream's (index, item) pairs as the list [item 0, item 1, ...]."""
    out: list = [None] * total
    for index, item in stream:
        out[index] = item
    return out
