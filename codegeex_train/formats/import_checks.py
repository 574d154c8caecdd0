"""What an import (--from-hf, --from-codegeex) checks before it writes anything, in this order:

1. ``check_field_types``: the source config's fields have their types (a bool is no int, 2.0 no int, "2" no number);
2. ``check_fits_files``: the config's tensor count (from a one- and a two-layer model) is at most what the weight
   files hold, and no dimension is larger than all their values together: nothing the size of the config (a hidden
   size of 2**40, 10**9 layers) is listed or allocated;
3. ``check_tensors``: every tensor the model needs is there, floating point (``WEIGHT_DTYPES``) and of the shape the
   config implies (a transposed QKV, a LayerNorm of the wrong width), then every value is finite (read in chunks).

Each refusal is one CheckpointError naming the file, the field or tensor, what was expected and what was found.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from codegeex_train.config.options import has_declared_type
from codegeex_train.model.shapes import model_parameter_shapes
from codegeex_train.checkpoint.safe_load import CheckpointError
from codegeex_train.config.model_config import ModelConfig

# What training and generation load weights as; an integer (or float8, complex) table would be cast, not kept.
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_EXPECTED = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}
_FINITE_CHUNK = 1 << 24  # elements checked at a time: a bool mask of 16 MiB, whatever the tensor's size


def _shown(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def check_field_types(fields: Mapping, declared: Mapping[str, str], where: str) -> None:
    """Each field of ``declared`` (name -> 'int', 'float | None', ...: a dataclass field's type) that ``fields``
    holds is of that type."""
    for name, kind in declared.items():
        if name in fields and not has_declared_type(fields[name], kind):
            base, _, optional = kind.partition(" | ")
            raise CheckpointError(f"{where}: field {name!r} is {_shown(fields[name])}; expected {_EXPECTED[base]}"
                                  f"{' or null' if optional else ''}")


def _tensor_count(config: ModelConfig) -> int:
    """How many tensors the whole model has, from models of one and two layers (nothing per layer is listed)."""
    one, two = (len(model_parameter_shapes(dataclasses.replace(config, num_layers=n))) for n in (1, 2))
    return one + (config.num_layers - 1) * (two - one)


# The config fields that size a tensor, each bounded by what the files hold.
SIZE_FIELDS = ("hidden_size", "ffn_hidden_size", "vocab_size", "max_position_embeddings")


def check_fits_files(config: ModelConfig, tensors: Mapping[str, object], where: str,
                     field_names: Mapping[str, str] | None = None) -> None:
    """Refuse a config that implies more tensors than ``tensors`` (the files' tensors, mapped: their shapes come from
    the headers) hold, or a dimension larger than all their values together: what is left to check
    (``check_tensors``) then lists no more names than the files hold and allocates nothing. ``field_names``: the
    source config's names of our fields, for messages."""
    names = field_names or {}
    have_values = sum(t.numel() for t in tensors.values() if isinstance(t, torch.Tensor))
    count = _tensor_count(config)
    if count > len(tensors):
        raise CheckpointError(f"{where}: {names.get('num_layers', 'num_layers')} {config.num_layers:,} implies "
                              f"{count:,} tensors; the weight files hold {len(tensors):,}: refused before listing them")
    for field in SIZE_FIELDS:
        value = getattr(config, field)
        if value > have_values:
            raise CheckpointError(f"{where}: {names.get(field, field)} {value:,} is more than all the weight files' "
                                  f"values together ({have_values:,}): refused before allocating anything")


def check_tensors(tensors: Mapping[str, object], expected: Mapping[str, tuple[int, ...]],
                  file_of: Callable[[str], object], implied_by: str, flag: str) -> None:
    """Every name of ``expected`` is in ``tensors``, a tensor of a ``WEIGHT_DTYPES`` dtype and of the expected shape
    (``implied_by``: what implies it, e.g. the config file); then every value is finite. ``file_of(name)``: the
    file that holds the tensor; ``flag``: what messages start with. Names ``expected`` lacks are the callers'."""
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{flag}: {implied_by} implies a tensor {name} of shape {shape}, which the weight "
                                  f"files lack")
        t = tensors[name]
        where = f"{flag}: {file_of(name)}: tensor {name}"
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{where} is a {type(t).__name__}, not a tensor")
        if t.dtype not in WEIGHT_DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in WEIGHT_DTYPES)
            raise CheckpointError(f"{where} is {str(t.dtype).removeprefix('torch.')}; weights must be floating "
                                  f"point ({allowed})")
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{where} has shape {tuple(t.shape)}; {implied_by} implies {tuple(shape)}")
    for name in expected:  # only once every shape is right: this reads the data
        t = tensors[name]
        if not all(bool(torch.isfinite(chunk).all()) for chunk in _chunks(t)):
            bad = sum(int((~torch.isfinite(chunk)).sum()) for chunk in _chunks(t))
            raise CheckpointError(f"{flag}: {file_of(name)}: tensor {name} holds {bad:,} non-finite value(s) (NaN "
                                  f"or inf) of {t.numel():,}: refused")


def _chunks(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``t`` in pieces of about ``_FINITE_CHUNK`` elements, none copied (a view of another layout: by rows)."""
    if t.is_contiguous():
        return t.reshape(-1).split(_FINITE_CHUNK)
    return t.split(max(1, _FINITE_CHUNK * t.shape[0] // t.numel()))
