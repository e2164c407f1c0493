"""Namespace backends for the userspace target: the contract (`base.py`), one module per kind (`ram.py`, `null.py`,
`file.py`: file and block), and `open_backend`, which opens the kind a namespace config names through the registry
(config/backends.py `KINDS`).  A new backend is its own module here and its registry entry: nothing in this file
or elsewhere in the engine names a kind (docs/architecture.md "The backend seam")."""
import importlib
from typing import Optional, Type

from ...config import NamespaceConfig
from ...config.backends import kind_of, names
from .base import Backend, BackendError, Op, check_new_size
from .file import BlockBackend, FileBackend
from .null import NullBackend
from .ram import RAM_RESERVE, RamBackend

__all__ = ["Backend", "BackendError", "Op", "RamBackend", "FileBackend", "BlockBackend", "NullBackend",
           "open_backend", "backend_class", "check_new_size", "RAM_RESERVE"]


def backend_class(kind: str) -> Type[Backend]:
    """The class the registry entry `kind` names (imported on first use)."""
    entry = kind_of(kind)
    if entry is None:
        raise BackendError(f"unknown backend {kind!r}", f"use one of {', '.join(names())}")
    module, _, cls = entry.implementation.partition(":")
    return vars(importlib.import_module(module))[cls]


def open_backend(ns: NamespaceConfig, lock: Optional[str] = None, inherit: Optional[Backend] = None) -> Backend:
    """Open the backend a namespace config describes (`lock` "exclusive" or "shared": flock its storage for as
    long as it is open; `inherit`: the backend of the namespace this one replaces, which hands over its lock)."""
    if kind_of(ns.backend) is None:
        raise BackendError(f"namespace {ns.nsid}: unknown backend {ns.backend!r}", f"use {', '.join(names())}")
    return backend_class(ns.backend).open(ns, lock=lock, inherit=inherit)
