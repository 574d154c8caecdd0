"""Reading a file the user named, never more of it than a stated bound.

    text = read_text(path, 1 << 20, "--deepspeed-config")      # the whole file, UTF-8
    data = read_bytes(path, MAX, "--prompt-file", gunzip=True)  # gzip (by its magic bytes) decompressed, bounded too
    for number, line in read_lines(path, MAX, "--samples"): ... # lines, one at a time, .gz alike
    for number, record in read_jsonl(path, MAX, "--samples"): ... # JSON lines: one object a line, blank ones skipped
    check_file(path, MAX, "--tokenizer-model")                  # before a library opens the file by its name

The file must be a regular one (links followed): a directory, a FIFO, a device (``/dev/zero``) or a socket is refused
before a byte is read. It is opened without blocking (a FIFO's open would wait for a writer) and checked with
``fstat``, so what is checked is what is read. A file larger than the bound (gzip: its decompressed bytes) is one
:class:`FileReadError` naming the file and the bound, and no more than bound + 1 bytes of it are ever held.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import stat
import zlib
from collections.abc import Iterable, Iterator
from typing import IO

GZIP_MAGIC = b"\x1f\x8b"


class FileReadError(ValueError):
    """A user's file that is missing, not a regular file, over its bound or undecodable; the message (one line)
    names the flag, the file and the bound."""


def describe_size(n: int) -> str:
    """1048576 -> '1 MiB', 1000 -> '1000 bytes'."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _where(path: str | os.PathLike, what: str) -> str:
    return f"{what} {path}" if what else str(path)


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _too_large(path, what: str, limit: int, decompressed: bool = False) -> FileReadError:
    size = describe_size(limit) + (" decompressed" if decompressed else "")
    return FileReadError(f"{_where(path, what)}: larger than {size}, the bound on this file: refused")


def _os_error(path, what: str, e: OSError) -> FileReadError:
    reason = "no such file" if e.errno == errno.ENOENT else f"cannot read it ({e.strerror or e})"
    return FileReadError(f"{_where(path, what)}: {reason}")


def _check_mode(path, what: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise FileReadError(f"{_where(path, what)}: {_file_kind(st.st_mode)}, not a regular file (nothing read "
                            f"from it)")


def check_file(path: str | os.PathLike, limit: int, what: str = "") -> int:
    """The size of ``path``, which must be a regular file of at most ``limit`` bytes: for a file a library reads by
    its name (a tokenizer's), checked just before it does."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise _os_error(path, what, e) from None
    _check_mode(path, what, st)
    if st.st_size > limit:
        raise _too_large(path, what, limit)
    return st.st_size


def _open(path, limit: int, what: str, gunzip: bool) -> tuple[IO[bytes], IO[bytes], bool]:
    """(the file, what to read: it or a gzip reader over it, whether gzip) of ``path``, checked a regular file and,
    unless gzip (``gunzip`` and its magic bytes), at most ``limit`` bytes on disk."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _os_error(path, what, e) from None
    try:
        st = os.fstat(fd)
        _check_mode(path, what, st)
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    if gunzip and f.peek(2)[:2] == GZIP_MAGIC:  # the decompressed bytes are counted as they are read
        return f, gzip.GzipFile(fileobj=f, mode="rb"), True
    if st.st_size > limit:
        f.close()
        raise _too_large(path, what, limit)
    return f, f, False


def read_bytes(path: str | os.PathLike, limit: int, what: str = "", *, gunzip: bool = False) -> bytes:
    """The bytes of ``path`` (``gunzip``: decompressed when it is gzip), at most ``limit`` of them."""
    raw, f, gzipped = _open(path, limit, what, gunzip)
    with raw:
        try:
            data = f.read(limit + 1)
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise FileReadError(f"{_where(path, what)}: cannot read it{' as gzip' if gzipped else ''} ({e})") from None
    if len(data) > limit:
        raise _too_large(path, what, limit, gzipped)
    return data


def decode_utf8(data: bytes, where: str) -> str:
    """``data`` as UTF-8 (a leading byte-order mark dropped); else one FileReadError naming ``where`` and the byte."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise FileReadError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_text(path: str | os.PathLike, limit: int, what: str = "", *, gunzip: bool = False) -> str:
    """``read_bytes`` decoded as UTF-8."""
    return decode_utf8(read_bytes(path, limit, what, gunzip=gunzip), _where(path, what))


def read_lines(path: str | os.PathLike, limit: int, what: str = "") -> Iterator[tuple[int, bytes]]:
    """(line number from 1, the line's bytes) of ``path``, gzip decompressed (by its magic bytes), until ``limit``
    bytes in all have been read: one more is a FileReadError (so is any one line longer than what is left)."""
    raw, f, gzipped = _open(path, limit, what, True)
    with raw:
        left, number = limit, 0
        try:
            while line := f.readline(left + 1):
                left -= len(line)
                if left < 0:
                    raise _too_large(path, what, limit, gzipped)
                number += 1
                yield number, line
        except (OSError, EOFError, zlib.error) as e:  # a truncated or corrupt .gz
            raise FileReadError(f"{_where(path, what)}: cannot read past line {number} ({e})") from None



def json_objects(lines: Iterable[tuple[int, bytes | str]], where: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of JSON lines, given as (line number, its bytes or text); a
    line that is not UTF-8, not JSON, nested too deeply or not an object is a FileReadError naming ``where:number``.
    The one JSON-lines parser: ``read_jsonl`` (evaluation's problems and samples) and tools/generate.py's
    --prompt-file."""
    for number, line in lines:
        if not line.strip():
            continue
        text = decode_utf8(line, f"{where}:{number}") if isinstance(line, bytes) else line
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise FileReadError(f"{where}:{number}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise FileReadError(f"{where}:{number}: JSON nested too deeply") from None
        if not isinstance(value, dict):
            raise FileReadError(f"{where}:{number}: expected a JSON object, got {type(value).__name__}")
        yield number, value


def _not_lfs_pointer(path, lines: Iterator[tuple[int, bytes]]) -> Iterator[tuple[int, bytes]]:
    for number, line in lines:
        if number == 1 and line.startswith(b"version https://git-lfs"):
            raise FileReadError(f"{path}: a Git LFS pointer, not the data (git lfs pull in its repository)")
        yield number, line


def read_jsonl(path: str | os.PathLike, limit: int, what: str = "") -> Iterator[tuple[int, dict]]:
    """``json_objects`` of ``path``'s lines, read as ``read_lines`` reads them (gzip by its magic bytes, at most
    ``limit`` bytes); a Git LFS pointer in place of the data is refused, naming the fix."""
    lines = read_lines(path, limit, what)
    try:
        yield from json_objects(_not_lfs_pointer(path, lines), str(path))
    finally:
        lines.close()
