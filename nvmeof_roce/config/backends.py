"""The backend registry: every namespace backend kind the config may name, declared once (`KINDS`).

An entry says what the config of such a namespace holds (a `device.path`, or a `size` kept by the target), whether
an I/O engine runs its calls off the event loop (`queue_depth`, `io_engine`), and which module implements it
(`implementation`, "module:Class", imported when a namespace of the kind opens: engine/backends/open_backend).
The config loader, the userspace checks, the control plane and the service ask the entry, never the kind's name;
the engine opens the class it names, which declares the rest of the contract (engine/backends/base.py).  Its
native twin is the C registry, csrc/backend.c `nq_backends[]`, keyed by the name a backend gives as its `native`.

A new backend is its module (engine/backends/<kind>.py), its C file (csrc/be_<kind>.c, when the native data path
serves it), an entry here and one in `nq_backends[]`: nothing else (docs/architecture.md "The backend seam",
tests/unit/test_architecture.py).  `register` adds one at run time (a test's, a plug-in's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

__all__ = ["BackendKind", "KINDS", "register", "unregister", "kind_of", "facts", "names"]


@dataclass(frozen=True)
class BackendKind:
    name: str
    implementation: str          # "package.module:Class", a subclass of engine/backends/base.py:Backend
    path: bool                   # its storage is device.path (a file or a block device); else the target's own
    size_required: bool          # nvmeof_roce.size is required (without a path there is nothing to size it)
    engine: bool = False         # an I/O engine runs its calls (engine/ioengine.py): queue_depth, io_engine apply
    memory: bool = False         # it is the target's memory: counted against the machine's (config/userspace.py)
    block_device_only: bool = False  # device.path must be a block device
    summary: str = ""            # one line for the error that lists the kinds
    # The key of the namespace's nvmeof_roce section that holds the kind's own settings, and the function that
    # parses it ("module:function", called (value, source, where) -> settings, raising ConfigError): the
    # loader keeps what it returns as NamespaceConfig.backend_settings.  None: the kind has no settings object.
    settings_key: Optional[str] = None
    settings_parser: str = ""
    sized_by_storage: bool = False  # its size comes from the storage (an image): nvmeof_roce.size is refused
    # What `target check` checks without opening it ("module:function", called (settings) ->
    # ([(settings key, problem, fix)], note of what it cannot check)); "": it is opened
    offline_check: str = ""

    def describe(self) -> str:
        return f"{self.name} {self.summary}".strip()


_PKG = "nvmeof_roce.engine.backends"

KINDS: Dict[str, BackendKind] = {}


def register(kind: BackendKind) -> BackendKind:
    """Add a kind (or replace the one of its name); returns it."""
    KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    KINDS.pop(name, None)


def kind_of(name: str) -> Optional[BackendKind]:
    return KINDS.get(name)


def names() -> Tuple[str, ...]:
    return tuple(KINDS)


# -- the entries: one per backend kind
register(BackendKind("ram", f"{_PKG}.ram:RamBackend", path=False, size_required=True, memory=True,
                     summary="keeps data in memory"))
register(BackendKind("file", f"{_PKG}.file:FileBackend", path=True, size_required=False, engine=True,
                     summary="uses device.path (a file, created with size if missing, or a block device)"))
register(BackendKind("null", f"{_PKG}.null:NullBackend", path=False, size_required=True,
                     summary="discards writes and reads zeros"))
register(BackendKind("block", f"{_PKG}.file:BlockBackend", path=True, size_required=False, engine=True,
                     block_device_only=True, summary="uses device.path, a block device"))
register(BackendKind("rbd", f"{_PKG}.rbd:RbdBackend", path=False, size_required=False, engine=True,
                     settings_key="rbd", settings_parser="nvmeof_roce.config.rbd:parse_rbd", sized_by_storage=True,
                     offline_check="nvmeof_roce.config.rbd:offline_problems",
                     summary='is an RBD image of a Ceph cluster ("rbd": {"pool": ..., "image": ...})'))


_UNKNOWN = BackendKind("?", "", path=False, size_required=False)


def facts(name: str) -> BackendKind:
    """The entry of `name`, or one that claims nothing (a name the loader refuses anyway)."""
    return KINDS.get(name, _UNKNOWN)
