"""perftest: run ib_send_lat / ib_write_lat / ib_read_lat / ib_write_bw (server and client on one link) and
parse their result tables.

Both sides run on this machine: the server is started first (it waits for a client), then the client connects
to the server's address on the same RDMA device (over rxe0 in the lab, 10.99.0.1). With `rdma_cm=True` the
two connect through the RDMA CM (`-R`) and the GID follows from the address; without it perftest exchanges
its parameters over TCP and needs the GID index of the RoCE v2 address (`-x N`), found from sysfs.

The latency tests print::

     #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]
     2       1000          3.88           18.52        4.05     	       4.14        	0.49   		6.54    		18.52

and the bandwidth tests::

     #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
     65536      5000             2758.45            2757.94		   0.044127

(older versions print fewer columns; newer ones say MiB/sec; `--report_gbits` says Gb/sec). perftest's
"MB/sec" is computed with 2^20, so both MB/sec and MiB/sec are MiB/s: `bw_*_mb_s` keep perftest's number and
unit, `bw_avg_bytes` is the rate in bytes/s.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import math
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from ..errors import NvmeofError, ToolMissing

log = logging.getLogger(__name__)

LATENCY_TESTS = ("ib_send_lat", "ib_write_lat", "ib_read_lat")
BANDWIDTH_TESTS = ("ib_write_bw", "ib_read_bw", "ib_send_bw")
DEFAULT_TESTS = ("ib_send_lat", "ib_write_lat", "ib_read_lat", "ib_write_bw")
DEFAULT_SIZES = {"lat": 2, "bw": 65536}
PERFTEST_PACKAGE = "perftest"
SYSFS_IB = Path("/sys/class/infiniband")

# perftest's header names, normalised (the real header has spaces inside some column names).
_HEADER_FIXES = [
    (re.compile(r"99\.9%\s*percentile"), "p99.9"),
    (re.compile(r"99%\s*percentile"), "p99"),
    (re.compile(r"BW\s+peak"), "bw_peak"),
    (re.compile(r"BW\s+average"), "bw_avg"),
]
_COLUMN_KEYS = {
    "#bytes": "bytes", "#iterations": "iterations",
    "t_min": "t_min_us", "t_max": "t_max_us", "t_typical": "t_typical_us", "t_avg": "t_avg_us",
    "t_stdev": "t_stdev_us", "p99": "p99_us", "p99.9": "p99_9_us",
    "bw_peak": "bw_peak", "bw_avg": "bw_avg", "MsgRate": "msg_rate_mpps", "CPU_Util": "cpu_util_pct",
}
# bytes per second for one unit of perftest's BW columns
_BW_UNITS = {"MB/sec": 1 << 20, "MiB/sec": 1 << 20, "Gb/sec": 1e9 / 8}


@dataclass
class PerftestRow:
    """One line of a perftest result table (one message size)."""

    bytes: int
    iterations: int
    t_min_us: Optional[float] = None
    t_max_us: Optional[float] = None
    t_typical_us: Optional[float] = None
    t_avg_us: Optional[float] = None
    t_stdev_us: Optional[float] = None
    p99_us: Optional[float] = None
    p99_9_us: Optional[float] = None
    bw_peak_mb_s: Optional[float] = None
    bw_avg_mb_s: Optional[float] = None
    bw_unit: str = ""
    bw_avg_bytes: Optional[float] = None
    msg_rate_mpps: Optional[float] = None


@dataclass
class PerftestResult:
    """A perftest run: the test, how it ran, and its table (the first row is the headline)."""

    test: str
    device: str
    address: str
    rdma_cm: bool
    gid_index: Optional[int]
    rows: List[PerftestRow] = field(default_factory=list)
    command: List[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return test_kind(self.test)

    @property
    def row(self) -> PerftestRow:
        return self.rows[0]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind"] = self.kind
        head = self.rows[0] if self.rows else None
        if head is not None:
            d.update({k: getattr(head, k) for k in (
                "bytes", "t_typical_us", "t_avg_us", "p99_us", "p99_9_us", "bw_avg_mb_s", "bw_peak_mb_s",
                "bw_unit", "bw_avg_bytes", "msg_rate_mpps")})
        return d


def test_kind(test: str) -> str:
    if test.endswith("_lat"):
        return "lat"
    if test.endswith("_bw"):
        return "bw"
    raise ValueError(f"{test} is not a perftest latency or bandwidth test")


def _num(text: str):
    try:
        return int(text)
    except ValueError:
        return float(text)


def parse_perftest_output(text: str) -> List[PerftestRow]:
    """The result table of a perftest run (one row per message size), from its text output."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("#bytes"):
            header_line = line
            break
    else:
        raise NvmeofError("no result table in perftest's output (no '#bytes' header)",
                          "see the perftest output kept with the results; did the client connect?")
    for pattern, repl in _HEADER_FIXES:
        header_line = pattern.sub(repl, header_line)
    columns: List[Tuple[str, str]] = []
    for token in header_line.split():
        m = re.match(r"([^\[]+)(?:\[([^\]]*)\])?$", token)
        name, unit = (m.group(1), m.group(2) or "") if m else (token, "")
        columns.append((name, unit))

    rows: List[PerftestRow] = []
    for line in lines[i + 1:]:
        s = line.strip()
        if not s:
            continue
        if s.startswith("---"):
            if rows:
                break
            continue
        fields = s.split()
        if not re.match(r"^\d+$", fields[0]):
            if rows:
                break
            continue
        try:
            values = [_num(f) for f in fields]
        except ValueError:
            break
        row = PerftestRow(bytes=int(values[0]), iterations=int(values[1]) if len(values) > 1 else 0)
        for (name, unit), value in zip(columns, values):
            key = _COLUMN_KEYS.get(name)
            if key in (None, "bytes", "iterations"):
                continue
            if key in ("bw_peak", "bw_avg"):
                setattr(row, f"{key}_mb_s", float(value) * (_BW_UNITS.get(unit, 1 << 20) / (1 << 20)))
                row.bw_unit = unit
                if key == "bw_avg":
                    row.bw_avg_bytes = float(value) * _BW_UNITS.get(unit, 1 << 20)
            elif key == "cpu_util_pct":
                continue
            else:
                # perftest prints "inf" when its clock measured nothing (seen on rxe under emulation): no figure
                setattr(row, key, float(value) if math.isfinite(value) else None)
        if row.bw_unit == "Gb/sec":  # bw_*_mb_s are MiB/s whatever perftest printed
            row.bw_unit = "MiB/sec"
        rows.append(row)
    if not rows:
        raise NvmeofError("perftest's result table is empty", "see the perftest output kept with the results")
    return rows


# --- where the address lives: RDMA device and GID index, from sysfs --------------------------------

def find_gid(address: str, device: Optional[str] = None, sysfs: Path = SYSFS_IB) -> Optional[Tuple[str, int, int]]:
    """(device, port, gid index) of the RoCE GID for an IPv4 address, RoCE v2 preferred; None if no device has it."""
    try:
        ipaddress.IPv4Address(address)
    except ValueError:
        raise NvmeofError(f"{address} is not an IPv4 address", "pass the IPv4 address of the RDMA interface")
    want = ipaddress.IPv6Address("::ffff:" + address)
    best = None
    devices = [sysfs / device] if device else sorted(sysfs.glob("*"))
    for dev in devices:
        for port_dir in sorted((dev / "ports").glob("*")):
            for gid_file in sorted((port_dir / "gids").glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else 0):
                try:
                    gid = ipaddress.IPv6Address(gid_file.read_text().strip())
                except (OSError, ValueError):  # unused GID slots refuse to be read
                    continue
                if gid != want:
                    continue
                try:
                    gtype = (port_dir / "gid_attrs" / "types" / gid_file.name).read_text().strip()
                except OSError:
                    gtype = ""
                candidate = (dev.name, int(port_dir.name), int(gid_file.name))
                if "v2" in gtype:
                    return candidate
                best = best or candidate
    return best


def rdma_device_for(address: str, sysfs: Path = SYSFS_IB) -> str:
    """The RDMA device carrying `address` (e.g. rxe0 for 10.99.0.1 in the lab)."""
    if not sysfs.is_dir() or not any(sysfs.iterdir()):
        raise NvmeofError("this machine has no RDMA device (/sys/class/infiniband is empty)",
                          "run on a machine with an RDMA NIC, or inside the lab: nvmeof-roce lab run -- nvmeof-roce bench")
    found = find_gid(address, sysfs=sysfs)
    if not found:
        raise NvmeofError(f"no RDMA device has the address {address} (no RoCE GID ::ffff:{address})",
                          "pass --traddr with the IPv4 address of an RDMA interface (see 'rdma link' and 'ip addr')")
    return found[0]


def _rdma_links() -> List[dict]:
    """`rdma link show`: each RDMA port with its netdev (software devices have no PCI device to read it from)."""
    from ..kernel.softroce import Rdma
    try:
        return Rdma().links()
    except NvmeofError:
        return []


def iwarp_device_for(address: str, sysfs: Path = SYSFS_IB) -> str:
    """The iWARP device (node type 4, RNIC: siw, Chelsio, irdma in iWARP mode) whose netdev holds `address`.
    iWARP GIDs carry the MAC, not the IP, so the address is looked up on the device's netdevs."""
    for dev in sorted(sysfs.iterdir()) if sysfs.is_dir() else []:
        try:
            if (dev / "node_type").read_text().split(":")[0].strip() != "4":
                continue
        except OSError:
            continue
        netdevs = [n.name for n in (dev / "device" / "net").iterdir()] if (dev / "device" / "net").is_dir() else []
        netdevs += [link.get("netdev") for link in _rdma_links() if link.get("ifname") == dev.name]  # siw: no device
        for netdev in netdevs:
            out = subprocess.run(["ip", "-j", "-4", "addr", "show", "dev", netdev], capture_output=True,
                                 text=True).stdout
            try:
                infos = json.loads(out or "[]")
            except ValueError:
                continue
            if any(a.get("local") == address for i in infos for a in i.get("addr_info", [])):
                return dev.name
    raise NvmeofError(f"no iWARP device has the address {address}",
                      "add one (in the lab: ip link add siwnet0 type dummy; ip addr add 10.98.0.1/24 dev siwnet0; "
                      "ip link set siwnet0 up; nvmeof-roce rdma add-siw siwnet0), or pass --iwarp-traddr")


# --- running ----------------------------------------------------------------------------------------

def perftest_binary(test: str) -> str:
    path = shutil.which(test)
    if not path:
        raise ToolMissing(test, PERFTEST_PACKAGE)
    return path


def perftest_args(test: str, device: str, *, size: Optional[int] = None, iterations: Optional[int] = None,
                  rdma_cm: bool = True, gid_index: Optional[int] = None, port: int = 18515, ib_port: int = 1,
                  extra: Sequence[str] = ()) -> List[str]:
    """Arguments shared by the server and client of one test (the client adds the server's address)."""
    kind = test_kind(test)
    args = ["-d", device, "-i", str(ib_port), "-p", str(port),
            "-s", str(size if size is not None else DEFAULT_SIZES[kind])]
    if iterations:
        args += ["-n", str(iterations)]
    if rdma_cm:
        args.append("-R")
    if gid_index is not None:
        args += ["-x", str(gid_index)]
    if kind == "lat":
        args.append("-F")  # no CPU-frequency warning: VMs and containers have no cpufreq to read
    return args + list(extra)


SERVER_START = 3.0  # s a perftest server is given to listen before a failed client attempt counts against it


def _stop(proc: Optional[subprocess.Popen], grace: float = 3.0) -> str:
    """Terminate a child we started (by its pid), and return what it printed."""
    if proc is None:
        return ""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)
    try:
        out, _ = proc.communicate(timeout=grace)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        out = ""
    return out or ""


def run_perftest(test: str, address: str, *, device: Optional[str] = None, size: Optional[int] = None,
                 iterations: Optional[int] = None, rdma_cm: bool = True, gid_index: Optional[int] = None,
                 port: int = 18515, ib_port: int = 1, timeout: float = 120.0, connect_timeout: float = 45.0,
                 extra: Sequence[str] = (), raw_output: Optional[Path] = None,
                 remote_server: bool = False) -> PerftestResult:
    """Run one perftest test with its server and client on this machine, over `address`'s RDMA device.
    With `remote_server` only the client runs here: the server was started on `address`'s machine
    (two-node bench), and `device` is this machine's RDMA device.

    Without rdma_cm and with no gid_index, the RoCE v2 GID index of `address` is looked up in sysfs.
    The client is retried while the server is not yet listening (it prints nothing until it exits), each time
    against a new server: a perftest server takes one connection and stops listening, so a client attempt that
    reached it and then failed (rdma_cm "Unexpected CM event" on rxe) leaves it deaf to every later one. The
    server is always stopped before returning. `raw_output` keeps both sides' text.
    """
    test_kind(test)
    binary = perftest_binary(test)
    if device is None:
        device = rdma_device_for(address)
    if not rdma_cm and gid_index is None:
        found = find_gid(address, device=device)
        if not found:
            raise NvmeofError(f"{device} has no RoCE GID for {address}", "pass --perftest-gid N (see 'show_gids')")
        gid_index = found[2]
    args = perftest_args(test, device, size=size, iterations=iterations, rdma_cm=rdma_cm, gid_index=gid_index,
                         port=port, ib_port=ib_port, extra=extra)
    server_cmd = [binary] + args
    client_cmd = [binary] + args + [address]
    log.info("perftest server: %s; client: %s", " ".join(server_cmd), " ".join(client_cmd))

    def start_server():
        return subprocess.Popen(server_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    server = None
    server_out = client_out = ""
    attempts: List[str] = []
    try:
        if not remote_server:
            server = start_server()
        started = time.monotonic()
        deadline = time.monotonic() + connect_timeout
        time.sleep(0.3)
        while True:
            if server is not None and server.poll() is not None:
                server_out = _stop(server)
                if not attempts:
                    raise NvmeofError(f"{test} server exited (code {server.returncode}) before a client connected: "
                                      f"{_tail(server_out)}", f"check '{test} -d {device}' by hand")
                server, started = start_server(), time.monotonic()  # it ended with a client's failed connection
                time.sleep(0.3)
            try:
                client = subprocess.run(client_cmd, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired as exc:
                # rxe sometimes leaves a client's connect unanswered for ever: one more try, with a new server
                if any(a.startswith("hung") for a in attempts):
                    raise NvmeofError(f"{test} client did not finish within {timeout:.0f} s, twice",
                                      "check the RDMA link (rdma link; ibv_devinfo)") from exc
                attempts.append(f"hung for {timeout:.0f} s")
                if server is not None:
                    server_out = _stop(server)
                    server, started = start_server(), time.monotonic()
                deadline = max(deadline, time.monotonic() + SERVER_START + 1.0)
                time.sleep(0.3)
                continue
            client_out = client.stdout + client.stderr
            if client.returncode == 0 and "#bytes" in client.stdout:
                break
            attempts.append(_tail(client_out))
            if server is not None and server.poll() is None and time.monotonic() - started > SERVER_START:
                server_out = _stop(server)  # it may have taken that failed connection: a fresh one listens again
                server, started = start_server(), time.monotonic()
            if time.monotonic() > deadline:
                raise NvmeofError(f"{test} client failed to run against {address} ({len(attempts)} attempts): "
                                  f"{attempts[-1]}",
                                  f"check that {device} is ACTIVE and has {address} (rdma link; ip addr); "
                                  "without rdma_cm pass the GID index (--perftest-gid)")
            time.sleep(0.25)
        try:
            if server is not None:
                server.wait(10)
        except subprocess.TimeoutExpired:
            pass
    finally:
        server_out = _stop(server) or server_out
        if raw_output is not None:
            raw_output.parent.mkdir(parents=True, exist_ok=True)
            raw_output.write_text(f"$ {' '.join(client_cmd)}\n{client_out}\n"
                                  f"$ {' '.join(server_cmd)}\n{server_out}\n", encoding="utf-8")
    rows = parse_perftest_output(client.stdout)
    return PerftestResult(test=test, device=device, address=address, rdma_cm=rdma_cm, gid_index=gid_index,
                          rows=rows, command=client_cmd)


def _tail(text: str, n: int = 4) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-n:]) or "no output"


def perftest_version(test: str = "ib_send_lat") -> str:
    path = shutil.which(test)
    if not path:
        return ""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    m = re.search(r"Version:\s*(\S+)", out.stdout + out.stderr)
    return m.group(1) if m else ""


__all__ = ["PerftestRow", "PerftestResult", "parse_perftest_output", "run_perftest", "perftest_args",
           "find_gid", "rdma_device_for", "iwarp_device_for", "perftest_binary", "perftest_version", "LATENCY_TESTS",
           "BANDWIDTH_TESTS", "DEFAULT_TESTS", "test_kind"]
