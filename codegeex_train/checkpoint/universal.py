"""A layout-free ("universal") training checkpoint: resume at any (TP, PP, DP) the model allows.

A training checkpoint is cut three ways: the model by TP rank and pipeline stage (``mp_rank_XX`` files), and
DeepSpeed ZeRO-2's fp32 master weights and Adam moments by DP rank as well (``zero_pp_rank_D_mp_rank_XX``
files, each a slice of one flat buffer per parameter group). ``to_universal`` undoes all three cuts:

1. per model-parallel rank, concatenate the DP ranks' fragments of each parameter in DP order (the optimizer
   file's ``param_slice_mappings`` say where each named parameter's fragment lies in that rank's slice), and
   reshape to the parameter's shape (``param_shapes`` of the model file);
2. per stage, merge the TP shards with the same name table as the model weights (``checkpoint/sharding.py``: which
   dimension, fused Q/K/V and K/V blocks as strided blocks, the padded vocabulary rows);
3. join the stages; the last stage's tied copy of the word table is dropped after checking that it equals the
   first stage's (the shared-embedding gradient sum keeps their weights and moments identical).

The result, in ``<dir>/<tag>/``: ``fp32.safetensors``, ``exp_avg.safetensors``, ``exp_avg_sq.safetensors``
(full tensors under the TP = PP = 1 model's names) and ``universal.json`` (model config, Adam's step count,
the LR schedule, iteration, consumed samples, the source layout, the tokenizer settings when the source records
them). Resuming from it (``--load`` detects it): weights are split for this run's layout and loaded before
``deepspeed.initialize`` (so ZeRO builds its fp32 masters from them, exactly), then each parameter's moments are
written into its ZeRO partition with ``safe_set_full_optimizer_state``, Adam's step count into every parameter
group, and the LR schedule and counters restored. Random-number streams start afresh from ``--seed``: dropout masks
depend on the layout.

Hyper-parameters (betas, weight decay, clipping) come from the resuming run's flags, as do batch sizes; the
global batch size must stay the same for the data order and LR schedule to continue exactly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections import defaultdict
from pathlib import Path

import torch

from codegeex_train.checkpoint.deepspeed_files import ZERO_FILE, check_model_states, check_zero_partition
from codegeex_train.checkpoint.files import (
    CheckpointError,
    model_config_from,
    read_checkpoint_meta,
    read_latest,
    type_name,
    write_latest,
)
from codegeex_train.checkpoint.safe_load import check_tag_dir, checkpoint_files, file_kind, open_regular, safe_torch_load
from codegeex_train.checkpoint.sharding import merge_state_dicts, split_model_parallel
from codegeex_train.checkpoint.train_state import TrainState
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.layout.dims import model_parallel_rank

UNIVERSAL_META = "universal.json"
STATES = ("fp32", "exp_avg", "exp_avg_sq")
FORMAT = "codegeex_train-universal/1"
MAX_META_BYTES = 1 << 20  # universal.json is a few kB; a larger one is not ours and is not read


def is_universal(load_dir: str | os.PathLike, tag: str) -> bool:
    """Whether ``load_dir/tag`` holds a ``universal.json`` entry (of any kind: ``read_universal_meta`` checks it)."""
    return os.path.lexists(Path(load_dir) / tag / UNIVERSAL_META)


def _load(path: Path) -> dict:
    return safe_torch_load(path)  # weights-only: DeepSpeed's few plain types allow-listed, nothing run


def _optim_files(tag_dir: Path, mp_rank: int) -> list[Path]:
    found = sorted((int(m.group(1)), p) for p in tag_dir.iterdir()
                   if (m := ZERO_FILE.match(p.name)) and int(m.group(2)) == mp_rank)
    if not found or [d for d, _ in found] != list(range(len(found))):
        raise CheckpointError(f"{tag_dir}: ZeRO optimizer files of model-parallel rank {mp_rank} are missing or "
                              f"incomplete (DP ranks found: {[d for d, _ in found]})")
    return [p for _, p in found]


def _model_file(tag_dir: Path, mp_rank: int) -> tuple[Path, dict]:
    path = tag_dir / f"mp_rank_{mp_rank:02d}_model_states.pt"
    state = _load(path)
    check_model_states(path, state)
    return path, state


def _mp_rank_states(tag_dir: Path, mp_rank: int) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """{state: {name: tensor}} of one model-parallel rank, its DP slices joined; and Adam's step count."""
    path, model_file = _model_file(tag_dir, mp_rank)
    shapes = check_model_states(path, model_file)
    fragments: dict[str, dict[str, list[torch.Tensor]]] = {s: defaultdict(list) for s in STATES}
    steps = set()
    for path in _optim_files(tag_dir, mp_rank):  # DP order: each rank holds the next slice of every group
        osd = check_zero_partition(path, _load(path), adam=True)
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            flat = {"fp32": osd["single_partition_of_fp32_groups"][g]}
            adam = osd["base_optimizer_state"]["state"][g]
            if "step" in adam:
                steps.add(int(adam["step"]))
            for state in STATES[1:]:
                flat[state] = adam[state]
            for name, address in mapping.items():
                for state, tensor in flat.items():
                    fragments[state][name].append(tensor.narrow(0, address.start, address.numel))
    if len(steps) != 1:
        raise CheckpointError(f"{tag_dir}: Adam step counts {sorted(steps)} differ between parameter groups")
    out: dict[str, dict[str, torch.Tensor]] = {s: {} for s in STATES}
    for group in shapes:
        for name, shape in group.items():
            for state in STATES:
                flat = torch.cat(fragments[state][name]) if fragments[state][name] else torch.empty(0)
                if flat.numel() != shape.numel():
                    raise CheckpointError(f"{tag_dir}: {name} has {flat.numel()} {state} values across the DP "
                                          f"ranks, expected {shape.numel()} for shape {tuple(shape)}")
                out[state][name] = flat.view(shape).clone()
    return out, steps.pop()


def to_universal(load_dir: str | os.PathLike, save_dir: str | os.PathLike) -> str:
    """Convert ``load_dir``'s latest training checkpoint (any TP, PP, DP) to a universal one in ``save_dir``;
    returns the tag."""
    from safetensors.torch import save_file

    if is_universal(load_dir, read_latest(load_dir)):
        raise CheckpointError(f"{load_dir} is already a universal checkpoint: --load it at any layout as it is")
    tag, meta = read_checkpoint_meta(load_dir)
    tag_dir = check_tag_dir(load_dir, tag)
    checkpoint_files(tag_dir)  # no link, FIFO or device among the *.pt entries: each is a regular file
    if not isinstance(meta.get("train_state"), dict):
        raise CheckpointError(f"{tag_dir} holds model weights only (no optimizer state to convert): load it "
                              f"with --load as it is")
    config = ModelConfig(**meta["model_config"])
    tp, pp = meta["tp_size"], meta["pp_size"]
    full: dict[str, dict[str, torch.Tensor]] = {s: {} for s in STATES}
    steps = set()
    for pp_rank in range(pp):
        shards = []
        for tp_rank in range(tp):
            states, step = _mp_rank_states(tag_dir, model_parallel_rank(tp_rank, pp_rank, tp))
            shards.append(states)
            steps.add(step)
        for state in STATES:
            merged = merge_state_dicts([s[state] for s in shards], config)
            for name, tensor in merged.items():
                if name in full[state]:  # the tied word table: the last stage's copy must equal the first's
                    if not torch.equal(full[state][name], tensor):
                        raise CheckpointError(f"{tag_dir}: the last stage's copy of {name} ({state}) differs from "
                                              f"the first stage's: the tied embedding was out of sync")
                    continue
                full[state][name] = tensor
    if len(steps) != 1:
        raise CheckpointError(f"{tag_dir}: Adam step counts {sorted(steps)} differ between ranks")
    model_file = _model_file(tag_dir, 0)[1]
    dp = len(_optim_files(tag_dir, 0))
    train_state = {k: v for k, v in meta["train_state"].items() if k != "rng"}  # RNG streams are per layout
    universal = {
        "format": FORMAT, "model_config": meta["model_config"], "iteration": meta["iteration"],
        "train_state": train_state, "adam_step": steps.pop(), "lr_scheduler": model_file["lr_scheduler"],
        "global_steps": model_file["global_steps"], "global_samples": model_file["global_samples"],
        "skipped_steps": model_file["skipped_steps"], "source_layout": {"tp": tp, "pp": pp, "dp": dp},
    }
    if "tokenizer" in meta:
        universal["tokenizer"] = meta["tokenizer"]
    out = Path(save_dir) / tag
    out.mkdir(parents=True, exist_ok=True)
    for state in STATES:
        save_file({k: v.contiguous() for k, v in full[state].items()}, str(out / f"{state}.safetensors"))
    (out / UNIVERSAL_META).write_text(json.dumps(universal, indent=1) + "\n")  # last: marks the tag complete
    write_latest(save_dir, tag)
    return tag


def _integer(minimum: int):
    return (lambda v: type(v) is int and v >= minimum), f"an integer >= {minimum}"


def _optional(check):
    ok, what = check
    return (lambda v: v is None or ok(v)), f"{what} or null"


_NUMBER = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)), "a number"
_STRING = (lambda v: isinstance(v, str)), "a string"
_MAPPING = (lambda v: isinstance(v, dict)), "an object"
# Each key of universal.json (as to_universal writes it) and what it must hold; nested objects by their own table.
_LR_SCHEDULER = {"num_steps": _integer(0), "max_lr": _NUMBER, "min_lr": _NUMBER, "decay_iters": _integer(0),
                 "warmup_iters": _integer(0), "style": _STRING}
_TRAIN_STATE = {"iteration": _integer(0), "consumed_train_samples": _integer(0), "wandb_run_id": _optional(_STRING)}
_SOURCE_LAYOUT = {"tp": _integer(1), "pp": _integer(1), "dp": _integer(1)}
_TOKENIZER = {"tokenizer_type": _optional(_STRING), "tokenizer_model": _optional(_STRING),
              "vocab_file": _optional(_STRING), "merge_file": _optional(_STRING),
              "whitespace_encoding": ((lambda v: isinstance(v, bool)), "true or false")}
_UNIVERSAL = {"format": _STRING, "model_config": _MAPPING, "iteration": _integer(0), "train_state": _TRAIN_STATE,
              "adam_step": _integer(0), "lr_scheduler": _LR_SCHEDULER, "global_steps": _integer(0),
              "global_samples": _integer(0), "skipped_steps": _integer(0), "source_layout": _SOURCE_LAYOUT}
_OPTIONAL = {"tokenizer": _TOKENIZER}
# Keys of nested objects that older universal checkpoints lack.
_NESTED_OPTIONAL = {"train_state": {"run_id": _STRING}, "lr_scheduler": {"global_batch_size": _integer(1)},
                    "tokenizer": {"fingerprint": _STRING, "vocab_size": _integer(1), "fim_rate": _NUMBER,
                                  "fim_spm_rate": _NUMBER, "fim_split_sample": _optional(_STRING),
                                  "fim_fragment_rate": _optional(_NUMBER)}}


def _check_object(path: Path, where: str, value: object, table: dict, optional: dict | None = None) -> None:
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: {where or 'the file'} is {type_name(value)}, not a JSON object")
    optional = optional or {}
    missing = [k for k in table if k not in value]
    extra = [str(k)[:40] for k in value if k not in table and k not in optional]
    if missing or extra:
        what = "; ".join(part for part in (missing and f"lacks {', '.join(map(repr, missing))}",
                                           extra and f"has unknown keys {', '.join(map(repr, extra))}") if part)
        raise CheckpointError(f"{path}: {where or 'the file'} {what}")
    for key, rule in {**table, **optional}.items():
        if key not in value:
            continue
        name = f"{where}.{key}" if where else key
        if isinstance(rule, dict):
            _check_object(path, name, value[key], rule, _NESTED_OPTIONAL.get(key))
            continue
        ok, what = rule
        if not ok(value[key]):
            raise CheckpointError(f"{path}: {name!r} is {type_name(value[key])}, not {what}")


def read_universal_meta(load_dir: str | os.PathLike, tag: str) -> dict:
    """``universal.json`` of ``load_dir/tag``, checked: a regular file (not a link) of at most ``MAX_META_BYTES``,
    valid JSON, exactly the keys ``to_universal`` writes, each of its type, a valid model. Anything else raises
    CheckpointError naming the file and the key (never its value)."""
    path = Path(load_dir) / tag / UNIVERSAL_META
    fd = open_regular(path, follow_symlinks=False)
    try:
        data = os.read(fd, MAX_META_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_META_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_META_BYTES} bytes: not a universal checkpoint's metadata")
    try:
        meta = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not UTF-8 text: not a universal checkpoint's metadata") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if isinstance(meta, dict) and "format" in meta and meta["format"] != FORMAT:
        shown = repr(meta["format"][:40]) if isinstance(meta["format"], str) else type_name(meta["format"])
        raise CheckpointError(f"{Path(load_dir) / tag}: unknown universal checkpoint format {shown} (this version "
                              f"reads {FORMAT!r})")
    _check_object(path, "", meta, _UNIVERSAL, _OPTIONAL)
    model_config_from(meta["model_config"], str(path))
    for state in STATES:  # the tensors' files: regular files of their own (safetensors maps them)
        tensors = path.parent / f"{state}.safetensors"
        try:
            mode = os.lstat(tensors).st_mode
        except OSError:
            raise CheckpointError(f"{path.parent}: {tensors.name} is missing (a universal checkpoint holds "
                                  f"{', '.join(s + '.safetensors' for s in STATES)})") from None
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{tensors} is {file_kind(mode)}, not a regular file: not read")
    return meta


def check_universal_tensors(load_dir: str | os.PathLike, tag: str) -> None:
    """Before any rank loads them: the three safetensors files parse (their headers only) and hold the same names
    with the same shapes. CheckpointError naming the file otherwise."""
    from safetensors import safe_open

    tag_dir = Path(load_dir) / tag
    layouts = {}
    for state in STATES:
        path = tag_dir / f"{state}.safetensors"
        try:
            with safe_open(str(path), framework="pt") as f:
                layouts[state] = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError, OSError: a crafted or damaged file
            raise CheckpointError(f"{path} is not a readable safetensors file ({' '.join(str(e).split())[:200]})") \
                from None
    for state in STATES[1:]:
        if layouts[state] != layouts["fp32"]:
            differ = sorted(set(layouts[state].items()) ^ set(layouts["fp32"].items()))[:1]
            raise CheckpointError(f"{tag_dir}: {state}.safetensors and fp32.safetensors hold different tensors (e.g. "
                                  f"{differ[0][0][:80]}): not one universal checkpoint")


def _stage_shard(load_dir, tag, state: str, config: ModelConfig, tp_size: int, tp_rank: int, pp_rank: int,
                 stage_layers: list[range]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    full = load_file(str(Path(load_dir) / tag / f"{state}.safetensors"))
    return split_model_parallel(full, config, tp_size, stage_layers)[model_parallel_rank(tp_rank, pp_rank, tp_size)]


def load_universal_weights(model: torch.nn.Module, load_dir, tag: str, *, pp_rank: int,
                           stage_layers: list[range]) -> None:
    """Before ``deepspeed.initialize``: this rank's slice of the fp32 weights into ``model`` (strict)."""
    model.load_state_dict(_stage_shard(load_dir, tag, "fp32", model.config, model.tp_size, model.tp_rank, pp_rank,
                                       stage_layers))


def _create_adam_state(zero, step: int) -> None:
    """Give ZeRO-2's wrapped AdamW the state it would hold after ``step`` steps (moments zero until set), and
    link each parameter's fragment to it. DeepSpeed (0.19.8) creates both lazily at the first step, so before it
    ``safe_set_full_optimizer_state`` has nothing to write into; these are the same calls its step makes."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    if not hasattr(zero, "single_partition_of_fp32_groups") or not hasattr(zero, "bit16_groups"):
        raise CheckpointError(f"a universal checkpoint resumes under DeepSpeed ZeRO stage 1 or 2 only (the engine's "
                              f"optimizer is {type(zero).__name__})")
    adam = zero.optimizer
    for flat in zero.single_partition_of_fp32_groups:
        adam.state[flat] = {"step": torch.tensor(float(step)), "exp_avg": torch.zeros_like(flat),
                            "exp_avg_sq": torch.zeros_like(flat)}
    for lp_params, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups):
        lazy_init_hp_params_optimizer_state(lp_params, flat, adam.state)
    zero._hp_optimizer_states_linked = True


def load_universal_training_state(engine, load_dir, tag: str, *, pp_rank: int, stage_layers: list[range],
                                  load_optimizer_states: bool = True):
    """After ``deepspeed.initialize``: Adam moments and step (unless ``load_optimizer_states`` is False:
    --no-load-optim), LR schedule, counters. Returns the TrainState."""
    from deepspeed.utils import safe_set_full_optimizer_state

    meta = read_universal_meta(load_dir, tag)
    model = engine.module
    if load_optimizer_states:
        _create_adam_state(engine.optimizer, meta["adam_step"])
        for state in STATES[1:]:
            shard = _stage_shard(load_dir, tag, state, model.config, model.tp_size, model.tp_rank, pp_rank,
                                 stage_layers)
            for name, param in model.named_parameters():
                safe_set_full_optimizer_state(param, shard[name].to(param.device), state)
    engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    engine.global_steps, engine.global_samples = meta["global_steps"], meta["global_samples"]
    engine.skipped_steps = meta["skipped_steps"]
    fields = {f.name for f in dataclasses.fields(TrainState)}
    return TrainState(**{k: v for k, v in meta["train_state"].items() if k in fields})

