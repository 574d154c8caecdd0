"""Model checkpoints in the layout DeepSpeed's ``save_checkpoint`` writes and ``--load`` reads:

    DIR/latest                                  text: the tag, e.g. iter_0000000 or global_step1000
    DIR/<tag>/mp_rank_{MP:02d}_model_states.pt  MP: the model-parallel rank (layout.dims.model_parallel_rank)
        {"module": that rank's state_dict,
         "codegeex_train": {"model_config": asdict(config), "tp_size", "pp_size", "iteration",
                            "num_chunks": v, the model chunks per rank of interleaved 1F1B (optional, 1),
                            "tokenizer": the five tokenizer flags, file paths absolute, the tokenizer's
                                         fingerprint and vocab_size (tokenization/record.py), and the four
                                         FIM flags of a run that trains FIM (optional),
                            "resolved_config": the run's flags as a config file, text (training checkpoints;
                                               config/config_file.py)}}

Under interleaved 1F1B a rank's file holds all of its chunks' layers under their global names, so it is named and
read like any stage's; only which layers it holds depends on v (``saved_num_chunks``).

``tokenizer`` (``tokenizer_settings``) is written by training checkpoints (and copied into universal ones); model
files converted from elsewhere may lack it. ``checkpoint_tokenizer`` picks what a tool uses: its own tokenizer flags
when any is given, else the checkpoint's, else the shipped default. The FIM flags beside them say whether the
vocabulary holds the code sentinels (--fim-rate above 0 adds them) and in which order the model learnt to infill
(``checkpoint_fim``).

``latest`` is written last and atomically (temp file + os.replace): a crash mid-save leaves the previous
``latest`` pointing at the previous, complete tag. It is read without following a symbolic link, at most
``MAX_LATEST_BYTES`` of it, and must hold a tag (``TAG_PATTERN``: ``iter_0000123`` as ``checkpoint_tag`` writes, or
DeepSpeed's default ``global_step123``); what it holds otherwise is never echoed (it could be anything the link or
file pointed at, such as an environment). Every file is read with weights-only unpickling
(``checkpoint/safe_load.py``): a file whose pickle would run code is refused, naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import stat
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from codegeex_train.checkpoint.safe_load import CheckpointError, check_tag_dir, file_kind, safe_torch_load
from codegeex_train.checkpoint.sharding import merge_state_dicts, partition_spec, stages_of_name
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.config.options import has_declared_type, type_name
from codegeex_train.config.redaction import redact_secrets
from codegeex_train.config.arguments import ConfigError
from codegeex_train.layout.dims import model_parallel_rank
from codegeex_train.model.shapes import model_parameter_shapes
from codegeex_train.tokenization.code_tokens import trained_order
from codegeex_train.tokenization.tokenizer import Tokenizer
from codegeex_train.tokenization.record import (  # (TOKENIZER_FIELDS, ...: imported from here by the tools)
    TOKENIZER_FIELDS,
    TOKENIZER_FILE_FLAGS,
    check_record,
    describe_record,
    describe_tokenizer,
    fingerprint_record,
    mismatch,
    tokenizer_flags,
)

META_KEY = "codegeex_train"
# Fields that change parameter shapes or names; the rest (dropout, init std, ...) may differ on load. Under RoPE no
# table has a row per position: --max-position-embeddings is then the longest sequence only, free to change.
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                "padded_vocab_size", "top_query_layer", "position_embedding_type",
                # the architecture switches, by what they change in the parameters (ModelConfig's properties)
                "normalization", "swiglu", "kv_groups", "linear_bias", "qkv_bias", "tied_output")
# Fields that change the function but not the shapes: a mismatch only warns (e.g. fine-tuning choices; a larger
# --rotary-base to extend the context).
FUNCTION_FIELDS = ("activation", "layernorm_epsilon", "rotary_percent", "rotary_base", "rotary_interleaved")
# DataConfig's fill-in-the-middle flags, recorded with the tokenizer's.
FIM_FIELDS = ("fim_rate", "fim_spm_rate", "fim_split_sample", "fim_fragment_rate")


# The tags we write (checkpoint_tag; 7 digits or more) and DeepSpeed's default one; nothing else names a tag.
TAG_PATTERN = re.compile(r"iter_[0-9]{7,}|global_step[0-9]+")
# A tag and its newline fit many times over; more is not a tag, and is not read.
MAX_LATEST_BYTES = 64


def checkpoint_tag(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def shard_file(directory: str | os.PathLike, tag: str, tp_rank: int, tp_size: int, pp_rank: int = 0) -> Path:
    return Path(directory) / tag / f"mp_rank_{model_parallel_rank(tp_rank, pp_rank, tp_size):02d}_model_states.pt"


def write_latest(directory: str | os.PathLike, tag: str) -> None:
    """Make ``directory/latest`` name ``tag``: a temp file (created anew, never through a link), synced, then
    renamed over ``latest``; on any error the temp file is removed and ``latest`` is as it was."""
    if not TAG_PATTERN.fullmatch(tag):
        raise ValueError(f"{tag!r} is not a checkpoint tag (such as {checkpoint_tag(100)})")
    tmp = Path(directory) / "latest.tmp"
    if os.path.lexists(tmp):  # left by a crash (or planted): a fresh file, not whatever it points at
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, Path(directory) / "latest")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_latest(directory: str | os.PathLike) -> str:
    """The tag ``directory/latest`` names. A symbolic link, a non-regular file, more than ``MAX_LATEST_BYTES`` or
    anything but a tag raises CheckpointError, which says what the file is (kind, size), never what it holds."""
    path = Path(directory) / "latest"
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint in {directory}: {path} does not exist (it names the tag to load; "
                              f"a save writes it last, so its absence also means no save completed)") from None
    except OSError as e:
        if os.path.islink(path):
            raise CheckpointError(f"{path} is a symbolic link, not a checkpoint tag: it is never followed (a save "
                                  f"writes 'latest' as a small file naming the tag)") from None
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path} is {file_kind(info.st_mode)}, not a checkpoint tag (a save writes "
                                  f"'latest' as a small file naming the tag)")
        data = os.read(fd, MAX_LATEST_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    tag = data.decode("ascii", errors="replace").strip()
    if len(data) > MAX_LATEST_BYTES or not TAG_PATTERN.fullmatch(tag):
        size = f"{info.st_size} bytes" if info.st_size else f"{len(data)} bytes read"
        raise CheckpointError(f"{path} is not a checkpoint tag ({size}; a tag is iter_ and 7 or more digits, such as "
                              f"{checkpoint_tag(100)}, or DeepSpeed's global_step100; its content is not shown)")
    return tag


def tokenizer_settings(flags, tokenizer: Tokenizer | None = None) -> dict:
    """What a checkpoint records of the tokenizer: the five tokenizer fields of ``flags`` (a ``DataConfig`` or
    anything with them), file paths made absolute (against the current directory) so that tools run elsewhere
    find them, and any credential in them redacted (``config.redaction``: a checkpoint is shared more widely than
    the job; a tool then asks for the flag instead); from a run that trains FIM (--fim-rate above 0), the FIM
    fields (``FIM_FIELDS``); and with the run's ``tokenizer``, its fingerprint and vocab_size
    (``tokenization/record.py``), which a resume compares (``check_same_tokenizer``)."""
    settings = {name: getattr(flags, name) for name in TOKENIZER_FIELDS}
    for name in TOKENIZER_FILE_FLAGS:
        if settings[name] is not None:
            settings[name] = redact_secrets(os.path.abspath(settings[name]))
    if getattr(flags, "fim_rate", 0):
        settings.update({name: getattr(flags, name) for name in FIM_FIELDS})
    if tokenizer is not None:
        settings.update(fingerprint_record(tokenizer))
    return settings


def check_same_tokenizer(recorded: object, tokenizer: Tokenizer, flags, where: str) -> None:
    """ConfigError unless this run's ``tokenizer`` (built from ``flags``, a ``DataConfig``) is the one a checkpoint
    was trained with: ``recorded`` (its metadata's ``tokenizer``) has a fingerprint, and this tokenizer's first
    ``vocab_size`` ids have it (tokens appended after them, e.g. FIM's sentinels, are allowed). A checkpoint without
    a fingerprint (saved before fingerprints, converted from elsewhere) is not checked. ``where``: '--load DIR
    (TAG)'."""
    if not isinstance(recorded, dict):
        return
    try:
        record = check_record(recorded, where)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    difference = None if record is None else mismatch(record, tokenizer)
    if difference is None:
        return
    ours = {name: getattr(flags, name, None) for name in TOKENIZER_FIELDS}
    fim = (" with --fim-rate above 0 (its FIM sentinels)" if recorded.get("fim_rate")
           and not getattr(flags, "fim_rate", 0) else "")
    raise ConfigError(f"{where} was trained with another tokenizer than this run's: {describe_tokenizer(recorded)}, "
                      f"{describe_record(record)}; this run's is {describe_tokenizer(ours)}, which {difference}: pass "
                      f"{tokenizer_flags(recorded)}{fim}, as the run that saved it did")


def checkpoint_fim(meta: dict) -> dict | None:
    """The FIM flags (``FIM_FIELDS``) a checkpoint's metadata ``meta`` records, with ``order``: the prompt order to
    infill in, 'spm' when the run trained mostly SPM (--fim-spm-rate above 0.5), else 'psm' (StarCoder's; both
    were trained at 0.5). None when the checkpoint records no FIM training (--fim-rate 0, or a checkpoint written
    before FIM or converted from elsewhere)."""
    saved = meta.get("tokenizer")
    if not isinstance(saved, dict) or not saved.get("fim_rate"):
        return None
    fim = {name: saved.get(name) for name in FIM_FIELDS}
    return {**fim, "order": trained_order(fim["fim_spm_rate"] or 0)}


def checkpoint_tokenizer(directory: str | os.PathLike, meta: dict, flags: dict) -> tuple[dict, str]:
    """(settings, a line saying which tokenizer and why) for a tool that loads checkpoint ``directory`` (``meta``:
    its metadata): the tokenizer flags ``flags`` when any of them is given (set, not the default), else those the
    checkpoint records (with its FIM flags: ``load_tokenizer`` then adds the sentinels training had), else the
    shipped default. A recorded file that no longer exists raises CheckpointError naming the file and the flag to
    pass instead."""
    given = {name: flags.get(name) for name in TOKENIZER_FIELDS}
    if any(given.values()):
        return given, f"tokenizer: {describe_tokenizer(given)} (from the command line)"
    saved = meta.get("tokenizer")
    if not isinstance(saved, dict):
        return given, (f"tokenizer: {describe_tokenizer(given)} (checkpoint {directory} records no tokenizer; "
                       f"pass the tokenizer flags training used if it was another)")
    fim = {name: saved[name] for name in FIM_FIELDS if name in saved}  # with the sentinels if FIM trained
    saved = {name: saved.get(name) for name in TOKENIZER_FIELDS}
    missing = [name for name in TOKENIZER_FILE_FLAGS if saved[name] is not None and not os.path.exists(saved[name])]
    if missing:  # the flags to pass instead: the recorded ones, a placeholder for each missing file
        flags_to_pass = tokenizer_flags(saved, {name: name.upper() for name in missing})
        gone = " and ".join(f"{saved[name]} ({TOKENIZER_FILE_FLAGS[name]})" for name in missing)
        raise CheckpointError(f"checkpoint {directory} records the tokenizer file {gone}, which no longer exists: "
                              f"pass {flags_to_pass} with {' and '.join(n.upper() for n in missing)} a copy "
                              f"of it")
    return {**saved, **fim}, f"tokenizer: {describe_tokenizer(saved)} (recorded in checkpoint {directory})"


def save_model_checkpoint(directory: str | os.PathLike, shard_sds: list[dict], config: ModelConfig, tp_size: int,
                          *, pp_size: int = 1, tag: str = "iter_0000000", iteration: int = 0,
                          tokenizer: dict | None = None, num_chunks: int = 1) -> Path:
    """Write one file per model-parallel rank (``shard_sds`` in MP order), then ``latest``; ``tokenizer``: the
    settings to record (``tokenizer_settings``), if known."""
    if len(shard_sds) != tp_size * pp_size:
        raise ValueError(f"{len(shard_sds)} shards for TP {tp_size} x PP {pp_size}")
    meta = {"model_config": dataclasses.asdict(config), "tp_size": tp_size, "pp_size": pp_size, "iteration": iteration,
            "num_chunks": num_chunks}
    if tokenizer is not None:
        meta["tokenizer"] = tokenizer
    for mp_rank, sd in enumerate(shard_sds):
        path = shard_file(directory, tag, mp_rank % tp_size, tp_size, mp_rank // tp_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"module": sd, META_KEY: meta}, path)
    write_latest(directory, tag)
    return Path(directory) / tag


def _describe(config_fields: dict, tp_size: int, pp_size: int) -> str:
    return ", ".join(f"{k} {v}" for k, v in config_fields.items()) + f", tp {tp_size}, pp {pp_size}"


def _shape_fields(config: ModelConfig) -> dict:
    """The SHAPE_FIELDS that shape this model's parameters (max_position_embeddings not under RoPE)."""
    return {k: getattr(config, k) for k in SHAPE_FIELDS if k != "max_position_embeddings" or not config.rope}


def describe_shape_difference(stored: ModelConfig, config: ModelConfig) -> str:
    """Each parameter-shape field on which the two models differ, both sides; empty when they have the same."""
    theirs, ours = _shape_fields(stored), _shape_fields(config)
    return "; ".join(f"{k}: checkpoint {theirs[k]}, this run {ours[k]}" for k in ours
                     if k in theirs and ours[k] != theirs[k])


# --- What each file must hold, from the config alone (no weights built: a check before any process group) ----------

def rank_parameter_shapes(config: ModelConfig, tp_size: int, stage_layers: Sequence[Sequence[int]],
                          pp_rank: int) -> dict[str, tuple[int, ...]]:
    """What the model file of any TP rank of pipeline stage ``pp_rank`` holds: that stage's parameters
    (``stage_layers``: each stage's global layer numbers) with their TP-sharded shapes."""
    shapes = {}
    for name, shape in model_parameter_shapes(config).items():
        if pp_rank in stages_of_name(name, stage_layers, config.tied_output):
            spec = partition_spec(name, config)
            if spec is not None:  # split along one dimension (strided blocks each split alike: same total)
                dim = spec[0]
                shape = shape[:dim] + (shape[dim] // tp_size,) + shape[dim + 1:]
            shapes[name] = shape
    return shapes


def state_dict_shapes(state_dict: dict) -> dict[str, tuple[int, ...] | None]:
    """Name -> shape of each tensor of ``state_dict``; None for a value that is not a tensor."""
    return {name: tuple(t.shape) if isinstance(t, torch.Tensor) else None for name, t in state_dict.items()}


def first_tensor_difference(shapes: dict[str, tuple[int, ...] | None],
                            expected: dict[str, tuple[int, ...]]) -> str | None:
    """The first way a checkpoint's tensors (``shapes``: name -> shape, None for a value that is no tensor) differ
    from ``expected`` (name -> shape), in words ('parameter X has shape (a, b) in the checkpoint, the model built
    from the flags has (c, d)'); None when they agree. A name only one side has is a difference too."""
    for name, want in expected.items():
        if name not in shapes:
            return f"it lacks parameter {name}, which the model built from the flags has (shape {want})"
        if shapes[name] is None:
            return f"parameter {name} is not a tensor"
        if shapes[name] != want:
            return (f"parameter {name} has shape {shapes[name]} in the checkpoint, the model built from the flags "
                    f"has {want}")
    extra = next((name for name in shapes if name not in expected), None)
    if extra is not None:
        return f"it holds parameter {str(extra)[:100]}, which the model built from the flags lacks"
    return None


def model_config_from(fields: object, where: str, tp_size: int = 1) -> ModelConfig:
    """The ModelConfig a checkpoint records (``fields``: its ``model_config``), each field of its declared type and
    the whole valid at ``tp_size``; otherwise CheckpointError naming ``where`` and the field. Fields it lacks take
    their defaults (files written before a field existed)."""
    if not isinstance(fields, dict):
        raise CheckpointError(f"{where}: 'model_config' is {type_name(fields)}, not a mapping of model fields")
    declared = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    for name, value in fields.items():
        if name not in declared:
            raise CheckpointError(f"{where}: 'model_config' has an unknown field {str(name)[:40]!r}")
        if not has_declared_type(value, declared[name]):
            kind, _, optional = declared[name].partition(" | ")
            raise CheckpointError(f"{where}: model_config field {name!r} is {type_name(value)}, not {kind}"
                                  f"{' or null' if optional else ''}")
    try:
        config = ModelConfig(**fields)
        config.validate(tp_size)
    except (TypeError, ValueError) as e:  # ValueError: ModelConfigError
        raise CheckpointError(f"{where}: its model_config is not a valid model ({' '.join(str(e).split())})") from None
    return config


def _load(path: Path, mmap: bool = False) -> dict:
    """A model file, weights-only (refused if its pickle needs more), checked to hold our layout."""
    state = safe_torch_load(path, mmap=mmap)
    meta = state.get(META_KEY) if isinstance(state, dict) else None
    if not isinstance(meta, dict) or not isinstance(state.get("module"), dict):
        raise CheckpointError(f"{path} is not a codegeex_train model file: it lacks the 'module' state dict or "
                              f"the {META_KEY!r} metadata (convert other checkpoints with tools/convert_checkpoint.py)")
    for k in ("tp_size", "pp_size", "iteration"):
        value = meta.get(k)
        if type(value) is not int or value < (k != "iteration"):
            raise CheckpointError(f"{path}: unreadable {META_KEY!r} metadata ({k} is {type_name(value)}; "
                                  f"tp_size, pp_size >= 1 and iteration >= 0 must be integers)")
    chunks = meta.get("num_chunks", 1)
    if type(chunks) is not int or chunks < 1:
        raise CheckpointError(f"{path}: unreadable {META_KEY!r} metadata (num_chunks is {type_name(chunks)}; it "
                              f"must be an integer >= 1)")
    model_config_from(meta.get("model_config"), f"{path}: {META_KEY!r} metadata", meta["tp_size"])  # as when saved
    return state


def read_model_file(path: str | os.PathLike) -> dict:
    """A model file's whole state, memory-mapped (its pickle read, not its tensors' data), checked to hold our
    layout (``module``, the metadata)."""
    return _load(Path(path), mmap=True)


def saved_num_chunks(meta: dict) -> int:
    """v of the run that saved ``meta`` (1: plain 1F1B, or saved before interleaving existed)."""
    return meta.get("num_chunks", 1)


def read_checkpoint_meta(directory: str | os.PathLike) -> tuple[str, dict]:
    """(tag, metadata) of the latest checkpoint, from its MP rank 0 file."""
    tag = read_latest(directory)
    check_tag_dir(directory, tag)
    path = shard_file(directory, tag, 0, 1)
    if not path.is_file():
        raise CheckpointError(f"{directory}/latest names tag {tag!r} but {path} does not exist")
    return tag, _load(path, mmap=True)[META_KEY]  # mmap: reads the metadata, not every tensor


def _check_fits(directory, tag: str, meta: dict, config: ModelConfig, tp_size: int, pp_size: int) -> None:
    stored = ModelConfig(**meta["model_config"])
    ours, theirs = _shape_fields(config), _shape_fields(stored)
    if (theirs, meta["tp_size"], meta["pp_size"]) == (ours, tp_size, pp_size):
        for name in FUNCTION_FIELDS:  # same shapes, different maths: allowed (fine-tuning), but say so
            if getattr(stored, name) != getattr(config, name):
                warnings.warn(f"checkpoint {directory} was saved with {name}={getattr(stored, name)!r}; "
                              f"this run uses {getattr(config, name)!r}", stacklevel=3)
        return
    hint = ("; convert it with tools/convert_checkpoint.py --load DIR --save NEW_DIR --tensor-model-parallel-size N "
            "--pipeline-model-parallel-size M" if theirs == ours else "")
    raise CheckpointError(f"checkpoint {directory} ({tag}) has {_describe(theirs, meta['tp_size'], meta['pp_size'])}; "
                          f"this run has {_describe(ours, tp_size, pp_size)}{hint}")


def load_model_shard(directory: str | os.PathLike, config: ModelConfig, tp_size: int, tp_rank: int, *,
                     pp_size: int = 1, pp_rank: int = 0) -> tuple[dict, dict]:
    """This rank's (state_dict, metadata) from the latest checkpoint, after checking that its model shape
    and TP/PP sizes equal this run's; the error names both."""
    tag = read_latest(directory)
    check_tag_dir(directory, tag)
    path = shard_file(directory, tag, tp_rank, tp_size, pp_rank)
    if not path.is_file():  # saved with fewer model-parallel ranks: explain with rank 0's metadata
        _check_fits(directory, tag, read_checkpoint_meta(directory)[1], config, tp_size, pp_size)
        raise CheckpointError(f"{path} does not exist")
    state = _load(path)  # every shard carries the metadata: one read per rank
    _check_fits(directory, tag, state[META_KEY], config, tp_size, pp_size)
    return state["module"], state[META_KEY]


def load_model_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, *, pp_size: int = 1,
                          pp_rank: int = 0) -> dict:
    """Load the latest checkpoint into ``model`` (a CodeGeeXModel stage, strict); returns the metadata."""
    sd, meta = load_model_shard(directory, model.config, model.tp_size, model.tp_rank, pp_size=pp_size,
                                pp_rank=pp_rank)
    model.load_state_dict(sd)
    return meta


def load_full_state_dict(directory: str | os.PathLike) -> tuple[dict, ModelConfig, dict]:
    """(TP=1 state dict, config, metadata) of the latest checkpoint, at whatever TP/PP it was saved."""
    tag, meta = read_checkpoint_meta(directory)
    config = ModelConfig(**meta["model_config"])
    tp, pp = meta["tp_size"], meta["pp_size"]
    full: dict = {}
    for pp_rank in range(pp):
        shards = [_load(shard_file(directory, tag, r, tp, pp_rank))["module"] for r in range(tp)]
        # Stages' names are global and disjoint, except the tied word table (first and last stage): keep one.
        full.update({k: v for k, v in merge_state_dicts(shards, config).items() if k not in full})
    return full, config, meta
