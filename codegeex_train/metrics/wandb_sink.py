"""The wandb sink: online when credentials exist, offline otherwise, and never a hung or crashed job.

Also a reader for offline runs (``read_offline_wandb_history``): wandb 0.31 no longer ships a Python
reader for its ``.wandb`` files (``wandb.sdk.internal.datastore`` is gone), so we parse the framing
ourselves (LevelDB's log format) and decode each record with wandb's own protobuf.
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import secrets
import string
import struct
import sys
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import urlparse

from codegeex_train.config.redaction import redact_secrets, secret_values

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.wandb.ai"


def has_wandb_credentials(environ: Mapping[str, str]) -> bool:
    """Whether wandb would find credentials without asking: an env key or token file, or a .netrc entry
    for the server. Reads files only: no network."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL", DEFAULT_BASE_URL)).hostname
    home = Path(environ.get("HOME", "~")).expanduser()
    candidates = [Path(environ["NETRC"]).expanduser()] if environ.get("NETRC") else [home / ".netrc",
                                                                                   home / "_netrc"]
    for path in candidates:
        try:
            if netrc.netrc(path).authenticators(host) is not None:
                return True
        except (OSError, netrc.NetrcParseError):
            continue
    return False


def choose_wandb_mode(environ: Mapping[str, str]) -> str | None:
    """``None`` lets wandb decide (WANDB_MODE is set, or credentials exist); otherwise "offline", because
    a keyless online init raises at once, or in a terminal waits forever at a login prompt."""
    if environ.get("WANDB_MODE") or has_wandb_credentials(environ):
        return None
    return "offline"


def new_run_id() -> str:
    """An id in wandb's style (8 of [a-z0-9]), chosen here so an offline fallback keeps the same id."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def wandb_key(record_key: str, split: str) -> str:
    """``loss`` -> ``train/loss``, ``valid_loss`` -> ``valid/loss``: one chart section per split."""
    return f"{split}/{record_key.removeprefix(split + '_')}"


class WandbSink:
    """Sends each record to a wandb run as ``{split}/{name}`` at ``step=iteration``."""

    def __init__(self, *, project: str, name: str | None, directory: str, run_config: dict,
                 run_id: str | None = None, init_timeout: float = 30.0,
                 environ: Mapping[str, str] = os.environ) -> None:
        import wandb  # imported here: ranks that never log don't pay wandb's import time

        self._wandb = wandb
        Path(directory).mkdir(parents=True, exist_ok=True)
        secrets = secret_values(environ)
        kwargs = dict(project=project, name=redact_secrets(name, secrets), dir=directory, id=run_id or new_run_id(),
                      resume="allow", config=redact_secrets(run_config, secrets))
        # wandb stores the command line (and host, git state, ...) as run metadata; a credential on the command
        # line (an environment credential's value, or one inside a URL) turns that record off.
        leaky_argv = any(redact_secrets(arg, secrets) != arg for arg in sys.argv)
        if leaky_argv:
            logger.warning("a credential appears on the command line: wandb will not record the run's metadata "
                           "(command line, host, git state)")
        mode = choose_wandb_mode(environ)
        try:
            self.run = wandb.init(mode=mode, settings=wandb.Settings(init_timeout=init_timeout,
                                                                     x_disable_meta=leaky_argv), **kwargs)
        except Exception as error:  # CommError (no network), UsageError (no key), AuthenticationError, ...
            if mode == "offline":
                raise
            logger.warning("wandb.init failed (%s: %s); logging offline to %s", type(error).__name__,
                           redact_secrets(str(error).splitlines()[0] if str(error) else "", secrets), directory)
            wandb.teardown()  # the failed init still holds the run id in wandb's service ("run ID is in use")
            self.run = wandb.init(mode="offline", settings=wandb.Settings(x_disable_meta=leaky_argv), **kwargs)

    @property
    def run_id(self) -> str:
        return self.run.id

    @property
    def mode(self) -> str:
        """The run's mode: online, offline or disabled."""
        return self.run.settings.mode

    def write(self, record: dict) -> None:
        split = record.get("split", "train")
        data = {wandb_key(k, split): v for k, v in record.items()
                if k not in ("iteration", "split") and v is not None}
        self.run.log(data, step=record["iteration"])

    def close(self) -> None:
        self.run.finish()
        # finish() can return before wandb's service has written the .wandb file (offline, 0.31: ~1 in 10
        # runs the file still held only its header); teardown waits for the service to flush and exit.
        self._wandb.teardown()


def _leveldb_log_payloads(data: bytes) -> Iterator[bytes]:
    """Yields the records of a LevelDB-style log (wandb's .wandb framing): a 7-byte file header
    (":W&B", magic, version), then 32 KiB blocks of chunks, each with a 7-byte header
    (crc32 seeded with the chunk type, length, type FULL/FIRST/MIDDLE/LAST)."""
    header_len, block = 7, 32768
    if data[:4] != b":W&B":
        raise ValueError("not a .wandb file (bad header)")
    pos, pending = header_len, b""
    while pos + header_len <= len(data):
        left_in_block = block - pos % block
        if left_in_block < header_len:  # a block's tail shorter than a header is zero padding
            pos += left_in_block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + header_len])
        if kind == 0 and length == 0:  # zero padding or a file cut short by a crash
            break
        chunk = data[pos + header_len:pos + header_len + length]
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != checksum:
            raise ValueError(f"checksum mismatch at byte {pos}")
        pos += header_len + length
        pending += chunk
        if kind in (1, 4):  # FULL or LAST ends a record
            yield pending
            pending = b""


def read_offline_wandb_history(run_dir: str | os.PathLike) -> list[dict]:
    """The history rows of an offline run (``.../offline-run-<time>-<id>``, or a ``.wandb`` file):
    one dict per ``wandb.log`` step, keys as logged (plus wandb's ``_step``, ``_runtime``, ...)."""
    from wandb.proto import wandb_internal_pb2

    path = Path(run_dir)
    files = [path] if path.is_file() else sorted(path.glob("*.wandb"))
    if len(files) != 1:
        raise FileNotFoundError(f"expected one .wandb file in {path}, found {len(files)}")
    rows = []
    for payload in _leveldb_log_payloads(files[0].read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            # wandb 0.31 writes keys as nested_key lists; older versions used key
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
