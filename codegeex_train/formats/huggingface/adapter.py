"""Hugging Face <-> our checkpoint: the adapter behind --to-hf / --from-hf. Every model this stack trains exports,
as the first of these it is:

    Llama-shaped (RMSNorm, SwiGLU)     LlamaForCausalLM, or MistralForCausalLM with a window (llama.py)
    Qwen2-shaped (+ Q, K, V biases)    Qwen2ForCausalLM (qwen2.py)
    StarCoder2-shaped                  Starcoder2ForCausalLM (LayerNorm, GeLU-tanh, RoPE; starcoder2.py)
    GPT-2-shaped (``is_gpt2_shaped``)  a plain ``GPT2LMHeadModel`` (gpt2.py's names)
    any other without the new options  CodeGeeX remote code (codegeex.py, remote/): config.json with auto_map and
                                       the two module files beside it; load with trust_remote_code=True

All but the last are transformers' own classes (no remote code); the three families share native.py's tensor map.
A model with an architecture option none of them has (RMSNorm with GeLU, say) is refused in one line. The class is
decided from the architecture alone (a checkpoint records no source class): the rules above never overlap.

An export directory holds config.json (the class's own config: RoPE fields and scaling, window, norm epsilon, bias
switches, tying), generation_config.json (eos = the tokenizer's eod, greedy), the tokenizer files (tokenizer.py:
a family's directory recorded at import is copied as it is, with its bos and pad; otherwise ours are written) and
the safetensors weights (files.py: one file, or shards and an index), in the dtype training saved. It streams: the
rank files are mapped and each tensor is merged, converted and added to the shard being filled, which is written
when full (peak memory: about one shard, not the model twice). It is written into a temporary directory beside the
target and renamed into place at the end: a crash never leaves a partial export under the final name.

--from-hf reads each kind back (config.json's model_type: gpt2, codegeex, llama, mistral, qwen2, starcoder2), at
any TP / PP, streaming too (each of our tensors is built from the mapped files when its rank file is written), and
records the directory's tokenizer (its files copied beside the checkpoint) so that training and tools/generate.py
use it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from codegeex_train.checkpoint.convert import Layout, open_full_tensors, save_at_layout
from codegeex_train.checkpoint.files import CheckpointError, checkpoint_tokenizer, describe_tokenizer
from codegeex_train.formats.huggingface.codegeex import CONFIG_FIELD_TYPES as CODEGEEX_CONFIG_FIELD_TYPES
from codegeex_train.formats.huggingface.codegeex import (
    config_from_hf_codegeex,
    copy_remote_code,
    hf_codegeex_config,
    hf_codegeex_shapes,
    hf_codegeex_to_full,
    is_gpt2_shaped,
    to_hf_tensor,
)
from codegeex_train.formats.huggingface.files import ShardWriter, hf_weight_files, read_hf_tensors, read_json_object
from codegeex_train.formats.huggingface.gpt2 import CONFIG_FIELD_TYPES as GPT2_CONFIG_FIELD_TYPES
from codegeex_train.formats.huggingface.gpt2 import FIELD_NAMES as GPT2_FIELD_NAMES
from codegeex_train.formats.huggingface.gpt2 import (
    LAYER_MAP,
    config_from_hf_gpt2,
    hf_gpt2_config,
    hf_gpt2_shapes,
    hf_gpt2_to_full,
)
from codegeex_train.formats.huggingface.llama import FAMILY as LLAMA
from codegeex_train.formats.huggingface.native import (
    DECODER_FIELD_TYPES,
    FIELD_NAMES,
    Family,
    hf_shapes,
    ignored,
    import_source,
    tensor_exporter,
)
from codegeex_train.formats.huggingface.qwen2 import FAMILY as QWEN2
from codegeex_train.formats.huggingface.starcoder2 import FAMILY as STARCODER2
from codegeex_train.formats.import_checks import check_field_types, check_fits_files, check_tensors
from codegeex_train.checkpoint.safe_load import verify_files
from codegeex_train.config.arguments import DataConfig
from codegeex_train.config.model_config import ModelConfig

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
MAX_CONFIG_BYTES = 1 << 20
FAMILIES: tuple[Family, ...] = (LLAMA, QWEN2, STARCODER2)
FAMILY_OF_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}
MODEL_TYPES = ("gpt2", "codegeex", *FAMILY_OF_MODEL_TYPE)


def export_class(config: ModelConfig) -> tuple[Family | None, str]:
    """(family or None, transformers class name) ``--to-hf`` writes a model of ``config`` as: a family's native
    class, else GPT2LMHeadModel or CodeGeeX remote code; CheckpointError for an architecture none of them has."""
    for family in FAMILIES:
        architecture = family.architecture(config)
        if architecture is not None:
            return family, architecture
    new = {"--normalization RMSNorm": config.normalization != "LayerNorm", "--swiglu": config.swiglu,
           "--group-query-attention": config.group_query_attention,
           "--untie-embeddings-and-output-weights": not config.tied_output,
           "--disable-bias-linear": config.disable_bias_linear, f"--rope-scaling {config.rope_scaling}":
           config.rope_scaling != "none", "--window-size": config.window_size is not None}
    used = [flag for flag, on in new.items() if on]
    if used:
        raise CheckpointError(f"--to-hf: no class --to-hf writes has this architecture ({', '.join(used)} with "
                              f"normalization {config.normalization}, swiglu {config.swiglu}, activation "
                              f"{config.activation}, qkv bias {config.qkv_bias}, other biases {config.linear_bias}, "
                              f"position embedding {config.position_embedding_type}, top query layer "
                              f"{config.top_query_layer}): Llama (RMSNorm, SwiGLU, all biases or none), Qwen2 "
                              f"(RMSNorm, SwiGLU, Q/K/V biases only), StarCoder2 (LayerNorm, gelu_tanh), each with "
                              f"whole-head non-interleaved RoPE and no top query layer")
    return None, "GPT2LMHeadModel" if is_gpt2_shaped(config) else "CodeGeeXForCausalLM"


def _gpt2_tensors(name: str, tensor: torch.Tensor, config: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """One of our TP=1 tensors -> GPT2LMHeadModel's (name, tensor): hf_gpt2.py's map, one tensor at a time; the
    word table trimmed to the vocabulary, Conv1D weights (in, out); lm_head left out (tied, as save_pretrained)."""
    if name == "word_embeddings.weight":
        return [("transformer.wte.weight", tensor[: config.vocab_size])]
    if name == "position_embeddings.weight":
        return [("transformer.wpe.weight", tensor)]
    if name.startswith("final_layernorm."):
        return [("transformer.ln_f." + name.removeprefix("final_layernorm."), tensor)]
    _, layer, rest = name.split(".", 2)  # layers.{i}.<ours>
    theirs, conv1d = next((t, c) for ours, t, c in LAYER_MAP if ours == rest)
    return [(f"transformer.h.{layer}.{theirs}", tensor.t() if conv1d else tensor)]


def _prepare_target(hf_dir: Path) -> Path:
    """A fresh temporary directory beside ``hf_dir`` (the target must not exist, or be an empty directory)."""
    if hf_dir.exists() and not (hf_dir.is_dir() and not any(hf_dir.iterdir())):
        raise CheckpointError(f"--to-hf {hf_dir}: already exists; an export writes a new directory (remove it or "
                              f"choose another name)")
    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{hf_dir.name}.partial-", dir=hf_dir.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would outlive the rename
    return tmp


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_tokenizer(load_dir: str, meta: dict, config: ModelConfig, tokenizer_flags: dict, out: Path,
                     family: Family | None) -> tuple:
    """The tokenizer files (the flags', else the recorded, else the shipped default): (special ids, a few words).
    A family's Hugging Face tokenizer directory (what --from-hf records) is copied as it is, with its own bos and
    pad; a named tokenizer of a family's model may have fewer ids than the model has rows (DeepSeek-Coder: 32,022
    ids, 32,256 rows). None are written for a checkpoint that records no tokenizer and does not fit the default's
    vocabulary, or for a tokenizer no tokenizer.json reproduces (SentencePiece): the model still exports, and the
    line says so."""
    from codegeex_train.formats.huggingface.tokenizer import (
        TOKENIZER_CONFIG,
        copy_hf_tokenizer,
        hf_special_ids,
        save_hf_tokenizer,
    )
    from codegeex_train.tokenization.tokenizer import TokenizerError, load_tokenizer

    settings, _ = checkpoint_tokenizer(load_dir, meta, tokenizer_flags)
    which = describe_tokenizer(settings)
    none = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": None}
    tokenizer = load_tokenizer(DataConfig(**{k: v for k, v in settings.items() if v is not None}))
    vocab = tokenizer.vocab_size
    named = any(tokenizer_flags.values()) or isinstance(meta.get("tokenizer"), dict)  # by the user or the run
    if vocab != config.vocab_size and not (family is not None and named and vocab < config.vocab_size):
        misfit = f"tokenizer {which} has {vocab} ids, the model {config.vocab_size}"
        if named:
            raise CheckpointError(f"--to-hf: {misfit}: pass the tokenizer flags training used")
        return none, f"none written ({misfit}; the checkpoint records none: pass the tokenizer flags training used)"
    directory = Path(settings.get("tokenizer_model") or "")
    if (family is not None and settings.get("tokenizer_type") == "HFTokenizer"
            and not settings.get("whitespace_encoding") and (directory / TOKENIZER_CONFIG).is_file()):
        copy_hf_tokenizer(directory, out)  # sentinels FIM training appended (DeepSeek-Coder's pad) are not in it
        return hf_special_ids(directory, tokenizer), f"{which} (its files copied)"
    try:
        return save_hf_tokenizer(settings, out, config.max_position_embeddings), which
    except TokenizerError as e:
        return none, f"none written ({' '.join(str(e).split())})"


def to_hf(load_dir: str, hf_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
          tokenizer_flags: dict | None = None) -> str:
    """Export ``load_dir``'s latest checkpoint (any TP / PP) into the new directory ``hf_dir``; returns what was
    written, in a few words. ``tokenizer_flags``: DataConfig's tokenizer fields given on the command line."""
    from tqdm import tqdm
    from transformers import GenerationConfig

    source = open_full_tensors(load_dir)
    config = source.config
    family, architecture = export_class(config)  # an architecture no class has: refused before anything is written
    gpt2 = architecture == "GPT2LMHeadModel"
    out = Path(hf_dir)
    tmp = _prepare_target(out)
    try:
        ids, tokenizer = _write_tokenizer(load_dir, source.meta, config, tokenizer_flags or {}, tmp, family)
        GenerationConfig(do_sample=False, **ids).save_pretrained(tmp)
        if family is not None:
            export = tensor_exporter(config)
            convert = lambda name, tensor, _: export(name, tensor)  # noqa: E731
        else:
            convert = _gpt2_tensors if gpt2 else to_hf_tensor
        writer = ShardWriter(tmp, max_shard_bytes)
        for name in tqdm(source.names, desc="--to-hf", unit="tensor", file=sys.stderr):
            for hf_name, tensor in convert(name, source.get(name), config):
                writer.add(hf_name, tensor)
                dtype = str(tensor.dtype).removeprefix("torch.")  # as training saved it
        written = writer.close()
        if family is not None or gpt2:
            hf_config = family.hf_config(config, architecture, ids) if family is not None else hf_gpt2_config(config)
            for key, value in {**ids, "dtype": dtype, "architectures": [architecture]}.items():
                setattr(hf_config, key, value)
            hf_config.save_pretrained(tmp)
        else:
            (tmp / "config.json").write_text(json.dumps({**hf_codegeex_config(config, **ids), "dtype": dtype},
                                                        indent=2) + "\n")
            copy_remote_code(tmp)
        os.rename(tmp, out)  # replaces an empty directory; never a partial export under the final name
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = len(list(out.glob("*.safetensors")))
    kind = architecture if family is not None or gpt2 else f"{architecture} (remote code: trust_remote_code=True)"
    size = f"{written / 1e9:.2f} GB" if written >= 1e9 else f"{written / 1e6:.1f} MB"
    return f"{kind}, {dtype}, {files} safetensors file{'s' if files > 1 else ''} ({size}), tokenizer: {tokenizer}"


def _read_config(hf_dir: str) -> dict:
    path = Path(hf_dir) / "config.json"
    d = read_json_object(path, MAX_CONFIG_BYTES)
    if d is None:
        raise CheckpointError(f"--from-hf: {path} is not a model config (a JSON object)")
    return d


def _gpt2_name(name: str) -> str:
    """GPT2LMHeadModel's name of a GPT-2 tensor (GPT2Model's lack "transformer.")."""
    return name if name.startswith("transformer.") or name == "lm_head.weight" else "transformer." + name


def _model_config(hf_dir: str, hf_config: dict, make_vocab_size_divisible_by: int) -> ModelConfig:
    """Our ModelConfig of config.json (``hf_config``), each field it names checked for its type first."""
    path = Path(hf_dir) / "config.json"
    model_type = hf_config.get("model_type")
    family = FAMILY_OF_MODEL_TYPE.get(model_type)
    if model_type == "gpt2" or family is not None:
        from transformers import AutoConfig

        check_field_types(hf_config, GPT2_CONFIG_FIELD_TYPES if family is None else
                          {**DECODER_FIELD_TYPES, **family.field_types}, f"--from-hf: {path}")
        try:  # transformers' own checks of the fields this import does not read; older files' RoPE fields read
            hf = AutoConfig.from_pretrained(hf_dir, local_files_only=True)  # into rope_parameters
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointError(f"--from-hf: {path}: transformers refuses it ({' '.join(str(e).split())})") from None
        if family is None:
            return config_from_hf_gpt2(hf, make_vocab_size_divisible_by)
        return family.config_from_hf(hf, make_vocab_size_divisible_by)
    if model_type == "codegeex":
        check_field_types(hf_config, CODEGEEX_CONFIG_FIELD_TYPES, f"--from-hf: {path}")
        try:
            return config_from_hf_codegeex(hf_config, make_vocab_size_divisible_by)
        except KeyError as e:
            raise CheckpointError(f"--from-hf: {path} lacks the CodeGeeX field {e}") from None
    raise CheckpointError(f"--from-hf {hf_dir}: model_type {str(model_type)[:40]!r} in config.json; this tool "
                          f"reads {', '.join(map(repr, MODEL_TYPES))} (GPT2LMHeadModel, CodeGeeX as --to-hf writes "
                          f"it, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Starcoder2ForCausalLM)")


def _native_source(hf_dir: str, tensors: dict, config: ModelConfig):
    """The streaming source of a family's mapped ``tensors``: refuses a tensor the config does not imply (a bias
    the config says is absent would otherwise be dropped unread)."""
    expected = hf_shapes(config)
    extra = next((name for name in tensors if name not in expected and not ignored(name, config)), None)
    if extra is not None:
        raise CheckpointError(f"--from-hf {hf_dir}: its weights hold {str(extra)[:100]}, which its config.json does "
                              f"not imply (a bias, or an untied lm_head, the config does not name?)")
    return import_source(tensors, config)


def from_hf(hf_dir: str, save_dir: str, layout: Layout, make_vocab_size_divisible_by: int) -> None:
    """A Hugging Face directory (``MODEL_TYPES``; sharded or not) -> our checkpoint at ``layout``, recording its
    tokenizer (its files copied into ``save_dir/tokenizer``) when it has one."""
    from codegeex_train.formats.huggingface.tokenizer import copy_hf_tokenizer, hf_tokenizer_settings

    config_path = Path(hf_dir) / "config.json"
    if not config_path.is_file():  # and never a Hub lookup of a mistyped path
        raise CheckpointError(f"--from-hf {hf_dir}: not a Hugging Face model directory (no config.json)")
    weight_files = hf_weight_files(hf_dir)  # before anything in it is opened (its config.json included)
    hf_config = _read_config(hf_dir)
    model_type = hf_config.get("model_type")
    gpt2, native = model_type == "gpt2", model_type in FAMILY_OF_MODEL_TYPE
    config = _model_config(hf_dir, hf_config, make_vocab_size_divisible_by)
    config.validate(layout.tp_size)  # a bad TP split fails before the weights are read
    verify_files(weight_files)  # pickled weights pass our weights-only check before anything else reads them
    tensors, sources = read_hf_tensors(hf_dir)  # mapped: shapes and dtypes known, no data read
    if gpt2:  # GPT2Model's names lack GPT2LMHeadModel's "transformer."
        tensors, sources = ({_gpt2_name(k): v for k, v in d.items()} for d in (tensors, sources))
    # Checked before anything the config's size is built or written: the config's counts against the files', then
    # each tensor's dtype, shape and values.
    field_names = GPT2_FIELD_NAMES if gpt2 else FIELD_NAMES if native else None
    check_fits_files(config, tensors, f"--from-hf: {config_path}", field_names)
    layout.stage_layers(config)
    shapes = hf_gpt2_shapes if gpt2 else hf_shapes if native else hf_codegeex_shapes
    check_tensors(tensors, shapes(config), sources.__getitem__, str(config_path), "--from-hf")
    if native:
        source = _native_source(hf_dir, tensors, config)
    else:
        try:
            source = (hf_gpt2_to_full if gpt2 else hf_codegeex_to_full)(tensors, config).__getitem__
        except KeyError as e:
            raise CheckpointError(f"--from-hf {hf_dir}: its weights lack {e}, which its config.json implies") from None
        del tensors
    tokenizer = hf_tokenizer_settings(hf_dir)
    if tokenizer is not None:  # a copy beside the checkpoint: it outlives HF_DIR
        tokenizer["tokenizer_model"] = str(copy_hf_tokenizer(hf_dir, Path(save_dir) / "tokenizer").resolve())
    save_at_layout(save_dir, source, config, layout, tokenizer=tokenizer)
