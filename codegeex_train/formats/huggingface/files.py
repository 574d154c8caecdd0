"""The weight files of a Hugging Face model directory, as ``save_pretrained`` lays them out:

    model.safetensors                             the whole model, when it fits in one shard
    model-00001-of-00003.safetensors ...          otherwise, each at most --max-shard-size (a bigger tensor alone)
    model.safetensors.index.json                  {"metadata": {"total_size": bytes}, "weight_map": {name: file}}
    pytorch_model.bin (+ .index.json)             older save_pretrained: pickles, read weights-only

``ShardWriter`` writes shards as they fill (one shard's tensors held at a time); ``hf_weight_files`` checks a
directory before anything in it is opened, ``read_hf_tensors`` then maps its tensors without copying them.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import torch

from codegeex_train.checkpoint.safe_load import CheckpointError, file_kind, safe_torch_load, verify_files
from codegeex_train.bounded_read import read_bytes

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth")  # what an HF directory may hold besides safetensors
# The index files of sharded weights (save_pretrained): {"weight_map": {parameter name: shard file name}}.
HF_INDEXES = (SAFE_INDEX, "pytorch_model.bin.index.json")
HF_FILES = (".json", ".safetensors", ".bin", ".pt", ".pth")  # what transformers may open in HF_DIR
MAX_INDEX_BYTES = 64 << 20
_SIZE = re.compile(r"(\d+)\s*(|B|KB|MB|GB|KIB|MIB|GIB)", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10**9, '500MiB' -> 500 * 2**20, '1000' -> 1000 bytes (transformers' units)."""
    match = _SIZE.fullmatch(text.strip())
    if not match or int(match.group(1)) < 1:
        raise ValueError(f"--max-shard-size {text!r}: not a size (a positive integer with an optional unit: "
                         f"B, KB, MB, GB, KiB, MiB or GiB, e.g. 5GB)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` (contiguous, CPU) as a safetensors file, each written from its own memory: unlike
    ``safetensors.torch.save_file``, which first copies the whole file's bytes, nothing is held twice. The format:
    an 8-byte little-endian header length, the JSON header (name -> dtype, shape, byte range; "__metadata__":
    {"format": "pt"}, which transformers requires), padded with spaces to 8 bytes, then the data in header order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


class ShardWriter:
    """Safetensors shards in ``directory``, each written once adding the next tensor would pass ``max_bytes``;
    ``close`` names them as save_pretrained does (``model.safetensors`` alone, else ``-0000i-of-0000n`` and the
    index) and returns the bytes written."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int) -> None:
        self.directory, self.max_bytes = Path(directory), max_bytes
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._files: list[Path] = []
        self._weight_map: dict[str, int] = {}  # name -> shard number
        self.tensor_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._shard and self._shard_bytes + size > self.max_bytes:
            self._flush()
        self._shard[name] = tensor.contiguous()
        self._shard_bytes += size
        self._weight_map[name] = len(self._files)
        self.tensor_bytes += size

    def _flush(self) -> None:
        path = self.directory / f"shard-{len(self._files):05d}.safetensors"  # renamed in close(), once n is known
        write_safetensors(path, self._shard)
        self._files.append(path)
        self._shard, self._shard_bytes = {}, 0

    def close(self) -> int:
        if self._shard or not self._files:
            self._flush()
        n = len(self._files)
        names = [SAFE_WEIGHTS] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for path, name in zip(self._files, names):
            os.replace(path, self.directory / name)
        written = sum((self.directory / name).stat().st_size for name in names)
        if n > 1:
            index = {"metadata": {"total_size": self.tensor_bytes},
                     "weight_map": {k: names[i] for k, i in sorted(self._weight_map.items())}}
            (self.directory / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return written


def _regular(path: Path, what: str) -> None:
    """``path`` (links followed: the Hub's cache links each file to its blob) must exist and be a regular file."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise CheckpointError(f"--from-hf: {what} {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"--from-hf: {what} {path} is {file_kind(mode)}, not a regular file")


def read_json_object(path: Path, limit: int) -> dict | None:
    """The JSON object in the regular file ``path``, or None when it is not JSON, or JSON but not an object (the
    caller's error names what the file should have been); over ``limit`` bytes or not a regular file is a
    FileReadError (bounded_read.py) naming the bound."""
    data = read_bytes(path, limit, "--from-hf")
    try:
        d = json.loads(data)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


def _index_shards(hf: Path, index: Path) -> dict[str, str]:
    """The weight map of ``index``: parameter name -> a shard file name inside ``hf`` (checked)."""
    weight_map = (read_json_object(index, MAX_INDEX_BYTES) or {}).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"--from-hf: {index} is not a weights index (a JSON object whose 'weight_map' maps "
                              f"parameter names to shard file names)")
    for shard in sorted(set(weight_map.values())):
        if shard in ("", ".", "..") or os.path.basename(shard) != shard or "\\" in shard:
            raise CheckpointError(f"--from-hf: {index} names the shard {shard[:80]!r}, which is not a file name "
                                  f"inside {hf}: refused")
        _regular(hf / shard, f"shard named by {index.name}:")
    return weight_map


def hf_weight_files(hf_dir: str) -> list[Path]:
    """The pickled weight files of ``hf_dir`` to check before any is opened: those in it and every shard its index
    files name. Every file transformers may open (``HF_FILES``) must be a regular file; an index that is not JSON,
    or names a shard that is missing, not a regular file, or not a plain name inside ``hf_dir`` (``../``, a path),
    is refused."""
    hf = Path(hf_dir)
    for path in sorted(hf.iterdir()):
        if path.name.endswith(HF_FILES):
            _regular(path, "file")
    pickled = {p for pattern in PICKLED_WEIGHTS for p in hf.glob(pattern)}
    for index_name in HF_INDEXES:
        if os.path.lexists(hf / index_name):
            pickled.update(hf / s for s in _index_shards(hf, hf / index_name).values()
                           if not s.endswith(".safetensors"))  # anything else is read as a pickle
    return sorted(pickled)


def read_hf_tensors(hf_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """Every tensor of ``hf_dir``'s weights (safetensors preferred, as transformers does; sharded or not),
    memory-mapped, not copied, and the file each came from. Call ``hf_weight_files`` first: pickles are verified
    weights-only here."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    hf = Path(hf_dir)
    for index_name, single in ((SAFE_INDEX, SAFE_WEIGHTS), (HF_INDEXES[1], "pytorch_model.bin")):
        if os.path.lexists(hf / index_name):
            files = sorted(set(_index_shards(hf, hf / index_name).values()))
        elif (hf / single).is_file():
            files = [single]
        else:
            continue
        tensors: dict[str, torch.Tensor] = {}
        sources: dict[str, Path] = {}
        for name in files:
            if name.endswith(".safetensors"):
                try:
                    state = load_file(str(hf / name))  # mapped by safetensors, its header checked against the size
                except SafetensorError as e:
                    raise CheckpointError(f"--from-hf: {hf / name} is not a safetensors file ({e})") from None
            else:
                verify_files([hf / name])
                state = safe_torch_load(hf / name, mmap=True)
                if not isinstance(state, dict):
                    raise CheckpointError(f"--from-hf: {hf / name} is not a state dict")
            tensors.update(state)
            sources.update(dict.fromkeys(state, hf / name))
        return tensors, sources
    raise CheckpointError(f"--from-hf {hf_dir}: no weights ({SAFE_WEIGHTS}, {SAFE_INDEX} or pytorch_model.bin)")
