"""The differential fuzz of the native data path: seeded cases of capsule batches, live changes and faults, every
CQE and every byte compared with the Python data path's (tests/unit/test_native_fuzz.py, `make test-native-fuzz`).

A case (`Case(seed)`, deterministic) builds one target per data path from one config (native_diff.py: loopback
for the Python path, the C queue on the fake verbs provider for the native one) and runs steps on both:

- a batch of 8-32 capsules delivered before one poll: reads, writes, flushes, Write Zeroes, Compare and DSM on RAM,
  null and file namespaces; fields out of range (NSID, LBA, NLB, SGL type, length, flags, a bad key); in-capsule
  data shorter and longer than its SGL says; fabrics and admin opcodes on the I/O queue; sometimes a Disconnect
  in the middle;
- a live change before the batch or while it is in flight: a RAM namespace resized, removed, added back,
  replaced (a new UUID), hidden from the host or shown again, the host's DH-HMAC-CHAP key set or removed; made
  as the control plane makes it (control/live.py `apply`, which calls the engine's verbs, engine/api.py);
- a fault on the native side: the wire held and released a few work requests at a time; a post that fails; the
  QP moved to the error state with work on the wire; io_uring completions failing (EIO, ECANCELED, EAGAIN) or
  stalled and released (`_native.uring_inject`; the Python path's engine meets the same errors).

The comparator's rules (`check_batch`):

1. Commands of one batch never share memory where one of them writes (a namespace's blocks, the host's buffer):
   NVMe does not order commands in flight, so overlapping ones have no single right outcome.  The generator gives
   command i of a batch stripe i of every namespace and slot i of the host buffer.
2. Completions are compared by CID, not in order (the order of completions in a batch is not the spec's to fix);
   every byte of the CQE is compared (result, SQ ID, CID, status) but the SQ Head Pointer: both paths advance
   it by one per completion, as nvmet does (nvmet_update_sq_head), so which command gets which value is the
   order the paths answered in, not what they answered.  Each path's SQHD values are checked on their own
   instead: a batch's completions carry the next values in turn, none skipped or repeated (`check_sqhd`).
3. With no fault injected and both queues alive, the native CQEs must equal the Python ones, and the host's buffer
   and every namespace must be equal byte for byte.
4. When a fault was injected, or a queue ended in the batch (a bad key, a Disconnect), the two paths may answer
   different subsets (which commands were answered before the queue went is the transport's timing).  Then every
   command answered by both is answered alike, and the native side is held to the acknowledged-data oracle: a
   command answered success did what it says (a Write's data is in the namespace, a Read's is in the host's
   buffer), a command not answered left its blocks either as they were or as it would have written them, and
   nothing outside the batch's commands changed.  The oracle runs on every batch, faults or not.
5. A queue that ends without a fault or a fatal capsule, or one path's queue ending while the other's lives on
   without a fault or a fatal capsule that explains it, is a divergence.  After a batch compared by the oracle
   the case ends: the two paths may have run different commands, so nothing after it compares.

Known divergences stay out of the at-scale run (`KNOWN`: the combinations that reproduce them are made
differently) and are replayed as strict xfails from the corpus (tests/unit/fixtures/native_fuzz/corpus.json),
until fixed.  None is known now; the last two, fixed (corpus seeds 133 and 150), were a ring error and a queue
ending while a live change was in flight.
  So in a batch with an io_uring error, a failed post or a capsule that ends the queue, the step's live change
  is made before the batch, not while it is in flight.

With the native queue on a poll-group thread, every live change is made before its batch: the thread takes the
capsules in its own time, so a change made after the first loop pass may precede them (they then meet the changed
namespace, rightly) where the Python path has started them all.

`run(seeds)` returns a `Tally` (capsules, batches, changes and faults by kind, divergences).  A failure raises
`Divergence` naming the seed, the step and what differed; the seed alone replays it.
"""
from __future__ import annotations

import errno
import os
import random
import select
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from loopback_env import HOST_A, HOST_B, SUB_4K, SUB_NULL, SUB_RAM, file_ns, null_ns, port, ram_ns
from native_diff import LoopbackEndpoint, NativeEndpoint, close_all, io_capsule, pattern, settle
from nvmeof_roce import native
from nvmeof_roce.config import parse_config
from nvmeof_roce.control import live
from nvmeof_roce.nvme import auth as A
from nvmeof_roce.transport.contracts import TransportError
from nvmeof_roce.transport.rdma import native as rdma_native

HOST_BUFFER = 4 << 20
SLOTS = 32
SLOT = HOST_BUFFER // SLOTS  # 128 KiB of host memory per command of a batch
READ, WRITE, FLUSH, WRITE_ZEROES, COMPARE, DSM, FABRICS = 0x02, 0x01, 0x00, 0x08, 0x05, 0x09, 0x7F
FCTYPE_DISCONNECT = 0x08
KEY = A.generate_secret(1, 32, key=bytes(range(32)))  # fixed: a case replays byte for byte
RAM_SIZES = {1: ("1M", "2M", "512K"), 4: ("256K", "512K", "128K")}
UUIDS = ("6d0e5f52-1f35-4c8b-9e35-bb1b2d7a0001", "6d0e5f52-1f35-4c8b-9e35-bb1b2d7a0002",
         "6d0e5f52-1f35-4c8b-9e35-bb1b2d7a0003")


class Divergence(AssertionError):
    pass


# ------------------------------------------------------------------------------------------------ the config

@dataclass
class Model:
    """What the generator knows of the running config: namespaces (size, block size, visibility), the key."""
    sizes: Dict[int, Optional[str]] = field(default_factory=lambda: {1: "1M", 4: "256K"})  # None: removed
    uuid2: int = 0
    hidden: Dict[int, bool] = field(default_factory=lambda: {1: False, 5: False})
    key: bool = False

    def blocks(self, nsid: int) -> Tuple[int, int]:
        """(blocks, LBA data size shift) of namespace `nsid` as configured now; (0, 9) if there is none."""
        if nsid in (1, 4):
            size = self.sizes[nsid]
            return (_bytes(size) >> 9, 9) if size else (0, 9)
        return {2: (256, 12), 3: (1 << 21, 9), 5: (2048, 9)}.get(nsid, (0, 9))

    def config(self, directory: Path) -> dict:
        def visible(nsid, ns):
            if self.hidden.get(nsid):
                ns["nvmeof_roce"]["visible_hosts"] = [HOST_B]
            return ns
        namespaces = [visible(1, ram_ns(1, self.sizes[1]))] if self.sizes[1] else []
        namespaces += [ram_ns(2, "1M", 4096, device={"uuid": UUIDS[self.uuid2]}), null_ns(3, "1G")]
        if self.sizes[4]:
            namespaces.append(ram_ns(4, self.sizes[4]))
        namespaces.append(visible(5, file_ns(5, directory / "ns5.img", "1M")))
        hosts = [{"nqn": HOST_A, "dhchap": {"key": KEY, "hash": "hmac(sha256)", "dhgroup": "null"}}] if self.key \
            else []
        return {"hosts": hosts, "ports": [port(1, "10.99.0.1:4420", [SUB_RAM, SUB_4K, SUB_NULL])],
                "subsystems": [{"nqn": SUB_RAM, "namespaces": namespaces},
                               {"nqn": SUB_4K, "namespaces": [ram_ns(1, "4M", 4096)]},
                               {"nqn": SUB_NULL, "namespaces": [null_ns(1)]}]}


def _bytes(size: str) -> int:
    return int(size[:-1]) << {"K": 10, "M": 20}[size[-1]]


# ------------------------------------------------------------------------------------------------ generation

@dataclass
class Command:
    cid: int
    opc: int
    nsid: int
    slba: int = 0
    nlb: int = 0
    length: int = 0
    offset: int = 0
    flags: int = 0x40
    sgl_id: int = 0x40
    bad_key: bool = False
    fua: bool = False
    extra: bytes = b""
    fatal: bool = False  # the capsule ends the queue (a bad key, a Disconnect)

    def capsule(self, ep) -> bytes:
        return io_capsule(ep, self.opc, self.nsid, self.slba, self.nlb, self.length, flags=self.flags,
                          sgl_id=self.sgl_id, offset=self.offset, bad_key=self.bad_key, cid=self.cid,
                          cdw12_hi=0x4000 if self.fua else 0, extra=self.extra)


@dataclass
class Step:
    commands: List[Command]
    change: Optional[Tuple[str, int, object]] = None  # (kind, nsid, value)
    change_mid: bool = False  # made while the batch is in flight (after the first poll), not before it
    fault: Optional[Tuple[str, object]] = None


def gen_command(rng: random.Random, model: Model, i: int, n: int) -> Command:
    stripe = SLOTS - 1 if i == n - 1 else i  # the last command may take the edges: it has the last stripe
    edge = i == n - 1
    c = Command(cid=i + 1, opc=READ, nsid=1, offset=i * SLOT if not edge else (SLOTS - 1) * SLOT)
    roll = rng.random()
    if roll < 0.05:  # a fabrics or admin command on an I/O queue
        c.opc = rng.choice([FABRICS, FABRICS, 0x06, 0x0A, 0x0C, 0x18, 0x10, 0x7E, 0x04, 0x0D, 0x11])
        c.nsid = rng.choice([0x00, 0x01, 0x04, 0x05, 0x06, 0x7E]) if c.opc == FABRICS else rng.choice([0, 1])
        c.length = rng.choice([0, 1024, 4096])
        return c
    c.opc = rng.choice([READ] * 6 + [WRITE] * 6 + [FLUSH, WRITE_ZEROES, COMPARE, DSM])
    c.nsid = rng.choice([1, 1, 1, 2, 2, 3, 4, 4, 5, 5, 5])
    blocks, shift = model.blocks(c.nsid)
    per_stripe = max(blocks // SLOTS, 1)
    c.nlb = rng.randrange(min(per_stripe, 16, SLOT >> shift))
    c.slba = stripe * per_stripe + rng.randrange(max(per_stripe - c.nlb, 1))
    c.fua = rng.random() < 0.2
    if c.opc == DSM:  # one range, no deallocate attribute: advice only (cdw10 = NR = slba's low byte)
        c.slba, c.nlb = 0, 0
    c.length = 0 if c.opc in (FLUSH, WRITE_ZEROES, DSM) and rng.random() < 0.8 else (c.nlb + 1) << shift
    if c.opc == DSM:
        c.length = 16
    if rng.random() < 0.12 and c.opc in (WRITE, READ) and c.length <= 4096:  # in-capsule data
        c.sgl_id = 0x01
        c.offset = 0
        declared = c.length
        kind = rng.choice(["match", "short", "long"])
        sent = {"match": declared, "short": rng.randrange(declared), "long": min(4096, declared + rng.randint(
            1, 600))}[kind]
        c.extra = pattern(sent, seed=rng.randrange(256))
    elif rng.random() < 0.15:  # a field out of range
        what = rng.choice(["nsid", "slba", "nlb", "length", "flags", "sgl", "key"] if edge else
                          ["nsid", "length", "flags", "sgl", "nlb0"])
        if what == "nsid":
            c.nsid = rng.choice([0, 9, 0xFFFFFFFF, 6])
        elif what == "slba" and blocks:
            c.slba = rng.choice([blocks - 1, blocks, (1 << 64) - 1, 1 << 63, blocks - c.nlb])
        elif what == "nlb":
            c.nlb = rng.choice([0xFFFF, 255, 63])
        elif what == "nlb0":
            c.nlb = 0
        elif what == "length":
            n = (c.nlb + 1) << shift
            c.length = rng.choice([max(0, n - 512), n + 512, 0, 0xFFFFFF])
        elif what == "flags":
            c.flags = rng.choice([0x80, 0x00, 0x41, 0xC0])
        elif what == "sgl":
            c.sgl_id = rng.choice([0x41, 0x00, 0x20, 0x5F] + [0x4F] * edge)
            # Keyed with Invalidate: the host's key goes with the response, while the batch's other commands
            # may still be moving data with it
            c.fatal = c.sgl_id == 0x4F
        elif what == "key":
            c.bad_key = True
            c.fatal = True
        if edge and rng.random() < 0.3:  # past the host's buffer: a remote access error ends the queue
            c.offset = rng.choice([HOST_BUFFER - 100, HOST_BUFFER - 4096, HOST_BUFFER])
            c.fatal = True
    return c


def gen_step(rng: random.Random, model: Model) -> Step:
    n = rng.randint(8, 32)
    commands = [gen_command(rng, model, i, n) for i in range(n)]
    if rng.random() < 0.04:  # a Disconnect in the middle of the batch
        at = rng.randrange(1, n - 1)
        commands[at] = Command(cid=at + 1, opc=FABRICS, nsid=FCTYPE_DISCONNECT, fatal=True)
    step = Step(commands)
    if rng.random() < 0.3:
        step.change = gen_change(rng, model)
        step.change_mid = step.change is not None and rng.random() < 0.4
    roll = rng.random()
    if roll < 0.12:
        step.fault = ("hold", rng.randint(1, 6))
    elif roll < 0.16:
        step.fault = ("post", (rng.choice(["send", "send", "recv"]), rng.choice([errno.ENOMEM, errno.EINVAL]),
                               rng.randint(1, 4)))
    elif roll < 0.20:
        step.fault = ("qp_error", rng.randint(0, 12))
    elif roll < 0.28:
        step.fault = ("uring", rng.choice(["eio", "ecanceled", "eagain"]))
    elif roll < 0.32:
        step.fault = ("stall", None)
    return step


def gen_change(rng: random.Random, model: Model) -> Optional[Tuple[str, int, object]]:
    kind = rng.choice(["resize", "resize", "remove", "add", "replace", "visibility", "key"])
    if kind == "resize":
        nsid = rng.choice([1, 4])
        if not model.sizes[nsid]:
            return None
        size = rng.choice([s for s in RAM_SIZES[nsid] if s != model.sizes[nsid]])
        model.sizes[nsid] = size
        return ("resize", nsid, size)
    if kind in ("remove", "add"):
        nsid = rng.choice([1, 4])
        if kind == "remove" and model.sizes[nsid]:
            model.sizes[nsid] = None
            return ("remove", nsid, None)
        if kind == "add" and not model.sizes[nsid]:
            model.sizes[nsid] = RAM_SIZES[nsid][0]
            return ("add", nsid, model.sizes[nsid])
        return None
    if kind == "replace":
        model.uuid2 = (model.uuid2 + 1) % len(UUIDS)
        return ("replace", 2, UUIDS[model.uuid2])
    if kind == "visibility":
        nsid = rng.choice([1, 5])
        model.hidden[nsid] = not model.hidden[nsid]
        return ("visibility", nsid, model.hidden[nsid])
    model.key = not model.key
    return ("key", 0, model.key)


class Case:
    """The steps of seed `seed`: 2-10 batches, the model of the config advanced by each change."""

    def __init__(self, seed: int):
        self.seed = seed
        rng = random.Random(seed)
        self.model = Model()
        self.steps = [gen_step(rng, self.model) for _ in range(rng.randint(2, 10))]


# ------------------------------------------------------------------------------------------------ running

@dataclass
class Tally:
    cases: int = 0
    batches: int = 0
    capsules: int = 0
    changes: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    fatal: Counter = field(default_factory=Counter)
    degraded: int = 0
    native_answers: int = 0

    def summary(self) -> str:
        return (f"{self.cases} cases, {self.batches} batches, {self.capsules} capsules "
                f"({self.native_answers} native answers), live changes {dict(self.changes)}, faults "
                f"{dict(self.faults)}, queues ended by {dict(self.fatal)}, {self.degraded} batches compared by the "
                f"acknowledged-data oracle, 0 divergences")


class Side:
    """One data path's target, its queue, and how a batch is run on it."""

    def __init__(self, name: str, ep, directory: Path):
        self.name, self.ep, self.directory = name, ep, directory

    @property
    def alive(self) -> bool:
        return self.ep.alive

    def namespaces(self) -> Dict[int, bytes]:
        out = {}
        for nsid, ns in self.ep.env.target.subsystem(SUB_RAM).namespaces.items():
            if ns.backend.kind in ("ram", "file"):
                out[nsid] = self.ep.namespace_bytes(SUB_RAM, nsid)
        return out

    def null_namespaces(self) -> set:
        return {nsid for nsid, ns in self.ep.env.target.subsystem(SUB_RAM).namespaces.items()
                if ns.backend.kind == "null"}

    def apply(self, model: Model) -> live.Applying:
        """Make the running target serve `model`'s config, as the control plane does (control/live.py)."""
        applying = live.Applying()
        new = parse_config(model.config(self.directory), "fuzz")
        live.apply(self.ep.env.target, new, applying=applying)
        return applying


class PythonSide(Side):
    def batch(self, capsules: List[bytes], mid=None) -> Tuple[Dict[int, bytes], Optional[live.Applying]]:
        """Send every capsule, then run the target until it is idle (`mid`: called once they all started)."""
        transport = self.ep.transport
        transport._outstanding = 0
        for capsule in capsules:
            transport.send(capsule)
        applying = None
        if mid is not None:
            self.ep.env.fabric.pump()  # every capsule received and started
            applying = mid()
        settle(self.ep.env, more=lambda: applying is not None and not applying.done)
        return collect(lambda: _poll(transport)), applying


def _poll(transport) -> List[bytes]:
    try:
        return list(transport.poll(0))
    except TransportError:
        return []


def collect(poll) -> Dict[int, bytes]:
    """{CID: CQE} of everything `poll` returns until it returns nothing."""
    got: Dict[int, bytes] = {}
    while True:
        cqes = poll()
        if not cqes:
            return got
        for cqe in cqes:
            cid = int.from_bytes(cqe[12:14], "little")
            if cid in got:
                raise Divergence(f"CID {cid} answered twice: {got[cid].hex()} and {cqe.hex()}")
            got[cid] = cqe


class NativeSide(Side):
    def __init__(self, *args, groups=None):
        super().__init__(*args)
        self.loop = None
        self.where = ""
        if groups is not None:  # the queue on a poll group's thread, the core on an event loop
            from nvmeof_roce.transport.eventloop import EventLoop
            self.loop = EventLoop(self.ep.env.target)
            self.ep.queue.start_polling(self.loop, "busy", poll_groups=groups)

    def close(self) -> None:
        if self.loop is not None:
            self.ep.queue.close()
            self.loop.close()

    def settle(self, expect: Optional[int] = None, got: Optional[Dict[int, bytes]] = None,
               more=lambda: False) -> Dict[int, bytes]:
        """Until the queue, its ring and the core are idle (a poll group: until `expect` answers came, or the
        queue closed, and nothing is in flight); the answers."""
        got = {} if got is None else got
        ep = self.ep

        def take():
            for cqe, _inv in ep.device.responses():
                cid = int.from_bytes(cqe[12:14], "little")
                if cid in got:
                    raise Divergence(f"native: CID {cid} answered twice: {got[cid].hex()} and {cqe.hex()}")
                got[cid] = cqe

        if self.loop is None:
            for _ in range(100):
                ep.settle()
                take()
                if not more():
                    return got
                ep.env.target.tick(ep.env.clock())
            raise Divergence(f"{self.where}: the native side did not settle")
        deadline = time.monotonic() + 60  # a hang guard, not a measure
        quiet = 0
        while True:
            if time.monotonic() > deadline:
                raise Divergence(f"native (poll group): {len(got)} of {expect} answers in 60 s, "
                                 f"stats {ep.queue.stats() if not ep.queue.closed else 'closed'}")
            self.loop.run_once(0.002)
            ep.env.fabric.pump()
            ep.env.target.tick(ep.env.clock())
            take()
            idle = not more() and (ep.queue.closed or (not ep.queue.stats()["native_in_flight"] and
                                                       (expect is None or len(got) >= expect)))
            quiet = quiet + 1 if idle else 0
            if quiet >= 3:
                return got

    def memory_of(self, change) -> Optional[Tuple[int, int]]:
        """(address, length) of the RAM memory a resize, removal or replacement lets go, or None."""
        if change is None or change[0] not in ("resize", "remove", "replace"):
            return None
        ns = self.ep.env.target.subsystem(SUB_RAM).namespaces.get(change[1])
        if ns is None or ns.backend.kind != "ram":
            return None  # staged namespaces' data is in the queue's own bounce chunks
        return rdma_native._address(ns.backend.buffer.obj), ns.num_blocks * ns.block_size

    def guard(self, applying, change, memory) -> None:
        """A change is never committed while work requests of the queue that reach the memory it lets go are on
        the wire (the fake moves data when a request completes, so it would write there).  Other namespaces'
        work goes on meanwhile: only the namespace changed is paused."""
        if applying is None or not applying.done or memory is None:
            return
        on_wire = self.ep.device.on_wire_into(*memory)
        if on_wire:
            raise Divergence(f"{self.where}: the live change {change} was committed with {on_wire} work requests "
                             f"into its memory still on the wire of the native queue (closed: "
                             f"{self.ep.queue.closed}); completing them would move data into the memory it let go")

    def deliver(self, capsules: List[bytes]) -> None:
        for capsule in capsules:
            rc = self.ep.device.deliver(capsule)
            if rc == -3:
                return  # the QP is in error: the host cannot send either
            assert rc == 0, f"deliver: {rc}"

    def batch(self, capsules: List[bytes], fault, expect: int, mid=None, change=None):
        ep, device = self.ep, self.ep.device
        kind, arg = fault if fault else (None, None)
        got: Dict[int, bytes] = {}
        applying = None
        threaded = self.loop is not None
        if kind == "post":
            which, err, nth = arg
            device.fail_post(which, err, nth)
        if kind == "uring":
            native.module.uring_inject(arg, 100000)
        if kind == "stall":
            native.module.uring_inject("stall", 100000)
        hold = kind in ("hold", "qp_error") or (mid is not None and not threaded)
        if hold:
            device.hold()
        self.deliver(capsules)
        if not threaded:
            ep.queue.poll()
        else:
            self.loop.run_once(0.002)
        memory = self.memory_of(change) if mid is not None else None
        if mid is not None:
            applying = mid()
            self.guard(applying, change, memory)
        if kind == "qp_error":
            if arg:
                device.release(arg)
            device.qp_error()
        elif kind == "stall":
            if not threaded:
                for _ in range(3):  # the ring's commands reach the hook and are held
                    pump_ring(ep)
            native.module.uring_inject("none")
            native.module.uring_release()
        elif hold and not threaded:
            step = arg if kind == "hold" else 3
            while device.release(step):
                ep.queue.poll()
                self.guard(applying, change, memory)
        if hold:
            device.hold(False)
        try:
            got = self.settle(expect, got, more=lambda: applying is not None and not applying.done)
        finally:
            if kind in ("uring", "stall"):
                native.module.uring_inject("none")
                native.module.uring_release()
        return got, applying


def pump_ring(ep) -> None:
    ep.queue.poll()
    if ep.queue.ring_fd is not None and not ep.queue.closed:
        select.select([ep.queue.ring_fd], [], [], 0.01)


def _regions(c: Command, shift: int) -> Tuple[Optional[Tuple[int, int]], Optional[Tuple[int, int]]]:
    """(namespace byte range the command writes, host byte range it writes), when it is valid enough to."""
    n = (c.nlb + 1) << shift
    ns = host = None
    if c.opc in (WRITE, WRITE_ZEROES) and c.slba < (1 << 40):
        ns = (c.slba << shift, n)
    if c.opc == READ and c.sgl_id >> 4 == 4:
        host = (c.offset, min(n, max(0, HOST_BUFFER - c.offset)))
    return ns, host


SQ_ENTRIES = 32  # both queues: sqsize 31


def check_sqhd(where: str, name: str, answers: Dict[int, bytes], completions_before: int) -> None:
    """Rule 2: the batch's completions carry the SQ heads after `completions_before`, one each, in some order."""
    heads = sorted((int.from_bytes(cqe[8:10], "little") - completions_before - 1) % SQ_ENTRIES
                   for cqe in answers.values())
    if heads != list(range(len(answers))):
        got = sorted(int.from_bytes(c[8:10], "little") for c in answers.values())
        raise Divergence(f"{where}: {name}: SQ heads {got} after {completions_before} completions")


def _masked(answers: Dict[int, bytes]) -> Dict[int, bytes]:
    return {cid: cqe[:8] + b"\0\0" + cqe[10:] for cid, cqe in answers.items()}


def check_batch(seed: int, index: int, step: Step, model: Model, py: Dict[int, bytes],
                nat: Dict[int, bytes], py_side: Side, nat_side: Side, before: dict, degraded: bool) -> None:
    where = f"seed {seed}, step {index}"
    check_sqhd(where, "python", py, before["python_answers"])
    check_sqhd(where, "native", nat, before["native_answers"])
    py, nat = _masked(py), _masked(nat)
    if not degraded:
        if nat != py:
            diff = {cid: (py.get(cid, b"").hex(), nat.get(cid, b"").hex()) for cid in set(py) | set(nat)
                    if py.get(cid) != nat.get(cid)}
            raise Divergence(f"{where}: CQEs differ (cid: python, native): {diff}; step {step}")
        if py_side.ep.host_bytes() != nat_side.ep.host_bytes():
            raise Divergence(f"{where}: the host's buffers differ; step {step}")
        py_ns, nat_ns = py_side.namespaces(), nat_side.namespaces()
        if py_ns.keys() != nat_ns.keys():
            raise Divergence(f"{where}: namespaces {sorted(py_ns)} (python) and {sorted(nat_ns)} (native)")
        for nsid in py_ns:
            if py_ns[nsid] != nat_ns[nsid]:
                raise Divergence(f"{where}: namespace {nsid} differs; step {step}")
    else:
        for cid in set(py) & set(nat):
            if py[cid] != nat[cid]:
                raise Divergence(f"{where}: CID {cid}: python {py[cid].hex()}, native {nat[cid].hex()}; step {step}")
    oracle(where, step, model, nat, nat_side, before)


def oracle(where: str, step: Step, model: Model, answers: Dict[int, bytes], side: Side, before: dict) -> None:
    """Acknowledged data is where it was said to be; nothing else moved (rule 4)."""
    host_before, ns_before = before["host"], before["ns"]
    host_now, ns_now = side.ep.host_bytes(), side.namespaces()
    host_expect = bytearray(host_before)
    may_host: List[Tuple[int, int, bytes]] = []
    ns_expect = {nsid: bytearray(b) for nsid, b in ns_before.items()}
    may_ns: List[Tuple[int, int, int, bytes]] = []
    for c in step.commands:
        null = c.nsid in before["null"]
        if c.nsid not in ns_before and not null:
            continue
        shift = model.blocks(c.nsid)[1]
        ns_range, host_range = _regions(c, shift)
        ok = c.cid in answers and int.from_bytes(answers[c.cid][14:16], "little") >> 1 == 0
        if ns_range is not None and not null:
            start, n = ns_range
            if start + n > len(ns_before[c.nsid]):
                continue
            if c.opc == WRITE_ZEROES:
                data = bytes(n)
            elif c.sgl_id == 0x01:
                data = c.extra[:n]
            else:
                data = host_before[c.offset:c.offset + n]
            if len(data) != n:
                continue
            if ok:
                ns_expect[c.nsid][start:start + n] = data
            else:
                may_ns.append((c.nsid, start, n, data))
        if host_range is not None:
            off, n = host_range
            start = c.slba << shift
            data = bytes(n) if null else ns_before[c.nsid][start:start + n]
            if len(data) != n:
                continue
            if ok:
                host_expect[off:off + n] = data
            else:
                may_host.append((off, 0, n, data))
    for nsid, start, n, data in may_ns:  # not answered: as it was, or as written
        now = ns_now.get(nsid, b"")[start:start + n]
        if now == data:
            ns_expect[nsid][start:start + n] = data
    for off, _, n, data in may_host:
        if host_now[off:off + n] == data:
            host_expect[off:off + n] = data
    if bytes(host_expect) != host_now:
        bad = next(i for i in range(len(host_now)) if host_now[i] != host_expect[i])
        raise Divergence(f"{where}: native host buffer at {bad} (slot {bad // SLOT}) is not what the answers say; "
                         f"answers {{cid: status}} {_statuses(answers)}; step {step}")
    replaced = before["replaced"]
    for nsid, expect in ns_expect.items():
        if nsid not in ns_now or nsid == replaced:  # gone, or new memory since the batch's commands ran
            continue
        common = min(len(expect), len(ns_now[nsid]))  # a resize keeps what fits
        if bytes(expect[:common]) != ns_now[nsid][:common]:
            bad = next(i for i in range(common) if ns_now[nsid][i] != expect[i])
            raise Divergence(f"{where}: native namespace {nsid} at byte {bad} is not what the answers say; answers "
                             f"{_statuses(answers)}; step {step}")


def _statuses(answers: Dict[int, bytes]) -> Dict[int, int]:
    return {cid: int.from_bytes(c[14:16], "little") >> 1 for cid, c in sorted(answers.items())}


# Each a combination kept out of the at-scale run while it reproduces a known divergence (none now):
# "ring error under a mid-batch change", "a queue ending under a mid-batch change".
KNOWN: set = set()


def run_case(seed: int, tally: Tally, groups=None, known: bool = False) -> None:
    """Case `seed` on both paths; `known`: reproduce the known divergences too (a corpus entry's replay)."""
    case = Case(seed)
    directory = Path(tempfile.mkdtemp(prefix="native-fuzz-"))
    py_ep = nat_ep = nat = None
    try:
        model = Model()
        sides = {}
        for name in ("python", "native"):
            os.mkdir(directory / name)
            config = model.config(directory / name)
            sides[name] = (LoopbackEndpoint if name == "python" else NativeEndpoint)(config, SUB_RAM,
                                                                                      host_buffer=HOST_BUFFER)
        py_ep, nat_ep = sides["python"], sides["native"]
        py = PythonSide("python", py_ep, directory / "python")
        nat = NativeSide("native", nat_ep, directory / "native", groups=groups)
        tally.cases += 1
        answered = {"python": 1, "native": 1}  # completions on the I/O queue, its Connect's the first
        for index, step in enumerate(case.steps):
            after = _advanced(model, step.change)
            fatal = [c for c in step.commands if c.fatal]
            change_mid = step.change_mid
            ring_error = bool(step.fault and step.fault[0] in ("uring", "post"))
            if change_mid and not known and ((fatal and "a queue ending under a mid-batch change" in KNOWN) or
                                             (ring_error and "ring error under a mid-batch change" in KNOWN)):
                change_mid = False  # KNOWN: made before the batch instead
            if groups is not None:  # a poll group's thread takes the capsules in its own time: no "in flight" yet
                change_mid = False
            if step.change and not change_mid:
                for side in (py, nat):
                    applying = side.apply(after)
                    if side is nat:
                        nat.settle(more=lambda: not applying.done)
                    else:
                        settle(py_ep.env, more=lambda: not applying.done)
                    if not applying.done or applying.error:
                        raise Divergence(f"seed {seed}, step {index}: {side.name}: the change {step.change} was "
                                         f"not made: {applying.error}")
                tally.changes[step.change[0]] += 1
            model.__dict__.update(after.__dict__)
            mid = step.change if step.change and change_mid else None
            before = {"host": nat_ep.host_bytes(), "ns": nat.namespaces(), "null": nat.null_namespaces(),
                      "python_answers": answered["python"], "native_answers": answered["native"],
                      "replaced": mid[1] if mid and mid[0] == "replace" else None}
            capsules = [(c.capsule(py_ep), c.capsule(nat_ep)) for c in step.commands]
            fault = step.fault
            if fault and fault[0] == "stall" and groups is not None:
                fault = None  # a stall is released by the main thread at once under a poll group: no window
            if fault and fault[0] == "uring":
                native.module.uring_inject(fault[1], 100000)
            try:
                got_py, py_applying = py.batch([p for p, _ in capsules],
                                               mid=(lambda: py.apply(after)) if mid else None)
            finally:
                native.module.uring_inject("none")
            nat.where = f"seed {seed}, step {index}"
            got_nat, nat_applying = nat.batch([n for _, n in capsules], fault, len(got_py),
                                              mid=(lambda: nat.apply(after)) if mid else None, change=mid)
            if mid:
                for side, applying in (("python", py_applying), ("native", nat_applying)):
                    if not applying.done or applying.error:
                        raise Divergence(f"seed {seed}, step {index}: {side}: the change {mid} made while the batch "
                                         f"was in flight was not made: {applying.error}")
                tally.changes[mid[0] + " (mid-batch)"] += 1
            tally.batches += 1
            tally.capsules += len(capsules)
            answered["python"] += len(got_py)
            answered["native"] += len(got_nat)
            tally.native_answers += len(got_nat)
            if fault:
                tally.faults[fault[0]] += 1
            ends = fault is not None and fault[0] in ("post", "qp_error") and not nat.alive
            if fault and fault[0] == "post" and nat.alive:  # the failing post was not reached: disarmed
                nat_ep.device.fail_post(fault[1][0], 0, 0)
            degraded = bool(fatal) or ends or not (py.alive and nat.alive)
            if py.alive != nat.alive and not ends and not fatal:
                raise Divergence(f"seed {seed}, step {index}: the python queue {'lives' if py.alive else 'ended'}, the "
                                 f"native one {'lives' if nat.alive else 'ended'}; answers python "
                                 f"{_statuses(got_py)}, native {_statuses(got_nat)}; step {step}")
            if not (py.alive and nat.alive) and not fatal and not ends:
                raise Divergence(f"seed {seed}, step {index}: a queue ended with no fault and no fatal capsule; "
                                 f"python {_statuses(got_py)}, native {_statuses(got_nat)}")
            tally.degraded += degraded
            check_batch(seed, index, step, model, got_py, got_nat, py, nat, before, degraded)
            if degraded:  # the two paths did not run the same commands: nothing after it compares
                if py.alive and nat.alive:
                    tally.fatal["nothing (ended after a degraded batch)"] += 1
                    break
                tally.fatal["disconnect" if any(c.opc == FABRICS for c in fatal) else
                            "bad key" if fatal else fault[0]] += 1
                break
    finally:
        if nat is not None:
            nat.close()
        native.module.uring_inject("none")
        native.module.uring_release()
        close_all(py_ep, nat_ep)
        shutil.rmtree(directory, ignore_errors=True)


def _advanced(model: Model, change) -> Model:
    """The model once `change` (already applied to `model` by the generator's replay) is made."""
    after = Model(dict(model.sizes), model.uuid2, dict(model.hidden), model.key)
    if change is None:
        return after
    kind, nsid, value = change
    if kind in ("resize", "add"):
        after.sizes[nsid] = value
    elif kind == "remove":
        after.sizes[nsid] = None
    elif kind == "replace":
        after.uuid2 = UUIDS.index(value)
    elif kind == "visibility":
        after.hidden[nsid] = value
    elif kind == "key":
        after.key = value
    return after


def run(seeds, tally: Optional[Tally] = None, groups=None, capsules: Optional[int] = None,
        known: bool = False) -> Tally:
    """Run the cases of `seeds` in order (until `capsules` were sent, if given)."""
    tally = tally or Tally()
    for seed in seeds:
        if capsules is not None and tally.capsules >= capsules:
            break
        run_case(seed, tally, groups=groups, known=known)
    return tally


def corpus_seeds() -> List[int]:
    import json
    path = Path(__file__).parent / "fixtures" / "native_fuzz" / "corpus.json"
    return [e["seed"] for e in json.loads(path.read_text())["cases"] if not e.get("xfail")]


def replay_first(first: int):
    """The corpus's seeds (the cases that once failed), then seeds from `first` on."""
    yield from corpus_seeds()
    seed = first
    while True:
        yield seed
        seed += 1
