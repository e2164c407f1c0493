"""`bench --two-node`: the targets on one lab node, the kernel host and fio on the other, one wire between.

On this machine, `run_on_machine` boots `lab run --nodes 2` with the same bench arguments plus
`--node target` for the target node (10.99.1.1) and `--node host` for the host node (10.99.1.2); the output
directory is the share.  In the guests:

  target node  sets up the targets (as the one-node bench does) and the perftest servers, announces them in
               the rendezvous file `bench-targets`, serves until `bench-done`, tears down;
  host node    waits for `bench-targets`, then runs the usual BenchRunner against `RemoteTarget`s: perftest
               clients, fio through nvme-cli, our initiator's perf; the result says which topology it measured.

With `--capture`, the host node keeps a short tcpdump capture (the first CAPTURE_PACKETS frames) of every fio run
next to its raw fio output, and its decoded per-flow summary (`nvmeof-roce rdma decode --summary`).
"""
from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from ..errors import NvmeofError
from .. import rendezvous
from ..output import progress
from .perftest import perftest_args, perftest_binary, rdma_device_for, run_perftest
from .targets import KernelHost, TargetUnderTest

TARGET_NODE, HOST_NODE = "10.99.1.1", "10.99.1.2"
LINK = "virtio-net NICs joined by a QEMU datagram socket, Soft-RoCE (rxe) on each, 1 vCPU per node"
CAPTURE_PACKETS = 3000


class RemoteTarget(TargetUnderTest):
    """A target the other node set up: its address and description, nothing to do here."""

    def __init__(self, info: dict):
        super().__init__(info["traddr"], info["trsvcid"], info["subnqn"], info["name"])
        self.kind = info["kind"]
        self.info = info

    def setup(self) -> None:
        pass  # done on the target node before it announced the target

    def teardown(self) -> None:
        pass  # the target node tears down after bench-done

    def describe(self) -> dict:
        return dict(self.info["describe"], node=TARGET_NODE)

    @property
    def trsvcids(self):
        """A userspace-Nw target's ports (each worker's): the host connects them all."""
        return [int(p) for p in self.info["describe"].get("trsvcids") or [self.trsvcid]]


class CapturingHost(KernelHost):
    """The kernel host, with a tcpdump capture from each connect to its disconnect (`bench --capture`)."""

    def __init__(self, out_dir: Path, netdev: str = "eth0"):
        self.out_dir = Path(out_dir) / "captures"
        self.netdev = netdev
        self.count = 0
        self.proc: Optional[subprocess.Popen] = None
        self.path: Optional[Path] = None

    def connect(self, target: TargetUnderTest) -> str:
        self.count += 1
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / f"{self.count:03d}-{target.name}.pcap"
        self.proc = subprocess.Popen(["tcpdump", "-i", self.netdev, "-U", "-c", str(CAPTURE_PACKETS), "-w",
                                      str(self.path), "udp", "port", "4791"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return super().connect(target)

    def disconnect(self, target: TargetUnderTest) -> None:
        super().disconnect(target)
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
            self._summarize(self.path)

    @staticmethod
    def _summarize(path: Path) -> None:
        from ..capture import pcap, roce
        try:
            d = roce.decode(pcap.read_packets(path.read_bytes(), str(path)))
        except (OSError, NvmeofError) as exc:
            progress(f"bench: capture {path.name}: {exc}")
            return
        path.with_suffix(".summary.json").write_text(json.dumps(d.to_dict(frames=False), indent=1))


# -- the target node

def config_on_target_node(path: Path, out_dir: Path) -> Path:
    """A copy of a userspace target config whose ports listen on the target node's address."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise NvmeofError(f"--userspace-config {path}: {exc}", "give a target config JSON file")
    for port in config.get("ports", []):
        port.setdefault("addr", {})["traddr"] = TARGET_NODE
    out = Path(out_dir) / "userspace-target.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(config, indent=1))
    return out


def serve_targets(targets: List[TargetUnderTest], perftest_tests, iterations: Optional[int], port: int,
                  timeout: float) -> int:
    device = rdma_device_for(TARGET_NODE) if perftest_tests else None
    started: List[TargetUnderTest] = []
    servers: List[subprocess.Popen] = []
    try:
        for t in targets:
            t.check()
        for t in targets:
            progress(f"bench (target node): setting up the {t.name} target ({t.kind}) on {t.traddr}:{t.trsvcid}")
            started.append(t)
            t.setup()
        for i, test in enumerate(perftest_tests):
            servers.append(subprocess.Popen([perftest_binary(test)] + perftest_args(
                test, device, iterations=iterations, port=port + i), stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
        info = [{"name": t.name, "kind": t.kind, "traddr": t.traddr, "trsvcid": t.trsvcid, "subnqn": t.subnqn,
                 "describe": t.describe()} for t in targets]
        rendezvous.signal("bench-targets", json.dumps(info))
        rendezvous.wait("bench-done", timeout)
        return 0
    finally:
        for proc in servers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for t in reversed(started):
            try:
                progress(f"bench (target node): tearing down the {t.name} target")
                t.teardown()
            except Exception as exc:  # keep tearing the others down
                progress(f"bench (target node): teardown of {t.name} failed: {exc}")


# -- the host node

def remote_targets(timeout: float) -> List[RemoteTarget]:
    return [RemoteTarget(info) for info in json.loads(rendezvous.wait("bench-targets", timeout))]


def remote_perftest(test, address, **kw):
    return run_perftest(test, address, remote_server=True, **kw)


def topology() -> dict:
    return {"kind": "two-node", "target_node": TARGET_NODE, "host_node": HOST_NODE, "link": LINK}


def done() -> None:
    rendezvous.signal("bench-done")


# -- this machine: boot the two nodes

def forwarded_argv(argv: List[str]) -> List[str]:
    """The bench arguments as given, without the ones that only mean something here."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--two-node",):
            continue
        if a in ("--out", "--timeout"):
            skip = True
            continue
        if a.startswith("--out=") or a.startswith("--timeout="):
            continue
        out.append(a)
    return out


def run_on_machine(bench_argv: List[str], out_dir: Path, timeout: float) -> int:
    """Boot the two nodes (`nvmeof-roce lab run --nodes 2`) with the bench on each; the results land in
    out_dir, the share.  Through the CLI: the lab layer sits below this one."""
    quoted = " ".join(shlex.quote(a) for a in forwarded_argv(bench_argv))
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "nvmeof_roce", "lab", "run", "--nodes", "2", "--share", str(out_dir.resolve()),
            "--timeout", str(timeout),
            "--target-cmd", f"nvmeof-roce bench {quoted} --node target --out /mnt/share/target-node",
            "--host-cmd", f"nvmeof-roce bench {quoted} --node host --out /mnt/share"]
    progress(f"bench --two-node: booting the target node ({TARGET_NODE}) and the host node ({HOST_NODE})")
    code = subprocess.run(argv).returncode
    if not (out_dir / "bench.json").exists():
        raise NvmeofError(f"the host node wrote no bench.json (lab exit code {code})",
                          "look at the two nodes' output above")
    return code


__all__ = ["RemoteTarget", "CapturingHost", "serve_targets", "remote_targets", "run_on_machine", "topology"]
