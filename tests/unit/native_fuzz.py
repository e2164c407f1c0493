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

The widened cases (`Case(seed, wide=True)`; the unit tier's second sample and `make test-native-fuzz` at scale)
add, from a second random stream so a narrow case stays what it was:

- hosts and controllers: besides the differential queue (host A), host A's second controller (the same host
  identifier: one registrant with it) and host B's, over loopback on both sides (their commands take the Python
  path in both runs, so their answers compare); host A's admin queue asks for a KATO;
- reservations on namespaces 1 (RAM) and 5 (file): Register, Unregister, Acquire, Preempt, Preempt and Abort,
  Release and Clear by either loopback controller, between batches, and one while a batch is in flight (a Preempt
  and Abort of host A by host B most often) with the wire held and released one work request at a time, so the
  change meets host A's native Writes with their READs still on it.  Answers, whether the change was fenced (it
  took an access away) and the reservation states are compared between the paths.  At a fenced answer the native
  side checks that no work request of host A's queue into the namespace's memory is on the wire
  (`device.on_wire_into`), and the host that made the change writes over the blocks of the batch's first Write to
  that namespace: started before the change, that Write must land before this one on both paths (the namespaces
  are compared byte for byte; the oracle applies the write after the batch's commands);
- host A's controller ended in a case's last batch with its work on the wire (`END_KINDS`: keep-alive expiry, the
  fake clock moved past KATO; a Disconnect of the I/O queue; the admin queue gone; both; host A removed from the
  allowed hosts), then namespace 1 resized, removed or added, or the file namespace resized, guarded as a
  mid-batch change is: never committed with work into the memory it lets go on the wire;
- host B removed from the subsystem's allowed hosts (its controller ended: checked) and allowed again (connected
  again), before a batch or during one; the file namespace resized or replaced by a new file, before or during.
  A block namespace would need a device the target can resize (a loop device of the lab): the file stands in.

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
6. When host A's controller ended in the batch (a wide case's last), a command both paths answered may differ
   only in the native answer being Invalid Namespace (`ENDED_STATUSES`): the native command finished after the
   end, when its namespace had left the queue's view; the loopback's Python path moved its data and answered
   before.  The oracle holds its data to "as it was or as written" then.

Known divergences stay out of the at-scale run (`KNOWN`: the combinations that reproduce them are made
differently) and are replayed as strict xfails from the corpus (tests/unit/fixtures/native_fuzz/corpus.json),
until fixed.  None is known now; the last two, fixed (corpus seeds 133 and 150), were a ring error and a queue
ending while a live change was in flight; the widened fuzz's first runs found two more, fixed (corpus seeds 4 and
40, wide): a reservation change that took host A's access answered its native Writes in flight Invalid Namespace,
and a file command the device failed, handed back to the core, escaped the fence of a live change.
  So in a batch with an io_uring error, a failed post or a capsule that ends the queue, the step's live change
  is made before the batch, not while it is in flight.

With the native queue on a poll-group thread, every live change is made before its batch: the thread takes the
capsules in its own time, so a change made after the first loop pass may precede them (they then meet the changed
namespace, rightly) where the Python path has started them all.

`run(seeds)` returns a `Tally` (capsules, batches, changes and faults by kind, divergences; for wide cases hosts,
controllers, reservation commands by outcome, fenced answers, controllers ended by kind).  A failure raises
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
    """What the generator knows of the running config: namespaces (size, block size, visibility), the key, the
    file namespace's size and file, which hosts the subsystem allows."""
    sizes: Dict[int, Optional[str]] = field(default_factory=lambda: {1: "1M", 4: "256K", 5: "1M"})  # None: removed
    uuid2: int = 0
    hidden: Dict[int, bool] = field(default_factory=lambda: {1: False, 5: False})
    key: bool = False
    file_gen: int = 0  # namespace 5's file: ns5.img, then ns5-1.img, ... (each replace a new file)
    allowed: Dict[str, bool] = field(default_factory=lambda: {"A": True, "B": True})

    def blocks(self, nsid: int) -> Tuple[int, int]:
        """(blocks, LBA data size shift) of namespace `nsid` as configured now; (0, 9) if there is none."""
        if nsid in (1, 4, 5):
            size = self.sizes[nsid]
            return (_bytes(size) >> 9, 9) if size else (0, 9)
        return {2: (256, 12), 3: (1 << 21, 9)}.get(nsid, (0, 9))

    def copy(self) -> "Model":
        return Model(dict(self.sizes), self.uuid2, dict(self.hidden), self.key, self.file_gen, dict(self.allowed))

    def config(self, directory: Path) -> dict:
        def visible(nsid, ns):
            if self.hidden.get(nsid):
                ns["nvmeof_roce"]["visible_hosts"] = [HOST_B]
            return ns
        # Reservations on namespaces 1 (RAM) and 5 (file): host A (the differential queue and a loopback
        # controller of the same host identifier) and host B (loopback) register, acquire and preempt there
        namespaces = [visible(1, ram_ns(1, self.sizes[1], resv={"enable": "1"}))] if self.sizes[1] else []
        namespaces += [ram_ns(2, "1M", 4096, device={"uuid": UUIDS[self.uuid2]}), null_ns(3, "1G")]
        if self.sizes[4]:
            namespaces.append(ram_ns(4, self.sizes[4]))
        name = "ns5.img" if not self.file_gen else f"ns5-{self.file_gen}.img"
        ns5 = file_ns(5, directory / name, self.sizes[5])
        ns5["resv"] = {"enable": "1"}
        namespaces.append(visible(5, ns5))
        host_a = {"nqn": HOST_A, "dhchap": {"key": KEY, "hash": "hmac(sha256)", "dhgroup": "null"}} if self.key \
            else {"nqn": HOST_A}
        allowed = [nqn for who, nqn in (("A", HOST_A), ("B", HOST_B)) if self.allowed[who]]
        return {"hosts": [host_a, {"nqn": HOST_B}], "ports": [port(1, "10.99.0.1:4420", [SUB_RAM, SUB_4K, SUB_NULL])],
                "subsystems": [{"nqn": SUB_RAM, "attr": {"allow_any_host": "0"}, "allowed_hosts": allowed,
                                "namespaces": namespaces},
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
class Resv:
    """A reservation command of one of the loopback controllers (host A's second controller "A", host B's "B")."""
    actor: str
    name: str  # register, unregister, acquire, release, clear, preempt, preempt-and-abort
    nsid: int
    opc: int
    cdw10: int
    data: bytes

    def __repr__(self) -> str:
        return f"Resv({self.actor} {self.name} ns {self.nsid} cdw10 {self.cdw10:#x} data {self.data.hex()})"


@dataclass
class Step:
    commands: List[Command]
    change: Optional[Tuple[str, int, object]] = None  # (kind, nsid, value)
    change_mid: bool = False  # made while the batch is in flight (after the first poll), not before it
    fault: Optional[Tuple[str, object]] = None
    # the widened fuzz (Case(wide=True)): reservation commands before the batch and one while it is in flight;
    # host A's controller ended in the last step (END_KINDS), then a live change with its work still on the wire
    resv_before: List[Resv] = field(default_factory=list)
    resv_mid: Optional[Resv] = None
    end: Optional[str] = None
    end_change: Optional[Tuple[str, int, object]] = None


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


# ------------------------------------------------------------------------------------------------ the widened fuzz

RESV_NVM = {"register": 0x0D, "unregister": 0x0D, "acquire": 0x11, "preempt": 0x11, "preempt-and-abort": 0x11,
            "release": 0x15, "clear": 0x15}
RESV_KEYS = {"A": 0xA, "B": 0xB}
END_KINDS = ("kato", "disconnect", "admin", "disconnect+admin", "host")
KATO_MS = 4000  # host A's admin queue asks for it in a wide case; "kato" moves the fake clock past it
ID_A = "00010203-0405-0607-0809-0a0b0c0d0e0f"  # RAW_HOSTID: the differential queue's host identifier
ID_B = "00000000-0000-4000-8000-0000000000bb"
FILE_SIZES = ("1M", "2M", "512K")


def gen_resv(rng: random.Random, actor: Optional[str] = None, name: Optional[str] = None,
             nsid: Optional[int] = None, rtype: Optional[int] = None) -> Resv:
    """A reservation command: mostly the right keys, so registrations, holds and preempts happen; sometimes a
    wrong one (a conflict both paths answer alike)."""
    from nvmeof_roce.nvme import reservation as R
    actor = actor or rng.choice(["A", "B", "B"])
    me, other = RESV_KEYS[actor], RESV_KEYS["B" if actor == "A" else "A"]
    crkey = me if rng.random() < 0.9 else 0x77
    rtype = rtype or rng.choice(R.TYPES)
    name = name or rng.choice(["register"] * 3 + ["acquire"] * 3 + ["preempt"] * 2 + ["preempt-and-abort"] * 4 +
                              ["release"] * 2 + ["clear", "unregister"])
    nsid = nsid or rng.choice([1, 1, 1, 5])
    if name == "register":
        cdw10, data = R.register_cdw10(R.REGISTER), R.KEYS.pack(0, me)
    elif name == "unregister":
        cdw10, data = R.register_cdw10(R.UNREGISTER), R.KEYS.pack(crkey, 0)
    elif name in ("acquire", "preempt", "preempt-and-abort"):
        action = {"acquire": R.ACQUIRE, "preempt": R.PREEMPT, "preempt-and-abort": R.PREEMPT_AND_ABORT}[name]
        cdw10, data = R.acquire_cdw10(action, rtype), R.KEYS.pack(crkey, 0 if action == R.ACQUIRE else other)
    else:
        cdw10 = R.release_cdw10(R.RELEASE if name == "release" else R.CLEAR, rtype)
        data = crkey.to_bytes(8, "little")
    return Resv(actor, name, nsid, RESV_NVM[name], cdw10, data)


def gen_wide_change(rng: random.Random, model: Model) -> Optional[Tuple[str, int, object]]:
    """A change of the widened fuzz: host B removed from the subsystem's allowed hosts (its controller ended) or
    allowed again, the file namespace resized or replaced by a new file."""
    kind = rng.choice(["hosts", "hosts", "file-resize", "file-resize", "file-replace"])
    if kind == "hosts":
        model.allowed["B"] = not model.allowed["B"]
        return ("hosts", 0, model.allowed["B"])
    if kind == "file-resize":
        size = rng.choice([s for s in FILE_SIZES if s != model.sizes[5]])
        model.sizes[5] = size
        return ("resize", 5, size)
    model.file_gen += 1
    return ("replace-file", 5, model.file_gen)


def gen_end_change(rng: random.Random, model: Model, kind: str) -> Optional[Tuple[str, int, object]]:
    """The change made once host A's controller ended, its work still on the wire: namespace 1 resized or removed,
    the file namespace resized; "host": host A itself removed from the allowed hosts (the change that ends it)."""
    if kind == "host":
        model.allowed["A"] = False
        return ("hosts-a", 0, False)
    what = rng.choice(["resize", "resize", "remove", "file"])
    if what == "file":
        size = rng.choice([s for s in FILE_SIZES if s != model.sizes[5]])
        model.sizes[5] = size
        return ("resize", 5, size)
    if not model.sizes[1]:
        model.sizes[1] = RAM_SIZES[1][0]
        return ("add", 1, model.sizes[1])
    if what == "remove":
        model.sizes[1] = None
        return ("remove", 1, None)
    size = rng.choice([s for s in RAM_SIZES[1] if s != model.sizes[1]])
    model.sizes[1] = size
    return ("resize", 1, size)


def gen_wide(rng: random.Random, model: Model, step: Step, first: bool, last: bool) -> None:
    """The widened fuzz's events of `step`, from their own random stream (the narrow case's draws are unchanged)."""
    if first and rng.random() < 0.6:  # both hosts registered on a namespace, host A holding it: preempts can act
        nsid, rtype = rng.choice([1, 1, 5]), rng.choice([1, 1, 2, 3, 4])
        step.resv_before = [gen_resv(rng, "A", "register", nsid), gen_resv(rng, "B", "register", nsid),
                            gen_resv(rng, "A", "acquire", nsid, rtype)]
    elif rng.random() < 0.35:
        step.resv_before = [gen_resv(rng) for _ in range(rng.randint(1, 3))]
    if step.change is None and rng.random() < 0.2:
        step.change = gen_wide_change(rng, model)
        step.change_mid = rng.random() < 0.5
    quiet = step.fault is None or step.fault[0] == "hold"
    if last and rng.random() < 0.3:
        step.end = rng.choice(END_KINDS)
        step.change_mid = False  # the step's own change, if any, before the batch
        if not quiet:
            step.fault = None
        step.end_change = gen_end_change(rng, model, step.end)
    elif not step.change_mid and rng.random() < 0.45:
        # a preempt and abort of host A by host B most often: the fence's window
        step.resv_mid = gen_resv(rng, "B", "preempt-and-abort") if rng.random() < 0.5 else gen_resv(rng)
        if not quiet:
            step.fault = None


class Case:
    """The steps of seed `seed`: 2-10 batches, the model of the config advanced by each change.  `wide`: with
    the widened fuzz's events (host B and a second controller of host A, reservations, ended controllers, host
    and file namespace changes), drawn from a second stream so the narrow case's steps are the same."""

    def __init__(self, seed: int, wide: bool = False):
        self.seed = seed
        self.wide = wide
        rng = random.Random(seed)
        wide_rng = random.Random(f"wide-{seed}")
        self.model = Model()
        self.steps = []
        count = rng.randint(2, 10)
        for i in range(count):
            step = gen_step(rng, self.model)
            if wide:
                gen_wide(wide_rng, self.model, step, i == 0, i == count - 1)
            self.steps.append(step)


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
    # the widened fuzz
    wide_cases: int = 0
    hosts: int = 0  # hosts with a controller on the subsystem, summed over cases
    controllers: int = 0  # controllers connected (host A's differential one, its loopback one, host B's), reconnects
    resv: Counter = field(default_factory=Counter)  # reservation commands by name and outcome
    fenced: int = 0  # reservation changes answered after a fence (an access taken away)
    fenced_on_wire: int = 0  # ... issued while host A's native work into the namespace's memory was on the wire
    overwrites: int = 0  # a write by the changing host right after such an answer, over host A's batch's blocks
    ended: Counter = field(default_factory=Counter)  # host A's controller ended mid-flight, by kind

    def summary(self) -> str:
        resv = dict(sorted(self.resv.items()))
        text = (f"{self.cases} cases, {self.batches} batches, {self.capsules} capsules "
                f"({self.native_answers} native answers), live changes {dict(self.changes)}, faults "
                f"{dict(self.faults)}, queues ended by {dict(self.fatal)}, {self.degraded} batches compared by the "
                f"acknowledged-data oracle")
        if self.wide_cases:
            text += (f"; widened: {self.wide_cases} cases, {self.hosts} hosts and {self.controllers} controllers "
                     f"connected, preempts {self.resv['preempt ok']}, preempt-and-aborts "
                     f"{self.resv['preempt-and-abort ok']}, {self.fenced} reservation changes answered after a fence "
                     f"({self.fenced_on_wire} issued with host A's work into the namespace on the wire, "
                     f"{self.overwrites} followed by a write over host A's blocks), reservation commands {resv}, "
                     f"controllers ended mid-flight {dict(self.ended)}")
        return text + ", 0 divergences"


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

    # -- the widened fuzz: the other controllers (loopback, on both sides), reservations, ended controllers

    ctrls: Dict[str, object]
    where = ""

    def connect(self, who: str):
        """Host A's second controller ("A", host A's host identifier: one registrant with the differential queue)
        or host B's ("B"), over loopback: KATO 0 (the target's max_kato), so moving the clock past host A's
        differential controller's KATO ends only that one."""
        hostnqn, hostid = (HOST_A, ID_A) if who == "A" else (HOST_B, ID_B)
        self.ctrls[who] = self.ep.env.connect(SUB_RAM, hostnqn=hostnqn, hostid=hostid, num_io_queues=1, kato_ms=0)
        return self.ctrls[who]

    def poll_hosts(self) -> None:
        env = self.ep.env
        env.fabric.pump()
        for who, ctrl in list(self.ctrls.items()):
            if ctrl is None:
                continue
            try:
                ctrl.poll_completions()
            except Exception:  # its controller was ended (a host removed): nothing of it is pending
                self.ctrls[who] = None

    def host_controllers(self, hostnqn: str) -> int:
        return sum(1 for c in self.ep.env.target.subsystem(SUB_RAM).controllers.values() if c.hostnqn == hostnqn)

    def wait(self, more) -> None:
        settle(self.ep.env, more=lambda: not self.tick() and more())

    wide = False

    def tick(self) -> None:
        """In a wide case, the target's tick while a batch settles (a real event loop ticks every second): a
        change that ends controllers is finished by a fence that may be checked only there."""
        if self.wide:
            self.ep.env.target.tick(self.ep.env.clock())

    def send_raw(self, capsule: bytes) -> None:
        raise NotImplementedError

    def end_controller(self, kind: str) -> None:
        """End host A's differential controller (or its I/O queue) as `kind` says, its batch in flight."""
        env = self.ep.env
        if kind == "kato":
            for _ in range(2):  # twice: native commands count as traffic at the first tick after them
                env.clock.advance(KATO_MS / 1000 + 1)
                env.target.tick(env.clock())
                env.fabric.pump()
        if kind in ("disconnect", "disconnect+admin"):
            self.send_raw(Command(cid=0x99, opc=FABRICS, nsid=FCTYPE_DISCONNECT).capsule(self.ep))
        if kind in ("admin", "disconnect+admin"):
            self.ep.admin.transport.close()
            env.fabric.pump()

    def resv_state(self) -> Dict[int, Optional[dict]]:
        out = {}
        for nsid, ns in self.ep.env.target.subsystem(SUB_RAM).namespaces.items():
            out[nsid] = ns.resv.snapshot() if ns.resv is not None else None
        return out

    def access_taken(self, nsid: int, before: Optional[dict]) -> bool:
        """Whether the reservation change from `before` took an access away from a host with a queue on the
        subsystem: the target answers it only after a fence then (engine/reservations.py _changed)."""
        from nvmeof_roce.engine.reservations import Reservation
        target = self.ep.env.target
        sub = target.subsystem(SUB_RAM)
        ns = sub.namespaces.get(nsid)
        if before is None or ns is None or ns.resv is None:
            return False
        old = Reservation()
        old.restore(before)
        hosts = {qs.ctrl.hostid for qs in target.queue_states() if qs.ctrl is not None and qs.ctrl.subsystem is sub}
        return any(old.allowed(h) - ns.resv.allowed(h) for h in hosts)

    def on_wire_into_ns(self, nsid: int) -> int:
        return 0

    def wire_check(self, pending: "Pending") -> None:
        pass


class Pending:
    """A reservation command of a loopback controller, in flight; `done` (polled by the batch's loops) once it
    and the write it may be followed by are answered.  At its answer, if the change took an access away (the
    target fenced it), the native side checks that no work request of host A's queue into the namespace's
    memory is on the wire (`Side.wire_check`), and the controller that made it writes over the blocks of the
    batch's first Write to the namespace: that Write started before the change, so on both paths it must land
    before this one (the namespace's bytes are compared, and the oracle knows of the write)."""

    def __init__(self, side: Side, op: Resv, region: Optional[Tuple[int, int]] = None):
        from nvmeof_roce.nvme.command import SQE
        self.side, self.op, self.region = side, op, region
        self.status: Optional[int] = None
        self.write_status: Optional[int] = None
        self.fenced = False
        self.violation: Optional[str] = None
        self.overlay: Optional[Tuple[int, int, bytes]] = None
        self.checked = self.finished = False
        self.error = None
        ns = side.ep.env.target.subsystem(SUB_RAM).namespaces.get(op.nsid)
        self.before = ns.resv.snapshot() if ns is not None and ns.resv is not None else None
        self.window = side.on_wire_into_ns(op.nsid)
        ctrl = side.ctrls.get(op.actor)
        if ctrl is None:  # the host is not allowed now (the model says so on both sides)
            self.status = -1
            self.checked = self.finished = True
            return
        ctrl.submit_io(SQE(opc=op.opc, nsid=op.nsid, cdw10=op.cdw10), self._answer, data_out=op.data,
                       name=op.name)

    def _answer(self, comp) -> None:
        self.status = comp.status

    def _written(self, comp) -> None:
        self.write_status = comp.status

    @property
    def done(self) -> bool:
        if self.finished:
            return True
        self.side.poll_hosts()
        if self.status is None:
            return False
        if not self.checked:
            self.checked = True
            self.fenced = self.status == 0 and self.side.access_taken(self.op.nsid, self.before)
            if self.fenced:
                self.side.wire_check(self)
            ctrl = self.side.ctrls.get(self.op.actor)
            if self.fenced and self.region is not None and ctrl is not None:
                slba, n = self.region
                data = pattern(n, seed=0xB7)
                self.overlay = (self.op.nsid, slba << 9, data)
                ctrl.submit_write(self.op.nsid, slba, data, self._written, block_size=512)
        if self.overlay is not None and self.write_status is None:
            return False
        self.finished = True
        return True

    def outcome(self) -> tuple:
        return self.status, self.fenced, self.write_status


class PythonSide(Side):
    def send_raw(self, capsule: bytes) -> None:
        if not self.ep.transport.closed:
            self.ep.transport._outstanding = 0
            self.ep.transport.send(capsule)
        self.ep.env.fabric.pump()

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
        settle(self.ep.env, more=lambda: applying is not None and not (self.tick() or applying.done))
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
                self.reap_closed()
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

    def reap_closed(self) -> None:
        """A closed queue whose ring still has commands in the kernel: what the transport's loop does on the ring's
        eventfd (NativeTargetQueue.reap_closed; the fake has no loop).  Their namespace references go with them."""
        queue = self.ep.queue
        if queue.closed and getattr(queue, "held", 0) and queue.ring_fd is not None:
            select.select([queue.ring_fd], [], [], 0.05)
            queue.reap_closed()

    def send_raw(self, capsule: bytes) -> None:
        if self.ep.device.deliver(capsule) == 0 and not self.ep.queue.closed:
            self.ep.queue.poll()

    def wait(self, more) -> None:
        self.settle(more=more)

    def on_wire_into_ns(self, nsid: int) -> int:
        memory = self.memory_of(("resize", nsid, None))
        return self.ep.device.on_wire_into(*memory) if memory else 0

    def wire_check(self, pending: Pending) -> None:
        """A fenced reservation change was answered: none of host A's work into the namespace is on the wire."""
        on_wire = self.on_wire_into_ns(pending.op.nsid)
        if on_wire:
            pending.violation = (f"{self.where}: {pending.op} took an access away and was answered with {on_wire} "
                                 f"work requests of host A's native queue into namespace {pending.op.nsid}'s memory "
                                 f"still on the wire (issued with {pending.window} on it); completing them would "
                                 f"land host A's data after the answer")

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
        if isinstance(applying, Pending):  # a reservation change: checked at its answer (wire_check)
            if applying.done and applying.violation:
                raise Divergence(applying.violation)
            return
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

    def batch(self, capsules: List[bytes], fault, expect: int, mid=None, change=None, stepwise: bool = False):
        """`stepwise`: with `mid`, the wire is released one work request at a time, the guard checked after each
        poll (the widened fuzz's mid-batch reservation changes and ended controllers)."""
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
            step = arg if kind == "hold" else 1 if stepwise else 3
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
# What a native command in flight when its controller ended may be answered (its namespace left the queue's view
# with the controller): Invalid Namespace, DNR.  The loopback's Python path moved its data and answered before.
ENDED_STATUSES = {0x400B}


def check_sqhd(where: str, name: str, answers: Dict[int, bytes], completions_before: int) -> None:
    """Rule 2: the batch's completions carry the SQ heads after `completions_before`, one each, in some order."""
    heads = sorted(int.from_bytes(cqe[8:10], "little") for cqe in answers.values())
    # (a wide case's last batch may have 33: its 32 commands and a Disconnect)
    if heads != sorted((completions_before + 1 + k) % SQ_ENTRIES for k in range(len(answers))):
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
                if step.end and nat[cid][:14] == py[cid][:14] and \
                        int.from_bytes(nat[cid][14:16], "little") >> 1 in ENDED_STATUSES:
                    continue  # answered after host A's controller ended, the Python path's before (rule 6)
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
    for nsid, start, data in before.get("overlay", ()):  # written after the batch's commands, by a fence's order
        if nsid in ns_expect and start + len(data) <= len(ns_expect[nsid]):
            ns_expect[nsid][start:start + len(data)] = data
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


def _label(change) -> str:
    kind, nsid, _ = change
    return {"resize": "file-resize" if nsid == 5 else "resize", "hosts": "host-b-allowed" if change[2] else
            "host-b-removed", "hosts-a": "host-a-removed"}.get(kind, kind)


def _write_region(commands: List[Command], nsid: int, model: Model) -> Optional[Tuple[int, int]]:
    """(slba, bytes) of the batch's first keyed Write to `nsid` that fits the namespace: the blocks the host that
    changed a reservation writes over once the change is answered (Pending)."""
    blocks = model.blocks(nsid)[0]
    for c in commands:
        if c.opc == WRITE and c.nsid == nsid and c.sgl_id == 0x40 and c.flags == 0x40 and not c.bad_key \
                and not c.fatal and c.slba + c.nlb < blocks and c.length == (c.nlb + 1) << 9:
            return c.slba, (c.nlb + 1) << 9
    return None


def run_resv(seed: int, index: int, sides, op: Resv, tally: Tally) -> None:
    """One reservation command between batches, on both sides; their answers and states compared."""
    outcomes = []
    for side in sides:
        pending = Pending(side, op)
        side.wait(lambda: not pending.done)
        if pending.violation:
            raise Divergence(pending.violation)
        outcomes.append(pending)
    _compare_resv(seed, index, op, outcomes, tally)


def _compare_resv(seed: int, index: int, op: Resv, outcomes: List[Pending], tally: Tally) -> None:
    py, nat = outcomes
    if py.outcome() != nat.outcome():
        raise Divergence(f"seed {seed}, step {index}: {op}: python (status, fenced, write) {py.outcome()}, native "
                         f"{nat.outcome()}")
    if py.status == -1:
        tally.resv[f"{op.name} (host not allowed)"] += 1
        return
    tally.resv[f"{op.name} {'ok' if py.status == 0 else f'{py.status:#x}'}"] += 1
    tally.fenced += py.fenced
    tally.fenced_on_wire += bool(py.fenced and nat.window)
    tally.overwrites += py.overlay is not None and py.write_status == 0


def _reconcile_hosts(seed: int, index: int, model: Model, sides, tally: Tally) -> None:
    """Host B's loopback controller: gone once the subsystem no longer allows it (the target ended it: checked),
    connected again once it does."""
    for side in sides:
        if not model.allowed["B"]:
            side.poll_hosts()
            if side.host_controllers(HOST_B):
                raise Divergence(f"seed {seed}, step {index}: {side.name}: host B was removed from the subsystem's "
                                 f"allowed hosts and still has a controller")
            side.ctrls["B"] = None
        elif side.ctrls.get("B") is None:
            side.connect("B")
            tally.controllers += side is sides[0]


def run_case(seed: int, tally: Tally, groups=None, known: bool = False, wide: bool = False) -> None:
    """Case `seed` on both paths; `known`: reproduce the known divergences too (a corpus entry's replay); `wide`:
    the widened fuzz's events too (Case)."""
    case = Case(seed, wide=wide)
    directory = Path(tempfile.mkdtemp(prefix="native-fuzz-"))
    py_ep = nat_ep = nat = None
    try:
        model = Model()
        sides = {}
        for name in ("python", "native"):
            os.mkdir(directory / name)
            config = model.config(directory / name)
            sides[name] = (LoopbackEndpoint if name == "python" else NativeEndpoint)(
                config, SUB_RAM, host_buffer=HOST_BUFFER, kato=KATO_MS if wide else 0)
        py_ep, nat_ep = sides["python"], sides["native"]
        py = PythonSide("python", py_ep, directory / "python")
        nat = NativeSide("native", nat_ep, directory / "native", groups=groups)
        both = (py, nat)
        for side in both:
            side.ctrls = {}
            side.wide = wide
            if wide:
                side.connect("A")
                side.connect("B")
        if wide:
            tally.wide_cases += 1
            tally.hosts += 2
            tally.controllers += 3
        tally.cases += 1
        answered = {"python": 1, "native": 1}  # completions on the I/O queue, its Connect's the first
        for index, step in enumerate(case.steps):
            py.where = nat.where = f"seed {seed}, step {index}"
            for op in step.resv_before:
                run_resv(seed, index, both, op, tally)
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
                        settle(py_ep.env, more=lambda: not (py.tick() or applying.done))
                    if not applying.done or applying.error:
                        raise Divergence(f"seed {seed}, step {index}: {side.name}: the change {step.change} was "
                                         f"not made: {applying.error}")
                tally.changes[_label(step.change)] += 1
                if wide:
                    _reconcile_hosts(seed, index, after, both, tally)
            model.__dict__.update(after.__dict__)
            mid = step.change if step.change and change_mid else None
            resv_mid = step.resv_mid if groups is None else None
            end = step.end if groups is None else None
            end_change = step.end_change if end else None
            after_end = _advanced(model, end_change)
            if resv_mid is not None and (fatal or ring_error):
                run_resv(seed, index, both, resv_mid, tally)  # a queue may end in the batch: before it instead
                resv_mid = None
            before = {"host": nat_ep.host_bytes(), "ns": nat.namespaces(), "null": nat.null_namespaces(),
                      "python_answers": answered["python"], "native_answers": answered["native"],
                      "replaced": mid[1] if mid and mid[0] in ("replace", "replace-file") else
                      end_change[1] if end_change and end_change[0] == "replace-file" else None}
            capsules = [(c.capsule(py_ep), c.capsule(nat_ep)) for c in step.commands]
            fault = step.fault
            if fault and fault[0] == "stall" and groups is not None:
                fault = None  # a stall is released by the main thread at once under a poll group: no window
            region = _write_region(step.commands, resv_mid.nsid, model) if resv_mid else None
            pendings = {}

            def mid_of(side):
                if mid:
                    return lambda: side.apply(after)
                if resv_mid:
                    def start():
                        pendings[side.name] = Pending(side, resv_mid, region)
                        return pendings[side.name]
                    return start
                if end:
                    def finish():
                        side.end_controller(end)
                        return side.apply(after_end) if end_change else None
                    return finish
                return None

            if fault and fault[0] == "uring":
                native.module.uring_inject(fault[1], 100000)
            try:
                got_py, py_applying = py.batch([p for p, _ in capsules], mid=mid_of(py))
            finally:
                native.module.uring_inject("none")
            got_nat, nat_applying = nat.batch([n for _, n in capsules], fault, len(got_py), mid=mid_of(nat),
                                              change=mid or end_change, stepwise=bool(resv_mid or end))
            if mid or end_change:
                for side, applying in (("python", py_applying), ("native", nat_applying)):
                    if not applying.done or applying.error:
                        raise Divergence(f"seed {seed}, step {index}: {side}: the change {mid or end_change} made "
                                         f"while the batch was in flight was not made: {applying.error}")
                tally.changes[_label(mid or end_change) + (" (mid-batch)" if mid else " (after an end)")] += 1
            if resv_mid:
                if pendings["native"].violation:
                    raise Divergence(pendings["native"].violation)
                _compare_resv(seed, index, resv_mid, [pendings["python"], pendings["native"]], tally)
                tally.resv["(mid-batch)"] += 1
                overlay = pendings["native"].overlay
                if overlay is not None and pendings["native"].write_status == 0:
                    before["overlay"] = [overlay]
            if wide and mid:
                _reconcile_hosts(seed, index, after, both, tally)
            if wide:
                py_resv, nat_resv = py.resv_state(), nat.resv_state()
                if py_resv != nat_resv:
                    raise Divergence(f"seed {seed}, step {index}: reservation states differ: python {py_resv}, "
                                     f"native {nat_resv}")
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
            if end:
                model.__dict__.update(after_end.__dict__)
                if py.alive or nat.alive:
                    raise Divergence(f"seed {seed}, step {index}: host A's controller ended ({end}) and its queue "
                                     f"lives on: python {'lives' if py.alive else 'ended'}, native "
                                     f"{'lives' if nat.alive else 'ended'}")
            degraded = bool(fatal) or ends or bool(end) or not (py.alive and nat.alive)
            if py.alive != nat.alive and not ends and not fatal:
                raise Divergence(f"seed {seed}, step {index}: the python queue {'lives' if py.alive else 'ended'}, the "
                                 f"native one {'lives' if nat.alive else 'ended'}; answers python "
                                 f"{_statuses(got_py)}, native {_statuses(got_nat)}; step {step}")
            if not (py.alive and nat.alive) and not fatal and not ends and not end:
                raise Divergence(f"seed {seed}, step {index}: a queue ended with no fault and no fatal capsule; "
                                 f"python {_statuses(got_py)}, native {_statuses(got_nat)}")
            tally.degraded += degraded
            check_batch(seed, index, step, model, got_py, got_nat, py, nat, before, degraded)
            if degraded:  # the two paths did not run the same commands: nothing after it compares
                if end:
                    tally.ended[end] += 1
                    break
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
    after = model.copy()
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
    elif kind == "hosts":
        after.allowed["B"] = value
    elif kind == "hosts-a":
        after.allowed["A"] = value
    elif kind == "replace-file":
        after.file_gen = value
    return after


def run(seeds, tally: Optional[Tally] = None, groups=None, capsules: Optional[int] = None,
        known: bool = False, wide: bool = False) -> Tally:
    """Run the cases of `seeds` in order (until `capsules` were sent, if given); `wide`: the widened cases."""
    tally = tally or Tally()
    for seed in seeds:
        if capsules is not None and tally.capsules >= capsules:
            break
        run_case(seed, tally, groups=groups, known=known, wide=wide)
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
