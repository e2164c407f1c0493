"""Kernel modules: is it loaded (/sys/module), load it with modprobe (the one modprobe wrapper)."""
import os

from ..errors import NvmeofError, ToolMissing
from . import tool

SYS_MODULE = "/sys/module"


class ModuleError(NvmeofError):
    pass


def is_loaded(name: str, sys_module: str = SYS_MODULE) -> bool:
    return os.path.isdir(os.path.join(sys_module, name.replace("-", "_")))


def ensure(name: str, why: str = "", sys_module: str = SYS_MODULE) -> bool:
    """Load module `name` unless loaded. Returns True if it had to be loaded."""
    if is_loaded(name, sys_module):
        return False
    try:
        res = tool.run("modprobe", [name], package="kmod", timeout=60)
    except ToolMissing:
        raise ModuleError(f"kernel module {name} is not loaded{(' (needed for ' + why + ')') if why else ''} and "
                          "modprobe is not installed",
                          f"install kmod (apt-get install kmod) and run modprobe {name}, as root") from None
    if not res.ok or not is_loaded(name, sys_module):
        detail = (res.stderr or res.stdout).strip() or f"exit {res.exit_code}"
        raise ModuleError(
            f"kernel module {name} is not loaded{(' (needed for ' + why + ')') if why else ''} "
            f"and modprobe failed: {detail}",
            f"load it as root (modprobe {name}); if it is missing, install the kernel's full module set "
            "(Debian: the -amd64 flavour, not -cloud-amd64, which has no RDMA)")
    return True
