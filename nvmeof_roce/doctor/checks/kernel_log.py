"""Recent kernel messages about RDMA and NVMe-oF errors, with the known ones explained."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ...errors import ToolMissing
from ..context import Context
from ..machine import ToolNotRun, missing_tool_reason
from ..result import CheckResult, ok, skipped, warn
from ..tools import ToolFailed, dmesg


@dataclass(frozen=True)
class KnownError:
    name: str
    pattern: re.Pattern
    meaning: str
    fix: str


def _known(name: str, pattern: str, meaning: str, fix: str) -> KnownError:
    return KnownError(name, re.compile(pattern, re.I), meaning, fix)


# Most specific first: a line is explained by the first entry that matches it.
KNOWN_ERRORS = [
    _known("host not allowed", r"Connect for subsystem .* is not allowed|Connect Invalid Data Parameter, hostnqn",
           "the target refused this host's NQN",
           "add the host's NQN (/etc/nvme/hostnqn) to the subsystem's allowed_hosts, or allow any host"),
    _known("unknown subsystem", r"Connect Invalid Data Parameter, subsysnqn",
           "the target has no subsystem with the NQN asked for",
           "check the subsystem NQN (nvme discover lists what the target exports)"),
    _known("connect rejected, no listener", r"Connect rejected: status 8 \(invalid service ID\)",
           "nothing listens on that address and port (RDMA CM reject: invalid service ID)",
           "start the target or enable its port; check traddr/trsvcid (4420)"),
    _known("connect rejected", r"Connect rejected: status",
           "the target's RDMA CM rejected the connection (the NVMe status in the message says why: "
           "invalid queue size, no resources, ...)",
           "read the nvme status in the line; check queue sizes (-Q) and the target's log"),
    _known("connection establishment failed", r"rdma connection establishment failed",
           "the RDMA CM handshake did not complete: -104 rejected/reset, -110 timed out (no answer: address, "
           "routing or UDP 4791 dropped), -113/-101 no route",
           "check the target is listening and reachable over RDMA (nvmeof-roce doctor --traddr ADDR)"),
    _known("address/route resolution failed", r"rdma_resolve_(addr|route) failed|address resolution failed|"
           r"route resolution failed|RDMA_CM_EVENT_(ADDR|ROUTE)_ERROR",
           "rdma_cm could not map the IP address to an RDMA port (no GID, route through a non-RDMA netdev, "
           "no ARP/ND answer)",
           "see address.traddr_gid and address.route"),
    _known("target cannot bind", r"binding CM ID to .* failed",
           "the kernel target could not listen on its port address: the address is not on an RDMA netdev (-99)",
           "put the port's traddr on the RDMA netdev (it needs a RoCE v2 GID), or use 0.0.0.0/::"),
    _known("transport retry exceeded", r"transport retry counter exceeded|RETRY_EXC_ERR|retry_exceeded",
           "packets were sent and never acknowledged after all retries: loss on the fabric (no PFC/ECN, MTU "
           "mismatch, bad cable), a firewall dropping UDP 4791, or the peer disappeared",
           "check fabric.counters, fabric.pfc and port.mtu on both ends, and the peer"),
    _known("RNR retry exceeded", r"RNR retry counter exceeded|RNR_RETRY_EXC",
           "the peer kept answering 'receiver not ready': it had no receive buffer posted (overloaded, stalled, "
           "or a queue depth larger than its receive queue)",
           "check the peer is alive and keeps up; align queue sizes between host and target"),
    _known("remote access error", r"remote access error|REM_ACCESS_ERR",
           "the peer refused an RDMA READ/WRITE: wrong rkey or address, memory not registered for remote "
           "access, or invalidated too early (a protocol bug on one side)",
           "capture both sides' logs; update the initiator/target; report it with the failing command"),
    _known("remote invalid request", r"remote invalid request error|REM_INV_REQ_ERR",
           "the peer could not execute the request (length beyond its limits, unsupported operation)",
           "check max transfer sizes (MDTS, max_sectors) and inline data size on both sides"),
    _known("local length error", r"local length error|LOC_LEN_ERR",
           "a message did not fit the receive buffer posted for it: in-capsule data or message size larger "
           "than the peer expected",
           "align the inline data size (nvmet port param_inline_data_size) with what hosts send"),
    _known("local protection error", r"local protection error|LOC_PROT_ERR",
           "a work request used memory not registered (or with the wrong key/access) on this side",
           "software bug on this side; check ulimit -l (stack.memlock) and update the driver"),
    _known("local QP operation error", r"local QP operation error|LOC_QP_OP_ERR",
           "a malformed work request (too many SGEs, inline data too large)",
           "software/driver bug; update the driver and rdma-core"),
    _known("keep-alive timeout", r"keep-alive timer .* expired|keep alive timeout",
           "the controller got no keep-alive in time: the host vanished or the fabric stalled",
           "check connectivity and fabric.counters; raise the keep-alive timeout (-k) on lossy links"),
    _known("I/O timeout", r"I/O \d+ QID \d+ timeout|I/O tag \d+ .* timeout",
           "commands did not complete in time; the host resets the controller",
           "check the target's health and the fabric (fabric.counters); look for preceding RDMA errors"),
    _known("QP fatal event", r"QP (fatal|access) error|received IB QP event",
           "the RDMA device reported an asynchronous error on a queue pair",
           "check the preceding lines and the device's firmware/driver messages"),
    _known("mlx5 error CQE", r"dump error cqe|mlx5_.*syndrome",
           "the mlx5 HCA completed a work request with an error (the syndrome says which)",
           "decode the syndrome (vendor_err) with the HCA docs; usually follows a transport error above"),
    _known("work requests flushed", r"WR flushed|WR_FLUSH_ERR",
           "outstanding work requests were flushed because the queue pair went to error: a consequence, "
           "the cause is an earlier error",
           "look at the error just before it"),
]

MAX_LINES_PER_ERROR = 3


def explain(line: str) -> Optional[KnownError]:
    """The known error a kernel log line reports, if any."""
    for known in KNOWN_ERRORS:
        if known.pattern.search(line):
            return known
    return None


def _kmsg_text(record: str) -> Optional[str]:
    """The message of a /dev/kmsg record "PRI,SEQ,USEC,FLAGS;text" (continuation lines → None)."""
    if record.startswith(" "):
        return None
    head, sep, text = record.partition(";")
    if not sep:
        return record
    fields = head.split(",")
    try:
        usec = int(fields[2])
        return f"[{usec / 1e6:12.6f}] {text}"
    except (IndexError, ValueError):
        return text


def _read_kernel_log(ctx: Context) -> Tuple[Optional[List[str]], str]:
    """(lines, where from): `dmesg` first, /dev/kmsg when dmesg is missing or restricted."""
    reasons = []
    try:
        return dmesg(ctx.machine), "dmesg"
    except (ToolMissing, ToolNotRun) as exc:
        reasons.append(missing_tool_reason(exc))
    except ToolFailed as exc:
        reasons.append(str(exc))
    records = ctx.machine.read_kmsg()
    if records is not None:
        return [t for t in (_kmsg_text(r) for r in records) if t is not None], "/dev/kmsg"
    reasons.append("/dev/kmsg not readable (kernel.dmesg_restrict=1 needs root or CAP_SYSLOG)")
    return None, "; ".join(reasons)


def check_kernel_messages(ctx: Context) -> CheckResult:
    """Detects RDMA and NVMe-oF errors in the kernel log (dmesg, else /dev/kmsg) and explains
    the known ones: completion errors (transport retry exceeded, RNR retry exceeded, remote
    access, local length/protection), CM failures (Connect rejected, connection establishment
    failed, address resolution), NVMe-oF refusals, keep-alive and I/O timeouts.  The log is
    history: errors may predate the current configuration, hence a warning, not a failure."""
    lines, source = _read_kernel_log(ctx)
    if lines is None:
        return skipped("kernel.messages", "", source)
    found = {}
    for line in lines:
        known = explain(line)
        if known is not None:
            found.setdefault(known.name, (known, []))[1].append(line.strip())
    if not found:
        return ok("kernel.messages", "", f"no RDMA/NVMe-oF errors in the kernel log ({len(lines)} lines, {source})",
                  [f"{source}: {len(lines)} lines read"], source=source, lines=len(lines))
    evidence = [f"{source}: {len(lines)} lines read"]
    fixes = []
    for name, (known, matched) in found.items():
        evidence.append(f"{name} x{len(matched)}: {known.meaning}")
        evidence += [f"  {m}" for m in matched[-MAX_LINES_PER_ERROR:]]
        fixes.append(f"{name}: {known.fix}")
    summary = ", ".join(f"{name} x{len(matched)}" for name, (_, matched) in found.items())
    details = {"source": source, "lines": len(lines),
               "errors": {name: {"count": len(m), "meaning": k.meaning, "last": m[-MAX_LINES_PER_ERROR:]}
                          for name, (k, m) in found.items()}}
    return warn("kernel.messages", "", summary, evidence, "\n".join(fixes), **details)
