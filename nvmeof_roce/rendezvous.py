"""Rendezvous between the two nodes of `lab run --nodes 2`: files in the shared directory.

In a guest, LAB_SYNC (set by the guest init) is /mnt/share/.lab-sync: one node
`signal`s a name, the other `wait`s for it.  The init itself writes
`<node>.up` once its link and rxe0 are up and `<node>.done` (the exit code)
when its command ends, so a target command can serve until `host.done`.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from .errors import NvmeofError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def sync_dir() -> Path:
    path = os.environ.get("LAB_SYNC")
    if not path:
        raise NvmeofError("no rendezvous directory (LAB_SYNC is not set)",
                          "lab signal/wait work inside a two-node lab guest (nvmeof-roce lab run --nodes 2)")
    return Path(path)


def _path(name: str) -> Path:
    if not _NAME.match(name):
        raise NvmeofError(f"rendezvous name {name!r} is not a plain file name",
                          "use letters, digits, '.', '_' and '-', e.g. target-ready")
    return sync_dir() / name


def signal(name: str, text: str = "") -> Path:
    """Create NAME (atomically, with TEXT in it)."""
    path = _path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{name}.{os.getpid()}")
    tmp.write_text(text + "\n" if text else "")
    tmp.rename(path)
    return path


def wait(name: str, timeout: float) -> str:
    """Wait until NAME exists; return its text."""
    path = _path(name)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() >= deadline:
            raise NvmeofError(f"rendezvous: {name} did not appear in {path.parent} within {timeout:.0f} s",
                              "the other node's command did not get there: look at its output")
        time.sleep(0.1)
    return path.read_text().strip()
