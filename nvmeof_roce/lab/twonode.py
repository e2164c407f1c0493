"""Two lab guests on a virtual wire: `lab run --nodes 2`, `lab shell --node host|target`.

Both guests boot the same image.  Each has one virtio NIC; the two NICs are
joined by a QEMU datagram netdev over a pair of unix sockets in a private
temporary directory (no host networking, no bridge, nothing leaves this
machine).  The guest init reads its role from the kernel command line
(nvmeof.node, nvmeof.addr, nvmeof.peer, nvmeof.mtu), puts Soft-RoCE on eth0,
and waits until the other node is up (files under /mnt/share/.lab-sync).

Rendezvous for the commands: `nvmeof-roce lab signal NAME` / `lab wait NAME`
in a guest; when a node's command ends, its init writes `<node>.done` there.

The caller holds /tmp/nvmeof-lab.lock for the whole run (the one case where two guests run at once).
"""
from __future__ import annotations

import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import NvmeofError, ToolMissing
from .image import LabImage
from .vm import QEMU, SETUP_FAILED, LabRun, _kill, _write_ctl, qemu_args

NODES = ("target", "host")
ADDRESSES = {"target": "10.99.1.1", "host": "10.99.1.2"}
MACS = {"target": "52:54:00:99:01:01", "host": "52:54:00:99:01:02"}
SYNC_DIR = ".lab-sync"
KILLED = 137  # reported for a node QEMU had to be killed (timeout, or its peer ended long ago)


@dataclass
class NodeSpec:
    command: List[str]
    mtu: int = 1500
    interactive: bool = False


def node_run(base: LabRun, node: str, spec: NodeSpec, wire: Path) -> LabRun:
    """The LabRun of one node: its command, kernel parameters and the NIC on the wire."""
    peer = "host" if node == "target" else "target"
    netdev = (f"dgram,id=wire,local.type=unix,local.path={wire / node},"
              f"remote.type=unix,remote.path={wire / peer}")
    return replace(base, command=spec.command, interactive=spec.interactive,
                   cmdline=f"nvmeof.node={node} nvmeof.addr={ADDRESSES[node]}/24 nvmeof.peer={ADDRESSES[peer]} "
                           f"nvmeof.mtu={spec.mtu}",
                   extra_args=["-netdev", netdev, "-device", nic_device(node, spec.mtu)])


def nic_device(node: str, mtu: int) -> str:
    """The virtio NIC.  Left to its defaults, virtio-net receives frames of any size whatever the guest's
    MTU (mergeable 64 KiB buffers), so an MTU mismatch could never drop a frame.  Like a real NIC, ours
    takes frames up to its boot MTU only: small receive buffers for 1500, host_mtu for jumbo boots."""
    base = f"virtio-net-pci,netdev=wire,mac={MACS[node]}"
    if mtu > 1500:
        return f"{base},host_mtu={mtu}"
    return f"{base},mrg_rxbuf=off,guest_tso4=off,guest_tso6=off,guest_ecn=off,guest_ufo=off"


def run_two(image: LabImage, base: LabRun, specs: Dict[str, NodeSpec], peer_grace: float = 120.0) -> Dict[str, int]:
    """Boot both nodes, stream their consoles (prefixed), return {node: exit code}.

    When one node ends, the other gets `peer_grace` seconds to finish before it is killed."""
    if shutil.which(QEMU) is None:
        raise ToolMissing(QEMU, "qemu-system-x86")
    if base.share is None:
        raise NvmeofError("two-node run without a share", "internal: the share carries the rendezvous")
    sync = base.share / SYNC_DIR
    shutil.rmtree(sync, ignore_errors=True)
    sync.mkdir(parents=True)
    interactive = [n for n, s in specs.items() if s.interactive]
    with tempfile.TemporaryDirectory(prefix="nvmeof-wire-") as wire_tmp, \
            tempfile.TemporaryDirectory(prefix="nvmeof-lab-ctl-target-") as ctl_t, \
            tempfile.TemporaryDirectory(prefix="nvmeof-lab-ctl-host-") as ctl_h:
        wire = Path(wire_tmp)
        ctls = {"target": Path(ctl_t), "host": Path(ctl_h)}
        procs: Dict[str, subprocess.Popen] = {}
        try:
            for node in NODES:
                run = node_run(base, node, specs[node], wire)
                _write_ctl(ctls[node], run)
                args = qemu_args(image, run, ctls[node])
                if run.interactive:
                    procs[node] = subprocess.Popen(args)
                elif interactive:  # the other node's console goes to a file while the shell has the terminal
                    with open(sync / f"{node}.console", "wb") as console:
                        procs[node] = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=console,
                                                       stderr=subprocess.STDOUT, start_new_session=True)
                else:
                    procs[node] = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                   stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + base.timeout
            if interactive:
                try:
                    procs[interactive[0]].wait(timeout=base.timeout)
                except subprocess.TimeoutExpired:
                    pass
            else:
                _stream_both(procs, deadline, peer_grace)
        finally:
            for proc in procs.values():
                _kill(proc)
        codes = {}
        for node in NODES:
            code_file = ctls[node] / "exit-code"
            text = code_file.read_text().strip() if code_file.exists() else ""
            codes[node] = int(text) if text else KILLED
            if codes[node] == SETUP_FAILED:
                raise NvmeofError(f"lab guest ({node} node): setup failed (see the message above)",
                                  "look at the node's console above: NIC, Soft-RoCE or rendezvous")
        return codes


def _stream_both(procs: Dict[str, subprocess.Popen], deadline: float, peer_grace: float) -> None:
    """Copy both consoles to stdout, line by line with a [node] prefix, until both QEMUs exit."""
    out = sys.stdout.buffer
    partial = {node: b"" for node in procs}
    first_end: Optional[float] = None
    with selectors.DefaultSelector() as sel:
        for node, proc in procs.items():
            os.set_blocking(proc.stdout.fileno(), False)
            sel.register(proc.stdout.fileno(), selectors.EVENT_READ, node)
        open_fds = len(procs)
        while open_fds:
            now = time.monotonic()
            limit = deadline if first_end is None else min(deadline, first_end + peer_grace)
            if now >= limit:
                return  # the caller kills what still runs; its missing exit code reads as KILLED
            for key, _ in sel.select(timeout=min(limit - now, 1.0)):
                node = key.data
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    open_fds -= 1
                    if partial[node]:
                        out.write(b"[%s] %s\n" % (node.encode(), partial[node]))
                    if first_end is None:
                        first_end = time.monotonic()
                    continue
                lines = (partial[node] + chunk.replace(b"\r\n", b"\n").replace(b"\r", b"")).split(b"\n")
                partial[node] = lines.pop()
                for line in lines:
                    out.write(b"[%s] %s\n" % (node.encode(), line))
                out.flush()
    for proc in procs.values():
        proc.wait()
