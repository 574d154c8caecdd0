"""The training run's data: a preflight check of the indexed datasets, the splits, per-rank loaders and batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from codegeex_train.config.arguments import ConfigError, DataConfig, TrainConfig
from codegeex_train.context_parallel.chunks import split_for_context_parallel
from codegeex_train.data.fim import FIM
from codegeex_train.data.gpt_dataset import (
    build_datasets_from_paths,
    build_train_valid_test_datasets,
    parse_data_prefix,
)
from codegeex_train.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset
from codegeex_train.data.sampler import build_pretraining_data_loader
from codegeex_train.data.stored_documents import holds_eod, opens_with
from codegeex_train.data.token_range import TokenIdError, check_token_ids
from codegeex_train.tokenization.tokenizer import Tokenizer
from codegeex_train.tokenization.record import (
    TOKENIZER_FIELDS,
    describe_record,
    describe_tokenizer,
    mismatch,
    read_dataset_record,
    tokenizer_flags,
)
from codegeex_train.layout.plan import ParallelPlan


def _prefixes(cfg: DataConfig) -> list[tuple[str, str]]:
    """(flag, prefix) for every dataset the run would read."""
    out = []
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        value = getattr(cfg, flag)
        if value:
            try:
                out += [("--" + flag.replace("_", "-"), p) for _, p in parse_data_prefix(value)]
            except ValueError as e:
                raise ConfigError(str(e)) from None
    return out


def _check_data_tokenizer(flag: str, prefix: str, cfg: DataConfig, tokenizer: Tokenizer) -> None:
    """The tokenizer preprocessing recorded beside the data (``PREFIX.meta.json``) is this run's: the same
    fingerprint over the ids the data's tokenizer had. Data preprocessed before the record existed is not checked."""
    try:
        record = read_dataset_record(prefix)
    except ValueError as e:
        raise ConfigError(f"{flag} {prefix}: {e}") from None
    difference = None if record is None else mismatch(record, tokenizer)
    if difference is not None:
        ours = {name: getattr(cfg, name) for name in TOKENIZER_FIELDS}
        raise ConfigError(f"{flag} {prefix}: written with another tokenizer than this run's: "
                          f"{describe_tokenizer(record)}, {describe_record(record)}; this run's is "
                          f"{describe_tokenizer(ours)}, which {difference}: pass {tokenizer_flags(record)} as "
                          f"tools/preprocess_data.py did, or re-run it with this run's tokenizer")


def _refuse_idle_flags(cfg: DataConfig, flag: str, prefix: str, ds: MMapIndexedDataset, tokenizer: Tokenizer,
                       fim: FIM | None) -> None:
    """Flags that would do nothing on this data, refused (data/stored_documents.py reads a few documents' ends)."""
    masking = [name for name, on in (("--reset-position-ids", cfg.reset_position_ids),
                                     ("--reset-attention-mask", cfg.reset_attention_mask),
                                     ("--eod-mask-loss", cfg.eod_mask_loss)) if on]
    if masking and not holds_eod(ds, tokenizer.eod):
        raise ConfigError(f"{' '.join(masking)} would change nothing on {flag} {prefix}: its documents hold no "
                          f"end-of-document token (id {tokenizer.eod}); re-run tools/preprocess_data.py with "
                          f"--append-eod, or drop the flag")
    # FIM leaves a segment holding a sentinel as stored: a repository document is one, unless split into files.
    if fim is not None and fim.split_sample is None and flag in ("--data-path", "--train-data-path"):
        if opens_with(ds, (fim.tokens.repo_name, fim.tokens.file_sep)):
            raise ConfigError(f"--fim-rate {cfg.fim_rate} would transform almost nothing of {flag} {prefix}: its "
                              f"documents are repository documents, which FIM leaves whole; add --fim-split-sample "
                              f"<file_sep> (FIM then works on each file)")


def preflight_data(cfg: DataConfig, padded_vocab_size: int, tokenizer: Tokenizer, fim: FIM | None = None) -> None:
    """Fail fast, before any process group: missing, foreign or corrupt files, empty data, data written by another
    tokenizer than this run's ``tokenizer``, and any token id outside that tokenizer's ids (the whole dataset's id
    range, cached beside its index), at every TP size; and flags that would act on nothing in this data
    (``_refuse_idle_flags``; ``fim``: the run's FIM transform, None without --fim-rate)."""
    vocab_size = min(tokenizer.vocab_size, padded_vocab_size)  # the padding rows are no token's
    for flag, prefix in _prefixes(cfg):
        try:
            ds = MMapIndexedDataset(prefix)
        except (FileNotFoundError, IndexedDatasetError) as e:
            raise ConfigError(f"{flag}: {e}") from None
        if len(ds) == 0 or ds.num_tokens == 0:
            raise ConfigError(f"{flag} {prefix}: the dataset holds no documents (empty corpus?); "
                              f"re-run tools/preprocess_data.py on a non-empty --input")
        _check_data_tokenizer(flag, prefix, cfg, tokenizer)
        try:
            check_token_ids(ds, vocab_size)
        except TokenIdError as e:
            raise ConfigError(f"{flag} {prefix}: {e}") from None
        _refuse_idle_flags(cfg, flag, prefix, ds, tokenizer, fim)


def num_samples(train: TrainConfig, plan: ParallelPlan) -> tuple[int, int, int]:
    """Samples each split must provide: every training step, and eval_iters global batches for eval/test."""
    eval_samples = train.eval_iters * plan.global_batch_size
    return train.train_iters * plan.global_batch_size, eval_samples, eval_samples


def build_datasets(cfg: DataConfig, train: TrainConfig, plan: ParallelPlan, rank: int, vocab_size: int | None = None,
                   fim: FIM | None = None):
    """Rank 0 builds (and caches) the sample indices first; the others then read them from the cache.

    ``vocab_size`` (the padded vocabulary): every sample's ids are checked against it as it is read. ``fim``: the
    run's FIM transform of the training split (data/fim.py; pretrain.py builds it once from --fim-*), None: left to
    right."""
    if (fim is None) != (not cfg.fim_rate):  # a caller that forgot it would train left to right without a word
        raise ValueError(f"build_datasets: --fim-rate {cfg.fim_rate} {'without' if fim is None else 'with'} a FIM "
                         f"transform: pass the run's (data/fim.py fim_from_flags), None only at --fim-rate 0")

    def build():
        sizes = num_samples(train, plan)
        if cfg.data_path:
            return build_train_valid_test_datasets(cfg.data_path, cfg.split, train.seq_length, train.seed, sizes,
                                                   vocab_size=vocab_size, fim=fim)
        return build_datasets_from_paths(cfg.train_data_path, cfg.valid_data_path, cfg.test_data_path,
                                         train.seq_length, train.seed, sizes, vocab_size=vocab_size, fim=fim)

    ready = dist.is_initialized()
    if ready and rank != 0:
        dist.barrier()
    datasets = build()
    if ready and rank == 0:
        dist.barrier()
    return datasets


def loader(dataset, consumed_samples: int, plan: ParallelPlan, dp_rank: int, num_workers: int, total_samples: int):
    """This DP rank's micro-batches from ``consumed_samples`` on; every TP/PP rank of it reads the same ones."""
    return build_pretraining_data_loader(dataset, consumed_samples, plan.micro_batch_size, dp_rank,
                                         plan.dp_size, num_workers=num_workers, total_samples=total_samples)


@dataclass(frozen=True)
class DocumentMasking:
    """Megatron's document masking of packed samples (--reset-position-ids, --reset-attention-mask,
    --eod-mask-loss) and the end-of-document id the documents are split at. All off: the batch is as before."""

    eod: int | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @classmethod
    def from_config(cls, cfg: DataConfig, eod: int) -> "DocumentMasking":
        return cls(eod, cfg.reset_position_ids, cfg.reset_attention_mask, cfg.eod_mask_loss)

    @property
    def enabled(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss


def position_ids(batch_size: int, seq_length: int, device: torch.device) -> torch.Tensor:
    """0 .. s-1 for every sequence (packed samples restart positions at each sample, not each document)."""
    return torch.arange(seq_length, device=device).unsqueeze(0).expand(batch_size, seq_length)  # (b, s)


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """(b, s) input ids -> (b, s) the index of each token's document in its packed sample: the number of EODs
    before it (an EOD belongs to the document it ends)."""
    is_eod = (tokens == eod).long()
    return is_eod.cumsum(dim=1) - is_eod  # (b, s)


def document_position_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """(b, s) input ids -> (b, s) positions that restart at 0 after every EOD (Megatron's --reset-position-ids)."""
    b, s = tokens.shape
    index = position_ids(b, s, tokens.device)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eod  # a document starts right after an EOD
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # its document's first index
    return index - first  # (b, s)


@dataclass(frozen=True)
class ContextParallelShare:
    """Which part of every sequence this rank's layers see under context parallelism: chunks r and 2·cp-1-r of
    2·cp (context_parallel/chunks.py). cp_size 1: the whole sequence."""

    cp_rank: int = 0
    cp_size: int = 1

    def split(self, t: torch.Tensor) -> torch.Tensor:
        """(b, s, ...) -> (b, s/cp, ...): this rank's two chunks of the sequence dimension, in order."""
        return split_for_context_parallel(t, 1, self.cp_rank, self.cp_size)


def get_batch(batch: dict, device: torch.device, masking: DocumentMasking | None = None,
              cp: ContextParallelShare | None = None) -> dict[str, torch.Tensor]:
    """Inputs, shifted labels, positions and the loss mask of one packed micro-batch; with ``masking``, Megatron's
    document masking (every rule reads the INPUT tokens, as Megatron's get_ltor_masks_and_position_ids does):
    positions restart after each EOD, ``document_ids`` (b, s) are added for the block-causal attention (the model
    builds its (b, 1, s, s) mask from them: tokens see their own document only), and the loss skips positions
    whose input is EOD (the prediction of a new document's first token from nothing of it).

    With ``cp`` (context parallelism) every rule reads the whole sequence first, then each (b, s) tensor keeps this
    rank's s/cp positions (positions stay global: the chunks' own), and ``loss_count`` holds the whole sequence's
    unmasked tokens, so that the CP ranks' loss shares add up to the mean without a collective (engine_stage.py)."""
    text = batch["text"].to(device, non_blocking=True)  # (b, s + 1)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    out = {"input_ids": tokens, "labels": labels, "position_ids": position_ids(*tokens.shape, device),
           "loss_mask": torch.ones_like(labels, dtype=torch.float32)}
    if "loss_mask" in batch:  # FIM's <fim_pad> padding (data/fim.py): no loss where the label is padding
        out["loss_mask"] = out["loss_mask"] * batch["loss_mask"].to(device, non_blocking=True)
    if masking is not None and masking.enabled:
        if masking.reset_position_ids:
            out["position_ids"] = document_position_ids(tokens, masking.eod)
        if masking.reset_attention_mask:
            out["document_ids"] = document_ids(tokens, masking.eod)
        if masking.eod_mask_loss:
            out["loss_mask"][tokens == masking.eod] = 0.0
    if cp is None or cp.cp_size == 1:
        return out
    return {name: cp.split(t) for name, t in out.items()} | {"loss_count": out["loss_mask"].sum()}
