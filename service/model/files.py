"""Bounded reads of the small files a model comes with (config.json, tokenizer files, a
safetensors header): each is read only if it is a regular file once links are followed (a link to
/dev/zero, a FIFO or a socket would read or wait forever), and never beyond the size it can have,
so a hostile or corrupted file is one clear error, never a read without end."""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

from .config import ConfigError

MAX_JSON_BYTES = 16 << 20  # config.json, model.safetensors.index.json, a tokenizer spec: KBs to a few MBs
MAX_TOKENIZER_BYTES = 256 << 20  # tokenizer.json / a ranks file: ~10 MB for Qwen's 151k tokens
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000  # the safetensors format's own limit


def regular_size(path: Path, error: type[Exception] = ConfigError) -> int:
    """path's size; `error` naming the path if it is missing or not a regular file."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise error(f"{path}: missing") from None
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a character device" if stat.S_ISCHR(st.st_mode)
                else "a block device" if stat.S_ISBLK(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        target = f" (a link to {os.path.realpath(path)})" if path.is_symlink() else ""
        raise error(f"{path}: is {kind}{target}; it must be a regular file")
    return st.st_size


def read_bounded(path: Path, max_bytes: int, error: type[Exception] = ConfigError) -> bytes:
    """The bytes of a regular file of at most max_bytes (read no further, even if it grows)."""
    size = regular_size(path, error)
    if size > max_bytes:
        raise error(f"{path}: {size} bytes is more than such a file can be ({max_bytes})")
    with open(path, "rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{path}: grew past {max_bytes} bytes while it was read")
    return data


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES, error: type[Exception] = ConfigError) -> Any:
    try:
        return json.loads(read_bounded(path, max_bytes, error))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        if isinstance(e, error):
            raise
        raise error(f"{path}: not valid JSON ({e})") from None


def check_safetensors(path: Path, error: type[Exception] = ConfigError) -> dict[str, Any]:
    """The header of a safetensors file, read within bounds and checked before the safetensors
    library sees the file: a pickle (or anything else) named *.safetensors is one clear error."""
    size = regular_size(path, error)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise error(f"{path}: {size} bytes is not a safetensors file (no header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_SAFETENSORS_HEADER_BYTES or n > size - 8:
            raise error(f"{path}: not a safetensors file (a header of {n} bytes in a file of {size}; "
                        "pickled weights are never loaded)")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        raise error(f"{path}: not a safetensors file (its header is not a JSON object; pickled weights are "
                    "never loaded)")
    return header
