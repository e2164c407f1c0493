"""Shared helpers for the target/initiator tests over the loopback fabric.

`Env` builds a Target from a config dict, listens on its ports, and connects
initiators.  `RawQueue` sends hand-built capsules and returns the parsed CQE,
for the error paths the initiator API never produces.
"""
from __future__ import annotations

import itertools
from typing import List, Optional

from nvmeof_roce.initiator.controller import Controller
from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.nvme.command import CQE, SQE
from nvmeof_roce.nvme.sgl import SglDescriptor
from nvmeof_roce.config import parse_config
from nvmeof_roce.engine.core import Target
from nvmeof_roce.transport.loopback import FakeClock, LoopbackFabric

HOST_A = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000a001"
HOST_B = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000b002"
SUB_RAM = "nqn.2024-01.io.test:ram"
SUB_4K = "nqn.2024-01.io.test:ram4k"
SUB_NULL = "nqn.2024-01.io.test:null"
SUB_FILE = "nqn.2024-01.io.test:file"
SUB_ONLY_A = "nqn.2024-01.io.test:only-a"
SUB_HIDDEN = "nqn.2024-01.io.test:not-exported"
ADDR1 = "10.99.0.1:4420"
ADDR2 = "10.99.0.2:4421"


def ram_ns(nsid: int, size: str = "1M", block_size: int = 512, **extra) -> dict:
    ns = {"nsid": nsid, "nvmeof_roce": {"backend": "ram", "size": size, "block_size": block_size}}
    ns.update(extra)
    return ns


def null_ns(nsid: int, size: str = "1G", block_size: int = 512) -> dict:
    return {"nsid": nsid, "nvmeof_roce": {"backend": "null", "size": size, "block_size": block_size}}


def file_ns(nsid: int, path: str, size: Optional[str] = "2M", block_size: int = 512) -> dict:
    ns = {"nsid": nsid, "device": {"path": str(path)}, "nvmeof_roce": {"backend": "file", "block_size": block_size}}
    if size:
        ns["nvmeof_roce"]["size"] = size
    return ns


def port(portid: int, address: str, subsystems: List[str], **extra) -> dict:
    traddr, svc = address.rsplit(":", 1)
    p = {"portid": portid, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": traddr, "trsvcid": svc},
         "subsystems": subsystems}
    p.update(extra)
    return p


def standard_config(tmp_path=None) -> dict:
    """Several subsystems: RAM (two namespaces), 4K RAM, null, file (if tmp_path), one restricted to
    HOST_A, one not exported on any port."""
    subsystems = [
        {"nqn": SUB_RAM, "namespaces": [ram_ns(1, "2M"), ram_ns(2, "1M")]},
        {"nqn": SUB_4K, "namespaces": [ram_ns(1, "4M", 4096)]},
        {"nqn": SUB_NULL, "namespaces": [null_ns(1)]},
        {"nqn": SUB_ONLY_A, "attr": {"allow_any_host": "0"}, "allowed_hosts": [HOST_A],
         "namespaces": [ram_ns(1, "1M")]},
        {"nqn": SUB_HIDDEN, "namespaces": [ram_ns(1, "1M")]},
    ]
    exported = [SUB_RAM, SUB_4K, SUB_NULL, SUB_ONLY_A]
    if tmp_path is not None:
        subsystems.append({"nqn": SUB_FILE, "namespaces": [file_ns(1, tmp_path / "ns1.img")]})
        exported.append(SUB_FILE)
    return {
        "hosts": [{"nqn": HOST_A}, {"nqn": HOST_B}],
        "ports": [port(1, ADDR1, exported), port(2, ADDR2, [SUB_RAM])],
        "subsystems": subsystems,
    }


def add_namespace(target, nqn: str, ns_config):
    """Add a namespace through the engine's verbs, as control/live.py does: open it, install it, tell the hosts."""
    ns = target.prepare_namespace(nqn, ns_config)
    target.install_namespace(nqn, ns)
    target.namespace_changed(nqn, ns.nsid)
    return ns


def pause_and_fence(target, nqn: str, nsid: int, on_drained=lambda: None) -> list:
    """Pause namespace `nsid` of `nqn` and fence it, as a live change does (engine/api.py when_drained, without the
    commit): `on_drained()` once no command from before can touch it.  Returns what resume_namespaces takes."""
    paused = target.pause_namespaces([(nqn, nsid)])
    target.fence(paused, lambda error: on_drained(), "a test's change")
    return paused


def remove_namespace(target, nqn: str, nsid: int) -> None:
    """Remove a namespace through the engine's verbs (closed now or after its jobs), and tell the hosts."""
    target.retire_namespace(nqn, nsid)
    target.namespace_changed(nqn, nsid)


class Env:
    """A Target on a loopback fabric with a fake clock; each port that exports a subsystem listened on at its
    address (as `target serve`: a port listens only while it exports one, control/live.py)."""

    def __init__(self, config: dict, in_capsule_size: int = 4096, **target_args):
        self.clock = FakeClock()
        self.config = parse_config(config, "test-config")
        self.target = Target(self.config, clock=self.clock, in_capsule_size=in_capsule_size, **target_args)
        self.fabric = LoopbackFabric(clock=self.clock)
        self.target.attach_loop(self.fabric)
        for p in self.config.ports:
            if p.subsystems:
                self.fabric.listen(f"{p.traddr}:{p.trsvcid}", self.target.port(p.portid))

    def connector(self, address: str = ADDR1):
        return self.fabric.connector(address)

    def connect(self, subnqn: str = SUB_RAM, address: str = ADDR1, hostnqn: str = HOST_A, **kwargs) -> Controller:
        kwargs.setdefault("clock", self.clock)
        kwargs.setdefault("timeout", 5.0)
        ctrl = Controller.connect(self.connector(address), subnqn, hostnqn=hostnqn, **kwargs)
        self.fabric.pump()  # deliver what connect() left in flight (the AER) before time moves
        return ctrl

    def close(self) -> None:
        self.target.close()
        self.fabric.pump()

    def operations(self, config_path: str, rpc_socket: Optional[str] = None, **kwargs):
        """The operations `target serve` runs around this target (service/ops.py: SIGHUP reload, the control
        socket, metrics, sd_notify), on the loopback fabric instead of RDMA listeners."""
        from nvmeof_roce.service.ops import Operations
        return Operations(LoopbackServer(self), config_path, rpc_socket=rpc_socket, **kwargs)


class LoopbackServer:
    """What the service's Operations needs of serve.py's TargetServer, on the loopback fabric (control/stats.py
    `Served` included: the Python data path, nothing polled)."""

    data_path, data_path_reason, poll, cores = "python", "", "interrupt", 1

    def __init__(self, env: Env):
        self.target = env.target
        self.loop = env.fabric
        self.listeners = []

    def transport_options(self) -> dict:
        return {}

    def addresses(self):
        return ["loopback"]


class RawQueue:
    """Hand-built capsules on one host queue; `exchange()` returns the parsed CQE."""

    _cids = itertools.count(0x100)

    def __init__(self, transport, buffer_size: int = 1 << 21):
        self.transport = transport
        self.buf = transport.register(buffer_size)

    @property
    def qid(self) -> int:
        return self.transport.qid

    def next_cid(self) -> int:
        return next(self._cids) & 0xFFFF

    def keyed(self, length: int, offset: int = 0) -> SglDescriptor:
        return SglDescriptor.keyed(self.buf.addr + offset, length, self.buf.key)

    def send(self, capsule: bytes) -> None:
        self.transport.send(capsule)

    def poll_one(self, tries: int = 5) -> Optional[CQE]:
        for _ in range(tries):
            cqes = self.transport.poll(0)
            if cqes:
                assert len(cqes) == 1, cqes
                return CQE.unpack(cqes[0])
        return None

    def exchange(self, capsule, extra: bytes = b"") -> CQE:
        if isinstance(capsule, SQE):
            capsule = capsule.pack()
        self.send(bytes(capsule) + extra)
        cqe = self.poll_one()
        assert cqe is not None, "no completion"
        return cqe

    def command(self, cmd, **fields) -> CQE:
        """Send a typed command (or SQE) with a fresh CID; check the CID and SQID echo."""
        sqe = cmd.to_sqe() if hasattr(cmd, "to_sqe") else cmd
        sqe.cid = self.next_cid()
        for k, v in fields.items():
            setattr(sqe, k, v)
        cqe = self.exchange(sqe)
        assert cqe.cid == sqe.cid and cqe.sqid == self.qid
        return cqe


RAW_HOSTID = bytes(range(16))


def raw_connect(connector, subnqn: str, hostnqn: str = HOST_A, qid: int = 0, cntlid: int = F.DYNAMIC_CNTLID,
                sqsize: int = 31, kato: int = 0, hsqsize: Optional[int] = None, hostid: bytes = RAW_HOSTID,
                data: Optional[bytes] = None):
    """CM-connect queue `qid` and send a Connect; returns (RawQueue, CQE)."""
    hsq = sqsize if hsqsize is None else hsqsize
    transport = connector.connect(qid, hsq + 1, hsq, 0 if qid == 0 else cntlid)
    q = RawQueue(transport)
    if data is None:
        data = F.ConnectData(hostid, cntlid, subnqn, hostnqn).pack()
    q.buf.view[:1024] = data
    cqe = q.command(F.ConnectCommand(qid=qid, sqsize=sqsize, kato=kato, sgl=q.keyed(1024)))
    return q, cqe


def raw_enable(q: RawQueue, cc: int = F.CC_DEFAULT | F.CC_EN) -> int:
    """Write CC and return CSTS."""
    assert q.command(F.PropertySet(offset=F.PROP_CC, value=cc)).status == 0
    return q.command(F.PropertyGet(offset=F.PROP_CSTS)).result
