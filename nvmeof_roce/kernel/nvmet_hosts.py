"""Hosts connected to the kernel target, where the kernel shows them.

configfs (/sys/kernel/config/nvmet) describes what is configured, never who is connected: Linux 6.1 exposes no
list of nvmet controllers at all.  From Linux 6.9, a kernel built with CONFIG_NVME_TARGET_DEBUGFS has one
directory per controller in debugfs (nvmet_debugfs_ctrl_setup)::

    /sys/kernel/debug/nvmet/<subsystem NQN>/ctrl<CNTLID>/{hostnqn,port,kato,state,host_traddr}

(/sys/class/nvme-fabrics is the *host* side: controllers this machine connected to, not to its target.)
"""
from __future__ import annotations

import os
from typing import List, Optional

DEBUGFS_NVMET = "/sys/kernel/debug/nvmet"
NOT_EXPOSED = ("this kernel does not list the hosts connected to nvmet (configfs never does; debugfs "
               "nvmet/<subsystem>/ctrl<N> exists from Linux 6.9 with CONFIG_NVME_TARGET_DEBUGFS, and needs "
               "debugfs mounted and root)")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def connected_hosts(root: str = DEBUGFS_NVMET) -> Optional[List[dict]]:
    """Every nvmet controller as {subnqn, cntlid, hostnqn, port, kato, state, host_traddr}; None if not exposed."""
    try:
        subsystems = sorted(os.listdir(root))
    except OSError:
        return None
    out = []
    for subnqn in subsystems:
        sdir = os.path.join(root, subnqn)
        try:
            entries = sorted(os.listdir(sdir))
        except OSError:
            continue
        for name in entries:
            if not name.startswith("ctrl") or not name[4:].isdigit():
                continue
            cdir = os.path.join(sdir, name)
            kato = _read(os.path.join(cdir, "kato"))
            out.append({"subnqn": subnqn, "cntlid": int(name[4:]), "hostnqn": _read(os.path.join(cdir, "hostnqn")),
                        "port": _read(os.path.join(cdir, "port")), "kato": int(kato) if kato.isdigit() else kato,
                        "state": _read(os.path.join(cdir, "state")),
                        "host_traddr": _read(os.path.join(cdir, "host_traddr"))})
    return out
