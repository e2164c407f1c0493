"""The userspace NVMe-oF initiator: a scriptable Python API over any transport's Connector.

    ctrl = Controller.connect(connector, "nqn.2014-08.org.example:disk", num_io_queues=2)
    ctrl.write(1, 0, data)
    assert ctrl.read(1, 0, len(data) // 512) == data
    ctrl.close()

What goes on the wire follows the Linux host (docs/protocol.md §4.3, §5.1, §8.2):
FLAGS 0x40 on every command, keyed SGLs of type 0x40 (never 0x4F) with the
exact transfer length, no in-capsule data on the admin queue, in-capsule data
only for I/O writes that fit IOCCSZ; the admin queue is 32 entries (31
outstanding); enable by CAP / CC.EN=0 / CAP / CC.EN=1 / poll CSTS.RDY.

Asynchronous path (load generation): `submit_read` / `submit_write` /
`submit_io` take a callback and return at once; `poll_completions()` runs the
callbacks; submissions respect each queue's depth.
"""
from __future__ import annotations

import logging
import time
import uuid as uuidlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import NvmeofError
from ..host_identity import host_identity
from ..nvme import admin as A
from ..nvme import auth as auth_proto
from ..nvme import fabrics as F
from ..nvme import identify as I
from ..nvme import log as L
from ..nvme import status as S
from ..nvme.cm import ADMIN_QUEUE_DEPTH
from ..nvme import reservation as R
from ..nvme.command import (CQE_STRUCT, FLAGS_SGL, NSID_ALL, NVM_DSM, NVM_FLUSH, NVM_READ, NVM_RESV_ACQUIRE,
                            NVM_RESV_REGISTER, NVM_RESV_RELEASE, NVM_RESV_REPORT, NVM_WRITE, NVM_WRITE_ZEROES, SQE,
                            SQE_SIZE, SQE_STRUCT)
from ..nvme.nvm import DSM_AD, DsmRange, pack_dsm_ranges
from ..nvme.sgl import ID_IN_CAPSULE, ID_KEYED
from ..nvme.status import NvmeStatusError
from ..transport.contracts import Connector, TransportError
from .auth import RECEIVE_LENGTH, HostAuthenticator, HostAuthError
from .queue import CommandTimeout, Completion, HostError, QueueFull, SlotQueue

log = logging.getLogger(__name__)

DEFAULT_KATO_MS = 5000  # NVME_DEFAULT_KATO
DEFAULT_TIMEOUT = 30.0  # seconds to wait for one command
SHUTDOWN_TIMEOUT = 5.0
ADMIN_SLOT_SIZE = 4096
DEFAULT_IO_SLOT_SIZE = 128 * 1024

Callback = Callable[["Completion"], None]
IN_CAPSULE_WORD = ID_IN_CAPSULE << 56  # an in-capsule data SGL's word, less its length (docs/protocol.md §2.2)


# ---------------------------------------------------------------------- host identity

_default_identity: Optional[Tuple[str, bytes]] = None
IDENTITY_PATHS = None  # host_identity.Paths; tests point it at a tree of their own


def default_host_identity() -> Tuple[str, bytes]:
    """(host NQN, 16-byte host ID) as nvme-cli derives them (host_identity.py: /etc/nvme/config.json's first
    host, /etc/nvme/hostnqn and hostid, the machine's DMI UUID ...), the same for the whole process."""
    global _default_identity
    if _default_identity is None:
        ident = host_identity(paths=IDENTITY_PATHS)
        _default_identity = (ident.hostnqn, uuidlib.UUID(ident.hostid).bytes)
    return _default_identity


def _parse_secret(text: Optional[str], option: str):
    if not text:
        return None
    try:
        return auth_proto.parse_secret(text)
    except auth_proto.SecretError as exc:
        raise HostError(f"{option}: {exc}", "give the whole DHHC-1:NN:...: string (nvmeof-roce gen-dhchap-key)")


def _hostid_bytes(hostid) -> bytes:
    if hostid is None:
        return default_host_identity()[1]
    if isinstance(hostid, uuidlib.UUID):
        return hostid.bytes
    if isinstance(hostid, str):
        return uuidlib.UUID(hostid).bytes
    hostid = bytes(hostid)
    if len(hostid) != 16:
        raise HostError(f"host ID must be 16 bytes, got {len(hostid)}", "give a UUID")
    return hostid


class Controller:
    """A connected NVMe-oF controller (admin queue + I/O queues).  Use `Controller.connect(...)`."""

    def __init__(self, connector: Connector, subnqn: str, hostnqn: str, hostid: bytes, kato_ms: int,
                 timeout: float, clock: Callable[[], float], dhchap_secret: Optional[str] = None,
                 dhchap_ctrl_secret: Optional[str] = None):
        self.connector = connector
        self.dhchap_secret = _parse_secret(dhchap_secret, "--dhchap-secret")
        self.dhchap_ctrl_secret = _parse_secret(dhchap_ctrl_secret, "--dhchap-ctrl-secret")
        if self.dhchap_ctrl_secret is not None and self.dhchap_secret is None:
            raise HostError("--dhchap-ctrl-secret without --dhchap-secret",
                            "bidirectional authentication needs the host key too")
        self.authenticated_queues: List[int] = []
        self.subnqn = subnqn
        self.hostnqn = hostnqn
        self.hostid = hostid
        self.kato_ms = kato_ms
        self.timeout = timeout
        self.clock = clock
        self.cntlid = 0
        self.cap = 0
        self.vs = 0
        self.cc = 0
        self.id_ctrl: Optional[I.IdentifyController] = None
        self.admin: Optional[SlotQueue] = None
        self.io_queues: List[SlotQueue] = []
        self.events: List[Tuple[int, int, int]] = []  # (type, info, log page) of completed AERs
        self.namespaces_changed = False
        self.ana_changed = False  # an ANA change notice arrived; ana_log() clears it
        self._ns_cache: Dict[int, I.IdentifyNamespace] = {}
        self._next_io = 0
        self._last_keep_alive = clock()
        self._keep_alive_in_flight = False
        self._aer_enabled = False
        self.closed = False

    # ------------------------------------------------------------------ connect / close
    @classmethod
    def connect(cls, connector: Connector, subnqn: str, hostnqn: Optional[str] = None, hostid=None,
                num_io_queues: int = 1, queue_size: int = 32, kato_ms: Optional[int] = None,
                timeout: float = DEFAULT_TIMEOUT, io_slot_size: int = DEFAULT_IO_SLOT_SIZE,
                use_in_capsule: bool = True, enable_aen: bool = True,
                clock: Callable[[], float] = time.monotonic, dhchap_secret: Optional[str] = None,
                dhchap_ctrl_secret: Optional[str] = None) -> "Controller":
        """Connect the admin queue, enable the controller, identify it, then connect I/O queues.

        `queue_size` is the I/O queue depth asked for (clamped to CAP.MQES + 1 and MAXCMD);
        `kato_ms` defaults to 5000 for I/O controllers and 0 for discovery controllers.  With
        `dhchap_secret` (and `dhchap_ctrl_secret` for bidirectional authentication, both
        `DHHC-1:NN:...:`) every queue authenticates when the target asks (AUTHREQ.ATR)."""
        if hostnqn is None:
            hostnqn = default_host_identity()[0]
        is_discovery = subnqn == F.DISCOVERY_NQN
        if kato_ms is None:
            kato_ms = 0 if is_discovery else DEFAULT_KATO_MS
        ctrl = cls(connector, subnqn, hostnqn, _hostid_bytes(hostid), kato_ms, timeout, clock, dhchap_secret,
                   dhchap_ctrl_secret)
        try:
            ctrl._connect_admin()
            ctrl._enable()
            ctrl._identify_and_check(is_discovery)
            if not is_discovery and num_io_queues > 0:
                ctrl._connect_io_queues(num_io_queues, queue_size, io_slot_size, use_in_capsule)
            wanted = ctrl.id_ctrl.oaes & (A.AEN_CFG_NS_ATTR | A.AEN_CFG_ANA_CHANGE)
            if enable_aen and not is_discovery and wanted:
                ctrl.set_features(A.FEAT_ASYNC_EVENT, wanted)
                ctrl._submit_aer()
        except BaseException:
            ctrl._abort()
            raise
        return ctrl

    def _connect_admin(self) -> None:
        transport = self.connector.connect(0, ADMIN_QUEUE_DEPTH, ADMIN_QUEUE_DEPTH - 1, 0)
        # 31 outstanding at most, like Linux (30 tags + the AER); never in-capsule data on admin
        self.admin = SlotQueue(transport, 0, ADMIN_QUEUE_DEPTH - 1, ADMIN_SLOT_SIZE, 0)
        self.cntlid = self._fabrics_connect(self.admin, ADMIN_QUEUE_DEPTH - 1, F.DYNAMIC_CNTLID, self.kato_ms)
        log.debug("connected to %s as controller %d", self.subnqn, self.cntlid)

    def _fabrics_connect(self, q: SlotQueue, sqsize: int, cntlid: int, kato_ms: int) -> int:
        data = F.ConnectData(self.hostid, cntlid, self.subnqn, self.hostnqn).pack()
        sqe = F.ConnectCommand(qid=q.qid, sqsize=sqsize, kato=kato_ms).to_sqe()
        comp = self._sync(q, sqe, data_out=data, name="Connect")
        if comp.result & (auth_proto.CONNECT_AUTHREQ_ATR | auth_proto.CONNECT_AUTHREQ_ASCR):
            if comp.result & auth_proto.CONNECT_AUTHREQ_ASCR:
                raise HostError(f"{self.subnqn}: queue {q.qid}: the target requires a secure channel (AUTHREQ.ASCR)",
                                "secure channel concatenation (TLS) is not supported by this initiator")
            if self.dhchap_secret is None:
                raise HostError(f"{self.subnqn}: queue {q.qid}: the target requires DH-HMAC-CHAP authentication",
                                "give the host key: --dhchap-secret DHHC-1:NN:...: (the target's hosts[].dhchap.key)")
            self._authenticate(q)
        elif self.dhchap_ctrl_secret is not None and q.qid == 0:
            # An I/O queue the target lets in without authentication is fine once the admin queue proved the
            # controller's key, as the Linux host takes it (nvmf_connect_io_queue): Linux 7.2's nvmet asks on the
            # admin queue only.
            raise HostError(f"{self.subnqn}: queue {q.qid}: the target does not authenticate this host, so it "
                            "cannot prove its controller key", "configure hosts[].dhchap on the target, or drop "
                            "--dhchap-ctrl-secret")
        return comp.result & 0xFFFF

    def _auth_command(self, q: SlotQueue, fctype: int, length: int, data_out=None, name: str = "") -> Completion:
        sqe = SQE(opc=F.FABRICS_OPCODE, nsid=fctype, cdw10=auth_proto.auth_cdw10(), cdw11=length)
        return self._sync(q, sqe, data_out=data_out, data_in_len=0 if data_out is not None else length, name=name)

    def _authenticate(self, q: SlotQueue) -> None:
        """DH-HMAC-CHAP on one queue (NVMe Base 2.0 §8.13.5; nvme_auth_negotiate and its work function)."""
        chap = HostAuthenticator(self.dhchap_secret, self.dhchap_ctrl_secret, self.hostnqn, self.subnqn, q.qid)
        send, recv = F.FCTYPE_AUTH_SEND, F.FCTYPE_AUTH_RECV
        msg = chap.negotiate()
        self._auth_command(q, send, len(msg), msg, "Authentication Send (Negotiate)")
        challenge = self._auth_command(q, recv, RECEIVE_LENGTH, name="Authentication Receive (Challenge)").data
        try:
            msg = chap.reply(challenge)
            self._auth_command(q, send, len(msg), msg, "Authentication Send (Reply)")
            try:
                success1 = self._auth_command(q, recv, RECEIVE_LENGTH,
                                              name="Authentication Receive (Success1)").data
            except (CommandTimeout, TransportError) as exc:
                # nvmet answers a failed reply with AUTH_Failure1 and ends the controller at once
                # (nvmet_ctrl_fatal_error), so the Failure1 often never arrives.
                raise HostAuthError(f"{self.subnqn}: queue {q.qid}: the controller refused authentication: it "
                                    f"dropped the queue after our DH-HMAC-CHAP reply ({exc})",
                                    "most likely a wrong host key: check --dhchap-secret against the target's key "
                                    "for this host NQN (the target's log says)") from None
            msg = chap.success1(success1)
        except HostAuthError as exc:
            if exc.failure2 is not None:
                try:
                    self._auth_command(q, send, len(exc.failure2), exc.failure2, "Authentication Send (Failure2)")
                except NvmeofError:
                    pass  # the failure is what we report
            raise
        if msg is not None:
            self._auth_command(q, send, len(msg), msg, "Authentication Send (Success2)")
        self.authenticated_queues.append(q.qid)
        log.debug("queue %d authenticated (%s, %s)", q.qid, auth_proto.HASH_NAMES[chap.hash_id],
                  auth_proto.DHGROUP_NAMES[chap.dhgroup_id])

    def _enable(self) -> None:
        self.cap = self.property_get(F.PROP_CAP, size8=True)
        css = F.CC_CSS_CSI << F.CC_CSS_SHIFT if self.cap & (1 << 43) else 0
        self.cc = F.CC_DEFAULT | css
        self.property_set(F.PROP_CC, self.cc)  # EN = 0 first, as recent Linux hosts do
        self.cap = self.property_get(F.PROP_CAP, size8=True)
        self.cc |= F.CC_EN
        self.property_set(F.PROP_CC, self.cc)
        deadline = time.monotonic() + max(F.cap_timeout_ms(self.cap), 500) / 1000 + 0.5
        while True:
            csts = self.property_get(F.PROP_CSTS)
            if csts == 0xFFFFFFFF or csts & F.CSTS_CFS:
                raise HostError(f"{self.subnqn}: controller fatal status after enable (CSTS {csts:#x})",
                                "the target refused CC; check its log")
            if csts & F.CSTS_RDY:
                break
            if time.monotonic() > deadline:
                raise CommandTimeout(f"{self.subnqn}: CSTS.RDY not set within CAP.TO", "check the target")
            time.sleep(0.001)
        self.vs = self.property_get(F.PROP_VS)

    def _identify_and_check(self, is_discovery: bool) -> None:
        idc = self.identify_controller()
        if idc.cntlid != self.cntlid:
            raise HostError(f"{self.subnqn}: Identify CNTLID {idc.cntlid} differs from Connect's {self.cntlid}")
        if not idc.sgls & I.SGLS_KEYED:
            raise HostError(f"{self.subnqn}: mandatory keyed SGLs are not supported by the controller")
        if idc.icdoff != 0:
            raise HostError(f"{self.subnqn}: ICDOFF {idc.icdoff} is not supported")
        if is_discovery and idc.subnqn != F.DISCOVERY_NQN and idc.cntrltype != I.CNTRLTYPE_DISCOVERY:
            raise HostError(f"{self.subnqn}: the subsystem is not a discovery controller")
        if not is_discovery and idc.kas == 0 and self.kato_ms:
            log.warning("%s: KAS is 0, keep-alive support is mandatory for fabrics", self.subnqn)

    def _connect_io_queues(self, count: int, queue_size: int, slot_size: int, use_in_capsule: bool) -> None:
        result = self.set_features(A.FEAT_NUM_QUEUES, ((count - 1) << 16) | (count - 1))
        granted = min(result & 0xFFFF, result >> 16) + 1
        count = min(count, granted)
        size = min(queue_size, F.cap_mqes(self.cap) + 1)
        if self.id_ctrl.maxcmd:
            size = min(size, self.id_ctrl.maxcmd)
        if size < 2:
            raise HostError(f"{self.subnqn}: I/O queue size {size} is too small")
        in_capsule = 0
        if use_in_capsule and self.id_ctrl.sgls & I.SGLS_OFFSET:
            in_capsule = max(0, self.id_ctrl.ioccsz * 16 - SQE_SIZE)
        max_transfer = 4096 << self.id_ctrl.mdts if self.id_ctrl.mdts else slot_size
        slot_size = min(slot_size, max_transfer)
        for qid in range(1, count + 1):
            transport = self.connector.connect(qid, size, size - 1, self.cntlid)
            q = SlotQueue(transport, qid, size, slot_size, in_capsule)
            self.io_queues.append(q)
            self._fabrics_connect(q, size - 1, self.cntlid, 0)

    def close(self) -> None:
        """Disconnect I/O queues, shut the controller down (CC.SHN, wait SHST), disconnect admin."""
        if self.closed:
            return
        self.closed = True
        for q in self.io_queues:
            self._close_transport(q)
        self.io_queues = []
        if self.admin is not None and not self.admin.dead:
            try:
                self.property_set(F.PROP_CC, (self.cc & ~F.CC_SHN_MASK) | F.CC_SHN_NORMAL)
                deadline = time.monotonic() + SHUTDOWN_TIMEOUT
                while (self.property_get(F.PROP_CSTS) & F.CSTS_SHST_MASK) != F.CSTS_SHST_COMPLETE:
                    if time.monotonic() > deadline:
                        log.warning("%s: shutdown did not complete within %.0f s", self.subnqn, SHUTDOWN_TIMEOUT)
                        break
                    time.sleep(0.001)
            except (TransportError, NvmeofError) as exc:
                log.warning("%s: shutdown: %s", self.subnqn, exc)
        if self.admin is not None:
            self._close_transport(self.admin)

    def _abort(self) -> None:
        self.closed = True
        for q in self.io_queues + ([self.admin] if self.admin else []):
            self._close_transport(q)

    @staticmethod
    def _close_transport(q: SlotQueue) -> None:
        try:
            q.transport.close()
        except TransportError:
            pass
        q.dead = q.dead or "closed"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ submitting and completing
    def _submit(self, q: SlotQueue, sqe: SQE, data_out=None, data_in_len: int = 0,
                callback: Optional[Callback] = None, name: str = "", block: bool = True,
                allow_big: bool = False) -> int:
        """Queue one command on `q`; returns its CID.  Data goes through the command's slot."""
        if q.dead:
            raise TransportError(f"queue {q.qid} is disconnected: {q.dead}")
        if not q.free:
            if not block:
                raise QueueFull(f"queue {q.qid}: all {q.depth} command slots are in use")
            self._wait(q, lambda: bool(q.free), f"a free slot on queue {q.qid}")
        slot, cid = q.take()
        big = None
        length = len(data_out) if data_out is not None else data_in_len
        try:
            if data_out is not None and length and length <= q.in_capsule_max:
                sgl_addr, sgl_word = 0, length | (ID_IN_CAPSULE << 56)
                payload = bytes(data_out)
            else:
                payload = None
                if length > q.slot_size:
                    if not allow_big:
                        raise HostError(f"{name}: transfer of {length} bytes exceeds the {q.slot_size}-byte slot",
                                        "split it (read()/write() do) or connect with a larger io_slot_size")
                    big = q.big_buffer(length)
                    addr, key, view = big.addr, big.key, big.view
                else:
                    addr, key, view = q.slot_addr(slot), q.memory.key, q.slot_view(slot)
                if data_out is not None and length:
                    view[:length] = data_out
                if length:
                    sgl_addr, sgl_word = addr, length | (key << 24) | (ID_KEYED << 56)
                else:
                    sgl_addr, sgl_word = 0, ID_KEYED << 56
            capsule = SQE_STRUCT.pack(sqe.opc, FLAGS_SGL, cid, sqe.nsid, sqe.cdw2, sqe.cdw3, 0, sgl_addr, sgl_word,
                                      sqe.cdw10, sqe.cdw11, sqe.cdw12, sqe.cdw13, sqe.cdw14, sqe.cdw15)
            if payload is not None:
                capsule += payload
            q.callbacks[slot] = callback
            q.tags[slot] = None
            q.data_lens[slot] = data_in_len
            q.names[slot] = name
            q.bigs[slot] = big
            q.transport.send(capsule)
        except BaseException:
            q.release(slot)
            raise
        return cid

    def submit_tagged(self, q: SlotQueue, write: bool, nsid: int, slba: int, nlb: int, length: int,
                      on_done: Callable[[int, int], None], tag: int, data=None) -> None:
        """The load generator's path: one NVM Read or Write of `length` bytes (`nlb` blocks, 1's based) on
        I/O queue `q` with nothing built per command but its capsule.  When it completes `on_done(tag,
        status)` runs, its slot already free again, so the callback may submit the next one.  A Write sends
        `data` (in the capsule if it fits, else from the slot); a Read's data lands in the slot and is not
        handed over.  Raises QueueFull when no slot is free."""
        if q.dead:
            raise TransportError(f"queue {q.qid} is disconnected: {q.dead}")
        if not q.free:
            raise QueueFull(f"queue {q.qid}: all {q.depth} command slots are in use")
        if length > q.slot_size:
            raise HostError(f"transfer of {length} bytes exceeds the {q.slot_size}-byte slot",
                            "connect with a larger io_slot_size")
        slot, cid = q.take()
        if write and length <= q.in_capsule_max:
            capsule = SQE_STRUCT.pack(NVM_WRITE, FLAGS_SGL, cid, nsid, 0, 0, 0, 0, length | IN_CAPSULE_WORD,
                                      slba & 0xFFFFFFFF, slba >> 32, (nlb - 1) & 0xFFFF, 0, 0, 0) + data
        else:
            addr = q.slot_addrs[slot]
            if write:
                start = slot * q.slot_size
                q.memory.view[start:start + length] = data
            capsule = SQE_STRUCT.pack(NVM_WRITE if write else NVM_READ, FLAGS_SGL, cid, nsid, 0, 0, 0, addr,
                                      length | q.keyed_word, slba & 0xFFFFFFFF, slba >> 32, (nlb - 1) & 0xFFFF,
                                      0, 0, 0)
        q.callbacks[slot] = on_done
        q.tags[slot] = tag
        try:
            q.transport.send(capsule)
        except BaseException:
            q.release(slot)
            raise

    def _process_queue(self, q: SlotQueue, timeout: float = 0.0) -> int:
        """Poll one queue and run the callbacks of what completed."""
        try:
            cqes = q.transport.poll(timeout)
        except TransportError as exc:
            q.dead = str(exc) or "transport error"
            q.release_all()
            raise
        if not cqes:
            return 0
        if q.defer_sends is None:
            self._complete(q, cqes)
            return len(cqes)
        q.defer_sends()  # what the callbacks submit goes out with one doorbell at the end
        try:
            self._complete(q, cqes)
        finally:
            q.flush()
        return len(cqes)

    @staticmethod
    def _complete(q: SlotQueue, cqes: list) -> None:
        unpack = CQE_STRUCT.unpack
        cids, tags, callbacks = q.cids, q.tags, q.callbacks
        for raw in cqes:
            result, dw1, _sqhd, sqid, cid, wire = unpack(raw)
            slot = cid & 0xFFF
            if slot >= q.depth or cids[slot] != cid:
                raise HostError(f"queue {q.qid}: completion for unknown command ID {cid:#x}",
                                "the target violated the protocol; reconnect")
            if sqid != q.qid:
                raise HostError(f"queue {q.qid}: completion for CID {cid:#x} names SQID {sqid}",
                                "the target violated the protocol; reconnect")
            callback = callbacks[slot]
            tag = tags[slot]
            if tag is not None:  # submit_tagged: free the slot first, the callback may reuse it
                q.release(slot)
                callback(tag, wire >> 1)
                continue
            data = None
            data_len = q.data_lens[slot]
            if data_len:
                big = q.bigs[slot]
                source = big.view if big is not None else q.slot_view(slot)
                data = source[:data_len]
            try:
                if callback is not None:
                    callback(Completion(q.qid, cid, wire >> 1, result, dw1, data, q.names[slot]))
            finally:
                q.release(slot)

    def _wait(self, q: SlotQueue, done: Callable[[], bool], what: str, timeout: Optional[float] = None) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not done():
            self._process_queue(q, 0.01)
            if not done() and time.monotonic() > deadline:
                raise CommandTimeout(f"timed out waiting for {what} on queue {q.qid}",
                                     "the target did not answer; check it and the connection")

    def _sync(self, q: SlotQueue, sqe: SQE, data_out=None, data_in_len: int = 0, name: str = "") -> Completion:
        box: List[Completion] = []

        def keep(comp: Completion) -> None:
            if comp.data is not None:
                comp.data = bytes(comp.data)  # the slot is reused after the callback
            box.append(comp)

        self._submit(q, sqe, data_out, data_in_len, keep, name, allow_big=True)
        self._wait(q, lambda: bool(box), name)
        return box[0].raise_for_status()

    def admin_command(self, sqe: SQE, data_out=None, data_in_len: int = 0, name: str = "admin command") -> Completion:
        """Run any admin command synchronously (raises NvmeStatusError on an error status)."""
        return self._sync(self.admin, sqe, data_out, data_in_len, name)

    # ------------------------------------------------------------------ fabrics and admin commands
    def property_get(self, offset: int, size8: bool = False) -> int:
        comp = self._sync(self.admin, F.PropertyGet(offset=offset, size8=size8).to_sqe(), name="Property Get")
        return comp.result64 if size8 else comp.result

    def property_set(self, offset: int, value: int) -> None:
        self._sync(self.admin, F.PropertySet(offset=offset, value=value).to_sqe(), name="Property Set")

    def identify(self, cns: int, nsid: int = 0, csi: int = 0) -> bytes:
        sqe = A.IdentifyCommand(cns=cns, nsid=nsid, csi=csi).to_sqe()
        return self._sync(self.admin, sqe, data_in_len=I.IDENTIFY_SIZE, name=f"Identify CNS {cns:#x}").data

    def identify_controller(self) -> I.IdentifyController:
        self.id_ctrl = I.IdentifyController.unpack(self.identify(A.CNS_CONTROLLER))
        return self.id_ctrl

    def identify_namespace(self, nsid: int) -> I.IdentifyNamespace:
        ns = I.IdentifyNamespace.unpack(self.identify(A.CNS_NAMESPACE, nsid))
        if ns.present:
            self._ns_cache[nsid] = ns
        else:
            self._ns_cache.pop(nsid, None)
        return ns

    def namespace_descriptors(self, nsid: int) -> I.NsDescriptorList:
        return I.NsDescriptorList.unpack(self.identify(A.CNS_NS_DESC_LIST, nsid))

    def active_namespaces(self) -> List[int]:
        """All active NSIDs (CNS 0x02, continued while a 1024-entry page comes back full)."""
        out: List[int] = []
        start = 0
        while True:
            page = I.ActiveNamespaceList.unpack(self.identify(A.CNS_ACTIVE_NS_LIST, start)).nsids
            out.extend(page)
            if len(page) < I.ActiveNamespaceList.MAX_ENTRIES:
                return out
            start = page[-1]

    def set_features(self, fid: int, value: int) -> int:
        sqe = A.SetFeaturesCommand(fid=fid, value=value).to_sqe()
        return self._sync(self.admin, sqe, name=f"Set Features {fid:#x}").result

    def get_features(self, fid: int, cdw11: int = 0) -> int:
        sqe = A.GetFeaturesCommand(fid=fid, cdw11=cdw11).to_sqe()
        return self._sync(self.admin, sqe, name=f"Get Features {fid:#x}").result

    def get_log_page(self, lid: int, length: int, nsid: int = NSID_ALL, offset: int = 0, rae: bool = False,
                     lsp: int = 0) -> bytes:
        """Read `length` bytes (a multiple of 4) of log page `lid` starting at byte `offset`."""
        cmd = A.GetLogPageCommand(lid=lid, numd=A.GetLogPageCommand.numd_for(length), nsid=nsid, lpo=offset,
                                  rae=rae, lsp=lsp)
        return self._sync(self.admin, cmd.to_sqe(), data_in_len=length, name=f"Get Log Page {lid:#x}").data

    def smart_log(self, nsid: int = NSID_ALL) -> L.SmartLog:
        return L.SmartLog.unpack(self.get_log_page(A.LID_SMART, L.SMART_LOG_SIZE, nsid))

    def error_log(self, entries: int = 64) -> List[L.ErrorLogEntry]:
        raw = self.get_log_page(A.LID_ERROR, entries * L.ERROR_ENTRY_SIZE)
        out = [L.ErrorLogEntry.unpack(raw, i * L.ERROR_ENTRY_SIZE) for i in range(entries)]
        return [e for e in out if e.error_count]

    def changed_namespaces(self) -> List[int]:
        """Read (and so clear) the Changed Namespace List log; re-arms namespace-change events."""
        self.namespaces_changed = False
        return L.ChangedNsList.unpack(self.get_log_page(A.LID_CHANGED_NS, L.CHANGED_NS_LOG_SIZE)).nsids

    def ana_log(self, groups_only: bool = False) -> L.AnaLog:
        """Read the whole ANA log (sized as the Linux host sizes it from NANAGRPID and MNAN); re-arms ANA
        change notices.  `groups_only` sets RGO: the groups and states without their NSID lists."""
        idc = self.id_ctrl
        if not idc.anacap or not idc.cmic & I.CMIC_ANA:
            raise NvmeofError(f"{self.subnqn}: the controller does not report ANA (CMIC bit 3 clear)",
                              "ANA needs a target with ANA groups (our target, or nvmet with multipath)")
        length = L.ANA_HEADER_SIZE + idc.nanagrpid * L.ANA_DESC_SIZE + (0 if groups_only else 4 * idc.mnan)
        self.ana_changed = False
        raw = self.get_log_page(A.LID_ANA, length, lsp=L.ANA_LSP_RGO if groups_only else 0)
        return L.AnaLog.unpack(raw)

    def keep_alive(self) -> None:
        self._sync(self.admin, A.KeepAliveCommand().to_sqe(), name="Keep Alive")
        self._last_keep_alive = self.clock()

    def maybe_keep_alive(self) -> bool:
        """Send a Keep Alive (asynchronously) if KATO/2 passed since the last one; True if sent.
        Call it from your loop; it also reaps finished admin completions (AERs, earlier keep-alives)."""
        if self.admin is None or self.admin.dead:
            return False
        self._process_queue(self.admin)
        if not self.kato_ms or self._keep_alive_in_flight:
            return False
        now = self.clock()
        if (now - self._last_keep_alive) * 1000 < self.kato_ms / 2:
            return False

        def done(comp: Completion) -> None:
            self._keep_alive_in_flight = False
            if not comp.ok:
                log.warning("%s: Keep Alive failed: %s", self.subnqn, S.describe(comp.status))

        self._keep_alive_in_flight = True
        self._last_keep_alive = now
        try:
            self._submit(self.admin, A.KeepAliveCommand().to_sqe(), callback=done, name="Keep Alive")
        except BaseException:
            self._keep_alive_in_flight = False
            raise
        return True

    def _submit_aer(self) -> None:
        def event(comp: Completion) -> None:
            if not comp.ok:  # like Linux: an AER that fails is not resubmitted
                log.info("%s: AER completed with %s", self.subnqn, S.describe(comp.status))
                return
            ev = A.parse_aer_result(comp.result)
            self.events.append(ev)
            if ev[0] == A.AER_TYPE_NOTICE and ev[1] == A.AER_NOTICE_NS_CHANGED:
                self.namespaces_changed = True
            if ev[0] == A.AER_TYPE_NOTICE and ev[1] == A.AER_NOTICE_ANA:
                self.ana_changed = True
                self._ns_cache.clear()
            if not self.closed and not self.admin.dead:
                self._submit_aer()

        self._submit(self.admin, A.AsyncEventRequestCommand().to_sqe(), callback=event, name="AER")
        self._aer_enabled = True

    def poll_admin(self) -> int:
        """Reap admin completions (AER events land in `events`)."""
        return self._process_queue(self.admin)

    # ------------------------------------------------------------------ NVM I/O
    def block_size(self, nsid: int) -> int:
        ns = self._ns_cache.get(nsid)
        if ns is None:
            ns = self.identify_namespace(nsid)
            if not ns.present:
                raise NvmeStatusError(S.INVALID_NS | S.DNR, f"namespace {nsid} is not active")
        return ns.block_size

    def _pick_queue(self, qid: Optional[int]) -> SlotQueue:
        if not self.io_queues:
            raise HostError(f"{self.subnqn}: no I/O queues", "connect with num_io_queues >= 1")
        if qid is not None:
            for q in self.io_queues:
                if q.qid == qid:
                    return q
            raise HostError(f"no I/O queue {qid}")
        # round robin, preferring a queue with a free slot
        n = len(self.io_queues)
        for i in range(n):
            q = self.io_queues[(self._next_io + i) % n]
            if q.free and not q.dead:
                self._next_io = (self._next_io + i + 1) % n
                return q
        q = self.io_queues[self._next_io % n]
        self._next_io = (self._next_io + 1) % n
        return q

    def submit_io(self, sqe: SQE, callback: Optional[Callback] = None, data_out=None, data_in_len: int = 0,
                  qid: Optional[int] = None, block: bool = True, name: str = "I/O") -> Tuple[int, int]:
        """Submit any I/O command; returns (qid, cid).  The callback gets a Completion."""
        q = self._pick_queue(qid)
        return q.qid, self._submit(q, sqe, data_out, data_in_len, callback, name, block)

    def submit_read(self, nsid: int, slba: int, nlb: int, callback: Callback, qid: Optional[int] = None,
                    block: bool = True, block_size: Optional[int] = None) -> Tuple[int, int]:
        """Read `nlb` blocks (1's based count); `completion.data` is valid during the callback only."""
        bs = block_size or self.block_size(nsid)
        sqe = SQE(opc=NVM_READ, nsid=nsid, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32, cdw12=(nlb - 1) & 0xFFFF)
        return self.submit_io(sqe, callback, data_in_len=nlb * bs, qid=qid, block=block, name="Read")

    def submit_write(self, nsid: int, slba: int, data, callback: Optional[Callback] = None,
                     qid: Optional[int] = None, block: bool = True, block_size: Optional[int] = None,
                     fua: bool = False) -> Tuple[int, int]:
        bs = block_size or self.block_size(nsid)
        if not len(data) or len(data) % bs:
            raise HostError(f"write of {len(data)} bytes is not a whole number of {bs}-byte blocks")
        nlb = len(data) // bs
        control = (1 << 14) if fua else 0
        sqe = SQE(opc=NVM_WRITE, nsid=nsid, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32,
                  cdw12=((nlb - 1) & 0xFFFF) | (control << 16))
        return self.submit_io(sqe, callback, data_out=data, qid=qid, block=block, name="Write")

    def poll_completions(self, timeout: float = 0.0, admin: bool = True) -> int:
        """Reap completions on every I/O queue (and the admin queue unless `admin` is False: a loop that
        calls `maybe_keep_alive` now and then reaps it there); returns how many ran."""
        count = 0
        for q in self.io_queues:
            if q.outstanding:
                count += self._process_queue(q, timeout)
        if admin and self.admin is not None and not self.admin.dead and self.admin.outstanding:
            count += self._process_queue(self.admin)
        return count

    @property
    def outstanding(self) -> int:
        return sum(q.outstanding for q in self.io_queues)

    def wait_idle(self, timeout: Optional[float] = None) -> None:
        """Poll until no I/O command is outstanding."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while self.outstanding:
            self.poll_completions(0.01)
            if self.outstanding and time.monotonic() > deadline:
                raise CommandTimeout(f"{self.outstanding} I/O commands still outstanding")

    def _max_blocks(self, bs: int) -> int:
        return max(1, self.io_queues[0].slot_size // bs) if self.io_queues else 1

    def read(self, nsid: int, slba: int, nlb: int, qid: Optional[int] = None) -> bytes:
        """Read `nlb` blocks from `slba` (split into slot-sized commands, pipelined)."""
        bs = self.block_size(nsid)
        out = bytearray(nlb * bs)
        failures: List[Completion] = []
        per_cmd = self._max_blocks(bs)
        for first in range(0, nlb, per_cmd):
            count = min(per_cmd, nlb - first)

            def done(comp: Completion, pos=first * bs) -> None:
                if comp.ok:
                    out[pos:pos + len(comp.data)] = comp.data
                else:
                    failures.append(comp)

            self.submit_read(nsid, slba + first, count, done, qid=qid, block_size=bs)
        self.wait_idle()
        if failures:
            failures[0].raise_for_status()
        return bytes(out)

    def write(self, nsid: int, slba: int, data, qid: Optional[int] = None, fua: bool = False) -> None:
        """Write whole blocks from `slba` (split into slot-sized commands, pipelined)."""
        bs = self.block_size(nsid)
        view = memoryview(bytes(data) if not isinstance(data, (bytes, bytearray, memoryview)) else data).cast("B")
        if not len(view) or len(view) % bs:
            raise HostError(f"write of {len(view)} bytes is not a whole number of {bs}-byte blocks")
        failures: List[Completion] = []
        per_cmd = self._max_blocks(bs) * bs
        for pos in range(0, len(view), per_cmd):
            chunk = view[pos:pos + per_cmd]
            self.submit_write(nsid, slba + pos // bs, chunk, lambda c: c.ok or failures.append(c), qid=qid,
                              block_size=bs, fua=fua)
        self.wait_idle()
        if failures:
            failures[0].raise_for_status()

    def _io_sync(self, sqe: SQE, data_out=None, qid: Optional[int] = None, name: str = "I/O") -> Completion:
        q = self._pick_queue(qid)
        return self._sync(q, sqe, data_out=data_out, name=name)

    def flush(self, nsid: int, qid: Optional[int] = None) -> None:
        self._io_sync(SQE(opc=NVM_FLUSH, nsid=nsid), qid=qid, name="Flush")

    def write_zeroes(self, nsid: int, slba: int, nlb: int, qid: Optional[int] = None) -> None:
        sqe = SQE(opc=NVM_WRITE_ZEROES, nsid=nsid, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32,
                  cdw12=(nlb - 1) & 0xFFFF)
        self._io_sync(sqe, qid=qid, name="Write Zeroes")

    def dsm_deallocate(self, nsid: int, ranges: Sequence[Tuple[int, int]], qid: Optional[int] = None) -> None:
        """Deallocate (discard) a list of (slba, nlb) ranges, nlb a 1's based block count."""
        if not 1 <= len(ranges) <= 256:
            raise HostError(f"DSM takes 1..256 ranges, got {len(ranges)}")
        data = pack_dsm_ranges([DsmRange(slba, nlb) for slba, nlb in ranges])
        sqe = SQE(opc=NVM_DSM, nsid=nsid, cdw10=len(ranges) - 1, cdw11=DSM_AD)
        self._io_sync(sqe, data_out=data, qid=qid, name="Dataset Management")

    # ------------------------------------------------------------------ reservations (nvme/reservation.py)
    def resv_register(self, nsid: int, action: int = R.REGISTER, nrkey: int = 0, crkey: int = 0,
                      iekey: bool = False, cptpl: int = R.CPTPL_NO_CHANGE, qid: Optional[int] = None) -> Completion:
        """Reservation Register: register (NRKEY), unregister or replace (CRKEY, or any with IEKEY)."""
        sqe = SQE(opc=NVM_RESV_REGISTER, nsid=nsid, cdw10=R.register_cdw10(action, iekey, cptpl))
        return self._io_sync(sqe, data_out=R.KEYS.pack(crkey, nrkey), qid=qid, name="Reservation Register")

    def resv_acquire(self, nsid: int, rtype: int, crkey: int, action: int = R.ACQUIRE, prkey: int = 0,
                     qid: Optional[int] = None) -> Completion:
        """Reservation Acquire: acquire, preempt or preempt and abort (PRKEY: the key preempted)."""
        sqe = SQE(opc=NVM_RESV_ACQUIRE, nsid=nsid, cdw10=R.acquire_cdw10(action, rtype))
        return self._io_sync(sqe, data_out=R.KEYS.pack(crkey, prkey), qid=qid, name="Reservation Acquire")

    def resv_release(self, nsid: int, rtype: int, crkey: int, action: int = R.RELEASE,
                     qid: Optional[int] = None) -> Completion:
        """Reservation Release: release the reservation of type `rtype`, or clear every registration."""
        sqe = SQE(opc=NVM_RESV_RELEASE, nsid=nsid, cdw10=R.release_cdw10(action, rtype))
        return self._io_sync(sqe, data_out=crkey.to_bytes(8, "little"), qid=qid, name="Reservation Release")

    def resv_report(self, nsid: int, length: int = 4096, eds: bool = True,
                    qid: Optional[int] = None) -> R.ReservationStatus:
        """Reservation Report with the extended data structure (128-bit host identifiers)."""
        sqe = SQE(opc=NVM_RESV_REPORT, nsid=nsid, cdw10=length // 4 - 1, cdw11=R.EDS if eds else 0)
        q = self._pick_queue(qid)
        return R.ReservationStatus.unpack(self._sync(q, sqe, data_in_len=length, name="Reservation Report").data)

    def resv_notification(self, rae: bool = False) -> R.NotificationLog:
        """Read (and so take) the oldest Reservation Notification log entry (count 0: none left)."""
        return R.NotificationLog.unpack(self.get_log_page(A.LID_RESERVATION, R.LOG_SIZE, rae=rae))
