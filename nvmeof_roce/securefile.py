"""One way to write a file the target owns: atomic, private, durable.

`write_file(path, data)` never leaves a partly written file at `path`, never follows a link planted at a
predictable name, and never shows the content to another local user:

    mkstemp in the same directory   an unpredictable name, created O_EXCL with mode 0600 (no symlink followed)
    write, fsync the file           the content is on disk before anyone can see it at `path`
    rename over `path`              atomic: a reader sees the old file or the new one
    fsync the directory             the rename itself survives a crash

Used for every file the target writes: `save_config` (DH-HMAC-CHAP secrets), the ANA state and applied
files, the pid file, the ready file (docs/security.md).
"""
from __future__ import annotations

import os
import tempfile
from typing import Union

MODE = 0o600


def write_file(path: str, data: Union[str, bytes], mode: int = MODE) -> None:
    """Replace `path` with `data` atomically (OSError if the directory cannot take it; nothing left behind)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    sync_directory(directory)


def sync_directory(directory: str) -> None:
    """fsync a directory, so that a rename or unlink in it is on disk."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
