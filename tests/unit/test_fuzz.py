"""Property-based fuzzing of the target over the loopback fabric.

Each hypothesis example builds a fresh target, connects a well-behaved host
(its own subsystem, reachable only with a host NQN the fuzzer cannot guess),
and drives several fuzz queues: an unconnected admin queue, a connected and
enabled admin queue, an I/O queue, an unconnected I/O queue and a discovery
controller.  Hypothesis draws ~40 capsule templates (opcode, flags, NSID, SGL
form, lengths, command dwords, Connect data, the queue) and a seed; each
template is expanded into mutated variants (bit flips, field swaps), so one
example sends about a thousand capsules in a shuffled order with partial pumps
in between, interleaved with the good host's I/O.

Invariants:
  - every capsule gets exactly one well-formed completion (CID echoed, SQID of
    its queue, phase 0) or its queue is torn down cleanly; only AERs may stay
    outstanding (held), at most four per controller;
  - the target never raises and never counts an internal error;
  - the good host's data always reads back as written.
"""
import logging
import os
import random
import struct
import uuid
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopback_env import Env, add_namespace, null_ns, port, ram_ns, remove_namespace
from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.nvme.command import CQE_STRUCT, SQE_STRUCT
from nvmeof_roce.nvme.sgl import ID_IN_CAPSULE, ID_KEYED
from nvmeof_roce.transport.contracts import TransportError
from nvmeof_roce.transport.loopback import SendQueueFull

pytestmark = pytest.mark.fuzz

ADDR = "10.99.0.1:4420"
SUB_GOOD = "nqn.2024-01.io.test:good"
SUB_FUZZ = "nqn.2024-01.io.test:fuzz"
SUB_FUZZ4K = "nqn.2024-01.io.test:fuzz4k"
SUB_FUZZNULL = "nqn.2024-01.io.test:fuzznull"
FUZZ_HOST = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000f0022"
GOOD_REGION = 64  # blocks the good host writes and checks
# NVMEOF_FUZZ_EXAMPLES shortens a local run; the default run sends over 100,000 capsules
EXAMPLES = int(os.environ.get("NVMEOF_FUZZ_EXAMPLES", 120))
TARGET_CAPSULES = 100_000 if EXAMPLES >= 120 else EXAMPLES * 500
VARIANTS = 30
BUFFER_SIZE = (1 << 20) + 8192

# fuzz queue slots: (name, qid)
UNCONNECTED_ADMIN, ADMIN, IO, UNCONNECTED_IO, DISCOVERY = range(5)
SLOT_QIDS = {UNCONNECTED_ADMIN: 0, ADMIN: 0, IO: 1, UNCONNECTED_IO: 2, DISCOVERY: 0}

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, (1 << 64) - 1)
interesting32 = st.sampled_from([0, 1, 2, 3, 7, 8, 0xF, 0x10, 31, 32, 127, 128, 255, 256, 1023, 1024, 4095, 4096,
                                 0x7FFF, 0x8000, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF])
dword = st.one_of(interesting32, u32)
opcodes = st.one_of(st.sampled_from([0x00, 0x01, 0x02, 0x04, 0x05, 0x06, 0x08, 0x09, 0x0A, 0x0C, 0x18, 0x7F]), u8)
nqn_choices = st.sampled_from([SUB_FUZZ, SUB_FUZZ4K, SUB_FUZZNULL, SUB_GOOD, F.DISCOVERY_NQN, "", "nqn.x",
                               "nqn.2024-01.io.test:" + "z" * 300, "\xff\xfe", FUZZ_HOST])



def mostly(common, rare):
    """`common` about four times out of five (hypothesis picks one_of branches evenly)."""
    return st.one_of(common, common, common, common, rare)


template_strategy = st.fixed_dictionaries({
    "slot": st.sampled_from([UNCONNECTED_ADMIN, ADMIN, ADMIN, ADMIN, IO, IO, IO, IO, UNCONNECTED_IO, DISCOVERY]),
    "opc": opcodes,
    "typical_fields": st.integers(0, 9),  # < 7: opcode and fields picked to be plausible for the queue
    "flags": mostly(st.just(0x40), st.one_of(st.sampled_from([0x80, 0x00, 0x41, 0x42, 0xC0]), u8)),
    "cid": u16,
    "nsid": mostly(st.sampled_from([1, 1, 2]), st.one_of(st.sampled_from([0, 3, 0xFFFFFFFF]), u32)),
    "fctype": st.one_of(st.sampled_from([0x00, 0x01, 0x04, 0x05, 0x06, 0x08]), u8),
    "sgl": st.sampled_from(["zero", "keyed", "keyed", "keyed", "keyed_inv", "bad_key", "out_of_bounds",
                            "inline", "inline", "raw"]),
    "sgl_len": st.one_of(st.sampled_from([0, 1, 16, 64, 512, 1023, 1024, 1025, 4096, 4097, 8192, 1 << 20,
                                          (1 << 20) + 512]), st.integers(0, 1 << 24)),
    "sgl_offset": mostly(st.just(0), st.one_of(st.integers(0, 5000), u64)),
    "sgl_raw": st.tuples(u64, u64),
    "cdw": st.lists(dword, min_size=8, max_size=8),  # cdw2, cdw3, cdw10..cdw15
    "match_length": mostly(st.just(True), st.just(False)),  # make the SGL length what the command implies
    "extra": st.sampled_from([0] * 12 + [16, 512, 1024, 4096, 4097, 6000]),
    "short": st.sampled_from([False] * 31 + [True]),
    "connect": st.fixed_dictionaries({
        "subnqn": nqn_choices, "hostnqn": st.sampled_from([FUZZ_HOST, FUZZ_HOST, "", "nqn.2014-08.org.x:h", "\x01"]),
        "cntlid": st.one_of(st.sampled_from([0xFFFF, 0, 1, 2, 2]), u16), "raw": st.sampled_from([False] * 4 + [True]),
    }),
})

SLOT_MIX = [UNCONNECTED_ADMIN, ADMIN, ADMIN, ADMIN, IO, IO, IO, IO, IO, UNCONNECTED_IO, DISCOVERY]
ADMIN_OPS = [0x06, 0x06, 0x02, 0x02, 0x09, 0x0A, 0x0C, 0x18, 0x7F, 0x7F, 0x7F]
IO_OPS = [0x02, 0x02, 0x01, 0x01, 0x00, 0x08, 0x09, 0x7F]


def plausible_fields(slot, rng, opc, fctype, cdws):
    """Opcode and dwords a real host might send on this queue, so the fuzz reaches deep paths."""
    cdw2, cdw3, cdw10, cdw11, cdw12, cdw13, cdw14, cdw15 = cdws
    if SLOT_QIDS[slot] == 0:
        opc = rng.choice(ADMIN_OPS)
        if opc == 0x7F:
            fctype = rng.choice([0x04, 0x04, 0x00, 0x01, 0x08])
            if fctype == 0x04:
                cdw10, cdw11 = rng.choice([(1, 0), (0, 0x08), (0, 0x14), (0, 0x1C), (0, rng.randrange(0x80))])
            elif fctype == 0x00:
                cdw10, cdw11 = 0, 0x14
                # mostly (re-)enable, so a fuzzed disable or shutdown does not silence the rest
                cdw12 = rng.choice([F.CC_DEFAULT | F.CC_EN] * 4 + [F.CC_DEFAULT, F.CC_EN, cdw12,
                                                                   F.CC_DEFAULT | F.CC_EN | F.CC_SHN_NORMAL])
        elif opc == 0x06:
            cdw10 = rng.choice([0, 1, 2, 3, 6, 8, 0x10, rng.getrandbits(8)])
        elif opc == 0x02:
            numd = rng.choice([127, 255, 1023, 15, rng.randrange(2048)])
            cdw10 = rng.choice([1, 2, 3, 4, 5, 0x70, 0x0C, rng.getrandbits(8)]) | (numd << 16) | \
                rng.choice([0, 0x8000])
            cdw11 = 0
            cdw12 = rng.choice([0, 0, 1024, 2, 4096])
            cdw13 = 0
        elif opc in (0x09, 0x0A):
            cdw10 = rng.choice([0x07, 0x0B, 0x0F, 0x06, 0x81, 0x01, 0x02, 0x05, rng.getrandbits(8)])
            cdw11 = rng.choice([0, 1, 0x00030003, 0xFFFF, 0x100, 1000, 60000, cdw11])
    else:
        opc = rng.choice(IO_OPS)
        if opc == 0x7F:
            fctype = rng.choice([0x08, 0x01, 0x04])
        cdw10 = rng.choice([0, 1, 100, 2047, 2048, 4095, rng.randrange(4096)])
        cdw11 = 0 if rng.random() < 0.9 else cdw11
        cdw12 = rng.choice([0, 1, 7, 15, 255, 256]) | rng.choice([0, 0, 0, 0x4000 << 16, 0x8000 << 16])
        if opc == 0x09:
            cdw10 = rng.choice([0, 1, 3, 255])
            cdw11 = rng.choice([4, 4, 1, 2, 0])
        cdw13 = cdw14 = cdw15 = 0
    return opc, fctype, (cdw2, cdw3, cdw10, cdw11, cdw12, cdw13, cdw14, cdw15)


example_strategy = st.fixed_dictionaries({
    "templates": st.lists(template_strategy, min_size=30, max_size=50),
    "seed": st.integers(0, 2 ** 32 - 1),
    "namespace_churn": st.booleans(),
})


# Why the target may close a queue on its own; anything else is a bug.
ALLOWED_CLOSE_REASONS = ("shorter than an SQE", "RDMA READ failed", "host sent Disconnect", "deleted: admin queue",
                         "deleted: keep-alive timeout", "target shutting down",
                         "shut down",  # a (fuzzed) CC.SHN ends the association's I/O queues
                         "NVMe Connect was refused", "no NVMe Connect within")  # transport/resources.py


class CloseReasons(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.unexpected = []

    def emit(self, record):
        message = record.getMessage()
        if "closing:" in message and not any(r in message for r in ALLOWED_CLOSE_REASONS):
            self.unexpected.append(message)


class FuzzQueue:
    def __init__(self, transport, qid):
        self.transport = transport
        self.qid = qid
        self.outstanding = Counter()  # CID -> count
        self.aer_cids = Counter()  # AERs sent on an admin queue: allowed to stay held
        self.dead = None


class Harness:
    """One fresh target, a good host, and the fuzz queues; counts and checks completions."""

    def __init__(self, stats: Counter):
        self.stats = stats
        self.good_host = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
        config = {
            "hosts": [{"nqn": self.good_host}],
            "ports": [port(1, ADDR, [SUB_GOOD, SUB_FUZZ, SUB_FUZZ4K, SUB_FUZZNULL])],
            "subsystems": [
                {"nqn": SUB_GOOD, "attr": {"allow_any_host": "0"}, "allowed_hosts": [self.good_host],
                 "namespaces": [ram_ns(1, "256K")]},
                {"nqn": SUB_FUZZ, "namespaces": [ram_ns(1, "1M"), ram_ns(2, "256K", 4096)]},
                {"nqn": SUB_FUZZ4K, "namespaces": [ram_ns(1, "1M", 4096)]},
                {"nqn": SUB_FUZZNULL, "namespaces": [null_ns(1, "64M")]},
            ],
        }
        self.env = Env(config)
        self.target = self.env.target
        self.fabric = self.env.fabric
        self.good = self.env.connect(SUB_GOOD, hostnqn=self.good_host, num_io_queues=2, queue_size=32,
                                     kato_ms=5000)
        self.model = {}
        self.connector = self.env.connector(ADDR)
        self.queues = {}
        self.buffer = None
        self.cntlid = None
        for slot in range(5):
            self.ensure(slot)

    # -- fuzz queue (re)creation
    def _open(self, qid, cntlid=0, size=32):
        transport = self.connector.connect(qid, size, size - 1, cntlid)
        if self.buffer is None:
            self.buffer = transport.register(BUFFER_SIZE)  # what fuzz capsules point at
            self.setup_buffer = transport.register(1024)  # Connect data of our own setup, out of their reach
        return FuzzQueue(transport, qid)

    def _exchange(self, q, sqe_bytes, extra=b""):
        q.transport.send(sqe_bytes + extra)
        for _ in range(5):
            cqes = q.transport.poll(0)
            if cqes:
                return CQE_STRUCT.unpack(cqes[0])
        raise AssertionError("setup command got no completion")

    def _connect(self, q, subnqn, cntlid):
        self.setup_buffer.view[:1024] = F.ConnectData(bytes(16), cntlid, subnqn, FUZZ_HOST).pack()
        cmd = F.ConnectCommand(cid=0xABC, qid=q.qid, sqsize=31, sgl=_keyed(self.setup_buffer, 0, 1024))
        result, _dw1, _sqhd, sqid, cid, wire = self._exchange(q, cmd.pack())
        assert (cid, sqid) == (0xABC, q.qid) and wire == 0, (hex(wire), subnqn)
        return result & 0xFFFF

    def _enable(self, q):
        cmd = F.PropertySet(cid=0xABD, offset=F.PROP_CC, value=F.CC_DEFAULT | F.CC_EN)
        assert self._exchange(q, cmd.pack())[5] == 0

    def ensure(self, slot):
        q = self.queues.get(slot)
        if q is not None and not q.dead:
            return q
        self.stats["queues_opened"] += 1
        if slot == UNCONNECTED_ADMIN:
            q = self._open(0)
        elif slot == ADMIN:
            q = self._open(0)
            self.cntlid = self._connect(q, SUB_FUZZ, F.DYNAMIC_CNTLID)
            self._enable(q)
        elif slot == IO:
            admin = self.ensure(ADMIN)
            q = self._open(1, self.cntlid)
            try:
                self._connect(q, SUB_FUZZ, self.cntlid)
            except AssertionError:  # the fuzzer changed the controller (queue count, state): start over
                self._kill(admin)
                self.ensure(ADMIN)
                q = self._open(1, self.cntlid)
                self._connect(q, SUB_FUZZ, self.cntlid)
        elif slot == UNCONNECTED_IO:
            q = self._open(2, self.cntlid or 0)
        else:
            q = self._open(0)
            self._connect(q, F.DISCOVERY_NQN, F.DYNAMIC_CNTLID)
            self._enable(q)
        self.queues[slot] = q
        return q

    def mark_dead(self, q, reason):
        if not q.dead:
            q.dead = reason
            self.stats["lost_in_teardown"] += sum(q.outstanding.values())
            q.outstanding.clear()

    def _kill(self, q):
        self.mark_dead(q, "replaced")
        try:
            q.transport.close()
        except TransportError:
            pass

    # -- completions
    def reap(self, q) -> int:
        if q.dead:
            return 0
        try:
            cqes = q.transport.poll(0)
        except TransportError as exc:
            self.mark_dead(q, str(exc))
            self.stats["teardowns"] += 1
            return 0
        for raw in cqes:
            assert len(raw) == 16
            _result, _dw1, sqhd, sqid, cid, wire = CQE_STRUCT.unpack(raw)
            assert sqid == q.qid, f"SQID {sqid} on queue {q.qid}"
            assert q.outstanding[cid] > 0, f"completion for CID {cid:#x} that is not outstanding"
            assert wire & 1 == 0, "phase bit set"
            q.outstanding[cid] -= 1
            # with duplicate CIDs in flight, only as many held AERs as commands remain can be that CID
            q.aer_cids[cid] = min(q.aer_cids[cid], q.outstanding[cid])
            self.stats["completions"] += 1
            self.stats["status_%03x" % ((wire >> 1) & 0x7FF)] += 1
        return len(cqes)

    def drain(self):
        for _ in range(50):
            self.fabric.pump()
            if not sum(self.reap(q) for q in self.queues.values()):
                if self.fabric.idle:
                    break
        for q in self.queues.values():
            if q.dead:
                continue
            left = +q.outstanding
            held = +q.aer_cids
            assert left == (left & held), f"queue {q.qid}: non-AER commands never completed: {left - held}"
            assert sum(left.values()) <= 4, f"queue {q.qid}: {sum(left.values())} AERs held (limit 4)"
            self.stats["held_aers"] += sum(left.values())

    # -- sending
    def send(self, slot, capsule, cid, is_aer):
        q = self.ensure(slot)
        for _ in range(3):
            try:
                q.transport.send(capsule)
                break
            except SendQueueFull:
                self.fabric.pump()
                self.reap(q)
            except TransportError:
                self.mark_dead(q, "send failed")
                return
        else:
            return  # full of held AERs: skip
        self.stats["capsules"] += 1
        q.outstanding[cid] += 1
        if is_aer:
            q.aer_cids[cid] += 1

    # -- the well-behaved host
    def good_step(self, rng):
        g = self.good
        g.maybe_keep_alive()
        nlb = rng.randint(1, 12)
        slba = rng.randrange(0, GOOD_REGION - nlb + 1)
        data = rng.randbytes(512 * nlb)
        g.write(1, slba, data)
        for i in range(nlb):
            self.model[slba + i] = data[i * 512:(i + 1) * 512]
        probe = rng.randrange(0, GOOD_REGION)
        assert g.read(1, probe, 1) == self.model.get(probe, bytes(512)), "good host read back wrong data"
        self.stats["good_ios"] += 2

    def good_verify(self):
        got = self.good.read(1, 0, GOOD_REGION)
        expected = b"".join(self.model.get(i, bytes(512)) for i in range(GOOD_REGION))
        assert got == expected, "good host data corrupted"

    def close(self):
        self.good.close()
        assert self.target.internal_errors == 0
        self.env.close()


def _keyed(buf, offset, length, key=None, invalidate=False):
    from nvmeof_roce.nvme.sgl import SglDescriptor
    return SglDescriptor.keyed(buf.addr + offset, length & 0xFFFFFF, buf.key if key is None else key, invalidate)


def implied_length(opc, fctype, cdw10, cdw12, slot):
    """The transfer length a well-formed command of this kind would carry."""
    if slot in (UNCONNECTED_ADMIN, ADMIN, DISCOVERY):
        if opc == 0x7F:
            return 1024 if fctype == F.FCTYPE_CONNECT else 0
        if opc == 0x06:
            return 4096
        if opc == 0x02:
            return (((cdw10 >> 16) + 1) * 4) & 0xFFFFFF
        return 0
    if opc in (0x01, 0x02):
        return ((cdw12 & 0xFFFF) + 1) * 512
    if opc == 0x09:
        return ((cdw10 & 0xFF) + 1) * 16
    if opc == 0x7F and fctype == F.FCTYPE_CONNECT:
        return 1024
    return 0


def build_capsule(h: Harness, t: dict, rng: random.Random, mutate: bool):
    """A capsule from a template, optionally mutated.  Returns (slot, bytes, cid, is_aer)."""
    # The template decides part of the time; the seeded rng spreads the rest (hypothesis likes to
    # repeat its simplest values, which would keep most capsules on one queue or one error path).
    slot = t["slot"] if rng.random() < 0.4 else rng.choice(SLOT_MIX)
    opc, flags, nsid, fctype = t["opc"], t["flags"], t["nsid"], t["fctype"]
    if rng.random() < 0.7:
        flags = 0x40 if rng.random() < 0.9 else rng.choice([0x80, 0x00, 0x41, rng.getrandbits(8)])
    if rng.random() < 0.5:
        nsid = rng.choice([1, 1, 1, 2, 0, 3, 0xFFFFFFFF])
    cdws = t["cdw"]
    if t["typical_fields"] < 7 or rng.random() < 0.5:
        opc, fctype, cdws = plausible_fields(slot, rng, opc, fctype, cdws)
    cdw2, cdw3, cdw10, cdw11, cdw12, cdw13, cdw14, cdw15 = cdws
    if opc == 0x7F:
        nsid = (nsid & ~0xFF) | fctype
        if fctype == F.FCTYPE_CONNECT and rng.random() < 0.7:
            cdw10 = (cdw10 & 0xFFFF if rng.random() < 0.2 else 0) | (SLOT_QIDS[slot] << 16)
            cdw11 = rng.choice([31, 0, 32, 127, 128, cdw11 & 0xFFFF]) | (cdw11 & 0x40000)
    length = t["sgl_len"]
    if t["match_length"]:
        length = implied_length(opc, fctype, cdw10, cdw12, slot)
    extra = b""
    kind = t["sgl"]
    if kind == "zero":
        sgl_addr, sgl_word = 0, ID_KEYED << 56
    elif kind in ("keyed", "keyed_inv"):
        offset = min(t["sgl_offset"], BUFFER_SIZE - 1) if t["sgl_offset"] < BUFFER_SIZE else 0
        length = min(length, BUFFER_SIZE - offset) & 0xFFFFFF
        d = _keyed(h.buffer, offset, length, invalidate=kind == "keyed_inv")
        sgl_addr, sgl_word = d.addr, d.word
    elif kind == "inline":  # a read-direction command: usually give it a good keyed SGL instead
        d = _keyed(h.buffer, 0, min(length, BUFFER_SIZE))
        sgl_addr, sgl_word = d.addr, d.word
    elif kind == "bad_key":
        d = _keyed(h.buffer, 0, length, key=h.buffer.key ^ 0x10101)
        sgl_addr, sgl_word = d.addr, d.word
    elif kind == "out_of_bounds":
        d = _keyed(h.buffer, BUFFER_SIZE - 16, max(length, 32))
        sgl_addr, sgl_word = d.addr, d.word
    elif kind == "inline" and (opc & 1 or rng.random() < 0.3):  # mostly on write-direction commands
        sgl_addr, sgl_word = t["sgl_offset"] % 5000, (length & 0xFFFFFFFF) | (ID_IN_CAPSULE << 56)
        limit = 4096 if rng.random() < 0.95 else 6000  # now and then more than the receive buffer holds
        extra = bytes(min(length + sgl_addr, limit))
    else:
        sgl_addr, sgl_word = t["sgl_raw"]
    if opc == 0x7F and fctype == F.FCTYPE_CONNECT:
        c = t["connect"]
        if c["raw"]:
            data = rng.randbytes(1024)
        else:
            cntlid = h.cntlid if (c["cntlid"] == 2 and h.cntlid) else c["cntlid"]
            raw = bytearray(F.ConnectData(rng.randbytes(16), cntlid, "", "").pack())
            raw[256:256 + 255] = c["subnqn"].encode("utf-8", "replace")[:255].ljust(255, b"\0")
            raw[512:512 + 255] = c["hostnqn"].encode("utf-8", "replace")[:255].ljust(255, b"\0")
            data = bytes(raw)
        h.buffer.view[:1024] = data
        if kind == "inline":
            extra = data
    cid = t["cid"] if not mutate else rng.randrange(0x10000)
    sqe = bytearray(SQE_STRUCT.pack(opc, flags, cid, nsid, cdw2, cdw3, 0, sgl_addr & ((1 << 64) - 1),
                                    sgl_word & ((1 << 64) - 1), cdw10, cdw11, cdw12, cdw13, cdw14, cdw15))
    if mutate and rng.random() < 0.6:
        for _ in range(rng.randint(1, 3)):
            what = rng.random()
            if what < 0.5:
                bit = rng.randrange(64 * 8)
                sqe[bit // 8] ^= 1 << (bit % 8)
            elif what < 0.8:
                pos = rng.randrange(0, 64, 4)
                sqe[pos:pos + 4] = struct.pack("<I", rng.choice([0, 1, 0xFFFFFFFF, rng.getrandbits(32)]))
            else:
                sqe[0] = rng.choice([0x00, 0x01, 0x02, 0x06, 0x08, 0x09, 0x0C, 0x18, 0x7F, rng.getrandbits(8)])
        cid = struct.unpack_from("<H", sqe, 2)[0]
        if rng.random() < 0.1:
            extra = bytes(rng.choice([1, 100, 4096, 4200]))
    if slot in (UNCONNECTED_ADMIN, ADMIN, DISCOVERY) and rng.random() < 0.97:
        extra = b""  # mostly stay within the 64-byte admin receive buffer; sometimes not (fatal)
    elif t["extra"] and not extra:
        extra = bytes(t["extra"])
    capsule = bytes(sqe) + extra
    if t["short"] and rng.random() < 0.5:
        capsule = capsule[:rng.randrange(0, 64)]
    is_aer = capsule[:1] == b"\x0c" and SLOT_QIDS[slot] == 0 and len(capsule) >= 64
    return slot, capsule, cid, is_aer


def run_example(example: dict, stats: Counter) -> None:
    rng = random.Random(example["seed"])
    h = Harness(stats)
    try:
        work = [(t, v > 0) for t in example["templates"] for v in range(VARIANTS)]
        rng.shuffle(work)
        for i, (template, mutate) in enumerate(work):
            slot, capsule, cid, is_aer = build_capsule(h, template, rng, mutate)
            h.send(slot, capsule, cid, is_aer)
            r = rng.random()
            if r < 0.3:
                h.fabric.pump(max_ops=rng.randint(1, 4))  # partial progress: varied interleavings
            elif r < 0.4:
                h.fabric.pump()
                for q in h.queues.values():
                    h.reap(q)
            if i % 60 == 59:
                h.good_step(rng)
                if rng.random() < 0.2:
                    h.env.clock.advance(0.5)
            if example["namespace_churn"] and i % 300 == 150:
                sub = h.target.subsystem(SUB_FUZZ)
                if 2 in sub.namespaces:
                    remove_namespace(h.target, SUB_FUZZ, 2)
                else:
                    cfg = h.env.config.subsystem(SUB_FUZZ).namespaces[1]
                    add_namespace(h.target, SUB_FUZZ, cfg)
                stats["namespace_changes"] += 1
        h.drain()
        h.good_step(rng)
        h.good_verify()
    finally:
        h.close()
    stats["examples"] += 1


def test_fuzz_capsules(capsys):
    stats = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(example_strategy)
    def fuzz(example):
        run_example(example, stats)

    reasons = CloseReasons()
    core_log = logging.getLogger("nvmeof_roce.engine.core")
    core_log.addHandler(reasons)
    level = core_log.level
    core_log.setLevel(logging.INFO)
    try:
        fuzz()
    finally:
        core_log.removeHandler(reasons)
        core_log.setLevel(level)
    statuses = sorted((k for k in stats if k.startswith("status_")), key=lambda k: -stats[k])
    with capsys.disabled():
        print(f"\n[fuzz] {stats['capsules']} capsules in {stats['examples']} examples: "
              f"{stats['completions']} completions, {stats['teardowns']} queue teardowns "
              f"({stats['lost_in_teardown']} commands lost with them), {stats['held_aers']} AERs held, "
              f"{stats['queues_opened']} queues opened, {stats['good_ios']} good-host I/Os, "
              f"{stats['namespace_changes']} namespace changes; distinct statuses: {len(statuses)} "
              f"(top: {', '.join(f'{k[7:]}x{stats[k]}' for k in statuses[:8])})")
    assert reasons.unexpected == []
    # every capsule is accounted for: completed, lost with its torn-down queue, or a held AER
    assert stats["capsules"] == stats["completions"] + stats["lost_in_teardown"] + stats["held_aers"]
    assert stats["capsules"] >= TARGET_CAPSULES
    assert len(statuses) >= 12  # the fuzzer reaches many different answers, not one error path
    assert stats["status_000"] >= stats["capsules"] // 50  # and plenty of commands that succeed
